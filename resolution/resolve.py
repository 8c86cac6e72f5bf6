"""``resolve(args, model, platform) -> ResolvedConfig``: the one entry point."""

from __future__ import annotations

import json
from typing import Any, Mapping

from flotilla.resolution.args import ServerArgs
from flotilla.resolution.config import ResolvedConfig
from flotilla.resolution.engine import run
from flotilla.resolution.errors import ArgumentError
from flotilla.resolution.fields import DEFAULTS, RESOLVABLE
from flotilla.resolution.model import ModelFacts
from flotilla.resolution.platform import PlatformFacts
from flotilla.resolution.rules import CATALOG


def resolve(args: ServerArgs, model: ModelFacts, platform: PlatformFacts) -> ResolvedConfig:
    """Resolve the server configuration: a pure function of its three inputs.

    Runs every rule of the catalog in its phase order. Raises
    :class:`~flotilla.resolution.errors.ResolutionError` listing every violated
    invariant when the combination is rejected.

    ``--json-model-override-args`` is applied to the model's config.json first,
    as SGLang applies it when it loads the config.
    """
    model = model.with_overrides(model_overrides(args.json_model_override_args))
    outcome = run(
        CATALOG,
        user=args.values,
        explicit=args.explicit,
        defaults=DEFAULTS,
        resolvable=RESOLVABLE,
        model=model,
        platform=platform,
    )
    return ResolvedConfig.build(outcome.values, outcome.env, outcome.provenance)


def model_overrides(raw: Any) -> Mapping[str, Any]:
    """The ``--json-model-override-args`` value as a dict (``{}`` when unset).

    Raises :class:`~flotilla.resolution.errors.ArgumentError` when it is not a
    JSON object.
    """
    if raw is None or raw == "":
        return {}
    if isinstance(raw, Mapping):
        return raw
    try:
        parsed = json.loads(raw)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ArgumentError(f"--json-model-override-args is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise ArgumentError(
            f"--json-model-override-args must be a JSON object, got {type(parsed).__name__}"
        )
    return parsed
