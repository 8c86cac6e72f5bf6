"""Batched token sampling over one step's logits ``[B, V]`` (float32).

The order of operations, per row (each row carries its own ``SamplingParams``):

1. logprobs, when asked for, are taken from ``log_softmax`` of the model's RAW
   logits: before penalties, temperature and truncation (vLLM's default
   "raw_logprobs"; it tells the caller what the model believed, independent of
   how the token was then picked);
2. penalties: repetition (HF/CTRL-style, over prompt and output tokens: a positive
   logit is divided by the penalty, a negative one multiplied), then presence and
   frequency (OpenAI-style, over output tokens only: ``logit -= presence * [count>0]
   + frequency * count``). Greedy rows get penalties too, as in HF and vLLM;
   Then a constrained row (``token_bitmask``: its grammar's allowed tokens, see
   :mod:`~flotilla.cluster.engine.grammar`) has every other token's logit set to ``-inf``;
3. greedy rows (temperature 0) take the argmax here;
4. temperature, then top-k, then top-p over the renormalised top-k set, then min-p
   (relative to the most likely remaining token);
5. the draw. A row with a seed draws by the exponential race ``argmax(p / E)``,
   ``E ~ Exp(1)``, its noise from its own ``torch.Generator``, so its tokens depend
   only on its seed and its own history, never on what else shares the batch. A row
   without a seed draws with the same race from the sampler's shared generator on the
   ``"torch"`` backend; on the ``"flashinfer"`` backend (CUDA logits) the unseeded rows
   instead run steps 4-5 in flashinfer's sorting-free kernels (the ``sample_tokens`` op:
   same distribution, the randomness from the shared generator's Philox stream).

Steps 1-3 run in torch on every backend, so logprobs, penalties and greedy choices do
not depend on the sampling backend. The argmax of step 3 is ``torch.argmax``'s, except that
CUDA float32 logits of at most ``triton_argmax.MAX_ROWS`` rows take it in one Triton launch
(:func:`greedy_argmax`: the same indices, ties to the lowest; ``triton_argmax.ENABLED = False``
turns it off); CPU logits, and machines without Triton, keep ``torch.argmax``.

Speculative decoding: a row with ``draft_token_ids`` owns ``1 + k`` logits rows, sampled by
the steps above as ``1 + k`` rows (:func:`expand_draft_rows`) and folded back into one token
with its accepted continuation (:func:`verify_drafts`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Sequence

import torch

from flotilla.cluster.engine.sampling_params import SamplingParams
from flotilla.kernels import registry as kernels


@dataclass
class SamplingRow:
    """One row of the logits and what sampling needs to know about its request.

    Attributes:
        params: the request's sampling parameters.
        token_ids: prompt followed by the tokens generated so far (for penalties).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        generator: the request's own generator when it has a seed, else ``None``
            (the sampler's shared generator is used).
        token_bitmask: the tokens a constrained request may take at this step (its grammar's
            packed bitmask: int32 ``[ceil(V / 32)]`` on the CPU, bit ``t % 32`` of word
            ``t // 32`` set when token ``t`` is allowed), or None (every token).
        draft_token_ids: speculative decoding: the drafts this row verifies; the row then
            owns ``1 + len(draft_token_ids)`` rows of the logits (see :func:`verify_drafts`).
        draft_bitmasks: a constrained row's bitmask after each draft (``[j - 1]``: the
            tokens allowed once ``d_1..d_j`` are taken; None: every token), one per draft.
    """

    params: SamplingParams
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    generator: torch.Generator | None = None
    token_bitmask: torch.Tensor | None = None
    draft_token_ids: tuple[int, ...] = ()
    draft_bitmasks: tuple[torch.Tensor | None, ...] = ()


@dataclass
class SampledToken:
    """The token chosen for one row, with logprobs when the row asked for them.

    Attributes:
        token_id: the chosen token.
        logprob: its raw logprob (``None`` unless asked for).
        top_logprobs: the ``params.logprobs`` most likely ``(token_id, logprob)`` pairs, best first.
        rank: the chosen token's rank among all tokens (1 = most likely).
        embedding: an embedding request's pooled vector (``SamplingParams.pooling``), else None.
        continuation: speculative decoding: the tokens this step chose after this one (the
            accepted drafts after the first, then the token sampled past them), each with
            its own logprobs; empty without drafts.
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None
    embedding: list[float] | None = None
    continuation: tuple["SampledToken", ...] = ()

    @property
    def emitted(self) -> list["SampledToken"]:
        """This token and its continuation, in order."""
        return [self, *self.continuation]


_SAMPLING_BACKENDS = ("torch", "flashinfer")


class SampledBatch:
    """One step's chosen tokens, queued on the device (see :meth:`Sampler.launch`).

    Attributes:
        token_ids: ``[B]`` int64 chosen ids on the logits' device, valid at once for
            kernels queued after them (a next step's input ids).

    On CUDA the ids start a non-blocking copy into pinned host memory when made;
    :meth:`resolve` waits for that copy alone (an event), not for later work on the
    stream, so a caller can queue the next step before resolving this one. NOTE: a batch
    with logprobs reads them back with ``tolist()``, which waits for everything queued on
    the stream, the next step included: correct, but that step is not overlapped.
    """

    def __init__(
        self,
        token_ids: torch.Tensor,
        raw_logprobs: torch.Tensor | None,
        rows: list[SamplingRow],
        drafts: list[tuple[int, ...]] | None = None,
        rewinds: list["_Rewind"] | None = None,
    ):
        self.token_ids = token_ids
        self._raw_logprobs = raw_logprobs
        self._rows = rows
        # Speculative decoding: each request row's drafts (``rows`` are then the expanded
        # rows, 1 + k per request); resolve() folds them back, one token per request row.
        self._drafts = drafts
        self._rewinds = rewinds or []
        # Embedding requests' vectors by row (set by the runner that pooled them).
        self.embeddings: dict[int, list[float] | None] = {}
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        if token_ids.is_cuda and raw_logprobs is None:
            self._host = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
            self._host.copy_(token_ids, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def resolve(self) -> list[SampledToken]:
        """The chosen tokens (with logprobs where asked for), in row order; waits for them."""
        if self._copied is not None:
            self._copied.synchronize()
            ids = self._host.tolist()
        else:
            ids = self.token_ids.tolist()
        if self._raw_logprobs is None:
            tokens = [SampledToken(t) for t in ids]
        else:
            tokens = _with_logprobs(ids, self._raw_logprobs, self._rows, self.token_ids)
        if self._drafts is not None:
            tokens = verify_drafts(tokens, self._drafts)
            for rewind in self._rewinds:
                rewind.apply(1 + len(tokens[rewind.row].continuation))
        for row, vector in self.embeddings.items():
            tokens[row].embedding = vector
        return tokens


class Sampler:
    """Picks one token per row of a ``[B, V]`` logits tensor (see the module docstring).

    Args:
        generator: used for rows without a seed (pass a seeded one for a reproducible
            engine-wide stream, e.g. from ``--random-seed``); on the logits' device.
        backend: ``"torch"`` (everywhere) or ``"flashinfer"`` (unseeded non-greedy rows of
            CUDA logits draw through the flashinfer ``sample_tokens`` op; CPU logits keep
            the torch path). ValueError when the backend is unknown or not installed.
    """

    def __init__(self, generator: torch.Generator | None = None, backend: str = "torch"):
        if backend not in _SAMPLING_BACKENDS:
            raise ValueError(f"sampling backend={backend!r} is not supported; use one of {list(_SAMPLING_BACKENDS)}")
        self.generator = generator
        self.backend = backend
        # NOTE: looked up now so an unavailable backend fails at start-up, not mid-request.
        self._sample_tokens = kernels.get("sample_tokens", backend) if backend != "torch" else None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        return self.sample(logits, rows)

    def warm_up(self, vocab_size: int, device: torch.device) -> list[tuple[int, int]]:
        """Compile, before serving, what greedy rows may launch at any small batch (see
        :func:`flotilla.kernels.triton_argmax.warm_up`); returns its launch shapes, or ``[]``
        where greedy rows stay on ``torch.argmax`` (CPU, no Triton, turned off)."""
        module = _triton_argmax() if torch.device(device).type == "cuda" else None
        if module is None or not module.ENABLED:
            return []
        return module.warm_up(vocab_size, device)

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        return self.launch(logits, rows).resolve()

    def launch(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> "SampledBatch":
        """Queue the sampling of ``logits`` on its device and return without waiting: the
        chosen ids are in :attr:`SampledBatch.token_ids` (on the device) at once, and
        :meth:`SampledBatch.resolve` turns them into :class:`SampledToken` s.

        NOTE: penalties read each row's ``token_ids`` now, on the host."""
        if logits.shape[0] != logits_rows(rows):
            raise ValueError(f"logits has {logits.shape[0]} rows but {len(rows)} sampling rows (with drafts: {logits_rows(rows)}) were given")
        drafts = [row.draft_token_ids for row in rows]
        rewinds = None
        if any(drafts):
            rewinds = _seeded_rewinds(rows, logits.shape[1])
            rows = expand_draft_rows(rows)
        else:
            drafts = None
        logits = logits.float()
        wants_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(wants_logprobs) else None
        if any(r.params.has_penalties for r in rows):
            logits = apply_penalties(logits.clone(), rows)
        if any(r.token_bitmask is not None for r in rows):
            logits = apply_token_bitmasks(logits, rows)
        return SampledBatch(self._choose(logits, rows), raw_logprobs, list(rows), drafts, rewinds)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        greedy = [r.params.greedy for r in rows]
        chosen = greedy_argmax(logits)
        if all(greedy):
            return chosen
        sampled = [i for i, g in enumerate(greedy) if not g]
        fast = []
        if self._sample_tokens is not None and logits.is_cuda:
            fast = [i for i in sampled if rows[i].generator is None]
            sampled = [i for i in sampled if rows[i].generator is not None]
        if fast:
            index = _device_index(fast, logits.device)
            params = [rows[i].params for i in fast]
            # NOTE: the parameter vectors stay on the CPU: the op picks its kernels from them there.
            chosen[index] = self._sample_tokens(
                logits.index_select(0, index), *_param_vectors(params, logits.shape[1], "cpu"), self.generator
            )
        if sampled:
            index = _device_index(sampled, logits.device)
            sub_rows = [rows[i] for i in sampled]
            probs = truncated_probs(logits.index_select(0, index), [r.params for r in sub_rows])
            noise = self._exponential_noise(probs, sub_rows)
            chosen[index] = (probs / noise).argmax(dim=-1)
        return chosen

    def _exponential_noise(self, probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            draw = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_(generator=self.generator)
            noise[unseeded] = draw
        for i, row in enumerate(rows):
            if row.generator is not None:
                # NOTE: one draw of V values per step from the row's own generator keeps a seeded
                # request's stream independent of the batch it shares.
                noise[i].exponential_(generator=row.generator)
        # Exp(1) samples can be exactly 0 in float32; keep the division finite.
        return noise.clamp_(min=1e-20)


def logits_rows(rows: Sequence[SamplingRow]) -> int:
    """How many logits rows ``rows`` sample from (``1 + k`` for a row verifying ``k`` drafts)."""
    return sum(1 + len(row.draft_token_ids) for row in rows)


def expand_draft_rows(rows: Sequence[SamplingRow]) -> list[SamplingRow]:
    """One row per logits row: a row verifying drafts ``d_1..d_k`` becomes ``1 + k`` rows,
    the ``j``-th sampling as if ``d_1..d_j`` had been chosen (its penalties count them).
    The rows share the request's generator, so a seeded request draws once per position; a
    constrained row's ``j``-th row takes the bitmask its grammar has after ``d_1..d_j``."""
    out = []
    for row in rows:
        out.append(replace(row, draft_token_ids=(), draft_bitmasks=()))
        if not row.draft_token_ids:
            continue
        masks = row.draft_bitmasks or (None,) * len(row.draft_token_ids)
        if len(masks) != len(row.draft_token_ids) or (row.token_bitmask is not None and not row.draft_bitmasks):
            raise ValueError(
                f"a constrained row verifying {len(row.draft_token_ids)} drafts needs a bitmask after each "
                f"(got {len(row.draft_bitmasks)})"
            )
        history = list(row.token_ids)
        for j in range(1, len(row.draft_token_ids) + 1):
            ids = history + list(row.draft_token_ids[:j]) if history else ()
            out.append(replace(row, token_ids=ids, token_bitmask=masks[j - 1], draft_token_ids=(), draft_bitmasks=()))
    return out


@dataclass
class _Rewind:
    """A seeded row that verified drafts drew noise for all ``1 + k`` positions; its
    generator is put back to where it would be after one draw per EMITTED token, as without
    speculation. So the row's later draws, and each emitted token's own draw, are those of the
    same request decoded one token at a time: seeded sampling gives the same tokens with and
    without speculation (the engine's float32 logits agreeing within their margins)."""

    row: int
    generator: torch.Generator
    state: torch.Tensor
    vocab_size: int

    def apply(self, draws: int) -> None:
        self.generator.set_state(self.state)
        for _ in range(draws):
            # NOTE: the same draw as Sampler._exponential_noise's for one row of V float32s.
            torch.empty(self.vocab_size, device=self.generator.device).exponential_(generator=self.generator)


def _seeded_rewinds(rows: Sequence[SamplingRow], vocab_size: int) -> list[_Rewind]:
    """The generators to rewind after verification: sampled, seeded rows with drafts (their
    state now, before this step's draws)."""
    return [
        _Rewind(i, row.generator, row.generator.get_state(), vocab_size)
        for i, row in enumerate(rows)
        if row.draft_token_ids and row.generator is not None and not row.params.greedy
    ]


def verify_drafts(tokens: Sequence[SampledToken], drafts: Sequence[tuple[int, ...]]) -> list[SampledToken]:
    """Fold the expanded rows' tokens back into one :class:`SampledToken` per request row.

    A request with drafts ``d_1..d_k`` sampled ``t_0..t_k`` (``t_j`` at the position after
    ``d_j``). Drafts are accepted while ``t_{j-1} == d_j``; the first ``t`` that differs (or
    ``t_k`` when all are accepted) ends the step. The emitted tokens are ``t_0..t_m`` (``m``
    accepted): the first is returned with the rest as its ``continuation``.

    Why the output is the target's: a greedy row's ``t_j`` is the argmax given the accepted
    tokens, exactly what decoding one token at a time would pick. For a sampled row the
    drafts are deterministic (a proposal of one token, with probability 1), so the rejection
    sampler of Leviathan et al. accepts ``d_j`` with probability ``p(d_j)`` and otherwise draws
    from ``p`` without ``d_j``, renormalised. Drawing ``t_{j-1} ~ p`` and accepting iff it is
    ``d_j`` does both at once: ``P(accept) = p(d_j)``, and a rejected ``t_{j-1}`` is distributed
    as ``p`` restricted to the other tokens. Each emitted token is thus a draw from the target's
    distribution given the tokens before it.
    """
    out, index = [], 0
    for row_drafts in drafts:
        chosen = list(tokens[index : index + 1 + len(row_drafts)])
        index += 1 + len(row_drafts)
        accepted = 0
        while accepted < len(row_drafts) and chosen[accepted].token_id == row_drafts[accepted]:
            accepted += 1
        first = chosen[0]
        first.continuation = tuple(chosen[1 : accepted + 1])
        out.append(first)
    if index != len(tokens):
        raise ValueError(f"{len(tokens)} sampled rows for drafts that need {index}")
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[B]`` int64) for ``[B, V]`` logits: through
    :func:`flotilla.kernels.triton_argmax.greedy_argmax` (one launch, the same indices) for
    CUDA float32 logits of 1 to ``MAX_ROWS`` rows while ``triton_argmax.ENABLED``, else
    ``torch.argmax``. Triton is imported only for CUDA logits."""
    if logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2:
        module = _triton_argmax()
        if module is not None and module.ENABLED and 1 <= logits.shape[0] <= module.MAX_ROWS:
            return module.greedy_argmax(logits)
    return logits.argmax(dim=-1)


@functools.lru_cache(maxsize=None)
def _triton_argmax() -> ModuleType | None:
    """:mod:`flotilla.kernels.triton_argmax`, or None where Triton is not installed."""
    try:
        from flotilla.kernels import triton_argmax
    except ImportError:
        return None  # NOTE: an optimization no flag names: without Triton greedy rows stay on torch
    return triton_argmax


def truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams], backend: str = "torch") -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p per row (the ``sampling_probs`` kernel
    op); returns probabilities ``[B, V]`` with truncated tokens at exactly 0."""
    vectors = _param_vectors(params, logits.shape[1], logits.device, logits.dtype)
    return kernels.get("sampling_probs", backend)(logits, *vectors)


def _param_vectors(
    params: Sequence[SamplingParams], vocab: int, device: str | torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(temperature, top_k, top_p, min_p)`` per row on ``device`` (the float ones in
    ``dtype``); a ``top_k`` that keeps every token is ``vocab``."""
    return (
        torch.tensor([p.temperature for p in params], dtype=dtype, device=device),
        torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long, device=device),
        torch.tensor([p.top_p for p in params], dtype=dtype, device=device),
        torch.tensor([p.min_p for p in params], dtype=dtype, device=device),
    )


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, presence and frequency penalties, in place on ``logits[B, V]``."""
    batch, vocab = logits.shape
    device = logits.device
    seen_all = _token_matrix([r.token_ids for r in rows], vocab, device)  # prompt + output
    seen_out = _token_matrix([r.token_ids[r.num_prompt_tokens :] for r in rows], vocab, device)
    out_counts = torch.zeros(batch, vocab + 1, device=device).scatter_add_(
        1, seen_out, torch.ones_like(seen_out, dtype=torch.float32)
    )[:, :vocab]
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    if (repetition != 1.0).any():
        present = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device).scatter_(1, seen_all, True)[:, :vocab]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(present, penalised, logits)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    return logits - presence * (out_counts > 0) - frequency * out_counts


def apply_token_bitmasks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``logits`` (a new tensor) with every token a row's ``token_bitmask`` does not allow at
    ``-inf``; rows without a bitmask are unchanged."""
    masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    packed = torch.stack([rows[i].token_bitmask for i in masked]).to(logits.device)
    allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    allowed[_device_index(masked, logits.device)] = unpack_bitmasks(packed, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))


def unpack_bitmasks(bitmasks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed bitmasks (int32 ``[R, ceil(V / 32)]``) as a bool ``[R, vocab_size]`` of the
    allowed tokens: token ``t`` is bit ``t % 32`` of word ``t // 32`` (xgrammar's and
    llguidance's layout)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmasks.device)
    bits = (bitmasks.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmasks.shape[0], -1)[:, :vocab_size].bool()


def _device_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device``; on CUDA through pinned memory, so the copy
    is queued instead of waiting for the work already on the stream (overlap scheduling)."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.long, device=device)
    return torch.tensor(rows, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)


def _token_matrix(lists: Sequence[Sequence[int]], vocab: int, device) -> torch.Tensor:
    """Right-pad token lists into ``[B, L]`` with the out-of-vocabulary id ``vocab``."""
    width = max((len(x) for x in lists), default=0) or 1
    out = torch.full((len(lists), width), vocab, dtype=torch.long, device=device)
    for i, ids in enumerate(lists):
        if len(ids):
            out[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    return out


def _with_logprobs(
    ids: list[int], raw_logprobs: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor
) -> list[SampledToken]:
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1))  # [B, 1]
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    max_top = max(r.params.logprobs or 0 for r in rows)
    top_values, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
    out = []
    for i, row in enumerate(rows):
        if row.params.logprobs is None:
            out.append(SampledToken(ids[i]))
            continue
        k = row.params.logprobs
        top = list(zip(top_ids[i, :k].tolist(), top_values[i, :k].tolist())) if k else []
        out.append(SampledToken(ids[i], float(chosen[i, 0]), top, int(ranks[i])))
    return out
