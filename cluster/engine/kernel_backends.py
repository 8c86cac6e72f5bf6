"""Which kernel backend each family of ops runs on, chosen once at start from the resolved config.

Resolution speaks SGLang's names (``attention_backend='fa3'``, ``sampling_backend='flashinfer'``,
``moe_runner_backend='auto'``); flotilla has fewer kernels, so each name maps to one of the
backends registered in :mod:`flotilla.kernels.registry`:

============  ==========================================  ===========================
family        CUDA, bfloat16 / float16                    CPU, or float32 anywhere
============  ==========================================  ===========================
attention     ``flashinfer`` (every CUDA kernel name:      ``torch``
              fa3, fa4, flashinfer, triton, trtllm_mha,
              trtllm_mla, flashmla, cutlass_mla, ...);
              ``torch`` for torch_native / flex_attention
elementwise   ``flashinfer`` (RMSNorm, RoPE, SiLU-and-mul) ``torch``
              when attention is flashinfer, else ``torch``
moe           ``triton`` (fused MoE) for MoE models        ``torch``
linear        ``triton`` (a GEMV for one-row inputs,       ``torch`` (``F.linear``)
              ``F.linear`` otherwise) when attention is
              flashinfer and triton is installed, else
              ``torch``
fp8           ``triton`` (weight-only FP8 GEMM) for        ``torch`` (dequantize,
              block-FP8 checkpoints                        float32 GEMM)
sampling      ``flashinfer`` unless sampling_backend is    ``torch``
              ``pytorch``
============  ==========================================  ===========================

``fp8`` runs op ``fp8_block_linear`` of the block-FP8 linear layers of an FP8 checkpoint
(``quantization_config.quant_method='fp8'``, 128x128 blocks); the checkpoint's FP8 routed
experts run op ``fp8_grouped_moe`` of the ``moe`` backend. NOTE: not ``deep_gemm``, whose GEMMs
fail on torch 2.11 (sgl-deep-gemm 0.2.1); the Triton kernels widen float8 weights in registers
and keep activations unquantized. The ``linear`` backend's ops never touch an FP8 layer (see
:func:`~flotilla.cluster.models.layers.use_linear_op`).

NOTE: float32 runs the torch references everywhere: flashinfer has no float32 attention
kernels, and float32 is the exactness path (GPU float32 greedy tokens are compared with the
CPU engine's), so every op family takes the reference there.

Choosing ``attention_backend=torch_native`` on CUDA asks for the reference attention; the
elementwise ops follow it (a whole-reference model, the oracle the GPU tests compare with).

A backend whose library is missing on this machine is a :class:`ValueError` at start that
names the resolved field, its value and what to do; :func:`load_kernel_backends` then imports
each chosen backend's registry module, so a broken install also fails at start, never in the
middle of a request.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

TORCH = "torch"
FLASHINFER = "flashinfer"
TRITON = "triton"

# SGLang attention backends that run on the torch reference on every device.
TORCH_ATTENTION_NAMES = frozenset({"torch_native", "torch", "flex_attention", "intel_amx"})
# SGLang attention backends that name CUDA kernels: on CUDA in bf16/fp16 they all run on
# flashinfer (paged prefill/decode, FA3 prefill kernels on SM90, flashinfer MLA for DeepSeek).
# NOTE: the sparse-attention names (dsa, nsa, dsv4, compressed) belong to architectures
# flotilla does not build; a model flotilla does build computes dense attention under them.
CUDA_ATTENTION_NAMES = frozenset(
    {
        "fa3",
        "fa4",
        "flashinfer",
        "triton",
        "trtllm_mha",
        "trtllm_mla",
        "flashmla",
        "cutlass_mla",
        "cutedsl_mla",
        "tokenspeed_mla",
        "dual_chunk_flash_attn",
        "minicpm_flashattn",
        "minicpm_flashinfer",
        "hpc_ops",
        "dsa",
        "nsa",
        "dsv4",
        "compressed",
    }
)
HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})

# What each non-torch backend imports, and how to install it.
_LIBRARIES = {
    FLASHINFER: ("flashinfer", "pip install --no-deps flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.12"),
    TRITON: ("triton", "pip install triton (it ships with CUDA builds of torch)"),
}
# The flag that asks for the torch reference instead, per resolved field.
_TORCH_FLAG = {
    "attention_backend": "--attention-backend torch_native",
    "prefill_attention_backend": "--attention-backend torch_native",
    "decode_attention_backend": "--attention-backend torch_native",
    "sampling_backend": "--sampling-backend pytorch",
    "moe_runner_backend": "--dtype float32 (the torch MoE reference)",
    "quant_method": "--dtype float32 (the torch FP8 reference)",
}
# One op of each family: fetching it imports the backend's registry modules.
_PROBE_OPS = {
    "attention": "attention_planner",
    "elementwise": "rms_norm",
    "moe": "fused_moe",
    "linear": "linear",
    "fp8": "fp8_block_linear",
    "sampling": "sample_tokens",
}


@dataclass(frozen=True)
class KernelBackends:
    """The kernel-registry backend of each op family (see the module docstring).

    Attributes:
        attention: paged attention, MLA attention and the per-step attention planner.
        elementwise: RMSNorm (with fused residual add), rotary embedding, SiLU-and-mul.
        moe: the fused expert computation of MoE layers.
        linear: the dense projections' and MoE routers' GEMM (``triton``: batch-1 decode steps
            on a Triton GEMV, every other shape on ``F.linear``; the embedding and LM head stay
            on torch).
        fp8: the block-FP8 projections' GEMM (op ``fp8_block_linear``) of an FP8 checkpoint.
        sampling: top-k/top-p/min-p sampling from probabilities.
        chosen_by: for each family, the resolved setting that chose it (``"attention_backend='fa3'"``),
            for messages and the start-up report; not part of equality.
    """

    attention: str = TORCH
    elementwise: str = TORCH
    moe: str = TORCH
    linear: str = TORCH
    fp8: str = TORCH
    sampling: str = TORCH
    chosen_by: Mapping[str, str] = field(default_factory=dict, compare=False, hash=False)

    def as_dict(self) -> dict[str, str]:
        """``{"attention": ..., "elementwise": ..., "moe": ..., "linear": ..., "fp8": ..., "sampling": ...}``."""
        return {
            "attention": self.attention,
            "elementwise": self.elementwise,
            "moe": self.moe,
            "linear": self.linear,
            "fp8": self.fp8,
            "sampling": self.sampling,
        }


def library_installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found on the path; nothing is imported)."""
    return importlib.util.find_spec(module) is not None


