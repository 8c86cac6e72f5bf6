"""Speculative decoding: a proposer drafts tokens, the target model checks them all in one step.

One round, inside :meth:`LLMEngine.step <flotilla.cluster.engine.llm_engine.LLMEngine.step>`:

1. propose (:meth:`Speculator.propose`): each running request in decode (one token to
   compute) that may take drafts gets up to ``k`` of them on ``Request.draft_token_ids``,
   where ``k = --speculative-num-draft-tokens - 1`` for NGRAM (SGLang counts the verified
   token as the draft tree's root) and ``--speculative-num-steps`` for the others, and never
   more than its ``max_tokens`` leaves room for. Embedding requests take none; a constrained
   request's drafts are cut where its grammar stops allowing them, and its bitmask after each
   draft masks that position;
2. schedule: the scheduler computes ``1 + k`` positions for such a request (fewer when the
   step's token budget or the KV pool is short: drafts are dropped before anyone is preempted);
3. verify: the runner keeps the logits of every position, and the sampler samples each as it
   would sample one token, then accepts drafts while the sample equals the draft
   (:func:`~flotilla.cluster.engine.sampler.verify_drafts`, which says why greedy and sampled
   outputs are the target's own);
4. accept: ``Scheduler.update`` appends the emitted tokens (``1 + accepted``), counts the
   accepted drafts' KV as computed and frees the blocks past the request's tokens; the engine
   checks stop conditions token by token, so stop strings, EOS and ``max_tokens`` end the
   completion where they would without speculation (later tokens are dropped);
5. observe (``Proposer.observe``): a hidden-state drafter reads what the step computed.

Proposers (``--speculative-algorithm``): ``NGRAM`` (:class:`NgramProposer`: lookup in a trie
of the requests' own tokens, no draft model), ``STANDALONE``
(:class:`~flotilla.cluster.engine.draft_model.DraftModelProposer`: a small draft model with a
KV pool of its own), ``NEXTN`` and ``EAGLE``
(:class:`~flotilla.cluster.engine.hidden_state_draft.HiddenStateProposer`: the checkpoint's MTP
layers, or an EAGLE-1 head, over the target's hidden states). All draft deterministically (a
chain, the most likely continuation), which is what makes target-only verification exact.
Overlap scheduling is off while speculating (the next step's input depends on what this one
accepts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from flotilla.cluster.engine.request import Request

ALGORITHMS = ("NGRAM", "STANDALONE", "NEXTN", "EAGLE")


class Proposer(Protocol):
    """Drafts tokens for requests in decode."""

    name: str

    def propose(self, wants: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        """Drafts for ``(request, at most k)`` pairs, by request id (fewer, or none, where
        the proposer has nothing). Called once per step, before the step is scheduled, with
        every request that may take drafts this step; a request not in ``wants`` has left
        decode (preempted, constrained), and its proposer state may be dropped."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what the proposer holds for a finished request (no-op for one it never saw)."""
        ...

    def observe(self, step: Any) -> None:
        """After each step (its requests updated): what a drafter that reads the step's hidden
        states takes from it (NEXTN); a no-op for the others."""
        ...


