"""The MoE runner (expert kernel) backend: quantization-driven choice, backend
compatibility, and the shared-experts fusion it forces off (SGLang's
``handle_moe_kernel_config``), plus the experimental Marlin runner's checks.

not ported: ``SGLANG_CUTLASS_MOE`` (a deprecated variable SGLang only warns
about; resolution assumes a clean environment, where it has no effect).
"""

from __future__ import annotations

from flotilla.resolution.engine import ensure, reject, rule
from flotilla.resolution.rules.common import env_flag

NVFP4_ONLINE_RUNNERS = ("flashinfer_trtllm", "flashinfer_trtllm_routed", "flashinfer_cutedsl")
MXFP8_RUNNERS = ("cutlass", "deep_gemm", "flashinfer_trtllm", "flashinfer_trtllm_routed")


def _mxfp8_runner(runner: str, platform) -> str:
    """The runner MXFP8 MoE uses given the requested one (auto or unsupported -> default)."""
    gfx95 = platform.is_hip and platform.is_gfx95
    allowed = MXFP8_RUNNERS + (("triton",) if gfx95 else ())
    fallback = "triton" if gfx95 else "flashinfer_trtllm"
    if runner == "auto" or runner not in allowed:
        return fallback
    return runner


@rule("_moe_runner_backend_quant_constraints", overrides=("moe_runner_backend",), whitelist=True)
def moe_runner_backend_quant_constraints(view, model, platform):
    """Some quantizations pin the MoE runner: NVFP4-online and MXFP8 to FlashInfer TRT-LLM, ModelOpt FP4 on SM120 to FlashInfer CUTLASS.

    An MXFP8 launch with an unsupported explicit runner is moved to the MXFP8
    default rather than rejected (SGLang only warns).
    """
    runner = view.moe_runner_backend
    quantization = view.quantization
    if quantization == "nvfp4_online":
        if not platform.is_sm100:
            reject(
                "--quantization nvfp4_online is supported only on "
                "NVIDIA Blackwell SM100/SM103 GPUs."
            )
        if runner == "auto":
            runner = "flashinfer_trtllm"
        elif runner not in NVFP4_ONLINE_RUNNERS:
            reject(
                "--quantization nvfp4_online supports only "
                "--moe-runner-backend flashinfer_trtllm or "
                "flashinfer_trtllm_routed, or flashinfer_cutedsl."
            )
    # Ascend runs MXFP8 MoE on its own runner, chosen later from "auto".
    if quantization == "mxfp8" and not platform.is_npu:
        runner = _mxfp8_runner(runner, platform)
    if runner == "auto" and quantization == "modelopt_fp4" and platform.is_sm120:
        runner = "flashinfer_cutlass"
    if runner != view.moe_runner_backend:
        return {"moe_runner_backend": runner}
    return None


