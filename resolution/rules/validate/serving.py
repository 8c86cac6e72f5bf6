"""Serving-side checks late in resolution: encoder disaggregation, tokenizer
batching, multimodal feature transport, environment-driven flags and the
remaining flag-combination validations (SGLang's ``handle_encoder_disaggregation``,
``handle_tokenizer_batching``, ``handle_environment_variables`` and
``handle_other_validations``).

not ported: InfiniBand device validation (reads /sys/class/infiniband on the
host), the environment writes of ``handle_environment_variables``
(SGLANG_ENABLE_TORCH_COMPILE and friends: runtime-only, no seed rule reads
them), CUDA VMM auto-selection for multi-node MNNVL (needs an IMEX channel
device on the host; absent, SGLang picks cpu), preferred-sampling-params
normalisation under --skip-tokenizer-init (tokenizer plumbing),
``handle_crash_dump_env`` (environment writes and a directory only) and
``handle_debug_utils`` (acts only inside SGLang's CI).
"""

from __future__ import annotations

from typing import Mapping

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.normalise.cuda_graph import DECODE, DISABLED, PREFILL, with_phase

LANGUAGE_MODEL_ONLY_ARCHITECTURES = ("MuseGlimmerForConditionalGeneration",)

ENCODER_DISAGGREGATION_ARCHITECTURES = frozenset({
    "Qwen2VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "InternS2PreviewForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration", "Qwen2_5OmniForConditionalGeneration",
    "Dots3NoteForCausalLM", "KimiVLForConditionalGeneration",
    "KimiK25ForConditionalGeneration", "KimiK3ForConditionalGeneration", "MiMoV2ForCausalLM",
})


def _check_language_model_only(view, model) -> None:
    if not view.language_model_only:
        return
    for flag, name in (
        (view.encoder_only, "--encoder-only"),
        (view.language_only, "--language-only"),
        (view.enable_prefix_mm_cache, "--enable-prefix-mm-cache"),
        (view.enable_broadcast_mm_inputs_process, "--enable-broadcast-mm-inputs-process"),
        (view.mm_enable_dp_encoder, "--mm-enable-dp-encoder"),
    ):
        if flag:
            reject(f"--language-model-only cannot be combined with {name}")
    if view.disaggregation_mode != "null":
        reject("--language-model-only is incompatible with --disaggregation-mode prefill/decode")
    if not any(a in LANGUAGE_MODEL_ONLY_ARCHITECTURES for a in model.architectures):
        reject(
            f"--language-model-only does not support {list(model.architectures)}. "
            f"Supported: {list(LANGUAGE_MODEL_ONLY_ARCHITECTURES)}."
        )


@rule("_handle_encoder_disaggregation", overrides=("encoder_transfer_backend",))
def handle_encoder_disaggregation(view, model, platform):
    """Encoder/language split serving needs a supported model and consistent flags.

    An ``auto`` encoder transfer backend gets its concrete choice."""
    _check_language_model_only(view, model)
    if view.enable_prefix_mm_cache and not view.encoder_only:
        reject("--enable-prefix-mm-cache requires --encoder-only to be enabled")
    if view.encoder_only and view.language_only:
        reject("Cannot set --encoder-only and --language-only together")
    if view.encoder_only and view.disaggregation_mode != "null":
        reject("Cannot set --encoder-only and --disaggregation-mode prefill/decode together")
    declared = {}
    arch = model.architecture
    if view.encoder_transfer_backend == "auto":
        declared["encoder_transfer_backend"] = (
            "zmq_to_tokenizer"
            if arch == "KimiK3ForConditionalGeneration" and view.tp_size > 1
            else "zmq_to_scheduler"
        )
    if (view.encoder_only or view.language_only) and arch not in ENCODER_DISAGGREGATION_ARCHITECTURES:
        reject(
            f"Model type {arch} is not supported for encoder disaggregation. "
            f"Supported architectures: Qwen2VL, Qwen3VL, Qwen3.5, InternS2, "
            f"Qwen2Audio, Qwen2.5Omni, Dots3-Note, Kimi, MiMoV2."
        )
    return declared


@rule(
    "_handle_tokenizer_batching",
    overrides=("detokenizer_worker_num", "enable_tokenizer_batch_encode", "enable_dynamic_batch_tokenizer"),
)
def handle_tokenizer_batching(view, model, platform):
    """One tokenizer batching approach at a time; none (and one detokenizer) without a tokenizer."""
    if view.enable_tokenizer_batch_encode and view.enable_dynamic_batch_tokenizer:
        reject(
            "Cannot enable both --enable-tokenizer-batch-encode and --enable-dynamic-batch-tokenizer. "
            "Please choose one tokenizer batching approach."
        )
    if not view.skip_tokenizer_init:
        return None
    declared = {}
    if view.detokenizer_worker_num != 1:
        declared["detokenizer_worker_num"] = 1
    if view.enable_tokenizer_batch_encode:
        declared["enable_tokenizer_batch_encode"] = False
    if view.enable_dynamic_batch_tokenizer:
        declared["enable_dynamic_batch_tokenizer"] = False
    return declared


