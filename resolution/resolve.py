"""``resolve(args, model, platform) -> ResolvedConfig``: the one entry point."""

from __future__ import annotations

from flotilla.resolution.args import ServerArgs
from flotilla.resolution.config import ResolvedConfig
from flotilla.resolution.engine import run
from flotilla.resolution.fields import DEFAULTS, RESOLVABLE
from flotilla.resolution.model import ModelFacts
from flotilla.resolution.platform import PlatformFacts
from flotilla.resolution.rules import CATALOG


def resolve(args: ServerArgs, model: ModelFacts, platform: PlatformFacts) -> ResolvedConfig:
    """Resolve the server configuration: a pure function of its three inputs.

    Runs every rule of the catalog in its phase order. Raises
    :class:`~flotilla.resolution.errors.ResolutionError` listing every violated
    invariant when the combination is rejected.
    """
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
