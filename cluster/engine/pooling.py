"""Embedding requests (``SamplingParams.pooling``): a prompt's final hidden states (the
model's output after its last norm, what the LM head reads) pooled into one vector.

``last`` takes the last prompt token's hidden state; ``mean`` averages every prompt
position's. The vector is float32 with unit L2 norm (OpenAI's and vLLM's default for
embeddings), so a dot product is the cosine similarity.

The runner pools in the step that completes the prompt, the step where a generation request
would sample: the vector goes back in that row's
:class:`~flotilla.cluster.engine.sampler.SampledToken` (``embedding``) and the engine ends the
request with it. A ``mean`` request whose prompt is prefilled in chunks leaves the sum of each
chunk here (:class:`HiddenPooler`) until its last chunk; it computes every position
(``Request.skip_prefix_cache``), since a prefix-cache hit holds K/V, not hidden states.
``last`` needs only the last position, which every prefill computes, cache hit or not.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

# Partial sums kept for mean-pooled prompts between their chunks (an aborted request's entry
# is dropped when this many newer ones arrived).
MAX_OPEN_MEANS = 4096


def pooling_of(item: Any) -> str | None:
    """The pooling of a scheduled request (None: a generation request)."""
    return getattr(item.request.sampling_params, "pooling", None)


def pools(step: Any) -> bool:
    """Whether a step holds an embedding request."""
    return any(pooling_of(item) is not None for item in step.scheduled)


class HiddenPooler:
    """Pools one runner's steps' hidden states for the embedding requests in them."""

    def __init__(self) -> None:
        self._means: OrderedDict[str, tuple[torch.Tensor, int]] = OrderedDict()

    def pool(self, step: Any, hidden: torch.Tensor) -> dict[int, list[float] | None]:
        """Each sampling row's vector (row = its index among the step's sampling requests),
        for the rows of embedding requests whose prompt this step completes; a ``mean`` row
        whose earlier chunks were not seen here gets None (the engine fails it)."""
        out: dict[int, list[float] | None] = {}
        offset, row = 0, 0
        for item in step.scheduled:
            how, count = pooling_of(item), item.num_new_tokens
            if how == "mean":
                vector = self._mean(item, hidden[offset : offset + count])
                if item.samples:
                    out[row] = vector
            elif how == "last" and item.samples:
                out[row] = unit(hidden[offset + count - 1])
            row += int(item.samples)
            offset += count
        return out

    def _mean(self, item: Any, rows: torch.Tensor) -> list[float] | None:
        request_id = item.request.request_id
        total, count = rows.float().sum(dim=0), rows.shape[0]
        if item.start_position > 0:
            earlier = self._means.pop(request_id, None)
            if earlier is None:
                return None
            total, count = total + earlier[0], count + earlier[1]
        else:
            self._means.pop(request_id, None)  # NOTE: recomputed from its start (preempted)
        if not item.samples:
            self._means[request_id] = (total, count)
            while len(self._means) > MAX_OPEN_MEANS:
                self._means.popitem(last=False)
            return None
        return unit(total / count)


def unit(vector: torch.Tensor) -> list[float]:
    """``vector`` in float32 with unit L2 norm, as a list."""
    vector = vector.float()
    return (vector / vector.norm().clamp_min(1e-12)).cpu().tolist()