def has_experts(hf_config: Mapping[str, Any]) -> bool:
    """Whether an HF config describes a mixture-of-experts model."""
    keys = ("num_experts", "n_routed_experts", "num_local_experts")
    return any(int(hf_config.get(key) or 0) > 0 for key in keys)


def kernel_backends_for(
    config: Any,
    dtype: torch.dtype | None = None,
    *,
    moe_model: bool = True,
    fp8_model: bool = False,
    available: Callable[[str], bool] = library_installed,
) -> KernelBackends:
    """The kernel backends a runner uses for the resolved ``config`` (see the module docstring).

    Args:
        config: the resolved configuration (``device``, ``dtype``, ``attention_backend``,
            ``prefill_attention_backend``, ``decode_attention_backend``, ``sampling_backend``,
            ``moe_runner_backend``; anything with those attributes).
        dtype: the model's activation dtype as loaded (``resolve_dtype``); when None it is read
            from ``config.dtype``, and ``auto`` counts as float32 (the torch references).
        moe_model: whether the model has MoE layers (a dense model needs no MoE backend).
        fp8_model: whether the checkpoint is block-FP8 (other models need no ``fp8`` backend).
        available: whether a library (a module name: ``flashinfer``, ``triton``) is installed
            here; the real check by default.

    Raises ValueError naming the field and value when a chosen backend's library is missing,
    when the prefill and decode attention backends map to different kernel backends, or when
    an attention backend names hardware other than CUDA.
    """
    device = str(getattr(config, "device", None) or "cpu")
    fields = _attention_fields(config)
    if device == "cpu":
        return KernelBackends(chosen_by={"attention": "device='cpu'"})
    if device != "cuda":
        if all(value in TORCH_ATTENTION_NAMES for _, value in fields):
            return KernelBackends(chosen_by={"attention": f"device={device!r}"})
        name, value = next((n, v) for n, v in fields if v not in TORCH_ATTENTION_NAMES)
        raise ValueError(
            f"{name}={value!r} is not available on device={device!r}: flotilla runs CUDA kernels and the torch "
            f"reference; use --attention-backend torch_native"
        )
    if _dtype_of(config, dtype) not in HALF_DTYPES:
        # NOTE: float32 (see the module docstring): the references, whatever resolution named.
        return KernelBackends(chosen_by={"attention": "dtype=float32"})
    attention, attention_by = _cuda_attention(fields)
    sampling_name = getattr(config, "sampling_backend", None) or FLASHINFER
    sampling = TORCH if sampling_name == "pytorch" else FLASHINFER
    moe_name = getattr(config, "moe_runner_backend", None) or "auto"
    chosen = KernelBackends(
        attention=attention,
        elementwise=FLASHINFER if attention == FLASHINFER else TORCH,
        moe=TRITON if moe_model else TORCH,
        # NOTE: an optimization no flag names: without triton the projections stay on F.linear.
        linear=TRITON if attention == FLASHINFER and available(_LIBRARIES[TRITON][0]) else TORCH,
        fp8=TRITON if fp8_model else TORCH,
        sampling=sampling,
        chosen_by={
            "attention": attention_by,
            "elementwise": attention_by,
            "linear": attention_by,
            "moe": f"moe_runner_backend={moe_name!r}",
            "fp8": "quant_method='fp8'",
            "sampling": f"sampling_backend={sampling_name!r}",
        },
    )
    _check_installed(chosen, available)
    return chosen


