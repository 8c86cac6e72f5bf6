"""Structured outputs: a request's output constraint as the engine's
:class:`~flotilla.cluster.engine.sampling_params.GuidedDecoding`.

Where a constraint can come from (at most one per request; two are a 400):

- OpenAI's ``response_format`` (chat): ``{"type": "text"}`` (none), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}`` (the schema; ``strict`` false lets objects carry properties the
  schema does not name, where it does not forbid them; a missing schema is any JSON value).
- vLLM's ``structured_outputs`` object (chat and completions): one of ``json`` (a schema, as
  an object or JSON text), ``regex``, ``choice`` (a list of strings: the output is one of
  them), ``grammar`` (EBNF), ``json_object: true``; and its older top-level spellings
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
- SGLang's top-level ``regex`` and ``ebnf``.

A schema is checked with ``jsonschema`` first, so a schema that is not a JSON Schema gets a
400 naming where in it the problem is; the grammar backend then compiles it in the engine
replica (a 400 naming the parameter when it cannot). The grammar applies to the generated
text only: a ``json_schema`` answer is the JSON value itself, no code fences.
"""

from __future__ import annotations

import json
import re
from typing import Any

from flotilla.cluster.engine.sampling_params import GuidedDecoding
from flotilla.serve.protocol import APIError, bad_request, quote

# Top-level body fields that carry a constraint besides response_format (vLLM's legacy and
# SGLang's spellings), with the kind each gives.
LEGACY_FIELDS = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "ebnf",
    "regex": "regex",
    "ebnf": "ebnf",
}
# structured_outputs' keys, with the kind each gives.
STRUCTURED_OUTPUT_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf", "json_object": "json_object"}


def guided_decoding_of(body: Any, response_format: dict[str, Any] | None = None) -> GuidedDecoding | None:
    """The constraint a request asks for (None: free generation); APIError(400) naming the
    parameter for a malformed one, or for more than one."""
    found: list[GuidedDecoding] = []
    if response_format is not None:
        guided = _response_format(response_format)
        if guided is not None:
            found.append(guided)
    structured = getattr(body, "structured_outputs", None)
    if structured is not None:
        found.append(_structured_outputs(structured))
    for name, kind in LEGACY_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            found.append(_constraint(kind, value, name))
    if len(found) > 1:
        names = ", ".join(g.param for g in found)
        raise bad_request(f"the request gives {len(found)} output constraints ({names}); give at most one", found[1].param)
    return found[0] if found else None


def _response_format(response_format: dict[str, Any]) -> GuidedDecoding | None:
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GuidedDecoding("json_object", param="response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema' (got {quote(kind)})",
            "response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            f"response_format.json_schema must be an object with a 'schema' (got {quote(spec)})", "response_format"
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"response_format.json_schema.strict must be a boolean (got {quote(strict)})", "response_format")
    schema = spec.get("schema", {})
    return GuidedDecoding(
        "json_schema", schema_text(schema, "response_format.json_schema.schema", "response_format"),
        param="response_format", strict=bool(strict),
    )  # fmt: skip


def _structured_outputs(value: Any) -> GuidedDecoding:
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object (got {quote(value)})", "structured_outputs")
    given = {k: v for k, v in value.items() if k in STRUCTURED_OUTPUT_KEYS and v not in (None, False)}
    if len(given) != 1:
        keys = ", ".join(STRUCTURED_OUTPUT_KEYS)
        raise bad_request(
            f"structured_outputs must set exactly one of {keys} (got {quote(sorted(given) or value)})", "structured_outputs"
        )
    (key, spec), = given.items()
    return _constraint(STRUCTURED_OUTPUT_KEYS[key], spec, "structured_outputs", f"structured_outputs.{key}")


def _constraint(kind: str, value: Any, param: str, where: str | None = None) -> GuidedDecoding:
    where = where or param
    if kind == "json_object":
        if value is not True:
            raise bad_request(f"{where} must be true (got {quote(value)})", param)
        return GuidedDecoding("json_object", param=param)
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise bad_request(f"{where} is not valid JSON: {exc}", param) from None
        return GuidedDecoding("json_schema", schema_text(value, where, param), param=param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{where} must be a non-empty list of non-empty strings (got {quote(value)})", param)
        return GuidedDecoding("regex", "|".join(f"({re.escape(c)})" for c in value), param=param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string (got {quote(value)})", param)
    return GuidedDecoding(kind, value, param=param)


def schema_text(schema: Any, where: str, param: str) -> str:
    """A JSON schema as the JSON text the engine compiles; APIError(400) naming ``param``,
    with the path inside the schema, when it is not a valid JSON Schema."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise bad_request(f"{where} must be a JSON schema object (got {quote(schema)})", param)
    check_schema(schema, where, param)
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def check_schema(schema: dict[str, Any], where: str, param: str) -> None:
    """APIError(400) naming ``param`` and the path of the first problem when ``schema`` is not
    a valid JSON Schema (its declared draft, else 2020-12)."""
    import jsonschema

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise APIError(400, f"{where}{path} is not a valid JSON schema: {exc.message}", param) from None
