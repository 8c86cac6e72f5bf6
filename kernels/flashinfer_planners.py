"""The ``flashinfer`` backend's ``attention_planner`` op: the factory above flotilla's two
flashinfer planners, which picks :class:`~flotilla.kernels.flashinfer_mla.FlashInferMLAPlanner`
for an MLA shape and :class:`~flotilla.kernels.flashinfer_attention.FlashInferAttentionPlanner`
otherwise (neither planner module imports the other)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flotilla.kernels.attention import AttentionShape
from flotilla.kernels.flashinfer_attention import FlashInferAttentionPlanner
from flotilla.kernels.flashinfer_mla import FlashInferMLAPlanner
from flotilla.kernels.registry import register


@register("attention_planner", "flashinfer")
def flashinfer_attention_planner(
    shape: AttentionShape,
    device: torch.device | str,
    *,
    block_size: int,
    max_num_seqs: int,
    max_num_pages: int,
    graph_batch_sizes: Sequence[int] = (),
    **options: Any,
):
    """The flashinfer planner for ``shape``: :class:`FlashInferAttentionPlanner`, or
    :class:`~flotilla.kernels.flashinfer_mla.FlashInferMLAPlanner` for an MLA shape.
    ``options`` (``workspace_bytes``, ``padding_page``) pass through."""
    planner_class = FlashInferMLAPlanner if shape.is_mla else FlashInferAttentionPlanner
    return planner_class(
        shape,
        device,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_pages=max_num_pages,
        graph_batch_sizes=graph_batch_sizes,
        **options,
    )
