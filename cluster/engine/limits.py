"""The engine's sizes the serving side needs too, from the resolved config: one definition
each, torch-free (the runner, the scheduler's config, the Serve deployment's bounds and the
prefix router all read them here)."""

from __future__ import annotations

from typing import Any

# Block size when the resolved page_size is 1 (a token-granular pool, which the
# torch backend does not need): 16 tokens, vLLM's default.
DEFAULT_BLOCK_SIZE = 16
# Requests running at once when --max-running-requests is not given.
DEFAULT_MAX_RUNNING_REQUESTS = 256


def block_size_for(config: Any) -> int:
    """The resolved ``page_size`` when it is above 1, else :data:`DEFAULT_BLOCK_SIZE`."""
    page_size = config.page_size or 1
    return page_size if page_size > 1 else DEFAULT_BLOCK_SIZE


def max_num_seqs_for(config: Any) -> int:
    """The most requests one step can hold: ``--max-running-requests`` (default 256), capped at
    the step's token budget (every running request decodes one token per step). The scheduler
    (``scheduler_config_for``) and the decode graphs use this one number."""
    chunk = config.chunked_prefill_size
    budget = chunk if chunk is not None and chunk > 0 else int(config.max_prefill_tokens or 16384)
    return int(min(config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS, budget))
