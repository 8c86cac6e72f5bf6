"""``SamplingParams``: how one request's tokens are chosen and when it stops.

Field names, meanings and defaults follow vLLM's ``SamplingParams`` so code
carries over (``max_tokens`` defaults to 16, as there). Every bad value raises a
``ValueError`` that names the parameter and the value seen. Checks that need
the model (stop token ids against the vocabulary) run in :meth:`verify_for_model`
when the engine accepts the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

# What a guided (constrained) request's output must match (GuidedDecoding.kind).
GUIDED_KINDS = ("json_schema", "json_object", "regex", "ebnf")
# How an embedding request pools the final hidden states of its prompt (SamplingParams.pooling).
POOLING_TYPES = ("last", "mean")

# Temperatures below this are treated as greedy (argmax), as vLLM does: dividing
# logits by a tiny temperature only adds overflow risk.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """Sampling and stopping controls of one request (vLLM's names and defaults).

    Attributes:
        n: completions to generate for the prompt (they share its KV blocks).
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability sum reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens; -1 keeps all.
        min_p: drop tokens less likely than ``min_p`` times the most likely one; 0 disables.
        seed: per-request random seed: the same seed gives the same tokens whatever else is batched.
        presence_penalty: subtracted from the logit of every token already generated (OpenAI semantics).
        frequency_penalty: subtracted once per earlier occurrence in the generated tokens.
        repetition_penalty: HF/CTRL-style multiplicative penalty on tokens of the prompt and the output;
            1 disables, > 1 discourages repetition.
        stop: strings that end the completion; the stop string is not returned unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the completion (the token is kept in ``token_ids``).
        max_tokens: most tokens to generate; ``None`` means up to the context length.
        ignore_eos: keep generating after the end-of-sequence token.
        logprobs: return the log-probabilities of this many most likely tokens at each step, plus the
            sampled token's (``0``: the sampled token only; ``None``: none).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        skip_special_tokens: leave special tokens out of the detokenized text.
        guided: the constraint the output must match (structured outputs, forced tool
            calls); None: free generation.
        pooling: an embedding request (one of :data:`POOLING_TYPES`): the prompt is prefilled
            and its final hidden states pooled into one vector (``last`` token or ``mean``);
            nothing is sampled. None: a generation request.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided: GuidedDecoding | None = None
    pooling: str | None = None
    # Normalised forms, filled in by __post_init__.
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.stop_strings = tuple(self.stop)
        self._validate()

    # -- derived --------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        """Sampling reduces to argmax (temperature 0)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def for_child(self, index: int) -> "SamplingParams":
        """The parameters of completion ``index`` of an ``n > 1`` request: ``n == 1``, and a
        seed derived from the parent's so that children differ yet stay reproducible."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids))

    # -- checks ---------------------------------------------------------------
    def verify_for_model(self, vocab_size: int) -> None:
        """Checks that need the model: every stop token id must exist in the vocabulary."""
        for token_id in self.stop_token_ids:
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"stop_token_ids contains {token_id}, which is not a token of this model "
                    f"(vocabulary size {vocab_size})"
                )

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be at least 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be non-negative (0 means greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            "top_k",
            self.top_k,
            "must be -1 (disabled) or at least 1",
        )
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "must be greater than 0")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "must be at least 1",
        )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
            "logprobs",
            self.logprobs,
            "must be a non-negative integer or None",
        )
        _check(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer or None")
        # NOTE: torch generators take a 64-bit seed; n > 1 children use seed + index.
        _check(
            self.seed is None or -(2**63) <= self.seed <= 2**63 - 1 - self.n,
            "seed",
            self.seed,
            f"must fit in a signed 64-bit integer (with room for n={self.n} child seeds)",
        )
        _check(
            self.guided is None or isinstance(self.guided, GuidedDecoding),
            "guided",
            self.guided,
            "must be a GuidedDecoding or None",
        )
        _check(self.pooling is None or self.pooling in POOLING_TYPES, "pooling", self.pooling, f"must be one of {list(POOLING_TYPES)} or None")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must hold non-empty strings")
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            self.stop_token_ids,
            "must hold non-negative token ids",
        )


@dataclass(frozen=True)
class GuidedDecoding:
    """What a constrained request's output must match; the engine's grammar backend
    (``--grammar-backend``) compiles it and masks every step's logits to the tokens it allows.

    Attributes:
        kind: one of :data:`GUIDED_KINDS`: ``json_schema`` (``spec`` is the schema as JSON
            text), ``json_object`` (any JSON object; ``spec`` empty), ``regex`` (``spec`` is the
            pattern), ``ebnf`` (``spec`` is the grammar, GBNF spelling with a ``root`` rule).
        spec: the schema, pattern or grammar text.
        param: the request parameter the constraint came from (``response_format``,
            ``tool_choice``, ``regex``...), named by the 400 when it does not compile.
        reasoning_start: token ids that open a reasoning section (``<think>``); when the output
            begins with them, the constraint applies only after ``reasoning_end``.
        reasoning_end: token ids that close the reasoning section (``</think>``); empty: no
            reasoning parser, the constraint applies from the first token.
        starts_in_reasoning: the prompt already opened the reasoning section (DeepSeek-R1's
            template ends with ``<think>``): the constraint waits for ``reasoning_end``.
        strict: a JSON schema is followed strictly (no properties or items it does not
            name; OpenAI's ``strict: true``); False lets objects carry extra properties
            where the schema does not forbid them.
    """

    kind: str
    spec: str = ""
    param: str = "response_format"
    reasoning_start: tuple[int, ...] = ()
    reasoning_end: tuple[int, ...] = ()
    starts_in_reasoning: bool = False
    strict: bool = True

    def __post_init__(self) -> None:
        _check(self.kind in GUIDED_KINDS, "guided.kind", self.kind, f"must be one of {list(GUIDED_KINDS)}")
        _check(isinstance(self.spec, str), "guided.spec", self.spec, "must be a string")
        _check(self.kind == "json_object" or bool(self.spec), "guided.spec", self.spec, f"must be given for kind {self.kind!r}")

    @property
    def cache_key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the reasoning gate is per request)."""
        return self.kind, self.spec, self.strict


def _check(ok: bool, name: str, value, requirement: str) -> None:
    if not ok:
        raise ValueError(f"{name} {requirement}, got {name}={value!r}")


def as_param_list(params: "SamplingParams | Sequence[SamplingParams] | None", count: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt: a single value is shared, a list must match ``count``."""
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(
            f"sampling_params has {len(params)} entries but there are {count} prompts; "
            "give one SamplingParams for all or one per prompt"
        )
    return params
