"""The model-override registry: constant per-architecture table, providers keyed
by exact architecture name, and providers keyed by an architecture predicate.

A provider is a rule (``fn(view, model, platform) -> {field: value}``) limited to
the resolvable fields. All providers that apply to a model run on one snapshot
of the configuration (none sees another's declarations); their declarations are
then applied in this order: the constant table entry, the exact-name providers in
registration order, then the matching predicate providers in registration order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from flotilla.resolution.engine import ProviderGroup, Rule

# Constant per-architecture overrides.
MODEL_OVERRIDES: dict[str, dict[str, Any]] = {
    # These models run in bfloat16 whatever dtype was requested.
    "MistralLarge3ForCausalLM": {"dtype": "bfloat16"},
    "PixtralForConditionalGeneration": {"dtype": "bfloat16"},
}

_EXACT: list[tuple[frozenset[str], Rule]] = []
_PREDICATE: list[tuple[Callable[[str], bool], Rule]] = []


def provider(*architectures: str, overrides: Iterable[str] = ()) -> Callable[[Callable], Rule]:
    """Register a provider for the named architectures (in registration order)."""

    def wrap(fn: Callable) -> Rule:
        rule_ = Rule(fn.__name__, fn, frozenset(overrides), whitelist=True)
        _EXACT.append((frozenset(architectures), rule_))
        return rule_

    return wrap


def provider_when(predicate: Callable[[str], bool], *, overrides: Iterable[str] = ()) -> Callable[[Callable], Rule]:
    """Register a provider for every architecture name ``predicate`` accepts."""

    def wrap(fn: Callable) -> Rule:
        rule_ = Rule(fn.__name__, fn, frozenset(overrides), whitelist=True)
        _PREDICATE.append((predicate, rule_))
        return rule_

    return wrap


def _constant_rule(architecture: str) -> Rule | None:
    table = MODEL_OVERRIDES.get(architecture)
    if not table:
        return None

    def constant(view, model, platform):
        return dict(table)

    constant.__doc__ = f"Constant overrides for {architecture} (the MODEL_OVERRIDES table)."
    # NOTE: the constant table wins over explicit user values, as in the seeds.
    return Rule(f"MODEL_OVERRIDES[{architecture!r}]", constant, frozenset(table), whitelist=True)


def providers_for(architecture: str) -> list[Rule]:
    """Every provider that applies to ``architecture``, in application order."""
    found: list[Rule] = []
    constant = _constant_rule(architecture)
    if constant is not None:
        found.append(constant)
    found += [r for archs, r in _EXACT if architecture in archs]
    found += [r for pred, r in _PREDICATE if pred(architecture)]
    return found


def registered_architectures() -> frozenset[str]:
    """Every architecture named by the table or an exact-name provider."""
    names = set(MODEL_OVERRIDES)
    for archs, _ in _EXACT:
        names |= archs
    return frozenset(names)


# The model-override stage as one catalog step.
MODEL_PROVIDERS = ProviderGroup("model_overrides", lambda model: providers_for(model.architecture))
