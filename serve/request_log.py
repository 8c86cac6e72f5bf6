"""The request log (``--log-requests``): one line per finished generation request, on the
``flotilla.serve.requests`` logger, beside the access log (``flotilla.serve.access``, one JSON
line per HTTP request, always on).

What a line holds follows SGLang's ``--log-requests-level``:

- ``0``: metadata: request id, route, status, latency, token counts;
- ``1``: and the sampling parameters of the body (everything but the prompt or messages);
- ``2`` (default): and the input (the body's ``prompt`` or ``messages``) and each choice's
  output text, each cut to :data:`PARTIAL_CHARS` characters (``...`` marks a cut);
- ``3``: the whole input and output.

``--log-requests-format`` is ``text`` (``key=value`` pairs, each value JSON-encoded: strings
quoted; SGLang's default) or ``json`` (one JSON object). The lines go to stdout
(``--log-requests-target stdout``, the only target built), which Ray collects per node.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Mapping

request_log = logging.getLogger("flotilla.serve.requests")
# Characters of input and output a level-2 line keeps (SGLang's partial logging is of this order).
PARTIAL_CHARS = 2048
_INPUT_FIELDS = ("prompt", "messages")


@dataclass(frozen=True)
class RequestLogSettings:
    """The resolved ``--log-requests*`` flags.

    Attributes:
        enabled: ``--log-requests``.
        level: ``--log-requests-level`` (0..3).
        fmt: ``--log-requests-format`` (``text`` or ``json``).
    """

    enabled: bool = False
    level: int = 2
    fmt: str = "text"

    @classmethod
    def of(cls, config: Any) -> "RequestLogSettings":
        return cls(
            enabled=bool(getattr(config, "log_requests", False)),
            level=int(getattr(config, "log_requests_level", 2)),
            fmt=str(getattr(config, "log_requests_format", "text")),
        )

    @property
    def keeps_text(self) -> bool:
        """Whether lines carry the outputs (so the job must gather each choice's text)."""
        return self.enabled and self.level >= 2


def configure_request_log(stream: Any = None) -> logging.Logger:
    """Send the request log to ``stream`` (default stdout, the message alone) unless it has a
    handler already; for processes whose logging nobody configured, such as a Serve replica."""
    if not request_log.handlers:
        handler = logging.StreamHandler(stream or sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        request_log.addHandler(handler)
        request_log.propagate = False
    request_log.setLevel(logging.INFO)
    return request_log


def request_record(settings: RequestLogSettings, meta: Mapping[str, Any], body: Any, outputs: list[str] | None) -> dict:
    """The fields of one line: ``meta`` (id, route, status, latency, tokens) and, by level,
    the sampling parameters of ``body``, its input and the ``outputs`` (one text per choice)."""
    record = dict(meta)
    if settings.level >= 1 and isinstance(body, Mapping):
        record["params"] = {k: v for k, v in body.items() if k not in _INPUT_FIELDS}
    if settings.level >= 2:
        limit = None if settings.level >= 3 else PARTIAL_CHARS
        if isinstance(body, Mapping):
            given = next((body[k] for k in _INPUT_FIELDS if k in body), None)
            record["input"] = _cut(given if isinstance(given, str) else json.dumps(given), limit)
        record["output"] = [_cut(text, limit) for text in outputs or []]
    return record


def format_record(settings: RequestLogSettings, record: Mapping[str, Any]) -> str:
    """One line: JSON, or ``key=value`` pairs."""
    if settings.fmt == "json":
        return json.dumps(record, ensure_ascii=False, default=str)
    parts = []
    for key, value in record.items():
        text = value if isinstance(value, (int, float)) and not isinstance(value, bool) else json.dumps(value, default=str)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _cut(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[:limit] + "..."
