"""Hidden-state drafters: ``NEXTN`` (the target checkpoint's own MTP layers) and ``EAGLE``
(an EAGLE draft head), both reading the target's final hidden states.

DeepSeek-V3/V3.2 and GLM-4.5/GLM-5 checkpoints carry MTP layers, loaded into the model's
``mtp`` module (:mod:`flotilla.cluster.models.mtp`); an EAGLE head
(:mod:`flotilla.cluster.models.eagle`) is a separate small checkpoint. Either, at position
``p``, takes the embedding of token ``p + 1`` and the target's final hidden state at ``p`` and
predicts token ``p + 2``, attending over its own paged KV cache.

The cache shares the target's block layout and the requests' block ids (one more tensor set
per draft layer, as large as the target's pool), so the prefix cache covers it too: a cached
block holds the draft KV its positions got when they were first computed.

After every engine step (:meth:`HiddenStateProposer.observe`) the draft runs over the
positions the step computed and kept (a prefill chunk's, or a verify step's original and
accepted positions), with the tokens after them and the target's hidden states there (the
runner keeps them: ``ModelRunner.keep_hidden``): that writes their draft KV, and its output at
a decode's last position gives the first draft ``d_1``. :meth:`HiddenStateProposer.propose`
chains the rest as SGLang does for chain drafting (top-1): ``d_j`` from the draft at the next
position over ``d_{j-1}``'s embedding and the draft's own output before it, one batched
forward per draft. Those positions' blocks are taken from the scheduler's pool now (the verify
step needs them anyway); the KV they get is overwritten when the target's hidden states arrive
for them.

Drafting is greedy, so drafts are deterministic (see
:func:`~flotilla.cluster.engine.sampler.verify_drafts`). It runs beside an in-process
:class:`ModelRunner` only: a worker group's hidden states stay on its ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch

from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.scheduler import ScheduledRequest, SchedulerOutput


class _TokensFrom:
    """Token ids addressed by absolute position from ``start`` (what ``prepare_inputs`` reads
    as ``all_token_ids[p]`` and ``all_token_ids[a:b]``)."""

    def __init__(self, start: int, ids: list[int]):
        self.start, self.ids = start, ids

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            return self.ids[key.start - self.start : key.stop - self.start]
        return self.ids[key - self.start]


@dataclass
class _Positions:
    """What :meth:`ModelRunner.prepare_inputs` reads of a request, for a draft forward: the
    input token at each position, the block ids (the target request's own) and ``num_tokens``
    (the forward samples at its last position when they end there)."""

    all_token_ids: _TokensFrom
    block_ids: list[int]
    num_tokens: int
    sampling_params: Any = None
    draft_token_ids: list = field(default_factory=list)


@dataclass
class _Next:
    """A decode's first draft and what the chain goes on from: the draft's output at the
    request's last kept position ``position``."""

    position: int
    token: int
    hidden: torch.Tensor


def mtp_proposer(runner: Any, pool: Any) -> "HiddenStateProposer":
    """NEXTN: the target's MTP layers (its model's ``mtp`` module) draft."""
    draft = getattr(getattr(runner, "model", None), "mtp", None)
    if draft is None:
        raise ValueError(
            "speculative_algorithm: NEXTN drafts with the checkpoint's MTP layers, and this model has none "
            "(config.json's num_nextn_predict_layers is 0 or missing) or runs on a worker group; "
            "use NGRAM, or STANDALONE with a draft model"
        )
    return HiddenStateProposer(runner, pool, draft, "NEXTN")


def eagle_proposer(runner: Any, pool: Any, config: Any) -> "HiddenStateProposer":
    """EAGLE: the head at ``--speculative-draft-model-path`` drafts over the target's features."""
    from flotilla.cluster.engine.draft_model import draft_source_of
    from flotilla.cluster.models.eagle import load_eagle_head

    model = getattr(runner, "model", None)
    if model is None:
        raise ValueError("speculative_algorithm: EAGLE drafts beside an in-process model runner, not a worker group; serve on one rank")
    return HiddenStateProposer(runner, pool, load_eagle_head(model, draft_source_of(config)), "EAGLE")


class HiddenStateProposer:
    """Drafts with a module over the target's hidden states (see the module docstring).

    Args:
        runner: the target's in-process :class:`~flotilla.cluster.engine.model_runner.ModelRunner`.
        pool: the scheduler's KV block pool (the chain's positions take blocks from it).
        draft: the draft module: ``draft(input_ids, positions, hidden, kv_caches, meta)`` -> its
            output ``[T, H]``, ``compute_logits``, ``kv_cache_spec()``.
        name: the algorithm, for the start-up line and the stats.
    """

    def __init__(self, runner: Any, pool: Any, draft: Any, name: str):
        self.runner, self.draft, self.pool, self.name = runner, draft, pool, name
        runner.keep_hidden = True
        layout = runner.kv_layout
        dtype = runner.kv_caches[0][0].dtype
        spec = replace(draft.kv_cache_spec(), dtype=dtype)
        num_blocks = layout.num_blocks + (layout.scratch_block is not None)
        with torch.inference_mode():
            self.kv_caches = spec.allocate(num_blocks, layout.block_size, runner.device)
        self._next: dict[str, _Next] = {}

    # -- after a step: the draft KV of what it kept, and the first drafts ------------------------

    def observe(self, step: SchedulerOutput) -> None:
        hidden = self.runner.last_hidden
        if hidden is None:
            return
        items, rows, offset = [], [], 0
        for item in step.scheduled:
            request, start = item.request, item.start_position
            kept = request.num_computed_tokens - start
            if request.status is RequestStatus.RUNNING and kept > 0 and request.num_tokens > start + kept:
                # NOTE: position p's input is the token after it; a decode samples at its last.
                decoding = request.num_tokens_to_compute == 1
                after = _TokensFrom(start, request.all_token_ids[start + 1 : start + kept + 1])
                shifted = _Positions(after, request.block_ids, start + kept + (0 if decoding else 1))
                items.append((request, ScheduledRequest(shifted, kept, start), decoding))
                rows.append(hidden[offset : offset + kept])
            else:
                self._next.pop(request.request_id, None)
            offset += item.num_new_tokens
        self.runner.last_hidden = None
        if not items:
            return
        out, logits = self._forward([s for _, s, _ in items], torch.cat(rows))
        sampled = iter(zip(logits.argmax(dim=-1).tolist(), out))
        for request, scheduled, decoding in items:
            if decoding:
                token, state = next(sampled)
                last = scheduled.start_position + scheduled.num_new_tokens - 1
                self._next[request.request_id] = _Next(last, int(token), state)
            else:
                self._next.pop(request.request_id, None)

    # -- before a step: the chain ------------------------------------------------------------------

    def propose(self, wants: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        chains: list[list] = []  # [request, drafts wanted, the chain's last _Next]
        for request, limit in wants:
            state = self._next.get(request.request_id)
            # NOTE: the first draft follows the request's last kept position, num_tokens - 2.
            if state is None or state.position != request.num_tokens - 2:
                continue
            drafts[request.request_id] = [state.token]
            # The chain writes positions up to num_tokens + limit - 3: blocks through them.
            while limit > 1 and not self._blocks_for(request, request.num_tokens + limit - 2):
                limit -= 1
            if limit > 1:
                chains.append([request, limit, state])
        depth = 1
        while chains:
            scheduled = []
            for request, _, state in chains:
                position = state.position + 1
                inputs = _Positions(_TokensFrom(position, [state.token]), request.block_ids, position + 1)
                scheduled.append(ScheduledRequest(inputs, 1, position))
            out, logits = self._forward(scheduled, torch.stack([state.hidden for _, _, state in chains]))
            depth += 1
            for chain, token, hidden in zip(chains, logits.argmax(dim=-1).tolist(), out):
                drafts[chain[0].request_id].append(int(token))
                chain[2] = _Next(chain[2].position + 1, int(token), hidden)
            chains = [chain for chain in chains if chain[1] > depth]
        return drafts

    def forget(self, request_id: str) -> None:
        self._next.pop(request_id, None)

    # -- helpers -----------------------------------------------------------------------------------

    def _blocks_for(self, request: Request, num_tokens: int) -> bool:
        """Make ``request``'s blocks cover ``num_tokens`` positions; False when the pool is short."""
        needed = self.pool.blocks_for_tokens(num_tokens) - len(request.block_ids)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        request.block_ids += self.pool.allocate(needed)
        return True

    @torch.inference_mode()
    def _forward(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft over ``scheduled`` (its inputs: the tokens after each position, and
        ``hidden`` [T, H] in the same order); ``(its output at each sampling position, their logits)``."""
        step = SchedulerOutput(scheduled=scheduled)
        input_ids, positions, meta, sample_index = self.runner.prepare_inputs(step)
        if meta.plan is None and meta.num_seqs > 0:
            self.runner.planner.plan(meta)
        out = self.draft(input_ids, positions, hidden, self.kv_caches, meta)
        chosen = out.index_select(0, sample_index)
        return chosen, self.draft.compute_logits(chosen).float()
