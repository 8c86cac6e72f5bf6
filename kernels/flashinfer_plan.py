"""What flotilla's two flashinfer attention planners share (MHA/GQA in
:mod:`~flotilla.kernels.flashinfer_attention`, MLA in :mod:`~flotilla.kernels.flashinfer_mla`):
the per-step plan every layer reads, the workspace size, the dtypes flashinfer's kernels take,
and the checks on a step's plan and the graph batch sizes. No flashinfer import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from flotilla.kernels.attention import AttentionMetadata

# Float workspace per planner: split-KV partial outputs of the largest decode/prefill plans
# (flashinfer suggests 128 MiB; large graph batches of many heads can need more).
WORKSPACE_BYTES = 256 << 20
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FlashInferStepPlan:
    """``meta.plan`` for flashinfer attention: the planned wrapper and what it was planned for.

    Attributes:
        wrapper: a planned flashinfer prefill or decode wrapper (or MLA wrapper), a
            :class:`DecodesThenPrefills` of both, or the planner's
            :class:`~flotilla.kernels.triton_decode_attention.TritonDecode`.
        num_tokens: query rows every ``run`` of this step must pass.
        scale: the planned softmax scale.
        sliding_window: the planned window (None: whole context).
        kind: ``"prefill"``, ``"mixed"`` (leading decodes on the decode wrapper, the rest
            on the prefill wrapper), ``"decode"``, ``"graph-decode"``, ``"triton-decode"``,
            ``"triton-graph-decode"`` or ``"mla"`` (diagnostics).
    """

    wrapper: Any
    num_tokens: int
    scale: float
    sliding_window: int | None
    kind: str

    def check(self, num_tokens: int, scale: float, sliding_window: int | None) -> None:
        """ValueError unless a layer's call matches the plan (Python values only: no sync)."""
        if num_tokens != self.num_tokens:
            raise ValueError(f"attention got {num_tokens} query tokens, the step's {self.kind} plan has {self.num_tokens}")
        if not math.isclose(scale, self.scale, rel_tol=1e-6) or sliding_window != self.sliding_window:
            raise ValueError(
                f"attention called with scale={scale}, sliding_window={sliding_window}; the planner's "
                f"AttentionShape says scale={self.scale}, sliding_window={self.sliding_window}"
            )


def require_plan(meta: AttentionMetadata) -> FlashInferStepPlan:
    """``meta.plan``, or a ValueError saying the planner was not run for this step."""
    if not isinstance(meta.plan, FlashInferStepPlan):
        raise ValueError(
            f"flashinfer attention needs meta.plan from the flashinfer attention planner (got {type(meta.plan).__name__}); "
            "call planner.plan(meta) once per step before the forward"
        )
    return meta.plan


def check_graph_sizes(graph_batch_sizes: Sequence[int]) -> tuple[int, ...]:
    """The sorted distinct graph batch sizes; ValueError on a non-positive one."""
    sizes = tuple(sorted(set(int(b) for b in graph_batch_sizes)))
    if sizes and sizes[0] < 1:
        raise ValueError(f"graph_batch_sizes must be positive, got {list(graph_batch_sizes)}")
    return sizes
