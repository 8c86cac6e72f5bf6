"""``LLMEngine``: requests in, token deltas out, one ``step()`` at a time.

A step is three calls: ``scheduler.schedule()`` picks the requests and token
counts, ``runner.execute()`` runs the forward pass and samples, and
``_update()`` appends the tokens, detokenizes them, checks the stop conditions
and finishes requests (which frees their blocks at once). With overlap scheduling
(on by default for an in-process CUDA runner, off with ``--disable-overlap-schedule``;
:mod:`~flotilla.cluster.engine.overlap`) a step launches the next forward before it
reads the previous step's tokens, so each ``step()`` returns the deltas of the step
before it and one more ``step()`` drains the last. ``n > 1`` requests are
``n`` child sequences over the same prompt: the prefix cache shares the prompt's
full blocks among them. With speculative decoding (``--speculative-algorithm``,
:mod:`~flotilla.cluster.engine.speculative`) a step first has the proposer draft tokens for
the requests in decode, verifies them in the same forward, and may emit several tokens
per request (one delta holding them all).

Bad input (empty prompt, a prompt that does not fit the context, bad sampling
parameters, unknown stop token ids) raises ``ValueError`` from
:meth:`LLMEngine.add_request` before anything is queued, so the engine keeps
serving the requests it has.

A failing runner (a dead worker rank, a collective or step that ran out of time) fails
every in-flight request: each completion finishes with reason ``"error"`` and the
message in ``RequestOutput.error``, its KV blocks are freed, and the engine refuses new
requests with :class:`EngineDeadError` until :meth:`LLMEngine.restart` builds a fresh
runner. Every wait is bounded, so this happens within the runner's timeouts.

A decode engine of a KV handoff admits a prefilled request
(:meth:`LLMEngine.add_prefilled_request`) as waiting for its KV: the request holds its blocks
and a running slot while the runner's ``kv`` handle reads the prompt's KV on the ranks' own
threads (:mod:`~flotilla.cluster.engine.remote_kv`), and every step meanwhile serves the
others. The step that sees the read ended puts the request in the batch (its first token is
that step's delta), or applies ``kv_load_failure_policy``. With nothing else to run the step
waits a few milliseconds for a read instead of spinning.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from flotilla.cluster.engine.detokenizer import IncrementalDetokenizer, find_stop_string, stop_holdback
from flotilla.cluster.engine.dp_scheduler import build_scheduler
from flotilla.cluster.engine.grammar import GrammarState, grammar_backend_for, no_backend_error
from flotilla.cluster.engine.kv_contract import (
    DEFAULT_KV_READ_TIMEOUT_S,
    KVHandoffError,
    KVReader,
    PrefillTicket,
    check_policy,
)
from flotilla.cluster.engine.model_runner import KVCacheLayout, max_num_seqs_for
from flotilla.cluster.engine.outputs import CompletionDelta, CompletionOutput, Logprob, RequestOutput, StepLogprobs
from flotilla.cluster.engine.overlap import PENDING_TOKEN, InflightStep, can_feed
from flotilla.cluster.engine.remote_kv import IDLE_WAIT_S, RemoteKVReads
from flotilla.cluster.engine.request import Request, RequestStatus
from flotilla.cluster.engine.runner_factory import RunnerSpec, build_runner
from flotilla.cluster.engine.sampler import SampledToken, SamplingRow
from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.cluster.engine.schedule_policy import PriorityPolicy
from flotilla.cluster.engine.scheduler import SchedulerConfig, UnschedulableRequestError
from flotilla.cluster.engine.speculative import speculator_for
from flotilla.cluster.models.sources import ModelSource, context_len_of
from flotilla.resolution import ResolvedConfig

# NOTE: "error" here is a completion whose token its grammar refused (see _update).
_FINISH_STATUS = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "error": RequestStatus.FINISHED_ABORTED,
}


def scheduler_config_for(config: ResolvedConfig, kv: KVCacheLayout) -> SchedulerConfig:
    """The scheduler's budgets from the resolved config and the KV pool that was allocated.

    ``--chunked-prefill-size`` is the step token budget (``-1`` turns chunking off, and the
    budget becomes ``--max-prefill-tokens``); ``--max-running-requests`` caps running requests
    (default 256; capped at the step budget so each can decode every step);
    ``--disable-radix-cache`` turns prefix caching off; ``--enable-hierarchical-cache`` gives it
    the host tier the runner allocated (``kv.host_blocks``); ``--schedule-policy``,
    ``--prefill-max-requests`` and the priority flags order and cap admission.
    """
    chunk = config.chunked_prefill_size
    chunked = chunk is not None and chunk > 0
    budget = chunk if chunked else int(config.max_prefill_tokens or 16384)
    # NOTE: kv.num_blocks excludes the runner's scratch block (CUDA graphs), so the pool never
    # hands it out; max_num_seqs_for caps running requests at the step budget.
    return SchedulerConfig(
        num_blocks=kv.num_blocks,
        block_size=kv.block_size,
        max_num_seqs=max_num_seqs_for(config),
        max_num_batched_tokens=int(budget),
        enable_prefix_caching=not config.disable_radix_cache,
        enable_chunked_prefill=chunked,
        num_host_blocks=kv.host_blocks,
        policy=config.schedule_policy or "fcfs",
        priority=priority_policy_for(config),
        max_new_requests=int(config.prefill_max_requests) if config.prefill_max_requests else None,
        seed=int(config.random_seed or 0),
    )


def priority_policy_for(config: ResolvedConfig) -> PriorityPolicy | None:
    """The scheduler's priority policy (``--enable-priority-scheduling``,
    ``--schedule-low-priority-values-first``, ``--disable-priority-preemption``,
    ``--priority-scheduling-preemption-threshold``), or None when priorities are off."""
    if not config.enable_priority_scheduling:
        return None
    return PriorityPolicy(
        low_values_first=bool(config.schedule_low_priority_values_first),
        preemption=not config.disable_priority_preemption,
        preemption_threshold=int(config.priority_scheduling_preemption_threshold),
    )


@dataclass
class _Sequence:
    """One completion being generated (engine-side state next to the scheduler's Request)."""

    request: Request
    parent: "_Parent"
    params: SamplingParams
    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None
    holdback: int
    streamed_chars: int = 0
    # The completion's grammar (a constrained request), else None.
    grammar: GrammarState | None = None
    # Speculative decoding: the grammar's bitmask after each of this step's drafts.
    draft_bitmasks: list = field(default_factory=list)


@dataclass
class _Parent:
    """A user request: its prompt and its ``n`` completions."""

    output: RequestOutput
    sequences: list[_Sequence] = field(default_factory=list)
    streaming: bool = False


def _replay_streamed(seq: _Sequence, token_ids: list[int]) -> None:
    """Bring a resumed completion to where the engine that streamed ``token_ids`` left it:
    the tokens recorded, their text decoded, and as much of it counted as streamed as that
    engine let out (everything but the stop strings' holdback: the visible length only grows,
    so after the last token it is the text's length less the holdback)."""
    completion = seq.completion
    completion.token_ids.extend(token_ids)
    if seq.detokenizer is not None:
        for token in token_ids:
            completion.text += seq.detokenizer.add(token)
    seq.streamed_chars = max(len(completion.text) - seq.holdback, 0)


class EngineDeadError(RuntimeError):
    """The model runner failed; in-flight requests were failed and the engine needs
    :meth:`LLMEngine.restart` before it accepts requests again."""


class LLMEngine:
    """The offline engine: the model runs in this process at one rank, on a Ray worker group at tp_size > 1.

    Args:
        config: the resolved configuration (resolved once by the caller).
        source: the model to load.
        tokenizer: an HF tokenizer for detokenization and stop strings; without one,
            completions carry token ids only (``text`` stays empty).
        runner: a prebuilt runner (built from ``config``, ``source`` and ``runner_spec`` when None).
        runner_spec: how :func:`~flotilla.cluster.engine.runner_factory.build_runner` builds the
            runner (where the ranks run, their Ray resources, a KV endpoint to attach); kept for
            :meth:`restart`. Default: the config decides (:class:`RunnerSpec`).
        placement: shorthand for ``runner_spec=RunnerSpec.from_placement(placement)``: Ray
            resources that ranks on a worker group need besides their CPU or GPU
            (``{"ranks": {...}, "joiners": {...}}``).
        overlap: overlap scheduling (see the module docstring); None: on when the runner
            can launch steps ahead (an in-process runner has ``launch``; a worker group says
            so in ``supports_overlap``), the model runs on CUDA and the config does not set
            ``disable_overlap_schedule``. True forces it on any such runner (CPU tests of the
            bookkeeping).
    """

    def __init__(
        self,
        config: ResolvedConfig,
        source: ModelSource,
        tokenizer: Any = None,
        runner: Any = None,
        placement: dict[str, dict[str, float]] | None = None,
        overlap: bool | None = None,
        runner_spec: RunnerSpec | None = None,
    ):
        if runner_spec is not None and placement is not None:
            raise ValueError("give runner_spec or placement, not both (placement is RunnerSpec.from_placement's shorthand)")
        self.config = config
        self.source = source
        self.tokenizer = tokenizer
        self.runner_spec = runner_spec or RunnerSpec.from_placement(placement)
        self.runner = runner or build_runner(config, source, self.runner_spec)
        # NOTE: a DPScheduler (one scheduler per DP-attention rank) under DP attention.
        self.scheduler = build_scheduler(config, scheduler_config_for(config, self.runner.kv_layout))
        self.vocab_size = self.runner.vocab_size
        self.context_len = context_len_of(config, source)
        self.eos_token_ids = _eos_ids(source.config_dict, tokenizer)
        # Constrained decoding (--grammar-backend; None: "none", or no tokenizer).
        self.grammars = grammar_backend_for(config, tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self._parents: dict[str, _Parent] = {}
        self._sequences: dict[str, _Sequence] = {}
        self._pending: list[CompletionDelta] = []
        self._backlog: dict[str, list[CompletionDelta]] = {}
        self._ids = itertools.count()
        # Requests whose KV blocks outlive them (add_request(hold_kv=True)), until they finish.
        self._hold_kv: set[str] = set()
        # Set when the runner failed (a worker died, a collective timed out): see restart().
        self.dead: EngineDeadError | None = None
        # Speculative decoding (--speculative-algorithm; None when off).
        self.speculator = speculator_for(config, source, self.runner, self.scheduler)
        self.overlap = self._overlap_wanted(overlap)
        # The launched step whose tokens are still on the device (overlap scheduling).
        self._inflight: InflightStep | None = None
        # KV reads of prefilled requests in flight (decode side of a handoff).
        self.remote_kv = RemoteKVReads()

    def _overlap_wanted(self, overlap: bool | None) -> bool:
        # NOTE: a worker group says itself whether its steps pipeline (GroupRunner.supports_overlap).
        supported = getattr(self.runner, "supports_overlap", hasattr(self.runner, "launch"))
        if self.speculator is not None:
            # NOTE: a step's input depends on the drafts the previous one accepted.
            if overlap:
                raise ValueError("overlap=True cannot run with speculative decoding: each step waits for the drafts the last one accepted")
            return False
        if overlap is not None:
            if overlap and not supported:
                raise ValueError(f"overlap=True needs a runner that can launch steps ahead; {type(self.runner).__name__} cannot")
            return overlap
        device = getattr(self.runner, "device", None)
        # NOTE: a worker group's driver-side device is the CPU; its ranks' is the config's.
        on_cuda = (device is not None and torch.device(device).type == "cuda") or self.config.device == "cuda"
        return supported and on_cuda and not bool(getattr(self.config, "disable_overlap_schedule", False))

    # -- requests ----------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
        hold_kv: bool = False,
        priority: int | None = None,
        resumed_token_ids: Sequence[int] = (),
    ) -> str:
        """Queue a request; returns its id. ValueError (naming the parameter) for bad input.

        ``stream=True`` keeps this request's deltas for :meth:`stream` while other
        requests are being streamed. ``hold_kv=True`` (prefill side of a KV handoff,
        ``n == 1`` only) keeps the request's KV blocks when it finishes, until
        :meth:`release_kv`; see :mod:`flotilla.cluster.engine.kv_handoff`. ``priority``:
        the request's priority under ``--enable-priority-scheduling`` (None:
        ``--default-priority-value``, else 0); see :meth:`priority_of`.

        ``resumed_token_ids`` (a migrated request, ``n == 1``): tokens another engine already
        generated and streamed for this request. They are its first outputs here: they count
        against ``max_tokens`` and in penalties, stop strings and its grammar, their KV is
        computed with the prompt's, and the stream goes on with the token after them (nothing
        is streamed for them; text that one of the request's stop strings might still claim
        was held back there and is held back here too).
        """
        if self.dead is not None:
            raise self.dead
        params = params or SamplingParams()
        resumed = [int(t) for t in resumed_token_ids]
        if resumed and (params.n != 1 or hold_kv or params.pooling is not None):
            raise ValueError(
                f"resumed_token_ids: only a generating request with n=1 resumes (got n={params.n}, "
                f"hold_kv={hold_kv}, pooling={params.pooling!r})"
            )
        if hold_kv:
            _require_handoff_support(self.scheduler)
            if params.n != 1:
                raise ValueError(f"hold_kv=True needs n=1 (got n={params.n}): one completion holds one prompt's KV")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use; request ids must be unique")
        max_tokens = self._validate(prompt_token_ids, params)
        if len(resumed) >= max_tokens:
            raise ValueError(
                f"resumed_token_ids: {len(resumed)} tokens already reach max_tokens={max_tokens}; nothing is left to generate"
            )
        if params.pooling is not None:
            _check_pooling(params, hold_kv)
            max_tokens = 1  # NOTE: the step that would sample its first token pools instead
        level = self.priority_of(priority)
        output = RequestOutput(request_id, prompt, prompt_token_ids, [])
        parent = _Parent(output, streaming=stream)
        children = [params] if params.n == 1 else [params.for_child(i) for i in range(params.n)]
        # NOTE: before anything is queued: a constraint that does not compile leaves no trace.
        grammars = [self._grammar_state(child) for child in children]
        if resumed and grammars[0] is not None:
            for position, token in enumerate(resumed):
                if not grammars[0].accept(token):
                    raise ValueError(
                        f"resumed_token_ids: token {token} at position {position} is not allowed by the request's constraint"
                    )
        requests = []
        for index, child in enumerate(children):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            if child_id in self._sequences:
                raise ValueError(f"request_id {request_id!r} clashes with a live completion {child_id!r}; use another id")
            skip_cache = child.pooling == "mean"
            requests.append(Request(child_id, prompt_token_ids, max_tokens, sampling_params=child, priority=level, skip_prefix_cache=skip_cache))
        for token in resumed:
            requests[0].append_output_token(token)
        limit = self.scheduler.max_tokens_per_request()
        if len(prompt_token_ids) + max_tokens > limit:
            raise ValueError(
                f"max_tokens: the request needs {len(prompt_token_ids) + max_tokens} tokens of KV cache "
                f"({len(prompt_token_ids)} prompt + max_tokens={max_tokens}), more than the {limit} one request may "
                f"use here; lower max_tokens or raise --max-total-tokens"
            )
        for index, (child, request) in enumerate(zip(children, requests)):
            self.scheduler.add(request)
            completion = CompletionOutput(index, logprobs=[] if child.logprobs is not None else None)
            if child.logprobs is not None:
                completion.cumulative_logprob = 0.0
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, child.skip_special_tokens)
            generator = self.runner.generator_for(child.seed) if child.seed is not None else None
            seq = _Sequence(request, parent, child, completion, detok, generator, stop_holdback(child.stop_strings))
            seq.grammar = grammars[index]
            if resumed:
                _replay_streamed(seq, resumed)
            parent.sequences.append(seq)
            output.outputs.append(completion)
            self._sequences[request.request_id] = seq
        self._parents[request_id] = parent
        if hold_kv:
            self._hold_kv.add(request_id)
        return request_id

    def _grammar_state(self, params: SamplingParams) -> GrammarState | None:
        """A constrained completion's grammar state (None without ``params.guided``);
        ValueError naming the request parameter when it cannot run or compile."""
        if params.guided is None:
            return None
        if self.grammars is None:
            raise no_backend_error(params.guided, self.config, self.tokenizer)
        return self.grammars.state_for(params.guided)

    def priority_of(self, priority: int | None) -> int:
        """The scheduling priority of a request that asked for ``priority``: its own value
        under ``--enable-priority-scheduling`` (``--default-priority-value``, else 0, when it
        gives none); 0 when priorities are off, where a given priority is a ValueError with
        ``--abort-on-priority-when-disabled`` (SGLang's behaviour) and ignored without it."""
        config = self.config
        if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 2**31):
            raise ValueError(f"priority must be an integer in (-2**31, 2**31) (got priority={priority!r})")
        if not config.enable_priority_scheduling:
            if priority is not None and config.abort_on_priority_when_disabled:
                raise ValueError(
                    f"priority: this server does not schedule by priority (got priority={priority}); "
                    "send the request without it, or start the server with --enable-priority-scheduling"
                )
            return 0
        if priority is None:
            return int(config.default_priority_value or 0)
        return priority

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; returns the effective max_tokens."""
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: the prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token id {bad[0]} is outside this model's vocabulary (size {self.vocab_size})"
            )
        if len(prompt_token_ids) >= self.context_len:
            raise ValueError(
                f"prompt_token_ids: the prompt has {len(prompt_token_ids)} tokens, but the context length is "
                f"{self.context_len} (max_position_embeddings or --context-length); the prompt must be shorter "
                f"to leave room for at least one generated token"
            )
        params.verify_for_model(self.vocab_size)
        room = self.context_len - len(prompt_token_ids)
        if params.max_tokens is None:
            # NOTE: "until the context is full", but never more than one request may hold.
            room = min(room, self.scheduler.max_tokens_per_request() - len(prompt_token_ids))
            return max(room, 1)
        return min(params.max_tokens, room)

    def abort(self, request_id: str) -> bool:
        """Cancel a request (all its completions); its KV blocks are free on return.
        Returns False when no unfinished request has this id."""
        parent = self._parents.get(request_id)
        if parent is None:
            return False
        aborted = False
        for seq in parent.sequences:
            if seq.completion.finish_reason is None and self.scheduler.abort(seq.request.request_id):
                self._finish(seq, "abort", None)
                delta = CompletionDelta(request_id, seq.completion.index, [], "", None, "abort")
                self._keep_for_stream(delta)
                self._pending.append(delta)
                aborted = True
        return aborted

    def has_unfinished_requests(self) -> bool:
        """Whether stepping still has work: live requests, a launched step, or KV reads in
        flight (an aborted request's read too: its blocks are freed when it ends)."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self.remote_kv)

    def get_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (complete once ``finished``)."""
        parent = self._parents[request_id]
        first = parent.sequences[0].request
        parent.output.num_cached_tokens = first.num_cached_prompt_tokens
        return parent.output

    def pop_output(self, request_id: str) -> RequestOutput:
        """:meth:`get_output`, then forget a finished request."""
        output = self.get_output(request_id)
        if not output.finished:
            raise ValueError(f"request_id {request_id!r} has not finished; abort it first")
        del self._parents[request_id]
        self._backlog.pop(request_id, None)
        return output

    # -- the step ----------------------------------------------------------------

    def take_pending(self) -> list[CompletionDelta]:
        """The deltas made between steps (a prefilled request's first token, aborts), now,
        without running a step; :meth:`step` would return them with its own otherwise."""
        deltas, self._pending = self._pending, []
        return deltas

    def step(self) -> list[CompletionDelta]:
        """Run one engine step; returns what each completion gained (plus aborts since the last
        step, and the first tokens of prefilled requests whose KV read ended). With overlap
        scheduling the gains are those of the step launched by the previous call. With nothing
        to run but KV reads in flight it waits up to :data:`~flotilla.cluster.engine.remote_kv.IDLE_WAIT_S`
        for one to end."""
        self.observe_kv_reads()
        if self.overlap:
            return self._step_overlapped()
        deltas, self._pending = self._pending, []
        if not self.scheduler.has_unfinished():
            self.remote_kv.wait(IDLE_WAIT_S)
            return deltas
        if self.speculator is not None:
            self._propose()
        step = self._schedule(deltas)
        if step is None or step.is_empty:
            self.remote_kv.wait(IDLE_WAIT_S)
            return deltas
        sampling = [item for item in step.scheduled if item.samples]
        rows = [self._sampling_row(self._sequences[item.request.request_id], item.draft_token_ids) for item in sampling]
        try:
            tokens = self.runner.execute(step, rows)
        except Exception as exc:  # noqa: BLE001 - a dead rank, a timed-out collective, an OOM: fail, never hang
            return deltas + self._fail_in_flight(exc)
        by_id = {item.request.request_id: t for item, t in zip(sampling, tokens)}
        for item in sampling:
            if item.draft_token_ids:
                self.speculator.stats.record(len(item.draft_token_ids), len(by_id[item.request.request_id].continuation))
        advanced = self.scheduler.update(
            step, {rid: [e.token_id for e in t.emitted] if t.continuation else t.token_id for rid, t in by_id.items()}
        )
        for request in advanced:
            delta = self._update_emitted(self._sequences[request.request_id], by_id[request.request_id])
            self._keep_for_stream(delta)
            deltas.append(delta)
        if self.speculator is not None:
            self.speculator.proposer.observe(step)
        return deltas

    def _propose(self) -> None:
        """Drafts for the running requests in decode; a constrained request's are cut where
        its grammar stops allowing them, and its bitmask after each is kept for its row."""
        self.speculator.propose(self.scheduler.running, self._may_draft)
        for request in self.scheduler.running:
            seq = self._sequences.get(request.request_id)
            if seq is None or seq.grammar is None or not request.draft_token_ids:
                continue
            seq.draft_bitmasks, allowed = seq.grammar.draft_bitmasks(request.draft_token_ids)
            del request.draft_token_ids[allowed:]

    def _may_draft(self, request: Request) -> bool:
        """Whether a request in decode may verify drafts: a generation request (an embedding
        request ends at its prompt)."""
        seq = self._sequences.get(request.request_id)
        return seq is not None and seq.params.pooling is None

    def _update_emitted(self, seq: _Sequence, sampled: SampledToken) -> CompletionDelta:
        """:meth:`_update` for each token a step emitted for ``seq`` (more than one after
        accepted drafts), up to the one that finishes it; one delta for them all."""
        delta = self._update(seq, sampled)
        for token in sampled.continuation:
            if delta.finish_reason is not None:
                break
            delta = _merged(delta, self._update(seq, token))
        return delta

    def _step_overlapped(self) -> list[CompletionDelta]:
        """One step under overlap scheduling: launch the next step, then resolve the one in flight."""
        deltas, self._pending = self._pending, []
        try:
            if self._inflight is not None and (self._inflight.all_reach_max_tokens() or self._constrained_in_flight()):
                deltas += self._resolve_inflight()
            step = self._schedule(deltas) if self.scheduler.has_unfinished() else None
            if step is None or step.is_empty:
                if self._inflight is None:
                    self.remote_kv.wait(IDLE_WAIT_S)
                return deltas + self._resolve_inflight()
            sampling = [item.request for item in step.scheduled if item.samples]
            rows = [self._sampling_row(self._sequences[r.request_id]) for r in sampling]
            if self._inflight is not None and not can_feed(step, self._inflight, rows, self._hold_kv):
                deltas += self._resolve_inflight()
            batch = self.runner.launch(step, rows, self._inflight.feed if self._inflight is not None else None)
            deltas += self._resolve_inflight()
        except Exception as exc:  # noqa: BLE001 - as in step(): fail every request, never hang
            self._inflight = None
            return deltas + self._fail_in_flight(exc)
        # NOTE: after the resolve, so the stop checks above saw no placeholder of this step
        # and requests they finished are skipped here.
        advanced = self.scheduler.update(step, dict.fromkeys((r.request_id for r in sampling), PENDING_TOKEN))
        self._inflight = InflightStep.launched(batch, sampling, advanced)
        return deltas

    def _constrained_in_flight(self) -> bool:
        """Whether a constrained request sampled in the step in flight: its next mask needs
        that token, so the next step waits for it (no overlap while such a step runs)."""
        return any(
            (seq := self._sequences.get(request.request_id)) is not None and seq.grammar is not None
            for request, _, _ in self._inflight.requests
        )

    def _schedule(self, deltas: list[CompletionDelta]) -> Any:
        """``scheduler.schedule()``; None, with the request failed (its error deltas appended
        to ``deltas``), when a request cannot be scheduled at all: admission fails that
        request, never the engine."""
        try:
            return self.scheduler.schedule()
        except UnschedulableRequestError as exc:
            deltas += self._fail_request(exc.request_id, str(exc))
            return None

    def _fail_request(self, request_id: str, reason: str) -> list[CompletionDelta]:
        """Finish every unfinished completion of the request owning the sequence
        ``request_id`` with ``"error"`` (``RequestOutput.error`` says why); their blocks are freed."""
        seq = self._sequences.get(request_id)
        if seq is None:
            self.scheduler.abort(request_id)
            return []
        deltas = []
        for sibling in seq.parent.sequences:
            if sibling.completion.finish_reason is not None:
                continue
            self.scheduler.abort(sibling.request.request_id)
            self._finish(sibling, "error", None)
            sibling.parent.output.error = reason
            index = sibling.completion.index
            delta = CompletionDelta(seq.parent.output.request_id, index, [], "", None, "error", error=reason)
            self._keep_for_stream(delta)
            deltas.append(delta)
        return deltas

    def _resolve_inflight(self) -> list[CompletionDelta]:
        """Wait for the step in flight (if any) and apply its tokens: the deltas it made."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        deltas = []
        for request, token in inflight.resolve():
            seq = self._sequences.get(request.request_id)
            if seq is None or seq.request is not request:
                continue  # aborted (or failed) since the launch
            delta = self._update(seq, token)
            self._keep_for_stream(delta)
            deltas.append(delta)
        return deltas

    def _fail_in_flight(self, exc: BaseException) -> list[CompletionDelta]:
        """The runner failed: finish every unfinished completion with ``"error"`` (freeing its
        KV blocks), mark the engine dead and return the error deltas."""
        reason = f"the model runner failed: {type(exc).__name__}: {exc}"
        self.dead = EngineDeadError(f"{reason}; the engine must be restarted (LLMEngine.restart())")
        deltas = []
        for seq in list(self._sequences.values()):
            self.scheduler.abort(seq.request.request_id)
            self._finish(seq, "error", None)
            seq.parent.output.error = reason
            delta = CompletionDelta(seq.parent.output.request_id, seq.completion.index, [], "", None, "error", error=reason)
            self._keep_for_stream(delta)
            deltas.append(delta)
        return deltas

    def restart(self) -> None:
        """Replace a failed runner (a fresh worker group) and scheduler; finished and failed
        requests stay readable, new ones are accepted again."""
        stop = getattr(self.runner, "shutdown", None)
        if stop is not None:
            stop()
        self.runner = build_runner(self.config, self.source, self.runner_spec)
        self.scheduler = build_scheduler(self.config, scheduler_config_for(self.config, self.runner.kv_layout))
        self._inflight = None
        # NOTE: reads in flight wrote into the old runner's cache; its peers were its connections.
        self.remote_kv = RemoteKVReads(self.remote_kv.listener)
        self.dead = None

    def commit_elastic_join(self, joiners: Any) -> None:
        """Grow the engine by prepared joining ranks (``GroupRunner.prepare_join``): the worker
        group moves to the grown world, then the scheduler gains the new DP ranks, so requests
        are routed to them only once they are in the group. Call between steps.

        ``ElasticJoinError`` when the commit failed (the engine keeps its old size and serves
        on); NotImplementedError when this engine cannot grow (then nothing was touched).
        """
        grow = getattr(self.scheduler, "grow", None)
        commit = getattr(self.runner, "commit_join", None)
        if grow is None or commit is None:
            raise NotImplementedError(
                "this engine cannot grow: start it with --elastic-ep-backend ray and --max-ep-size above its size"
            )
        commit(joiners)
        grow(self.runner.dp_size)

    def dp_rank_of(self, request_id: str) -> int | None:
        """The DP rank serving a live request (0 without DP attention; None when not live)."""
        rank_of = getattr(self.scheduler, "rank_of", None)
        if rank_of is None:
            return 0 if self.scheduler.get(request_id) is not None else None
        return rank_of(request_id)

    def _keep_for_stream(self, delta: CompletionDelta) -> None:
        parent = self._parents.get(delta.request_id)
        if parent is not None and parent.streaming:
            self._backlog.setdefault(delta.request_id, []).append(delta)

    def _sampling_row(self, seq: _Sequence, drafts: tuple[int, ...] = ()) -> SamplingRow:
        request = seq.request
        mask = seq.grammar.next_bitmask() if seq.grammar is not None else None
        draft_masks = tuple(seq.draft_bitmasks[: len(drafts)]) if seq.grammar is not None and drafts else ()
        return SamplingRow(seq.params, request.all_token_ids, request.num_prompt_tokens, seq.generator, mask, drafts, draft_masks)

    def _update(self, seq: _Sequence, sampled: SampledToken) -> CompletionDelta:
        """Record one sampled token of ``seq``; check the stop conditions; return its delta."""
        if seq.params.pooling is not None:
            return self._pooled(seq, sampled)
        params, completion, token = seq.params, seq.completion, sampled.token_id
        completion.token_ids.append(token)
        step_logprobs = self._record_logprobs(completion, sampled) if params.logprobs is not None else None
        finish, stop_reason, error = None, None, None
        if seq.grammar is not None and not seq.grammar.accept(token):
            # NOTE: the mask makes this unreachable unless a token came from elsewhere (a
            # prefill engine's first token): the completion cannot go on within its grammar.
            finish = "error"
            error = f"{params.guided.param}: token {token} is not allowed by the request's constraint here"
            seq.parent.output.error = error
        elif token in self.eos_token_ids and not params.ignore_eos:
            finish = "stop"
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        if seq.detokenizer is not None and (finish is None or params.include_stop_str_in_output):
            new_text = seq.detokenizer.add(token)
            completion.text += new_text
            if finish is None and params.stop_strings:
                match = find_stop_string(completion.text, len(new_text), params.stop_strings)
                if match is not None:
                    stop, start = match
                    end = start + len(stop) if params.include_stop_str_in_output else start
                    completion.text = completion.text[:end]
                    finish, stop_reason = "stop", stop
        # NOTE: the completion's count, not the request's: after accepted drafts the request
        # already holds the tokens this call has not recorded yet.
        if finish is None and len(completion.token_ids) >= seq.request.max_tokens:
            finish = "length"
            if seq.detokenizer is not None:
                completion.text += seq.detokenizer.flush()
        if finish is not None:
            if seq.request.request_id in self._hold_kv:
                self.scheduler.hold_blocks(seq.request.request_id)
            self.scheduler.finish(seq.request.request_id, _FINISH_STATUS[finish])
            self._finish(seq, finish, stop_reason)
        visible = len(completion.text) if finish is not None else max(len(completion.text) - seq.holdback, seq.streamed_chars)
        text, seq.streamed_chars = completion.text[seq.streamed_chars : visible], visible
        delta = CompletionDelta(
            seq.parent.output.request_id,
            completion.index,
            [token],
            text,
            [step_logprobs] if step_logprobs is not None else None,
            finish,
            stop_reason,
            error=error,
        )
        return delta

    def _pooled(self, seq: _Sequence, sampled: SampledToken) -> CompletionDelta:
        """An embedding request's step: its vector instead of a token; it ends at once."""
        request_id = seq.parent.output.request_id
        error = None
        if sampled.embedding is None:
            error = "the runner returned no embedding for a pooling request"
            seq.parent.output.error = error
        finish = "stop" if error is None else "error"
        seq.completion.embedding = sampled.embedding
        self.scheduler.finish(seq.request.request_id, _FINISH_STATUS[finish])
        self._finish(seq, finish, None)
        return CompletionDelta(request_id, seq.completion.index, [], "", None, finish, None, error=error, embedding=sampled.embedding)

    def _record_logprobs(self, completion: CompletionOutput, sampled: SampledToken) -> StepLogprobs:
        decode = self._token_text
        entry: StepLogprobs = {
            token: Logprob(lp, rank, decode(token)) for rank, (token, lp) in enumerate(sampled.top_logprobs or [], 1)
        }
        entry.setdefault(sampled.token_id, Logprob(sampled.logprob, sampled.rank, decode(sampled.token_id)))
        completion.logprobs.append(entry)
        completion.cumulative_logprob += sampled.logprob
        return entry

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _finish(self, seq: _Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.completion.finish_reason = reason
        seq.completion.stop_reason = stop_reason
        del self._sequences[seq.request.request_id]
        self._hold_kv.discard(seq.request.request_id)
        if self.speculator is not None:
            self.speculator.proposer.forget(seq.request.request_id)
        parent = seq.parent
        parent.output.finished = all(s.completion.finish_reason is not None for s in parent.sequences)

    # -- KV handoff (prefill/decode disaggregation) ----------------------------------

    def held_kv_blocks(self, request_id: str) -> list[int] | None:
        """The KV block ids a finished ``hold_kv=True`` request left in the cache (its prompt's
        KV, in position order), or None (not finished, not held, or already released)."""
        return getattr(self.scheduler, "held_blocks", lambda _: None)(request_id)

    def held_kv_dp_rank(self, request_id: str) -> int:
        """The DP-attention rank whose KV pool holds ``request_id``'s held blocks (0 without DP
        attention): only that DP rank's ranks serve their reads."""
        rank = getattr(self.scheduler, "held_rank", lambda _: None)(request_id)
        return int(rank or 0)

    def release_kv(self, request_id: str) -> bool:
        """Free the KV blocks held for ``request_id``; False when none are held."""
        release = getattr(self.scheduler, "release_held_blocks", None)
        return release is not None and release(request_id) is not None

    def add_prefilled_request(
        self,
        ticket: PrefillTicket,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt: str | None = None,
        stream: bool = False,
        policy: str = "recompute",
        priority: int | None = None,
        timeout_s: float = DEFAULT_KV_READ_TIMEOUT_S,
        reader: KVReader | None = None,
    ) -> str:
        """Queue a request whose prompt another engine computed (decode side of a KV
        handoff: ``ticket``); returns its id (``priority`` as in :meth:`add_request`). See
        :func:`flotilla.cluster.engine.kv_handoff.decode_prefilled`.

        The request gets blocks for its prompt and waits for its KV (``WAITING_FOR_REMOTE_KV``)
        while ``reader`` (the runner's ``kv`` handle when None) reads the ticket's blocks into
        them, off this thread, bounded by ``timeout_s`` (blocks already in the local prefix
        cache are not read); the engine steps the other requests meanwhile. The step that sees
        the read ended puts the request in the batch with the ticket's first token as its
        first delta. When the read fails, ``policy`` applies: ``"recompute"`` computes the
        prompt here as an ordinary request, ``"fail"`` finishes it with ``"error"`` (the
        message in ``RequestOutput.error`` names ``kv_load_failure_policy='fail'``); its blocks
        are freed either way. When the engine cannot admit it now (other requests waiting, no
        free slot or blocks) it is an ordinary request from the start. A read that cannot
        even start (no KV endpoint) raises ``KVHandoffError`` under ``"fail"`` (nothing queued).
        """
        check_policy(policy)
        _require_handoff_support(self.scheduler)
        params = params or SamplingParams()
        first_token = ticket.first_token
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < self.vocab_size:
            raise ValueError(f"first_token must be a token id in [0, {self.vocab_size}) (got first_token={first_token!r})")
        if params.n != 1 or params.logprobs is not None:
            raise NotImplementedError(
                f"a prefilled request takes n=1 and no logprobs (got n={params.n}, logprobs={params.logprobs}); "
                "send such requests to a colocated engine"
            )
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds (got timeout_s={timeout_s!r})")
        src = [int(b) for b in ticket.block_ids]
        prompt_token_ids = list(ticket.prompt_token_ids)
        if len(src) < self.scheduler.pool.blocks_for_tokens(len(prompt_token_ids)):
            raise ValueError(
                f"block_ids: {len(src)} blocks cannot hold a {len(prompt_token_ids)}-token prompt "
                f"(block size {self.scheduler.pool.block_size}); pass the prefill engine's blocks of this prompt"
            )
        request_id = self.add_request(prompt_token_ids, params, request_id, prompt, stream, priority=priority)
        admitted = self.scheduler.admit_prefilled(request_id)
        if admitted is None:
            return request_id
        dst, num_cached = admitted
        if num_cached == len(dst):  # NOTE: match_prefix leaves the last token's block to fill
            self._join_batch(request_id, first_token)
            return request_id
        # NOTE: under DP attention the blocks are the routed DP rank's; only its ranks read.
        dp_rank = getattr(self.scheduler, "rank_of", lambda _: None)(request_id)
        try:
            self.remote_kv.start(
                reader or self.runner.kv, request_id, ticket, src[num_cached : len(dst)], dst[num_cached:], timeout_s, policy,
                dp_rank=dp_rank,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - a read that cannot start goes through the policy
            self.scheduler.remote_kv_failed(request_id)
            if policy == "fail":
                self._forget(request_id)
                raise KVHandoffError(
                    f"request {request_id!r}: reading {len(dst) - num_cached} KV blocks from {ticket.peer_id!r} could "
                    f"not start ({type(exc).__name__}: {exc}); kv_load_failure_policy='fail'"
                ) from exc
        return request_id

    def observe_kv_reads(self) -> None:
        """Look at the KV reads in flight (never waits): a prefilled request whose read ended
        joins the batch, its first token a delta of :meth:`take_pending` (or of the next
        :meth:`step`); one whose read failed follows its policy; an aborted one's blocks are
        freed. :meth:`step` calls it first."""
        if not self.remote_kv:
            return
        for read, outcome in self.remote_kv.ended():
            request_id = read.request_id
            if self.scheduler.release_draining(request_id):
                continue  # NOTE: aborted while its read was in flight
            if not isinstance(outcome, BaseException):
                self._join_batch(request_id, read.ticket.first_token)
                continue
            self.scheduler.remote_kv_failed(request_id)
            if read.policy == "fail":
                reason = (
                    f"request {request_id!r}: reading {read.num_blocks} KV blocks from {read.ticket.peer_id!r} failed "
                    f"({type(outcome).__name__}: {outcome}); kv_load_failure_policy='fail'"
                )
                self._pending += self._fail_request(request_id, reason)

    def _join_batch(self, request_id: str, first_token: int) -> None:
        """A prefilled request's KV is in place: it runs from the next step; its first token
        (the prefill engine's) is a delta now."""
        self.scheduler.remote_kv_loaded(request_id, first_token)
        delta = self._update(self._sequences[request_id], SampledToken(int(first_token)))
        self._keep_for_stream(delta)
        self._pending.append(delta)

    def _forget(self, request_id: str) -> None:
        """Drop an ``n == 1`` request without a trace (frees its blocks)."""
        self.scheduler.abort(request_id)
        self._sequences.pop(request_id, None)
        self._parents.pop(request_id, None)
        self._backlog.pop(request_id, None)

    # -- streaming -----------------------------------------------------------------

    def iter_outputs(self) -> Iterator[CompletionDelta]:
        """Step until every request has finished, yielding each delta as it is made."""
        while self.has_unfinished_requests() or self._pending:
            yield from self.step()

    def stream(self, request_id: str) -> Iterator[CompletionDelta]:
        """The deltas of one request until it finishes, stepping the engine as needed.

        Deltas of other requests added with ``stream=True`` wait in their own backlog for
        their own :meth:`stream`; a request streamed after it started loses nothing either
        when it was added with ``stream=True``.
        """
        parent = self._parents.get(request_id)
        if parent is None:
            raise ValueError(f"request_id {request_id!r} is not known to the engine")
        parent.streaming = True
        while True:
            yield from self._backlog.pop(request_id, [])
            if parent.output.finished:
                return
            self.step()

    # -- metrics ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Prefix-cache hit rate, preemptions, running/waiting counts, KV usage, and the
        runner's start-up seconds (``startup_load_s``, ``startup_kv_alloc_s``,
        ``startup_warmup_s``, ``startup_graph_capture_s``; see :meth:`startup_report`)."""
        pool = self.scheduler.pool
        stats = {
            "prefix_cache_hit_rate": pool.hit_rate,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_cache_usage": pool.usage,
        }
        host_tier = getattr(self.scheduler, "host_tier", None)
        if host_tier is not None:
            stats["host_kv_stored_blocks"] = host_tier.stored_blocks
            stats["host_kv_loaded_blocks"] = host_tier.loaded_blocks
        for key, value in self.startup_report().items():
            if key.endswith("_s"):
                stats[f"startup_{key}"] = value
        if self.speculator is not None:
            spec = self.speculator.stats
            stats["spec_decode_num_drafts"] = spec.num_drafts
            stats["spec_decode_num_draft_tokens"] = spec.num_draft_tokens
            stats["spec_decode_num_accepted_tokens"] = spec.num_accepted_tokens
            stats["spec_decode_acceptance_rate"] = spec.acceptance_rate
        return stats

    def startup_report(self) -> dict[str, Any]:
        """The runner's start-up report (``ModelRunner.startup_report``: load, KV allocation,
        warm-up and CUDA-graph capture seconds, captured decode batch sizes, kernel backends);
        empty for a runner that keeps none (a Ray worker group)."""
        report = getattr(self.runner, "startup_report", None)
        return report() if report is not None else {}


def _check_pooling(params: SamplingParams, hold_kv: bool) -> None:
    """An embedding request takes one completion and nothing that belongs to sampling."""
    if params.n != 1 or params.logprobs is not None or params.guided is not None or hold_kv:
        raise ValueError(
            f"pooling={params.pooling!r} (an embedding request) takes n=1, no logprobs, no output constraint and "
            f"no KV handoff (got n={params.n}, logprobs={params.logprobs}, guided={params.guided is not None})"
        )


def _merged(first: CompletionDelta, then: CompletionDelta) -> CompletionDelta:
    """One delta for two consecutive deltas of a completion."""
    logprobs = None if first.logprobs is None else first.logprobs + (then.logprobs or [])
    return CompletionDelta(
        first.request_id, first.index, first.token_ids + then.token_ids, first.text + then.text, logprobs,
        then.finish_reason, then.stop_reason, error=then.error,
    )


def _require_handoff_support(scheduler: Any) -> None:
    if not hasattr(scheduler, "admit_prefilled"):
        raise NotImplementedError(
            f"KV handoff needs a scheduler that holds and admits prefilled blocks ({type(scheduler).__name__} "
            "does not); use Scheduler or DPScheduler"
        )


def _eos_ids(hf_config: dict, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: config.json's ``eos_token_id`` (int or list) and the tokenizer's."""
    ids = hf_config.get("eos_token_id")
    found = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        found.add(eos)
    return frozenset(int(i) for i in found)
