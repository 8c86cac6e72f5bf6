"""How a MoE layer's tokens meet their experts across ranks: the token exchange strategies.

:class:`~flotilla.cluster.models.moe_layer.FusedMoE` routes each token to ``top_k`` logical
experts, maps every (token, k) pair to one physical slot (``FusedMoE.slots_for``) and computes
the pairs whose slot it holds (``FusedMoE.compute``). A dispatcher decides which tokens each
rank sees and how the partial results become every token's complete output. It is picked
from the layout by :func:`make_dispatcher`:

- One rank in the MoE view and no DP attention (:class:`LocalDispatch`): every expert is
  here; compute, nothing to exchange.
- ``moe_a2a_backend == "none"`` (:class:`AllReduceDispatch`): every rank computes its own
  experts (its slots, its MoE-TP slice of each) for ALL tokens of the engine group, with
  zero contribution from pairs routed elsewhere (``expert_map`` is ``-1`` there), and the
  partial outputs are summed by an all-reduce over the ``tp`` communicator (the whole engine
  group: with ``moe_dp_size == 1`` the MoE view ``ep x moe_tp`` covers every rank exactly
  once, so the sum holds each pair once). With DP attention each DP rank holds different
  tokens (possibly none), so the layer first all-gathers them (hidden rows plus the chosen
  expert ids and weights, routing being per token) over ``attn_dp``, and afterwards keeps
  its own DP rank's rows. Attention-TP ranks of one DP rank hold identical tokens, so after
  the gather every rank holds the same global batch, and the replica choice (by row index)
  agrees everywhere.
- Any other backend name (e.g. ``"deepep"``; :class:`AllToAllDispatch`): every (token, k)
  pair's hidden row and slot id travel over the ``ep`` communicator to the EP rank owning the
  slot (an all-to-all with uneven counts); that rank runs its local experts on what it
  received, one pair per row, and sends each expert output back the same way; the sender
  weights and sums its pairs per token (in float32, as the single-rank kernel does: the
  routing weights never leave the sender). Attention-TP ranks hold identical tokens, so each
  dispatches only its ``1/attn_tp`` chunk and the combined rows are all-gathered over
  ``attn_tp``: no pair is computed twice. DP attention needs nothing more: the ``ep`` group
  spans every DP rank and an idle rank sends and receives zero rows. Requires
  ``moe_tp_size == 1`` (pairs are whole-expert work).

NOTE: on CPU the all-to-all is flotilla's ``torch.distributed`` collective
(:meth:`~flotilla.cluster.distributed.Communicator.all_to_all`) whatever the resolved backend
name; the vendor kernels that names such as ``deepep`` or ``mooncake`` stand for (low-latency
dispatch into registered GPU buffers) are GPU work for a later issue. The exchange pattern
and the results are the same.

``moe_dp_size > 1`` (MoE data parallelism, which exchanges tokens over attention CP) is not
supported yet and fails at build time. Every collective here must be joined by every rank
of its group, so an idle DP rank still calls the layer with ``T == 0``.
"""

from __future__ import annotations

import math
from typing import Protocol, Sequence

import torch

from flotilla.cluster.models.base import ParallelLayout