def _runner_quant_checks(view, model) -> None:
    """Each FlashInfer runner accepts only some quantizations and EP layouts."""
    runner, quantization, ep_size, tp_size = (
        view.moe_runner_backend,
        view.quantization,
        view.ep_size,
        view.tp_size,
    )
    if runner == "flashinfer_cutlass":
        ensure(
            quantization in ("modelopt_fp4", "modelopt_fp8", "modelopt_mixed", None),
            f"Invalid quantization '{quantization}'. \nFlashInfer Cutlass MOE supports only: "
            "'modelopt_fp4', 'modelopt_fp8', 'modelopt_mixed', or bfloat16 (None).",
        )
        ensure(
            ep_size in (1, tp_size),
            "The expert parallel size must be 1 or the same as the tensor parallel size",
        )
    if runner == "flashinfer_cutedsl":
        ensure(
            quantization in ("modelopt_fp4", "modelopt_mixed", "nvfp4_online") or model.nvfp4_moe_meta,
            f"Invalid quantization '{quantization}'. \nFlashInfer CuteDSL MOE currently supports only: "
            "'modelopt_fp4', 'modelopt_mixed' (with NVFP4 MoE layers), 'nvfp4_online', or hybrid NVFP4 models.",
        )
        ensure(
            ep_size in (1, tp_size),
            "The expert parallel size must be 1 or the same as the tensor parallel size",
        )
        ensure(
            view.moe_a2a_backend in ("none", "deepep", "flashinfer"),
            "flashinfer_cutedsl supports moe_a2a_backend='none', 'deepep', or 'flashinfer', "
            f"got '{view.moe_a2a_backend}'.",
        )
        per_token = env_flag(view, "SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION")
        if view.moe_a2a_backend == "deepep" and (quantization == "nvfp4_online" or per_token):
            reject(
                "flashinfer_cutedsl per-token NVFP4 activation requires "
                "moe_a2a_backend='none' or 'flashinfer'."
            )
    if runner in ("flashinfer_trtllm", "experimental_sgl_trtllm"):
        ensure(
            quantization
            in (
                "modelopt_fp4",
                "nvfp4_online",
                "fp8",
                "mxfp8",
                "modelopt_fp8",
                "modelopt_mixed",
                "compressed-tensors",
                None,
            ),
            f"Invalid quantization '{quantization}'. \nFlashInfer TRTLLM MOE supports only: "
            "'modelopt_fp4', 'nvfp4_online', 'fp8', 'modelopt_fp8', 'modelopt_mixed', "
            "'compressed-tensors', or bfloat16 (None).",
        )
    if runner == "flashinfer_trtllm_routed":
        ensure(
            quantization in ("fp8", "mxfp8", "modelopt_fp4", "modelopt_mixed", "nvfp4_online", None),
            f"Invalid quantization '{quantization}'. \nFlashInfer TRTLLM routed MOE supports only: "
            "'fp8', 'mxfp8', 'modelopt_fp4', 'modelopt_mixed', 'nvfp4_online', or bfloat16 (None).",
        )


@rule("handle_moe_kernel_config")
def handle_moe_kernel_config(view, model, platform):
    """The chosen MoE runner must support the quantization, the EP size and the A2A backend.

    NOTE: the FP8/MXFP8 CUTLASS check runs after the fusion pass in SGLang;
    that pass only touches ``disable_shared_experts_fusion``, so checking it
    here sees the same values.
    """
    _runner_quant_checks(view, model)
    if view.moe_runner_backend == "cutlass" and view.quantization in ("fp8", "mxfp8"):
        ensure(view.ep_size == 1, "FP8/MXFP8 Cutlass MoE is only supported with ep_size == 1")
    return None


@rule("_moe_runner_fusion_disable", whitelist=True)
def moe_runner_fusion_disable(view, model, platform):
    """The FlashInfer CuteDSL, TRT-LLM and TRT-LLM-routed MoE runners cannot fuse shared experts."""
    if view.moe_runner_backend in (
        "flashinfer_cutedsl",
        "flashinfer_trtllm",
        "experimental_sgl_trtllm",
        "flashinfer_trtllm_routed",
    ):
        return {"disable_shared_experts_fusion": True}
    return None


@rule("validate_experimental_sgl_marlin")
def validate_experimental_sgl_marlin(view, model, platform):
    """The experimental Marlin MoE runner supports EP only without A2A, and LoRA only on its narrow path."""
    if view.moe_runner_backend != "experimental_sgl_marlin":
        return None
    if view.ep_size > 1 and view.moe_a2a_backend != "none":
        reject("experimental_sgl_marlin EP requires --moe-a2a-backend none")
    lora_enabled = bool(view.enable_lora) or (view.enable_lora is None and bool(view.lora_paths))
    if not lora_enabled:
        return None
    if not view.lora_use_virtual_experts:
        reject("experimental_sgl_marlin LoRA requires --lora-use-virtual-experts")
    if view.lora_backend != "triton":
        reject("experimental_sgl_marlin LoRA requires --lora-backend triton")
    if view.ep_size <= 1:
        return None
    if (
        view.init_expert_location != "trivial"
        or view.ep_num_redundant_experts != 0
        or view.enable_eplb
        or view.elastic_ep_backend is not None
        or view.enable_elastic_expert_backup
        or view.elastic_ep_rejoin
    ):
        reject(
            "experimental_sgl_marlin EP requires trivial expert placement "
            "without redundancy, EPLB, or elastic EP"
        )
    return None
