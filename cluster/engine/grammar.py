"""Constrained decoding: the grammar backends (``--grammar-backend``) and each constrained
request's grammar state.

A request with ``SamplingParams.guided`` (structured outputs, forced tool calls) gets a
:class:`GrammarState` per completion. Before each step the engine asks it for the packed
bitmask of the tokens the grammar allows next (:meth:`GrammarState.next_bitmask`, int32
``[ceil(V / 32)]``, xgrammar's and llguidance's common layout); the row carries it to the
sampler (:class:`~flotilla.cluster.engine.sampler.SamplingRow`), which sets every other
token's logit to ``-inf`` before the greedy or sampled choice. After the step the chosen token
advances the state (:meth:`GrammarState.accept`). The mask is per row: constrained and free
requests step in the same batch, and a free row's logits are never touched.

Backends (both run on the CPU, next to the engine):

- ``xgrammar`` (the default): JSON schema (strict or not), any JSON object, regex, EBNF (GBNF).
- ``llguidance``: the same kinds (EBNF through its GBNF-to-Lark conversion).
- ``none``: no backend; a constrained request is refused with a ValueError naming the
  request's parameter and ``--grammar-backend``.

Compiling is the slow part (milliseconds for a schema; the tokenizer's tables, built once,
take a few hundred): :meth:`GrammarBackend.compile` is thread-safe and cached by the
constraint (LRU, :data:`COMPILE_CACHE_SIZE` entries), and the serving engine calls it off its
engine thread before the request is queued (:class:`~flotilla.serve.async_engine.AsyncEngine`),
so :meth:`GrammarBackend.state_for` on the engine thread finds it compiled. A constraint that
does not compile is a ValueError whose message starts with the request parameter it came from
(``response_format: ...``), which the ingress answers with a 400 naming it.

The grammar ends only in a state where a stop token (the model's EOS ids) is allowed: once the
JSON is whole the mask allows nothing else, so the completion ends with ``stop``. A
completion that reaches ``max_tokens`` first ends with ``length`` and its text is cut
mid-JSON (the client sees ``finish_reason: length``).

Reasoning: with a reasoning parser the constraint applies after the reasoning section
(``GuidedDecoding.reasoning_end``): while the output is inside ``<think>...</think>`` no
mask is applied.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Sequence

import torch

from flotilla.cluster.engine.sampling_params import GuidedDecoding

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
# Compiled constraints kept per backend (LRU): agents resend the same schemas and tools.
COMPILE_CACHE_SIZE = 256


class GrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary and makes grammar states.

    Args:
        name: ``xgrammar`` or ``llguidance`` (see :func:`grammar_backend_for` for ``none``).
        tokenizer: the engine's HF tokenizer.
        vocab_size: the model's vocabulary (the logits' width; may exceed the tokenizer's).
        stop_token_ids: the model's EOS ids: the tokens that end a completed grammar.
        any_whitespace: JSON may hold any whitespace between tokens (False:
            ``--constrained-json-disable-any-whitespace``: no free whitespace; xgrammar
            writes the canonical ``", "`` and ``": "`` separators, llguidance its compact form).
    """

    def __init__(self, name: str, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], any_whitespace: bool = True):
        if name not in ("xgrammar", "llguidance"):
            raise ValueError(f"grammar_backend={name!r} is not a grammar backend; use xgrammar or llguidance")
        if tokenizer is None:
            raise ValueError("constrained decoding needs the model's tokenizer, and this engine has none (skip_tokenizer_init)")
        self.name = name
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self.any_whitespace = any_whitespace
        self.words = (self.vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._impl: Any = None  # NOTE: built on first use (off the engine thread when serving)

    # -- compiling -----------------------------------------------------------------

    def compile(self, guided: GuidedDecoding) -> Any:
        """The compiled form of ``guided`` (cached); ValueError naming ``guided.param`` when
        it does not compile. Thread-safe."""
        key = guided.cache_key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            impl = self._implementation()
        try:
            compiled = impl.compile(guided, self.any_whitespace)
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backends raise RuntimeError for bad input
            raise ValueError(f"{guided.param}: {_what(guided)} does not compile: {_first_line(exc)}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > COMPILE_CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _implementation(self) -> Any:
        if self._impl is None:
            maker = _XGrammar if self.name == "xgrammar" else _LLGuidance
            self._impl = maker(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._impl

    def state_for(self, guided: GuidedDecoding) -> "GrammarState":
        """A fresh grammar state for one completion constrained by ``guided``."""
        compiled = self.compile(guided)
        return GrammarState(self._impl.matcher(compiled), guided, self.words)


def grammar_backend_for(config: Any, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> GrammarBackend | None:
    """The backend ``--grammar-backend`` names (None for ``none``); ValueError for a name
    that is not one of :data:`GRAMMAR_BACKENDS`."""
    name = getattr(config, "grammar_backend", None) or "xgrammar"
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"grammar_backend={name!r} is not supported; use one of {list(GRAMMAR_BACKENDS)}")
    if name == "none" or tokenizer is None:
        return None
    any_whitespace = not bool(getattr(config, "constrained_json_disable_any_whitespace", False))
    return GrammarBackend(name, tokenizer, vocab_size, stop_token_ids, any_whitespace)


def no_backend_error(guided: GuidedDecoding, config: Any, tokenizer: Any) -> ValueError:
    """Why a constrained request cannot run on an engine without a backend."""
    if tokenizer is None:
        reason = "this server has no tokenizer (skip_tokenizer_init), which constrained decoding needs"
    else:
        reason = f"this server runs without a grammar backend (--grammar-backend {getattr(config, 'grammar_backend', 'none')})"
    return ValueError(f"{guided.param}: {reason}; send the request without the constraint, or start the server with --grammar-backend xgrammar")


def _what(guided: GuidedDecoding) -> str:
    return {
        "json_schema": "the JSON schema",
        "json_object": "the JSON grammar",
        "regex": "the regular expression",
        "ebnf": "the EBNF grammar",
    }[guided.kind]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    # NOTE: xgrammar prefixes "[time] /path/file.cc:line: "; the client needs the message only.
    lines = [line for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else type(exc).__name__
    if line.startswith("[") and ": " in line:
        line = line.split(": ", 1)[1]
    return line[:300]


# -- the grammar state of one completion ----------------------------------------------------


class GrammarState:
    """One completion's position in its grammar, behind its reasoning gate.

    The gate (with a reasoning parser, ``guided.reasoning_end`` set): a prompt that opened
    the reasoning section (``starts_in_reasoning``) leaves the output unconstrained until the
    reasoning end tag; otherwise the first token may open the section (the grammar's tokens
    or the start tag's first token are allowed) and, if it does not, the grammar applies
    from that token on.

    Attributes:
        guided: the constraint.
        phase: ``active`` (the grammar applies), ``first`` (the first token: grammar or the
            reasoning start), ``opening`` (inside a multi-token start tag), ``reasoning``.
    """

    def __init__(self, matcher: Any, guided: GuidedDecoding, words: int):
        self.matcher = matcher
        self.guided = guided
        self.words = words
        if not guided.reasoning_end:
            self.phase = "active"
        elif guided.starts_in_reasoning or not guided.reasoning_start:
            self.phase = "reasoning"
        else:
            self.phase = "first"
        # Output tokens of the reasoning tags seen so far.
        self._seen: list[int] = []
        # Tokens the matcher took (what a rollback after drafted positions undoes).
        self._matched = 0

    @property
    def active(self) -> bool:
        return self.phase == "active"

    def next_bitmask(self) -> torch.Tensor | None:
        """The packed bitmask of the tokens allowed next (int32 ``[words]``, CPU), or None
        while nothing is constrained (reasoning) or once the grammar ended."""
        if self.phase in ("reasoning", "opening") or self.matcher.terminated():
            return None
        mask = torch.zeros(self.words, dtype=torch.int32)
        self.matcher.fill(mask)
        if self.phase == "first":
            token = self.guided.reasoning_start[0]
            mask[token // 32] |= _bit(token % 32)
        return mask

    def draft_bitmasks(self, drafts: Sequence[int]) -> tuple[list[torch.Tensor | None], int]:
        """Speculative decoding: ``(the bitmask after each of the first j drafts, for j = 1..n;
        n)``, where ``n`` is how many leading drafts the grammar allows (a draft it does not
        allow would be rejected by the mask anyway). The state is left as it was: the tokens
        verification accepts are taken by :meth:`accept` after the step, as any others."""
        saved = (self.phase, list(self._seen), self._matched, self.matcher.snapshot())
        masks: list[torch.Tensor | None] = []
        try:
            for token in drafts:
                if self.matcher.terminated() and self.phase == "active":
                    break  # NOTE: the grammar ended: only the stop token was allowed, and it ends the output
                allowed = self.next_bitmask()
                if allowed is not None and not (int(allowed[token // 32]) >> (token % 32)) & 1:
                    break
                if not self.accept(token):
                    break
                masks.append(self.next_bitmask())
        finally:
            taken = self._matched - saved[2]
            if taken:
                self.matcher.rollback(taken)
            self.phase, self._seen, self._matched = saved[0], saved[1], saved[2]
            self.matcher.restore(saved[3])
        return masks, len(masks)

    def _match(self, token: int) -> bool:
        ok = self.matcher.accept(token)
        if ok:
            self._matched += 1
        return ok

    def accept(self, token_id: int) -> bool:
        """Advance by the chosen token; False when the grammar does not allow it (the
        output left its constraint)."""
        token = int(token_id)
        if self.phase == "active":
            return self.matcher.terminated() or self._match(token)
        start, end = self.guided.reasoning_start, self.guided.reasoning_end
        if self.phase == "reasoning":
            self._seen.append(token)
            if tuple(self._seen[-len(end) :]) == tuple(end):
                self.phase = "active"
            return True
        self._seen.append(token)
        if tuple(self._seen) == tuple(start):
            self.phase, self._seen = "reasoning", []
            return True
        if tuple(self._seen) == tuple(start[: len(self._seen)]):
            self.phase = "opening"
            return True
        # NOTE: the output did not open a reasoning section: its tokens so far are the grammar's.
        seen, self._seen, self.phase = self._seen, [], "active"
        return all(self._match(t) for t in seen)


def _bit(index: int) -> int:
    """Bit ``index`` of an int32 word (bit 31 is the sign bit)."""
    return -(1 << 31) if index == 31 else 1 << index


# -- backends --------------------------------------------------------------------------------


class _XGrammar:
    """xgrammar: a compiler per tokenizer; a GrammarMatcher per completion."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, guided: GuidedDecoding, any_whitespace: bool) -> Any:
        if guided.kind == "json_schema":
            return self.compiler.compile_json_schema(guided.spec, any_whitespace=any_whitespace, strict_mode=guided.strict)
        if guided.kind == "json_object":
            # NOTE: an object (OpenAI's json_object); xgrammar's built-in JSON grammar takes any value.
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
        if guided.kind == "regex":
            return self.compiler.compile_regex(guided.spec)
        return self.compiler.compile_grammar(guided.spec)

    def matcher(self, compiled: Any) -> "_XGrammarMatcher":
        return _XGrammarMatcher(self.xgr.GrammarMatcher(compiled))


class _XGrammarMatcher:
    def __init__(self, matcher: Any):
        self.m = matcher

    def fill(self, mask: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(mask.view(1, -1), 0)

    def accept(self, token_id: int) -> bool:
        return bool(self.m.accept_token(token_id))

    def terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def snapshot(self) -> None:
        return None  # NOTE: the matcher's whole state is its token history (rollback)

    def restore(self, snapshot: None) -> None:
        pass


class _LLGuidance:
    """llguidance: a tokenizer wrapper; an LLMatcher per completion."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.stop_token_ids = frozenset(stop_token_ids)
        eos = stop_token_ids[0] if len(stop_token_ids) == 1 else stop_token_ids
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile(self, guided: GuidedDecoding, any_whitespace: bool) -> Any:
        matcher_type = self.llg.LLMatcher
        if guided.kind in ("json_schema", "json_object"):
            schema = json.loads(guided.spec) if guided.kind == "json_schema" else {"type": "object"}
            if isinstance(schema, dict):
                options = {"whitespace_flexible": any_whitespace}
                if guided.kind == "json_schema" and guided.strict:
                    # NOTE: strict JSON schema: no properties beyond those the schema names.
                    options["lenient"] = False
                schema = {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
            grammar = matcher_type.grammar_from_json_schema(json.dumps(schema))
        elif guided.kind == "regex":
            grammar = matcher_type.grammar_from_regex(guided.spec)
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = matcher_type.grammar_from_lark(gbnf_to_lark(guided.spec))
        failed, messages = matcher_type.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            raise RuntimeError("; ".join(messages) or "the grammar is not valid")
        return grammar

    def matcher(self, compiled: Any) -> "_LLGuidanceMatcher":
        return _LLGuidanceMatcher(self.llg, self.llg.LLMatcher(self.tokenizer, compiled), self.stop_token_ids)


class _LLGuidanceMatcher:
    """NOTE: llguidance reports "stopped" as soon as only a stop token may follow; the
    grammar ends here (as xgrammar's does) once the stop token itself was taken."""

    def __init__(self, llg: Any, matcher: Any, stop_token_ids: frozenset[int]):
        self.llg, self.m, self.stop_token_ids = llg, matcher, stop_token_ids
        self.ended = False

    def fill(self, mask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(self.m, mask.view(1, -1), 0)

    def accept(self, token_id: int) -> bool:
        ok = bool(self.m.consume_token(token_id)) and not self.m.is_error()
        self.ended = ok and token_id in self.stop_token_ids
        return ok

    def terminated(self) -> bool:
        return self.ended

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)

    def snapshot(self) -> bool:
        return self.ended

    def restore(self, ended: bool) -> None:
        self.ended = ended