@dataclass
class SpecDecodeStats:
    """What speculation did so far (vLLM's ``spec_decode_*`` counters).

    Attributes:
        num_drafts: draft rounds verified (a request verifying at least one draft in a step).
        num_draft_tokens: drafted tokens verified.
        num_accepted_tokens: drafted tokens accepted.
        accepted_lengths: accepted drafts per round, since the last :meth:`take_accepted_lengths`.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.accepted_lengths.append(num_accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified drafted tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def take_accepted_lengths(self) -> list[int]:
        taken, self.accepted_lengths = self.accepted_lengths, []
        return taken


class Speculator:
    """The engine's side of speculation: which requests draft, how many, and the counts.

    Args:
        proposer: drafts tokens (see :class:`Proposer`).
        num_draft_tokens: ``k``, the most drafts a request verifies in one step.
    """

    def __init__(self, proposer: Proposer, num_draft_tokens: int):
        if num_draft_tokens < 1:
            raise ValueError(f"speculative decoding needs at least one draft per step (got k={num_draft_tokens}): raise --speculative-num-draft-tokens or --speculative-num-steps")
        self.proposer = proposer
        self.num_draft_tokens = num_draft_tokens
        self.stats = SpecDecodeStats()

    @property
    def name(self) -> str:
        return self.proposer.name

    def propose(self, running: Sequence[Request], may_draft: Any) -> None:
        """Set ``draft_token_ids`` on every request of ``running`` (empty where it drafts
        nothing). ``may_draft(request)`` says whether a request may verify drafts at all."""
        wants = []
        for request in running:
            request.draft_token_ids = []
            if request.num_tokens_to_compute != 1 or not may_draft(request):
                continue
            room = request.max_tokens - request.num_output_tokens - 1
            if room > 0:
                wants.append((request, min(room, self.num_draft_tokens)))
        drafts = self.proposer.propose(wants)
        for request, limit in wants:
            request.draft_token_ids = list(drafts.get(request.request_id, ()))[:limit]


def _num_drafts(config: Any, algorithm: str) -> int:
    """``k``, the drafts a request verifies per step, from the resolved config."""
    # NOTE: NGRAM's draft tree counts the verified token as its root; STANDALONE drafts one
    # token per draft-model step (resolution sets num_draft_tokens = num_steps + 1 for it).
    field = "speculative_num_draft_tokens" if algorithm == "NGRAM" else "speculative_num_steps"
    size = getattr(config, field, None)
    if size is None:
        raise ValueError(f"{field}: unset for speculative_algorithm={algorithm}; resolve the config first")
    return int(size) - 1 if algorithm == "NGRAM" else int(size)


def _drafts_from_the_target(config: Any) -> bool:
    """EAGLE/NEXTN with the target's own checkpoint as the draft (its MTP layers)."""
    path = getattr(config, "speculative_draft_model_path", None)
    return path is None or path == getattr(config, "model_path", None)


def speculative_algorithm_of(config: Any) -> str | None:
    """The resolved ``--speculative-algorithm`` in capitals, or None when speculation is off."""
    algorithm = getattr(config, "speculative_algorithm", None)
    if algorithm is None or str(algorithm).upper() == "NONE":
        return None
    return str(algorithm).upper()


def speculation_summary(config: Any) -> dict[str, Any] | None:
    """What speculation a config runs, for ``/v1/models`` and ``flotilla serve``'s ready
    line: ``{"algorithm", "num_draft_tokens"}`` (drafts per step) and, for STANDALONE,
    ``"draft_model"``; None when it is off."""
    algorithm = speculative_algorithm_of(config)
    if algorithm is None:
        return None
    shown = "NEXTN" if algorithm == "EAGLE" and _drafts_from_the_target(config) else algorithm
    summary: dict[str, Any] = {"algorithm": shown, "num_draft_tokens": _num_drafts(config, algorithm)}
    if algorithm == "STANDALONE":
        summary["draft_model"] = getattr(config, "speculative_draft_model_path", None)
    return summary


def speculator_for(config: Any, source: Any, runner: Any, scheduler: Any) -> Speculator | None:
    """The speculator ``config`` asks for (None without ``--speculative-algorithm``).

    ``source`` and ``runner`` are the target's (a draft model must share its vocabulary and
    device; NEXTN drafts with the runner's own model), ``scheduler`` its scheduler (NEXTN
    takes blocks from its pool). The runtime-support table refuses the algorithms and settings
    not built here before an engine starts; the checks below are for engines built from a
    config directly."""
    algorithm = speculative_algorithm_of(config)
    if algorithm is None:
        return None
    if not hasattr(scheduler, "running"):
        raise NotImplementedError(
            f"speculative_algorithm={algorithm} needs a single-pool scheduler ({type(scheduler).__name__} is not one): "
            "drop --enable-dp-attention or --speculative-algorithm"
        )
    k = _num_drafts(config, algorithm)
    if algorithm == "NGRAM":
        proposer: Proposer = NgramProposer(
            max_trie_depth=int(config.speculative_ngram_max_trie_depth),
            capacity=int(config.speculative_ngram_capacity),
        )
    elif algorithm == "STANDALONE":
        from flotilla.cluster.engine.draft_model import DraftModelProposer

        proposer = DraftModelProposer.from_config(config, source, runner)
    elif algorithm == "EAGLE":
        from flotilla.cluster.engine.hidden_state_draft import eagle_proposer, mtp_proposer

        # NOTE: resolution spells NEXTN as EAGLE, with the target's checkpoint as the draft.
        if _drafts_from_the_target(config):
            proposer = mtp_proposer(runner, scheduler.pool)
        else:
            proposer = eagle_proposer(runner, scheduler.pool, config)
    else:
        raise ValueError(f"speculative_algorithm={algorithm} is not built; use one of {', '.join(ALGORITHMS)}")
    return Speculator(proposer, k)


