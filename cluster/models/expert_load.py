"""Measured expert load: how many routed (token, k) pairs each LOGICAL expert received, per MoE
layer (the expert-distribution recorder's ``stat`` mode).

:class:`FusedMoE` calls :meth:`ExpertLoadRecorder.record` with the router's ``topk_ids`` before
any replica/slot mapping, so the counts are per logical expert whatever the placement; that is
the ``load`` vector :func:`~flotilla.cluster.eplb.balanced_placement` and
:func:`~flotilla.cluster.eplb.grow_placement` take (``snapshot()["total"]``).

Window (SGLang's ``--expert-distribution-recorder-buffer-size``): a forward pass's counts are
committed by :meth:`ExpertLoadRecorder.end_pass`; with ``window=N`` the snapshot sums the last
``N`` committed passes (a ring buffer of per-pass counts, as SGLang's ``stat`` accumulator),
with ``window=None`` or ``-1`` every pass since the last :meth:`~ExpertLoadRecorder.reset`.
Counts of a pass not yet committed are included too. Each rank counts the tokens its own router
saw; summing over ranks (and not double counting attention-TP ranks that see the same tokens)
is the caller's business.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertLoadRecorder:
    """Counts of routed pairs per (MoE layer, logical expert), kept on ``device``.

    Args:
        num_layers: MoE layers recorded; ``record`` takes an index in ``[0, num_layers)``.
        num_experts: logical routed experts ``E`` of each layer.
        window: forward passes kept (ring buffer); None or ``-1`` for cumulative counts.
        device: where the counters live (the model's device: recording never syncs the host).
        layer_ids: the model's decoder-layer index of each recorded layer, reported by
            ``snapshot`` (default ``0..num_layers-1``).
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        window: int | None = None,
        device: torch.device | str = "cpu",
        layer_ids: list[int] | None = None,
    ):
        if num_layers < 1 or num_experts < 1:
            raise ValueError(f"num_layers={num_layers} and num_experts={num_experts} must both be at least 1")
        if window is not None and window != -1 and window < 1:
            raise ValueError(
                f"expert_distribution_recorder_buffer_size={window} must be a positive number of forward "
                f"passes, or -1 (unbounded)"
            )
        if layer_ids is not None and len(layer_ids) != num_layers:
            raise ValueError(f"{len(layer_ids)} layer_ids for num_layers={num_layers}")
        self.num_layers, self.num_experts = num_layers, num_experts
        self.window = None if window in (None, -1) else int(window)
        self.layer_ids = list(layer_ids) if layer_ids is not None else list(range(num_layers))
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget every count (committed passes and the pass in progress)."""
        shape = (self.num_layers, self.num_experts)
        self._current = torch.zeros(shape, dtype=torch.int64, device=self.device)
        if self.window is None:
            self._kept = torch.zeros(shape, dtype=torch.int64, device=self.device)
        else:
            self._kept = torch.zeros((self.window, *shape), dtype=torch.int64, device=self.device)
        self.num_passes = 0

    def record(self, layer_index: int, topk_ids: torch.Tensor) -> None:
        """Add one count per entry of ``topk_ids[T, k]`` (logical ids) to layer ``layer_index``.

        ``T`` may be 0 (an idle DP rank's empty batch): nothing is added."""
        ids = topk_ids.reshape(-1).to(device=self.device, dtype=torch.int64)
        # NOTE: index_add_ into a fixed-size row, not bincount: no host sync on CUDA.
        self._current[layer_index].index_add_(0, ids, torch.ones_like(ids))

    def end_pass(self) -> None:
        """Commit the counts recorded since the last call as one forward pass."""
        if self.window is None:
            self._kept += self._current
        else:
            self._kept[self.num_passes % self.window].copy_(self._current)
        self._current.zero_()
        self.num_passes += 1

    def counts(self) -> torch.Tensor:
        """``[num_layers, E]`` int64 counts in the window (plus the pass in progress)."""
        kept = self._kept if self.window is None else self._kept.sum(dim=0)
        return kept + self._current

    def snapshot(self) -> dict:
        """Plain, picklable counts: ``{"layer_ids": [L], "per_layer": [L][E], "total": [E],
        "num_passes": int, "window": int | None}``; ``total`` sums the layers."""
        counts = self.counts().cpu()
        return {
            "layer_ids": list(self.layer_ids),
            "per_layer": counts.tolist(),
            "total": counts.sum(dim=0).tolist(),
            "num_passes": self.num_passes,
            "window": self.window,
        }


def attach_load_recorder(model: nn.Module, window: int | None = None) -> ExpertLoadRecorder | None:
    """Create one recorder for every :class:`FusedMoE` of ``model`` (in module order) and set
    each layer's ``load_recorder`` / ``load_layer_index``; None when the model has no MoE layer."""
    from flotilla.cluster.models.moe_layer import moe_layers

    layers = moe_layers(model)
    if not layers:
        return None
    experts = {m.num_experts for _, m in layers}
    if len(experts) != 1:
        raise ValueError(f"MoE layers disagree on the number of experts ({sorted(experts)})")
    layer_ids = [layer for layer, _ in layers]
    device = layers[0][1].w13.device
    recorder = ExpertLoadRecorder(len(layers), experts.pop(), window, device, layer_ids)
    for index, (_, module) in enumerate(layers):
        module.load_recorder = recorder
        module.load_layer_index = index
    return recorder