@rule("_handle_multimodal_feature_transport", overrides=("mm_feature_transport", "keep_mm_feature_on_device"))
def handle_multimodal_feature_transport(view, model, platform):
    """Multimodal features travel through CPU memory unless a CUDA IPC/VMM pool is requested.

    The pools need CUDA (IPC also a single node, VMM no pipeline parallelism)."""
    transport = view.mm_feature_transport
    if view.keep_mm_feature_on_device:
        if transport not in (None, "cuda_ipc"):
            reject(
                "--keep-mm-feature-on-device conflicts with "
                f"--mm-feature-transport={transport}. Use only "
                "--mm-feature-transport=cuda_ipc."
            )
        transport = "cuda_ipc"
    if transport is None:
        # NOTE: only multi-node GB200/GB300 with a mounted IMEX channel picks
        # cuda_vmm; resolution sees no such device, so every case lands on cpu.
        transport = "cpu"
    if view.encoder_only and transport in ("cuda_ipc", "cuda_vmm"):
        transport = "cpu"
    if transport == "cuda_vmm":
        if not platform.is_cuda:
            reject("--mm-feature-transport=cuda_vmm requires NVIDIA CUDA.")
        if view.pp_size != 1:
            reject("--mm-feature-transport=cuda_vmm does not support pipeline parallelism.")
    if transport == "cuda_ipc":
        if not platform.is_cuda:
            reject("--mm-feature-transport=cuda_ipc requires NVIDIA CUDA.")
        if view.nnodes != 1:
            reject("--mm-feature-transport=cuda_ipc only supports a single node.")
    return {"mm_feature_transport": transport, "keep_mm_feature_on_device": False}


@rule("_handle_environment_variables", overrides=("debug_cuda_graph",))
def handle_environment_variables(view, model, platform):
    """CUDA-graph debugging needs CUDA or ROCm; the DeepSeek-V4 FP4 indexer needs SM100/SM120."""
    declared = {}
    if view.debug_cuda_graph and not (platform.is_cuda or platform.is_hip):
        declared["debug_cuda_graph"] = False
    if view.enable_deepseek_v4_fp4_indexer and not (platform.is_sm100 or platform.is_sm120):
        reject(
            "--enable-deepseek-v4-fp4-indexer requires SM100 or SM120 GPUs with "
            "DeepGEMM FP4 indexer support."
        )
    return declared


def _optimistic_prefill_unsupported(view) -> bool:
    if view.pp_size > 1:
        return True
    if view.enable_hierarchical_cache and (
        view.hicache_storage_backend is not None or view.hicache_write_policy != "write_back"
    ):
        return True
    return bool(view.uses_mamba_radix_cache)


@rule(
    "_handle_other_validations",
    overrides=("optimistic_prefill_attempts", "cuda_graph_config", "skip_server_warmup"),
)
def handle_other_validations(view, model, platform):
    """Tensor-dump/msProbe modes run eagerly without warmup; optimistic prefill and JSON options are checked.

    Optimistic prefill is dropped where it is unsupported (PP, non-write-back
    hierarchical cache, mamba radix cache)."""
    if view.default_chat_template_kwargs is not None and not isinstance(view.default_chat_template_kwargs, Mapping):
        reject("--default-chat-template-kwargs must decode to a JSON object")
    declared: dict = {}
    if (
        view.optimistic_prefill_attempts > 0
        and view.disaggregation_mode == "prefill"
        and _optimistic_prefill_unsupported(view)
    ):
        declared["optimistic_prefill_attempts"] = 0
    if view.debug_tensor_dump_output_folder is not None or view.msprobe_dump_config is not None:
        graphs = with_phase(view.cuda_graph_config, DECODE, backend=DISABLED)
        declared["cuda_graph_config"] = with_phase(graphs, PREFILL, backend=DISABLED)
        declared["skip_server_warmup"] = True
    limits = view.limit_mm_data_per_request
    if limits and isinstance(limits, Mapping):
        allowed = ["image", "video", "audio"]
        for modality in limits:
            if modality not in allowed:
                reject(
                    f"Invalid modality '{modality}' in --limit-mm-data-per-request."
                    f"Allowed modalities are: {allowed}"
                )
    return declared