class FusedMoE(Protocol):
    """What a dispatcher needs of the MoE layer it serves
    (:class:`flotilla.cluster.models.moe_layer.FusedMoE`, which builds its dispatcher here)."""

    slots_per_rank: int

    def slots_for(self, topk_ids: torch.Tensor, first_row: int = 0) -> torch.Tensor:
        """Physical slot of each (token, k) pair of ``topk_ids`` (logical expert ids)."""
        ...

    def compute(self, hidden: torch.Tensor, weights: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
        """This rank's experts on ``hidden`` for the pairs whose slot is local."""
        ...


def _moe_dp_size(parallel: ParallelLayout) -> int:
    """MoE data-parallel width: the engine group's world over ``ep x moe_tp`` (1 without comms)."""
    world = getattr(parallel.comms.get("tp"), "size", None)
    if world is None:
        return 1
    return max(1, world // (parallel.ep_size * parallel.moe_tp_size))


def make_dispatcher(parallel: ParallelLayout):
    """The token exchange for ``parallel`` (see the module docstring).

    Raises NotImplementedError for ``moe_dp_size > 1`` and for an all-to-all backend with
    ``moe_tp_size > 1``.
    """
    moe_dp = _moe_dp_size(parallel)
    if moe_dp > 1:
        raise NotImplementedError(
            f"MoE data parallelism is not supported yet (moe_dp_size={moe_dp} from a world of "
            f"{parallel.comms['tp'].size} ranks, ep_size={parallel.ep_size}, moe_tp_size={parallel.moe_tp_size}); "
            "use moe_dp_size=1 so that ep_size * moe_tp_size covers the engine group"
        )
    if parallel.ep_size == parallel.moe_tp_size == parallel.dp_size == 1:
        return LocalDispatch()
    if parallel.moe_a2a_backend == "none":
        return AllReduceDispatch(parallel)
    return AllToAllDispatch(parallel)


class LocalDispatch:
    """Every expert is on this rank and no other rank needs this layer's tokens."""

    def __call__(self, moe: "FusedMoE", hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return moe.compute(hidden, weights, moe.slots_for(ids))


class AllReduceDispatch:
    """Backend ``"none"``: all tokens on every rank, partial outputs all-reduced over ``tp``."""

    def __init__(self, parallel: ParallelLayout):
        self.parallel = parallel

    def __call__(self, moe: "FusedMoE", hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        num_tokens, start = hidden.shape[0], 0
        if self.parallel.dp_size > 1:
            dp = self.parallel.comm("attn_dp")
            # NOTE: one varlen gather of byte rows carries hidden, weights and ids together.
            packed, counts = dp.all_gather_varlen(pack_rows(hidden, weights, ids))
            hidden, weights, ids = unpack_rows(packed, [(t.dtype, t.shape[1:]) for t in (hidden, weights, ids)])
            start = sum(counts[: dp.rank])
        out = moe.compute(hidden, weights, moe.slots_for(ids))
        if self.parallel.ep_size * self.parallel.moe_tp_size > 1:
            out = self.parallel.comm("tp").all_reduce(out)
        return out[start : start + num_tokens]


class AllToAllDispatch:
    """Any backend other than ``"none"``: pairs dispatched to their experts' EP ranks and
    combined back with all-to-all over ``ep`` (moe_tp_size must be 1)."""

    def __init__(self, parallel: ParallelLayout):
        if parallel.moe_tp_size != 1:
            raise NotImplementedError(
                f"moe_a2a_backend={parallel.moe_a2a_backend!r} needs whole experts per rank, but moe_tp_size="
                f"{parallel.moe_tp_size} (tp_size / ep_size with ep_size={parallel.ep_size}); set ep_size equal to "
                "tp_size or use moe_a2a_backend='none'"
            )
        self.parallel = parallel

    def _attn_tp(self):
        return self.parallel.group if self.parallel.group is not None else self.parallel.comm("attn_tp")

    def __call__(self, moe: "FusedMoE", hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        parallel = self.parallel
        lo, hi = chunk_bounds(hidden.shape[0], parallel.tp_size, parallel.tp_rank)
        hidden, weights, ids = hidden[lo:hi], weights[lo:hi], ids[lo:hi]
        slots = moe.slots_for(ids, first_row=lo).reshape(-1)
        # Pairs ordered by destination rank (stable: a token's pairs keep their k order).
        dest = torch.div(slots, moe.slots_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)
        token_of_pair = torch.div(order, ids.shape[1], rounding_mode="floor")
        send_counts = torch.bincount(dest, minlength=parallel.ep_size).tolist()
        ep = parallel.comm("ep")
        payload = pack_rows(hidden[token_of_pair], slots[order].unsqueeze(1))
        received, recv_counts = ep.all_to_all(payload, send_counts)
        rows, row_slots = unpack_rows(received, [(hidden.dtype, hidden.shape[1:]), (torch.int64, (1,))])
        # NOTE: weight 1 per row: the bare expert output goes back, weighted by the sender.
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=rows.device)
        outputs, _ = ep.all_to_all(moe.compute(rows, ones, row_slots), recv_counts)
        pair_weights = weights.reshape(-1)[order].float().unsqueeze(1)
        combined = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        combined.index_add_(0, token_of_pair, outputs.float() * pair_weights)
        combined = combined.to(hidden.dtype)
        if parallel.tp_size > 1:
            combined, _ = self._attn_tp().all_gather_varlen(combined)
        return combined


def chunk_bounds(num_rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of chunk ``index`` when ``num_rows`` split into ``parts`` contiguous
    chunks whose sizes differ by at most one (the first ``num_rows % parts`` one longer)."""
    base, extra = divmod(num_rows, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (index < extra)


def pack_rows(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate tensors with the same row count as raw bytes: ``[N, total_bytes]`` uint8,
    so one collective moves rows of mixed dtypes (undo with :func:`unpack_rows`)."""
    num_rows = parts[0].shape[0]
    flat = [p.reshape(num_rows, math.prod(p.shape[1:])).contiguous().view(torch.uint8) for p in parts]
    return torch.cat(flat, dim=1)


def unpack_rows(packed: torch.Tensor, specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> list[torch.Tensor]:
    """Split :func:`pack_rows`' bytes back into tensors of ``(dtype, row shape)`` each."""
    num_rows, offset, out = packed.shape[0], 0, []
    for dtype, row_shape in specs:
        width = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        part = packed[:, offset : offset + width].contiguous().view(dtype)
        out.append(part.reshape(num_rows, *row_shape))
        offset += width
    if offset != packed.shape[1]:
        raise ValueError(f"unpack_rows: specs cover {offset} bytes per row, the rows hold {packed.shape[1]}")
    return out
