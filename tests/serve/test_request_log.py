"""``--log-requests`` with its level and format, and ``--log-level``: the ingress app over
httpx's ASGI transport with a stub engine that answers two pieces of text per request."""

import asyncio
import json
import logging
from types import SimpleNamespace

import httpx
import pytest

from flotilla.cluster.log_level import apply_log_level
from flotilla.serve.ingress import create_app
from flotilla.serve.request_log import PARTIAL_CHARS, RequestLogSettings, format_record, request_record
from flotilla.serve.types import CompletionChunk, GenerateChunk, ServeOptions


class TwoPieces:
    async def generate(self, request):
        yield GenerateChunk(request.request_id, [CompletionChunk(0, [7], "Pa")])
        yield GenerateChunk(request.request_id, [CompletionChunk(0, [8], "ris", finish_reason="length")], True, 5, 2)

    async def is_healthy(self):
        return True

    async def metrics_text(self):
        return ""


def logged_lines(caplog, *, stream=False, **flags):
    config = SimpleNamespace(context_length=64, page_size=16, **flags)
    app = create_app(TwoPieces(), None, ServeOptions(served_model_name="m"), config)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            body = {"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0, "stream": stream}
            response = await http.post("/v1/completions", json=body, headers={"X-Request-Id": "rid-1"})
            assert response.status_code == 200, response.text

    with caplog.at_level(logging.INFO, logger="flotilla.serve.requests"):
        caplog.clear()
        asyncio.run(main())
    return [r.getMessage() for r in caplog.records if r.name == "flotilla.serve.requests"]


def test_no_request_log_without_the_flag(caplog):
    assert logged_lines(caplog) == []
    assert logged_lines(caplog, log_requests=False, log_requests_level=3) == []


@pytest.mark.parametrize("stream", [False, True])
def test_json_lines_hold_what_each_level_asks(caplog, stream):
    def line(level):
        (text,) = logged_lines(caplog, stream=stream, log_requests=True, log_requests_level=level, log_requests_format="json")
        return json.loads(text)

    zero = line(0)
    assert zero["request_id"] == "rid-1" and zero["status"] == 200 and zero["completion_tokens"] == 2
    assert "params" not in zero and "input" not in zero and "output" not in zero
    one = line(1)
    assert one["params"] == {"max_tokens": 2, "temperature": 0, "stream": stream} and "input" not in one
    two = line(2)
    assert two["input"] == "[1, 2, 3]" and two["output"] == ["Paris"]


def test_text_lines_are_key_value_pairs(caplog):
    (text,) = logged_lines(caplog, log_requests=True, log_requests_level=2, log_requests_format="text")
    assert text.startswith('request_id="rid-1" method="POST" path="/v1/completions" status=200 ')
    assert 'output=["Paris"]' in text and 'input="[1, 2, 3]"' in text


def test_level_two_cuts_long_text_and_level_three_keeps_it():
    body, outputs = {"prompt": "x" * (PARTIAL_CHARS + 10)}, ["y" * (PARTIAL_CHARS + 1)]
    partial = request_record(RequestLogSettings(True, 2, "json"), {}, body, outputs)
    assert len(partial["input"]) == PARTIAL_CHARS + 3 and partial["input"].endswith("...")
    assert partial["output"][0] == "y" * PARTIAL_CHARS + "..."
    whole = request_record(RequestLogSettings(True, 3, "json"), {}, body, outputs)
    assert whole["input"] == body["prompt"] and whole["output"] == outputs
    assert json.loads(format_record(RequestLogSettings(True, 3, "json"), whole)) == whole


def test_log_level_sets_flotillas_loggers():
    logger = logging.getLogger("flotilla")
    before = logger.level
    try:
        apply_log_level(SimpleNamespace(log_level="WARNING"))
        assert not logging.getLogger("flotilla.serve.ingress").isEnabledFor(logging.INFO)
        apply_log_level(SimpleNamespace(log_level="debug"))
        assert logging.getLogger("flotilla.cluster.worker").isEnabledFor(logging.DEBUG)
        with pytest.raises(ValueError, match=r"log_level must be one of debug, info, warning, error, critical \(got log_level='loud'\)"):
            apply_log_level(SimpleNamespace(log_level="loud"))
    finally:
        logger.setLevel(before)


def test_the_request_log_goes_to_stdout_and_other_targets_are_refused(capsys):
    from flotilla.resolution.runtime_support import refusals
    from flotilla.serve.request_log import configure_request_log, request_log

    handlers, propagate = list(request_log.handlers), request_log.propagate
    try:
        request_log.handlers.clear()
        configure_request_log()
        request_log.info("request_id=x")
        assert capsys.readouterr().out == "request_id=x\n"
    finally:
        request_log.handlers[:] = handlers
        request_log.propagate = propagate
    assert refusals({"log_requests_target": ["stdout"]}) == ()
    (refusal,) = refusals({"log_requests_target": ["stdout", "/var/log/flotilla"]})
    assert refusal.line.startswith("--log-requests-target stdout /var/log/flotilla is not supported")
