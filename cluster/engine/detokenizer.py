"""Incremental detokenization and stop-string matching for one completion.

Decoding a growing token list one token at a time must not split a multi-byte
character (a byte-level BPE token can carry half of one: ``decode`` then ends in
U+FFFD) and must keep the spaces a tokenizer only renders with left context (a
SentencePiece ``"▁word"`` decodes to ``"word"`` at the start of a string). So the
text of the new tokens is taken as the difference between decoding a window that
starts a few tokens back (``prefix_offset``) with and without them, and is held
back while it ends in an incomplete character.
"""

from __future__ import annotations

from typing import Protocol, Sequence

# How many prompt tokens to decode as left context for the first generated tokens.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    """What detokenization needs from a tokenizer (HF tokenizers satisfy it)."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one completion's tokens into text as they arrive.

    Args:
        tokenizer: anything with HF's ``decode(ids, skip_special_tokens=...)``.
        prompt_token_ids: the prompt (its last few tokens give the first token its context).
        skip_special_tokens: leave special tokens out of the text.
    """

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        # NOTE: a decode of the longer window can rewrite the end of the shorter one
        # (tokenizer clean-up); the new text is what lies past the shorter decode.
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a completion: whatever text the held-back tokens decode to."""
        if self._read_offset == len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""


def find_stop_string(text: str, new_text_len: int, stops: Sequence[str]) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last ``new_text_len`` characters of
    ``text``: ``(stop, index where it starts)``, or ``None``."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def stop_holdback(stops: Sequence[str]) -> int:
    """Characters a stream must hold back so that it never shows the start of a stop
    string that later completes."""
    return max((len(s) for s in stops), default=1) - 1
