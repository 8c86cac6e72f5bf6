"""Speculative decoding, per algorithm: frozen-KV MTP, the EAGLE family
(EAGLE, EAGLE3, STANDALONE) and n-gram (SGLang's ``_handle_frozen_kv_mtp``,
``_handle_eagle_family`` and ``_handle_ngram``, dispatched by
``SpeculativeAlgorithm.handle_server_args``). The block drafters (DFlash,
DSpark) are in ``speculative_blocks``; the shared helpers live here.
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import attention_backends
from flotilla.resolution.rules.live import Live

DEFAULT_SPEC_MAX_RUNNING_REQUESTS = 48
MIXED_CHUNK_ALGORITHMS = ("EAGLE", "EAGLE3", "DFLASH", "DSPARK")
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "STANDALONE")
# Targets whose checkpoint carries its own MTP draft layers.
MTP_SELF_DRAFT_ARCHITECTURES = (
    "DeepseekV32ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV4ForCausalLM",
    "Glm4MoeForCausalLM",
    "Glm4MoeLiteForCausalLM",
    "GlmMoeDsaForCausalLM",
    "BailingMoeForCausalLM",
    "BailingMoeV2ForCausalLM",
    "BailingMoeV2_5ForCausalLM",
    "MistralLarge3ForCausalLM",
    "PixtralForConditionalGeneration",
    "HYV3ForCausalLM",
)
WIDE_TREE_ARCHITECTURES = ("LlamaForCausalLM", "Grok1ForCausalLM", "Grok1VForCausalLM")
PAGED_TREE_BACKENDS = ("flashinfer", "fa3", "triton")


def device_of(view, platform) -> str:
    """The device the server runs on (declared by the normalise phase, else the platform's)."""
    return view.device or platform.torch_device


def default_max_running_requests(live: Live) -> None:
    """Speculative decoding caps running requests at 48 unless the user chose a cap."""
    if live.max_running_requests is None:
        live.declare(max_running_requests=DEFAULT_SPEC_MAX_RUNNING_REQUESTS)


def _cpu_overlap_off(live: Live, platform) -> None:
    """Speculative decoding on CPU has no overlap schedule."""
    if device_of(live, platform) == "cpu" and not live.disable_overlap_schedule:
        live.declare(disable_overlap_schedule=True)


def draft_is_target(live: Live) -> bool:
    """The draft checkpoint is the target's own (its config is the one we have)."""
    return live.speculative_draft_model_path is not None and live.speculative_draft_model_path == live.model_path


@rule("_handle_frozen_kv_mtp", overrides=("enable_mixed_chunk",))
def handle_frozen_kv_mtp(view, model, platform):
    """Frozen-KV MTP caps running requests at 48 by default and cannot mix chunked prefill into decode."""
    if view.speculative_algorithm != "FROZEN_KV_MTP":
        return None
    live = Live(view)
    default_max_running_requests(live)
    if view.enable_mixed_chunk:
        live.declare(enable_mixed_chunk=False)
    return live.out


def auto_speculative_params(view, model) -> tuple[int, int, int]:
    """(num_steps, eagle_topk, num_draft_tokens) tuned per architecture."""
    if view.speculative_algorithm != "STANDALONE" and model.architecture in WIDE_TREE_ARCHITECTURES:
        return (5, 4, 8)
    return (3, 1, 4)


def _rejection_sampling_checks(live: Live) -> None:
    """Rejection sampling needs an EAGLE/EAGLE3 top-1 chain, plain thresholds and no determinism."""
    if live.speculative_algorithm not in ("EAGLE", "EAGLE3"):
        reject(
            "--speculative-use-rejection-sampling is only supported for "
            "EAGLE / EAGLE3 / NEXTN, not "
            f"speculative_algorithm={live.speculative_algorithm}.",
            kind="NotImplementedError",
        )
    if live.speculative_eagle_topk != 1:
        reject("--speculative-use-rejection-sampling requires --speculative-eagle-topk=1.")
    if live.speculative_accept_threshold_single != 1.0 or live.speculative_accept_threshold_acc != 1.0:
        reject(
            "--speculative-use-rejection-sampling is incompatible with "
            "--speculative-accept-threshold-single / "
            "--speculative-accept-threshold-acc; rejection sampling ignores "
            "the accept thresholds."
        )
    if live.enable_deterministic_inference:
        reject(
            "--speculative-use-rejection-sampling is incompatible with "
            "--enable-deterministic-inference; the sampling kernel draws "
            "coins from the global RNG and is not batch-invariant."
        )


def _greater_than_one(topk) -> bool:
    """``topk > 1`` as SGLang evaluates it: an unset topk is a TypeError there."""
    if topk is None:
        reject("'>' not supported between instances of 'NoneType' and 'int'", kind="TypeError")
    return topk > 1


def _eagle_draft_and_params(live: Live, model) -> None:
    """MTP targets draft from their own checkpoint; unset steps/topk/tokens are tuned per architecture."""
    if model.architecture in MTP_SELF_DRAFT_ARCHITECTURES and live.speculative_draft_model_path is None:
        live.declare(speculative_draft_model_path=live.model_path, speculative_draft_model_revision=live.revision)
    if not live.speculative_adaptive and live.speculative_num_steps is None:
        ensure(
            live.speculative_eagle_topk is None and live.speculative_num_draft_tokens is None,
            "--speculative-eagle-topk and --speculative-num-draft-tokens need "
            "--speculative-num-steps (set all three or none)",
        )
        steps, topk, tokens = auto_speculative_params(live, model)
        live.declare(
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens,
        )


@rule(
    "_handle_eagle_family",
    overrides=("speculative_num_draft_tokens", "enable_mixed_chunk", "disable_overlap_schedule"),
)
def handle_eagle_family(view, model, platform):
    """EAGLE-family drafting: 48 running requests by default, tuned steps/topk, draft tokens = steps + 1 at top-1, backend limits.

    Standalone drafting rejects DP attention; MTP targets draft from their own
    checkpoint; a tree (topk > 1) over paged KV needs a backend that can
    express it.
    """
    if view.speculative_algorithm not in EAGLE_FAMILY:
        return None
    if view.speculative_algorithm == "STANDALONE" and view.enable_dp_attention:
        reject("Currently standalone speculative decoding does not support dp attention.")
    live = Live(view)
    default_max_running_requests(live)
    _cpu_overlap_off(live, platform)
    if live.enable_mixed_chunk and live.speculative_algorithm not in MIXED_CHUNK_ALGORITHMS:
        live.declare(enable_mixed_chunk=False)
    _eagle_draft_and_params(live, model)
    topk = live.speculative_eagle_topk
    if "trtllm_mha" in attention_backends(live) and _greater_than_one(topk):
        reject("trtllm_mha backend only supports topk = 1 for speculative decoding.")
    if live.speculative_use_rejection_sampling:
        _rejection_sampling_checks(live)
        if live.enable_multi_layer_eagle and topk != 1:
            reject(
                "--speculative-use-rejection-sampling with multi-layer EAGLE "
                "(--enable-multi-layer-eagle) requires --speculative-eagle-topk 1; "
                "rejection sampling is only implemented for the linear (topk=1) chain."
            )
    if topk == 1 and live.speculative_num_draft_tokens != live.speculative_num_steps + 1:
        live.declare(speculative_num_draft_tokens=live.speculative_num_steps + 1)
    if _greater_than_one(topk) and (live.page_size or 1) > 1 and live.attention_backend not in PAGED_TREE_BACKENDS:
        reject(
            f"speculative_eagle_topk > 1 with page_size > 1 is only supported on "
            f"{PAGED_TREE_BACKENDS}; got attention_backend="
            f"{live.attention_backend!r}. Use page_size == 1 or one of those backends."
        )
    return live.out


def _ngram_corpus_checks(live: Live) -> None:
    if live.speculative_ngram_external_corpus_path is None:
        return
    budget = live.speculative_ngram_external_sam_budget
    if budget <= 0:
        reject(
            "--speculative-ngram-external-sam-budget must be positive when "
            "--speculative-ngram-external-corpus-path is set."
        )
    if live.speculative_ngram_external_corpus_max_tokens <= 0:
        reject(
            "--speculative-ngram-external-corpus-max-tokens must be positive when "
            "--speculative-ngram-external-corpus-path is set."
        )
    if budget > live.speculative_num_draft_tokens - 1:
        reject(
            "speculative_ngram_external_sam_budget must be less than or equal to "
            f"speculative_num_draft_tokens - 1 ({live.speculative_num_draft_tokens - 1})."
        )


@rule(
    "_handle_ngram",
    overrides=("enable_mixed_chunk", "speculative_eagle_topk", "disable_overlap_schedule"),
)
def handle_ngram(view, model, platform):
    """N-gram drafting on CUDA/CPU: BFS breadth as topk, 12 draft tokens by default, no mixed chunks, no DP attention."""
    if view.speculative_algorithm != "NGRAM":
        return None
    if device_of(view, platform) not in ("cuda", "cpu"):
        reject("Ngram speculative decoding only supports CUDA or CPU devices.")
    live = Live(view)
    _cpu_overlap_off(live, platform)
    default_max_running_requests(live)
    live.declare(enable_mixed_chunk=False, speculative_eagle_topk=view.speculative_ngram_max_bfs_breadth)
    if live.speculative_num_draft_tokens is None:
        live.declare(speculative_num_draft_tokens=12)
    if live.speculative_num_steps is None:
        live.declare(speculative_num_steps=live.speculative_num_draft_tokens // live.speculative_eagle_topk)
    _ngram_corpus_checks(live)
    topk = live.speculative_eagle_topk
    if topk > 1 and (live.page_size or 1) > 1 and live.attention_backend != "flashinfer":
        reject(
            f"speculative_eagle_topk({topk}) > 1 "
            f"with page_size({live.page_size}) > 1 is unstable "
            "and produces incorrect results for paged attention backends. "
            "This combination is only supported for the 'flashinfer' backend."
        )
    if live.enable_dp_attention:
        reject("Currently ngram speculative decoding does not support dp attention.")
    return live.out


STEPS = [handle_frozen_kv_mtp, handle_eagle_family, handle_ngram]
