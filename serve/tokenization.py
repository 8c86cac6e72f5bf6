"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes ``{"prompt": str, "add_special_tokens": true}`` or a chat
``{"messages": [...], "add_generation_prompt": true, "tools": [...], "chat_template_kwargs":
{...}}`` (rendered with the server's chat template, as ``/v1/chat/completions`` renders it)
and answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` with
``return_token_strs: true``, else null). ``/detokenize`` takes ``{"tokens": [...]}`` and
answers ``{"prompt": str}``. Both need the server's tokenizer (400 without one).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from flotilla.serve.prompts import render_chat
from flotilla.serve.protocol import ChatMessage, _Strict, bad_request, quote
from flotilla.serve.tools import check_tools


class TokenizeRequest(_Strict):
    """``POST /tokenize``: ``prompt`` or ``messages`` (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def tokenize(req: TokenizeRequest, tokenizer: Any, chat_template: str | None, template_kwargs: dict, max_model_len: int | None) -> dict[str, Any]:
    """The ``/tokenize`` answer; APIError(400) naming the parameter."""
    _need(tokenizer, "prompt" if req.messages is None else "messages")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("/tokenize takes exactly one of prompt or messages", "prompt")
    if req.messages is not None:
        if not req.messages:
            raise bad_request("messages is empty; give at least one message", "messages")
        prompt = render_chat(
            tokenizer,
            req.messages,
            chat_template=chat_template,
            add_generation_prompt=req.add_generation_prompt is not False,
            template_kwargs={**template_kwargs, **(req.chat_template_kwargs or {})},
            tools=list(check_tools(req.tools)) if req.tools else None,
        )
        tokens = prompt.token_ids
        if req.add_special_tokens:
            tokens = list(tokenizer.encode(prompt.text, add_special_tokens=True))
    else:
        # NOTE: vLLM's default: a plain prompt gets the tokenizer's special tokens.
        tokens = list(tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False))
    strs = tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Any) -> dict[str, Any]:
    """The ``/detokenize`` answer; APIError(400) naming ``tokens`` for an id outside the
    tokenizer's vocabulary."""
    _need(tokenizer, "tokens")
    limit = len(tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < limit]
    if bad:
        raise bad_request(
            f"tokens holds {quote(bad[0])}, which is not a token id of this model; send ids in [0, {limit})", "tokens"
        )
    return {"prompt": tokenizer.decode(req.tokens)}


def _need(tokenizer: Any, param: str) -> None:
    if tokenizer is None:
        raise bad_request(f"{param}: this server has no tokenizer (skip_tokenizer_init)", param)