class NgramProposer:
    """Drafts by looking the request's latest tokens up in a trie of the tokens seen so far
    (every running request's prompt and output; SGLang's n-gram cache, as one chain).

    The trie holds every window of up to ``max_trie_depth`` consecutive tokens, each node
    with how often its window occurred. A request's draft: the longest suffix of its tokens
    (at most ``max_trie_depth - k`` tokens, so that ``k`` tokens can follow within the
    trie's depth) whose node has children, then the most frequent child, ``k`` times or
    until a leaf. Insertion is incremental: each new token extends the windows that end at
    it (``max_trie_depth`` dictionary steps per token).

    Args:
        max_trie_depth: longest window stored (``--speculative-ngram-max-trie-depth``).
        capacity: most trie nodes (``--speculative-ngram-capacity``); a full trie is
            cleared and refilled from the tokens that arrive after.
    """

    name = "NGRAM"

    def __init__(self, max_trie_depth: int = 18, capacity: int = 10_000_000):
        if max_trie_depth < 2:
            raise ValueError(f"speculative_ngram_max_trie_depth must be at least 2 (got {max_trie_depth})")
        if capacity < 1:
            raise ValueError(f"speculative_ngram_capacity must be positive (got {capacity})")
        self.max_trie_depth = max_trie_depth
        self.capacity = capacity
        # A node: token -> [count, children]; the root's children start every window.
        self.root: dict[int, list] = {}
        self.num_nodes = 0
        self.num_clears = 0
        # Per request: (tokens inserted so far, the open windows' nodes, oldest first).
        self._states: dict[str, tuple[int, list[dict]]] = {}

    def propose(self, wants: Sequence[tuple[Request, int]]) -> dict[str, list[int]]:
        live = {request.request_id for request, _ in wants}
        for request_id in [r for r in self._states if r not in live]:
            del self._states[request_id]
        drafts = {}
        for request, limit in wants:
            self._insert(request)
            draft = self._match(request.all_token_ids, limit)
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def observe(self, step: Any) -> None:
        pass  # NOTE: the trie takes a request's new tokens when it next drafts

    def _insert(self, request: Request) -> None:
        seen, windows = self._states.get(request.request_id, (0, []))
        tokens = request.all_token_ids
        keep = self.max_trie_depth - 1
        for token in tokens[seen:]:
            extended = []
            for node in [*windows, self.root]:
                entry = node.get(token)
                if entry is None:
                    entry = node[token] = [0, {}]
                    self.num_nodes += 1
                entry[0] += 1
                extended.append(entry[1])
            # NOTE: a window of max_trie_depth tokens is complete; the others may grow.
            windows = extended[-keep:]
            if self.num_nodes > self.capacity:
                self._clear()
                windows = []
        self._states[request.request_id] = (len(tokens), windows)

    def _clear(self) -> None:
        self.root, self.num_nodes = {}, 0
        self.num_clears += 1
        self._states = {request_id: (seen, []) for request_id, (seen, _) in self._states.items()}

    def _match(self, tokens: Sequence[int], limit: int) -> list[int]:
        longest = min(len(tokens), max(1, self.max_trie_depth - limit))
        for length in range(longest, 0, -1):
            node = self.root
            for token in tokens[len(tokens) - length :]:
                entry = node.get(token)
                if entry is None:
                    break
                node = entry[1]
            else:
                if node:
                    return _most_frequent_chain(node, limit)
        return []


def _most_frequent_chain(node: dict[int, list], limit: int) -> list[int]:
    """Follow the most frequent child from ``node`` up to ``limit`` times (ties: the token
    seen first, dictionaries keeping insertion order)."""
    chain = []
    while node and len(chain) < limit:
        token, entry = max(node.items(), key=lambda item: item[1][0])
        chain.append(token)
        node = entry[1]
    return chain
