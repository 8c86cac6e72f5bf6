"""What the engine hands back: per-step deltas for streaming and per-request
results shaped like vLLM's (``out.outputs[0].text``, ``.token_ids``, ``.finish_reason``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one candidate token at one step.

    Attributes:
        logprob: ``log_softmax`` of the model's raw logits (before penalties, temperature
            and truncation, as vLLM reports by default).
        rank: 1 for the most likely token.
        decoded_token: the token's text, when a tokenizer is present.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One step's candidates: token id -> Logprob (the sampled token plus the top ones).
StepLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a prompt (``n > 1`` gives several, by ``index``).

    Attributes:
        index: which of the ``n`` completions this is.
        text: the generated text (stop strings removed unless asked to keep them).
        token_ids: the generated token ids (a stop token id is kept, as in vLLM).
        cumulative_logprob: sum of the sampled tokens' logprobs when logprobs were asked for.
        logprobs: per generated token, the top candidates, when ``SamplingParams.logprobs`` is set.
        finish_reason: ``"stop"`` (eos, stop string or stop token), ``"length"`` (max_tokens or the
            context limit), ``"abort"``, ``"error"`` (the engine failed it: see
            ``RequestOutput.error``), or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it (``None`` for eos or length).
        embedding: an embedding request's pooled vector (``SamplingParams.pooling``; float32
            values, unit L2 norm); such a completion has no tokens.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[StepLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    embedding: list[float] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything known about one request (the shape of vLLM's ``RequestOutput``).

    Attributes:
        request_id: the id given to (or made by) the engine.
        prompt: the prompt text, when the prompt was given as text.
        prompt_token_ids: the tokenized prompt.
        outputs: one :class:`CompletionOutput` per completion.
        finished: every completion has finished.
        num_cached_tokens: prompt tokens served from the prefix cache (first completion).
        error: why the engine failed this request (its completions finish with reason
            ``"error"``), or None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None


@dataclass
class CompletionDelta:
    """What one completion gained in one engine step (for streaming).

    Attributes:
        request_id: the parent request's id.
        index: which completion.
        token_ids: tokens sampled this step.
        text: newly final text (text that might still turn into a stop string is held back).
        logprobs: candidates for each of ``token_ids`` when asked for.
        finish_reason: set on the last delta of a completion.
        stop_reason: see :class:`CompletionOutput`.
        error: with ``finish_reason == "error"``, what failed.
    """

    request_id: str
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[StepLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its last delta

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
