"""Deprecated flag spellings and the defaults SGLang fills in before model handling.

not ported: ``_handle_prefill_delayer_env_compat`` (reads only SGLANG_* variables
no rule declares; a no-op in a clean environment).
not ported: the random ``random_seed`` default (non-deterministic; left unset
so the workers pick one).
not ported: ModelScope path resolution (SGLANG_USE_MODELSCOPE; downloads).
"""

from __future__ import annotations

from flotilla.resolution.engine import reject, rule
from flotilla.resolution.rules.live import Live

_DEPRECATED_TOOL_CALL_PARSERS = {"qwen25": "qwen", "glm45": "glm"}
_ATTENTION_BACKEND_FIELDS = (
    "attention_backend",
    "decode_attention_backend",
    "prefill_attention_backend",
    "speculative_draft_attention_backend",
)
_GRPC_WORKER_THREADS_DEFAULT = 4  # SGLANG_GRPC_WORKER_THREADS when unset


@rule(
    "_handle_deprecated_args",
    overrides=(
        "image_processor_backend",
        "tool_call_parser",
        "enable_flashinfer_allreduce_fusion",
        *_ATTENTION_BACKEND_FIELDS,
    ),
)
def handle_deprecated_args(view, model, platform):
    """Deprecated spellings become their replacements (fast-image-processor off -> pil,
    qwen25/glm45 parsers, --enable-flashinfer-allreduce-fusion -> backend auto, the
    'compressed' attention backend -> dsv4, --grpc-mode) and gRPC settings are checked."""
    live = Live(view)
    if live.disable_fast_image_processor:
        if live.image_processor_backend not in ("auto", "pil"):
            reject(
                "--disable-fast-image-processor conflicts with "
                f"--image-processor-backend={live.image_processor_backend}."
            )
        live.declare(image_processor_backend="pil")
    if live.tool_call_parser in _DEPRECATED_TOOL_CALL_PARSERS:
        live.declare(tool_call_parser=_DEPRECATED_TOOL_CALL_PARSERS[live.tool_call_parser])
    if live.enable_flashinfer_allreduce_fusion and live.flashinfer_allreduce_fusion_backend is None:
        live.declare(flashinfer_allreduce_fusion_backend="auto")
    live.declare(enable_flashinfer_allreduce_fusion=False)
    renamed = {
        name: "dsv4" for name in _ATTENTION_BACKEND_FIELDS if getattr(live, name) == "compressed"
    }
    live.declare(**renamed)
    if live.grpc_mode and not live.smg_grpc_mode:
        live.declare(smg_grpc_mode=True)
    live.declare(grpc_worker_threads=_GRPC_WORKER_THREADS_DEFAULT)
    legacy_grpc = live.smg_grpc_mode or live.grpc_mode
    if legacy_grpc and live.grpc_port is None:
        live.declare(grpc_port=live.port + 10000)
    _check_grpc(live, legacy_grpc)
    return live.out


def _check_grpc(live: Live, legacy_grpc: bool) -> None:
    if live.grpc_port is not None:
        if not 1 <= live.grpc_port <= 65535:
            reject(f"--grpc-port / SGLANG_GRPC_PORT ({live.grpc_port}) must be between 1 and 65535")
        if live.grpc_worker_threads is not None and live.grpc_worker_threads < 1:
            reject(f"SGLANG_GRPC_WORKER_THREADS ({live.grpc_worker_threads}) must be >= 1")
    native_grpc = live.grpc_port is not None and not legacy_grpc
    if live.sidecar_args is not None:
        if live.sidecar is None:
            reject("--sidecar-args requires --sidecar.")
        args = live.sidecar_args
        if not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
            reject("--sidecar-args must be a JSON array of strings.")
    if live.sidecar is not None:
        if not live.sidecar.strip():
            reject("--sidecar must not be empty.")
        if legacy_grpc:
            reject(
                "--sidecar requires SGLang's native gRPC server; "
                "it cannot be combined with --smg-grpc-mode/--grpc-mode."
            )
        if live.grpc_port is None:
            reject("--sidecar requires --grpc-port or SGLANG_GRPC_PORT.")
    if not native_grpc:
        return
    if live.use_ray:
        reject(
            "--grpc-port is not supported with --use-ray: the Ray "
            "serve launch path does not start the native gRPC server."
        )
    if live.encoder_only:
        reject(
            "--grpc-port is not supported with --encoder-only: "
            "encoder disaggregation uses its own server."
        )
    if live.tokenizer_worker_num > 1:
        reject(
            "Native gRPC does not yet support --tokenizer-worker-num > 1. "
            "Unset --grpc-port or set --tokenizer-worker-num 1."
        )
    if live.api_key or live.admin_api_key:
        reject(
            "--grpc-port is incompatible with --api-key/--admin-api-key: "
            "the native gRPC listener bypasses HTTP auth middleware."
        )


@rule(
    "_handle_missing_default_values",
    overrides=("device", "quantization", "speculative_draft_model_quantization"),
)
def handle_missing_default_values(view, model, platform):
    """Tokenizer path and served name default to the model path, the device to the
    platform's torch device (index stripped), the draft model's quantization to the
    target's; --quantization unquant means no quantization."""
    live = Live(view)
    if live.tokenizer_path is None:
        live.declare(tokenizer_path=live.model_path)
    if live.served_model_name is None:
        live.declare(served_model_name=live.model_path)
    if live.device is None:
        live.declare(device=platform.torch_device)
    live.declare(device=live.device.split(":")[0])
    if live.mm_process_config is None:
        live.declare(mm_process_config={})
    if live._speculative_draft_quantization_explicitly_set is None:
        live.declare(
            _speculative_draft_quantization_explicitly_set=(
                live.speculative_draft_model_quantization is not None
            )
        )
    if live.speculative_draft_model_quantization is None:
        live.declare(speculative_draft_model_quantization=live.quantization)
    if live.quantization == "unquant":
        live.declare(quantization=None)
    if live.speculative_draft_model_quantization == "unquant":
        live.declare(speculative_draft_model_quantization=None)
    return live.out


STEPS = (handle_deprecated_args, handle_missing_default_values)
