"""Reasoning parsers (``--reasoning-parser``, SGLang's names): a thinking model's output split
into ``reasoning_content`` (the section between the start and end tags, ``<think>`` and
``</think>`` for most) and ``content`` (what follows it), whole or streamed.

Where the section starts:

- ``deepseek-r1``, ``qwen3-thinking``, ``step3``: generation starts inside it (their
  templates end the prompt with the start tag, and the model may or may not repeat it);
- ``qwen3``, ``glm45``, ``deepseek-v3``, ``kimi``: the output opens it itself, or the
  rendered prompt ends with the start tag (thinking switched on in the template).

Choices: the reasoning is stripped of the whitespace at both ends, the content of the
whitespace right after the end tag; a section that never closes is all reasoning (the
answer was cut, or DeepSeek-R1 ran out of tokens); an output that never opens one is all
content, unchanged. Streamed pieces concatenate to exactly the whole split: a piece that may
be the start of a tag, and whitespace that may end the reasoning, are held back.
"""

from __future__ import annotations


class ReasoningParser:
    """Splits one output's reasoning section from its content (see the module docstring).

    Attributes:
        start: the tag that opens the section.
        end: the tag that closes it.
        always_starts_inside: generation starts inside the section whatever the prompt.
    """

    start = "<think>"
    end = "</think>"
    always_starts_inside = False

    def starts_in_reasoning(self, prompt_text: str | None) -> bool:
        """Whether generation begins inside the section (the prompt opened it)."""
        if self.always_starts_inside:
            return True
        return bool(prompt_text) and prompt_text.rstrip().endswith(self.start)

    def split(self, text: str, in_reasoning: bool) -> tuple[str | None, str]:
        """A whole output as (reasoning or None when it has no section, content)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            text, in_reasoning = stripped[len(self.start) :], True
        if not in_reasoning:
            return None, text
        reasoning, found, content = text.partition(self.end)
        return reasoning.strip(), content.lstrip() if found else ""

    def streamer(self, in_reasoning: bool) -> "ReasoningStream":
        return ReasoningStream(self, in_reasoning)


class ReasoningStream:
    """One streamed output's split: :meth:`feed` each new piece, :meth:`finish` at the end;
    each returns ``(reasoning delta, content delta)``."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool):
        self.parser = parser
        # "opening": is there a start tag at the beginning?; then "reasoning" or "content";
        # "after": the content after the end tag (its leading whitespace dropped).
        self.phase = "opening"
        self.in_reasoning = in_reasoning
        self.buffer = ""
        self.reasoning_started = False  # a non-whitespace reasoning character went out

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        if self.phase == "opening":
            stripped = self.buffer.lstrip()
            start = self.parser.start
            if stripped.startswith(start):
                self.buffer, self.phase = stripped[len(start) :], "reasoning"
            elif start.startswith(stripped):
                return "", ""  # NOTE: maybe the start tag (or only whitespace so far)
            elif self.in_reasoning:
                self.phase = "reasoning"
            else:
                self.phase, content, self.buffer = "content", self.buffer, ""
                return "", content
        if self.phase == "reasoning":
            head, found, tail = self.buffer.partition(self.parser.end)
            if found:
                reasoning = self._reasoning(head.rstrip())
                self.phase, self.buffer = "after", tail
            else:
                keep = partial_suffix(self.buffer, self.parser.end)
                ready = self.buffer[: len(self.buffer) - keep]
                out = ready.rstrip()
                self.buffer = ready[len(out) :] + self.buffer[len(ready) :]
                return self._reasoning(out), ""
        if self.phase == "after":
            content, self.buffer = self.buffer.lstrip(), ""
            if content:
                self.phase = "content"
        elif self.phase == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:
            text = text.lstrip()
            self.reasoning_started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.phase == "opening":
            if self.in_reasoning:
                return self._reasoning(rest.strip()), ""
            return "", rest
        if self.phase == "reasoning":
            return self._reasoning(rest.rstrip()), ""
        if self.phase == "after":
            return "", rest.lstrip()
        return "", rest


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _StartsInside(ReasoningParser):
    always_starts_inside = True


class _Kimi(ReasoningParser):
    start = "◁think▷"
    end = "◁/think▷"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek-r1": _StartsInside,
    "qwen3-thinking": _StartsInside,
    "step3": _StartsInside,
    "deepseek-v3": ReasoningParser,
    "qwen3": ReasoningParser,
    "glm45": ReasoningParser,
    "kimi": _Kimi,
}


def reasoning_parser_for(name: str) -> ReasoningParser:
    """The parser ``--reasoning-parser`` names; ValueError naming the flag for another name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is not built; use one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
