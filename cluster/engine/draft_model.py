"""``STANDALONE`` speculative decoding: a small draft model proposes, the target verifies.

The draft model runs in the engine's process on its own :class:`ModelRunner` (the target's
device and dtype, the draft's weights), with a KV pool of its own: a
:class:`~flotilla.cluster.engine.block_manager.KVBlockPool` as large as the target's, and one
draft-side :class:`Request` per target request in decode, holding the draft cache's view of
its tokens.

A round for ``k`` drafts: the draft request catches up with the target's tokens (what the
target accepted since the last round: the cached positions that still agree with the
target's tokens are kept, the rest recomputed), samples ``d_1`` greedily, then runs ``k - 1``
one-token steps for ``d_2..d_k``. All requests of a round share each of those ``k`` forward
passes. Drafting is greedy, so the drafts are a deterministic function of the tokens, which
is what target-only verification (:func:`~flotilla.cluster.engine.sampler.verify_drafts`)
needs to keep the target's distribution.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from flotilla.cluster.engine.block_manager import KVBlockPool
from flotilla.cluster.engine.request import Request
from flotilla.cluster.engine.scheduler import ScheduledRequest, SchedulerOutput
from flotilla.resolution import ResolvedConfig
from flotilla.resolution.frozen import thaw

# A draft request's output budget: the target's engine bounds the real one.
_UNBOUNDED = 1 << 40


class DraftModelProposer:
    """Drafts with a separate small model (see the module docstring).

    Args:
        runner: the draft model's :class:`~flotilla.cluster.engine.model_runner.ModelRunner`.
        target_vocab_size: the target's vocabulary; a draft model must share it.
    """

    name = "STANDALONE"

    def __init__(self, runner: Any, target_vocab_size: int):
        if runner.vocab_size != target_vocab_size:
            raise ValueError(
                f"speculative_draft_model_path: the draft model's vocabulary has {runner.vocab_size} tokens and the "
                f"target's {target_vocab_size}; a draft model must use the target's tokenizer"
            )
        self.runner = runner
        layout = runner.kv_layout
        self.pool = KVBlockPool(layout.num_blocks, layout.block_size, enable_prefix_caching=False)
        self._states: dict[str, Request] = {}

    @classmethod
    def from_config(cls, config: ResolvedConfig, source: Any, target_runner: Any) -> "DraftModelProposer":
        """The draft runner for ``--speculative-draft-model-path`` (its revision, load format
        and KV cache dtype from the ``speculative_draft_*`` fields), built in this process."""
        from flotilla.cluster.engine.model_runner import ModelRunner

        return cls(ModelRunner(draft_config(config), draft_source_of(config)), int(target_runner.vocab_size))

    def propose(self, wants: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        live = {request.request_id for request, _ in wants}
        for request_id in [r for r in self._states if r not in live]:
            self._drop(request_id)
        drafting: list[tuple[Request, int]] = []
        for request, limit in wants:
            draft = self._catch_up(request, limit)
            if draft is not None:
                drafting.append((draft, limit))
        drafts: dict[str, list[int]] = {d.request_id: [] for d, _ in drafting}
        step = 0
        while drafting:
            scheduled = SchedulerOutput()
            for draft, _ in drafting:
                start = draft.num_computed_tokens
                scheduled.scheduled.append(ScheduledRequest(draft, draft.num_tokens - start, start))
            with torch.inference_mode():
                tokens = self.runner.step_logits(scheduled).argmax(dim=-1).tolist()
            step += 1
            still = []
            for (draft, limit), token in zip(drafting, tokens):
                draft.num_computed_tokens = draft.num_tokens
                draft.all_token_ids.append(int(token))
                drafts[draft.request_id].append(int(token))
                if step < limit:
                    still.append((draft, limit))
            drafting = still
        return drafts

    def _catch_up(self, request: Request, limit: int) -> Request | None:
        """The draft request for ``request``, its tokens made the target's (the cached prefix
        that agrees kept) and blocks for ``limit`` drafts; None when the pool is short."""
        tokens = request.all_token_ids
        draft = self._states.get(request.request_id)
        if draft is None:
            draft = self._states[request.request_id] = Request(request.request_id, list(tokens), _UNBOUNDED)
        else:
            agree = _common_prefix(draft.all_token_ids, tokens)
            draft.num_computed_tokens = min(draft.num_computed_tokens, agree)
            draft.all_token_ids = list(tokens)
        draft.num_computed_tokens = min(draft.num_computed_tokens, len(tokens) - 1)
        # NOTE: the round writes the draft cache up to position len + limit - 2 (d_limit is
        # never fed); one more slot keeps the count simple.
        needed = self.pool.blocks_for_tokens(len(tokens) + limit) - len(draft.block_ids)
        if needed > 0:
            if not self.pool.can_allocate(needed):
                return None
            draft.block_ids += self.pool.allocate(needed)
        return draft

    def forget(self, request_id: str) -> None:
        if request_id in self._states:
            self._drop(request_id)

    def observe(self, step: Any) -> None:
        pass  # NOTE: the draft request catches up with the target's tokens when it next drafts

    def _drop(self, request_id: str) -> None:
        draft = self._states.pop(request_id)
        self.pool.free(draft.block_ids)
        draft.block_ids = []

    @property
    def num_held_blocks(self) -> int:
        """Draft-cache blocks held for requests in decode (0 once none is)."""
        return self.pool.num_used_blocks


def draft_source_of(config: ResolvedConfig) -> Any:
    """The :class:`ModelSource` of ``--speculative-draft-model-path`` at
    ``--speculative-draft-model-revision``; ValueError naming both when it is not found."""
    from flotilla.cluster.models.sources import resolve_model_source

    path = getattr(config, "speculative_draft_model_path", None)
    if path is None:
        raise ValueError("speculative_draft_model_path: this speculative algorithm needs a draft model; pass --speculative-draft-model-path")
    revision = getattr(config, "speculative_draft_model_revision", None)
    # NOTE: "main" is resolution's default for an unset revision: the cache's current
    # snapshot of a hub id, and no revision at all for a local path or the embedded model.
    try:
        return resolve_model_source(path, None if revision in (None, "main") else revision)
    except ValueError as exc:
        raise ValueError(f"speculative_draft_model_path={path!r}, speculative_draft_model_revision={revision!r}: {exc}") from None


def draft_config(config: ResolvedConfig) -> ResolvedConfig:
    """The config the draft runner is built with: the target's, one rank, with the draft's
    load format and KV cache dtype where set (``--speculative-draft-load-format``,
    ``--speculative-draft-kv-cache-dtype``)."""
    values = thaw(config.config)
    load_format = values.get("speculative_draft_load_format")
    if load_format is not None:
        values["load_format"] = load_format
    kv_dtype = values.get("speculative_draft_kv_cache_dtype")
    if kv_dtype is not None:
        values["kv_cache_dtype"] = kv_dtype
    return ResolvedConfig.build(values, dict(config.env), ())


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