def _attention_fields(config: Any) -> list[tuple[str, str]]:
    """The attention-backend fields that are set, as ``(field, value)``; ``attention_backend``
    defaults to ``torch_native`` when none is."""
    names = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
    found = [(name, getattr(config, name, None)) for name in names]
    found = [(name, str(value)) for name, value in found if value]
    return found or [("attention_backend", "torch_native")]


def _cuda_attention(fields: list[tuple[str, str]]) -> tuple[str, str]:
    """``(backend, "field='value'")`` for the attention fields on CUDA in bf16/fp16."""
    chosen: dict[str, str] = {}
    for name, value in fields:
        if value in TORCH_ATTENTION_NAMES:
            backend = TORCH
        elif value in CUDA_ATTENTION_NAMES:
            backend = FLASHINFER
        else:
            raise ValueError(
                f"{name}={value!r} is not a CUDA attention backend; on CUDA use a CUDA one (fa3, flashinfer, "
                f"triton, ...: all run on flashinfer here) or --attention-backend torch_native"
            )
        chosen.setdefault(backend, f"{name}={value!r}")
    if len(chosen) > 1:
        raise ValueError(
            f"flotilla runs one attention backend for prefill and decode, but {chosen[TORCH]} runs on the torch "
            f"reference and {chosen[FLASHINFER]} on flashinfer; set --attention-backend alone (or both split "
            f"fields to the same kind)"
        )
    backend, by = next(iter(chosen.items()))
    return backend, by


def _dtype_of(config: Any, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    name = str(getattr(config, "dtype", None) or "auto").replace("torch.", "")
    if name in ("half", "float16"):
        return torch.float16
    if name == "bfloat16":
        return torch.bfloat16
    return torch.float32


def _check_installed(backends: KernelBackends, available: Callable[[str], bool]) -> None:
    for family, backend in backends.as_dict().items():
        if backend not in _LIBRARIES:
            continue
        module, install = _LIBRARIES[backend]
        if available(module):
            continue
        setting = backends.chosen_by.get(family, family)
        field_name = setting.split("=", 1)[0]
        instead = _TORCH_FLAG.get(field_name, "--attention-backend torch_native")
        raise ValueError(f"{setting} needs {module}, which is not installed on this machine: {install}, or {instead}")


# The DSA fields and what each asks for: flotilla's DSA ops have the torch reference only
# (flotilla.kernels.dsa); the CUDA kernels the seeds name there are not built yet.
DSA_FIELDS = ("dsa_prefill_backend", "dsa_decode_backend", "dsa_topk_backend")
# Values that ask for the torch reference (resolution's CPU choice; sgl-kernel is the top-k default,
# which the reference stands in for wherever attention runs the reference).
TORCH_DSA_NAMES = frozenset({"torch", "sgl-kernel"})


def dsa_backend_for(config: Any, backends: KernelBackends) -> str:
    """The kernel backend of the DeepSeek sparse attention ops (``dsa_indexer``,
    ``dsa_sparse_mla``) for a DSA model (DeepSeek-V3.2, GLM-5) under the resolved ``config``.

    The torch reference wherever the attention family runs the reference (CPU, float32, or
    ``--attention-backend torch_native`` on CUDA): the DSA fields then name ``torch`` (what
    resolution gives on the ``cpu`` platform) or a CUDA kernel the reference stands in for, as the
    attention fields do. With CUDA attention kernels a CUDA DSA kernel would be needed, which is not
    built: ValueError naming the field and value."""
    if backends.attention == TORCH:
        return TORCH
    attention = backends.chosen_by.get("attention", f"attention backend {backends.attention!r}")
    named = [(n, getattr(config, n, None)) for n in DSA_FIELDS]
    cuda = [f"{n}={v!r}" for n, v in named if v is not None and v not in TORCH_DSA_NAMES]
    what = f"{', '.join(cuda)} name CUDA DSA kernels, which are not built yet" if cuda else "the CUDA DSA kernels are not built yet"
    raise ValueError(
        f"flotilla runs DeepSeek sparse attention on its torch reference only ({what}), and {attention} runs CUDA "
        f"attention kernels; use --attention-backend torch_native (or --dtype float32) for the reference"
    )


def load_kernel_backends(backends: KernelBackends, registry: Any) -> None:
    """Import every non-torch backend's registry modules now (one op of each family), so a
    library that is installed but broken fails at start. ValueError names the setting."""
    for family, backend in backends.as_dict().items():
        if backend == TORCH:
            continue
        try:
            registry.get(_PROBE_OPS[family], backend)
        except ValueError as exc:
            setting = backends.chosen_by.get(family, family)
            raise ValueError(
                f"{setting} selects the {backend!r} {family} kernels, which failed to load on this machine: {exc}"
            ) from exc
