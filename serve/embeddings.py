"""``POST /v1/embeddings`` (OpenAI's shape): each input's embedding from the served model,
computed by the engine like a prefill, batched with whatever else it runs (no sampling).

``input`` is a string, a list of strings, a list of token ids, or a list of token-id lists
(one embedding each, ``index`` in input order). ``encoding_format`` ``float`` (the default)
or ``base64`` (the float32 little-endian bytes, what the openai client decodes). The vector
is the model's final hidden state (after its last norm) pooled over the prompt and scaled to
unit length: ``pooling`` ``last`` (the last token's, the default: what a causal model's
representation of the whole input is) or ``mean`` (every position's average; a flotilla
extra). ``dimensions`` must be the model's hidden size (there is no truncation). Each input
travels to the engine as one request of a group (admitted all or none, as a multi-prompt
completion), so it runs on any engine replica; under PD it runs whole on a decode replica
(there is nothing to hand off).
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import Field

from flotilla.cluster.engine.sampling_params import POOLING_TYPES, SamplingParams
from flotilla.serve.prompts import normalize_prompts
from flotilla.serve.protocol import _Strict, bad_request, quote
from flotilla.serve.responses import EngineStreams, GenerationJob, check_chunk, unavailable


class EmbeddingRequest(_Strict):
    """``POST /v1/embeddings``."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    pooling: str | None = None  # NOTE: flotilla's extra: "last" (default) or "mean"

    def sampling_params(self) -> SamplingParams:
        """The engine's parameters of each input; APIError(400) naming the parameter."""
        pooling = self.pooling or "last"
        if pooling not in POOLING_TYPES:
            raise bad_request(f"pooling must be one of {list(POOLING_TYPES)} (got pooling={quote(self.pooling)})", "pooling")
        return SamplingParams(max_tokens=1, pooling=pooling)


def embedding_inputs(req: EmbeddingRequest, tokenizer: Any, max_prompts: int | None) -> list:
    """The request's inputs as prompts (APIError(400) naming ``input``)."""
    return normalize_prompts(req.input, tokenizer, max_prompts, param="input")


async def embedding_response(req: EmbeddingRequest, job: GenerationJob, streams: EngineStreams) -> dict[str, Any]:
    """Read the inputs' streams to the end and build the answer (APIError(400) naming
    ``dimensions`` when it is not the model's embedding size: nothing shortens them)."""
    vectors: dict[int, list[float]] = {}
    while (item := await streams.next()) is not None:
        i, chunk = item
        check_chunk(chunk)
        for c in chunk.completions:
            if c.embedding is not None:
                vectors[i] = c.embedding
        job.record(i, chunk)
    count = len(job.prompts)
    missing = [i for i in range(count) if i not in vectors]
    if missing:
        raise unavailable(f"the engine returned no embedding for input {missing[0]}")
    size = len(vectors[0])
    if req.dimensions is not None and req.dimensions != size:
        raise bad_request(
            f"dimensions must be this model's embedding size, {size} (got dimensions={req.dimensions}); "
            "the server does not shorten embeddings",
            "dimensions",
        )
    prompt_tokens = job.totals()[0]
    data = [
        {"object": "embedding", "index": i, "embedding": encode(vectors[i], req.encoding_format or "float")}
        for i in range(count)
    ]
    return {"object": "list", "data": data, "model": job.model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as ``float`` (a JSON list) or ``base64`` (float32 little-endian bytes)."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector
