"""Prompts as the ingress builds them: chat templates, prompt normalisation, prefix keys.

The ingress tokenizes (the engine replicas receive token ids); the engine detokenizes
(see :mod:`flotilla.serve.ingress`). Everything here raises :class:`APIError` (400) naming
the parameter, so a bad prompt never reaches an engine replica.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

from flotilla.cluster.engine.limits import DEFAULT_BLOCK_SIZE
from flotilla.serve.protocol import APIError, ChatMessage, bad_request, quote
from flotilla.serve.tools import template_messages

# Tokens per prefix-routing block when there is no config: the engine's default KV block size.
DEFAULT_PREFIX_BLOCK = DEFAULT_BLOCK_SIZE
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Prompt:
    """One tokenized prompt: ``text`` when it was given (or rendered) as text."""

    token_ids: list[int]
    text: str | None = None


def render_chat(
    tokenizer: Any,
    messages: Sequence[ChatMessage],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> Prompt:
    """Apply the chat template (``add_generation_prompt=True`` by default) and tokenize;
    ``tools`` (OpenAI function tools) go to the template as its ``tools`` variable, and an
    assistant message's tool-call arguments reach it as objects."""
    if tokenizer is None:
        message = "messages: this server has no tokenizer (skip_tokenizer_init); use /v1/completions with token ids"
        raise bad_request(message, "messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("messages: the model has no chat template; start the server with --chat-template", "messages")
    conversation = template_messages([m.template_dict() for m in messages])
    extra = {"tools": tools} if tools else {}
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **extra,
            **(template_kwargs or {}),
        )
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - a template's raise_exception() or a Jinja error is the client's input
        raise bad_request(f"messages: the chat template rejected the conversation: {exc}", "messages") from None
    # NOTE: the rendered template already holds the special tokens; add none.
    return Prompt(list(tokenizer.encode(text, add_special_tokens=False)), text)


def normalize_prompts(prompt: Any, tokenizer: Any, max_prompts: int | None = None, param: str = "prompt") -> list[Prompt]:
    """``/v1/completions``' ``prompt`` as a list of prompts: a string, a list of strings
    (several prompts), a list of token ids (one), or a list of token-id lists (several);
    at most ``max_prompts`` of them (``--max-prompts-per-request``; None: any number),
    checked before anything is tokenized. Errors name ``param`` (``input`` for embeddings)."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt or [])
    if not items:
        raise bad_request(f"{param} is empty; give a string, token ids, or a non-empty list of them", param)
    if max_prompts is not None and len(items) > max_prompts:
        raise bad_request(
            f"{param} holds {len(items)} prompts and this server takes at most {max_prompts} per request "
            "(--max-prompts-per-request); send the others in further requests",
            param,
        )
    out = []
    for i, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{i}]"
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{where} is an empty string; give some text", param)
            if tokenizer is None:
                message = f"{where}: this server has no tokenizer (skip_tokenizer_init); send token ids"
                raise bad_request(message, param)
            out.append(Prompt(list(tokenizer.encode(item)), item))
        else:
            ids = list(item)
            if not ids:
                raise bad_request(f"{where} is an empty token list; give at least one token id", param)
            if any(t < 0 for t in ids):
                raise bad_request(f"{where} holds a negative token id (got {quote(min(ids))})", param)
            out.append(Prompt(ids))
    return out


def prefix_key(token_ids: Sequence[int], block_size: int = DEFAULT_PREFIX_BLOCK) -> int | None:
    """A stable hash of the prompt's first ``block_size`` tokens (None when shorter):
    requests with the same key share at least that prefix's KV block.

    NOTE: stable across processes (blake2b, not ``hash``), so every ingress replica gives
    the same key for the same prefix.
    """
    if len(token_ids) < block_size:
        return None
    data = b"".join((int(t) & _MASK64).to_bytes(8, "little") for t in token_ids[:block_size])
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1
