"""The rule engine: run an ordered catalog of pure rules over a read-only view.

A rule is a plain function ``rule(view, model, platform) -> {field: value}``. It
reads the configuration as resolved so far through a :class:`View` (user input
overlaid with every earlier declaration), the model's facts and the platform's
facts, and returns what it declares. It never writes anything. The engine
records each declaration as provenance and applies it for the rules after it.

Environment variables a rule wants set are declared too: a key ``Env("NAME")``
in the returned mapping. They become ``ResolvedConfig.env`` and are applied by
workers at start; no rule touches ``os.environ``.

A rule that finds an invariant violated raises :class:`Violation` (via
:func:`ensure` or :func:`reject`). The engine records it, drops that rule's
declarations and goes on, so one run reports every violation it can find.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

from flotilla.resolution.errors import ResolutionError, RuleContractError, Violation


class Phase(enum.Enum):
    """The phases of resolution, in the order they run."""

    NORMALISE = "normalise"  # legacy aliases, deprecated flags, platform and memory defaults
    MODEL = "model"  # model overrides: constant table, exact providers, predicate providers, arch passes
    PASSES = "passes"  # post-process passes: kernel backends, attention, page size
    PARALLEL = "parallel"  # parallelism handlers: DP, CP, MoE/A2A, EPLB, elastic EP, PP, speculative
    VALIDATE = "validate"  # late validation and capability adjustments


@dataclass(frozen=True)
class Env:
    """A declared environment variable (key of a rule's returned mapping)."""

    name: str


def ensure(condition: Any, message: str, *, kind: str = "AssertionError") -> None:
    """Raise a :class:`Violation` with ``message`` unless ``condition`` holds.

    ``kind`` names the exception class the seed rule raises (``AssertionError``
    for asserts, ``ValueError`` for explicit raises); it is kept for fidelity.
    """
    if not condition:
        raise Violation(message, kind=kind)


def reject(message: str, *, kind: str = "ValueError") -> None:
    """Raise a :class:`Violation` unconditionally."""
    raise Violation(message, kind=kind)


RuleFn = Callable[["View", Any, Any], "Mapping[Any, Any] | None"]


@dataclass(frozen=True)
class Rule:
    """One named rule of the catalog.

    Attributes:
        name: the seed's source name (``_handle_dwdp``, ``_page_size_default``...);
            it is what provenance and ``--explain`` show.
        fn: the rule body, ``fn(view, model, platform) -> mapping``.
        overrides: fields this rule may change even when the user set them
            explicitly. Changing any other explicit field is a contract error.
        whitelist: when true the rule may declare only resolvable fields (the
            seeds' declaration whitelist for model overrides and passes).
    """

    name: str
    fn: RuleFn
    overrides: frozenset[str] = frozenset()
    whitelist: bool = False

    @property
    def reason(self) -> str:
        doc = (self.fn.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else self.name


def rule(
    name: str | None = None, *, overrides: Iterable[str] = (), whitelist: bool = False
) -> Callable[[RuleFn], Rule]:
    """Decorator turning a function into a :class:`Rule` (it does not register it;
    the catalog lists rules in order)."""

    def wrap(fn: RuleFn) -> Rule:
        return Rule(name or fn.__name__, fn, frozenset(overrides), whitelist)

    return wrap


@dataclass(frozen=True)
class ProviderGroup:
    """Rules evaluated together on one snapshot of the view.

    The model-override providers of an architecture all read the state at the
    start of their stage (none sees a sibling's declarations); their
    declarations are then applied in order, last writer wins.
    """

    name: str
    select: Callable[[Any], Sequence[Rule]]  # model -> the providers that apply


Step = Rule | ProviderGroup


@dataclass(frozen=True)
class Change:
    """One provenance record: ``rule`` set ``field`` from ``old`` to ``new``."""

    field: str
    old: Any
    new: Any
    rule: str
    reason: str
    overrode_user: bool = False

    def to_json(self) -> dict:
        return {
            "field": self.field,
            "old": self.old,
            "new": self.new,
            "rule": self.rule,
            "reason": self.reason,
            "overrode_user": self.overrode_user,
        }


class View:
    """Read-only view of the configuration being resolved.

    Attribute access answers a field's current value (the latest declaration,
    else the user's input, else the field default). Writes are refused.
    """

    __slots__ = ("_values", "_env", "_explicit", "_defaults")

    def __init__(
        self,
        values: Mapping[str, Any],
        env: Mapping[str, str],
        explicit: frozenset[str],
        defaults: Mapping[str, Any],
    ):
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_env", env)
        object.__setattr__(self, "_explicit", explicit)
        object.__setattr__(self, "_defaults", defaults)

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        try:
            return values[name]
        except KeyError:
            raise AttributeError(f"no server field named {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("the resolution view is read-only; rules return declarations")

    def env(self, name: str) -> str | None:
        """The value an earlier rule declared for environment variable ``name``.

        Resolution assumes a clean environment: nothing else is visible here.
        """
        return self._env.get(name)

    def explicit(self, name: str) -> bool:
        """Whether the user set field ``name`` on the command line."""
        return name in self._explicit

    def default(self, name: str) -> Any:
        """The field's default (its value when nobody set or declared it)."""
        return self._defaults[name]


@dataclass
class _State:
    values: dict[str, Any]
    env: dict[str, str]
    explicit: frozenset[str]
    defaults: Mapping[str, Any]
    resolvable: frozenset[str]
    user: Mapping[str, Any]
    provenance: list[Change] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    def view(self) -> View:
        return View(dict(self.values), dict(self.env), self.explicit, self.defaults)

    def apply(self, rule_: Rule, declared: Mapping[Any, Any]) -> None:
        for key in declared:
            if isinstance(key, Env):
                continue
            if key not in self.values:
                raise RuleContractError(f"{rule_.name}: {key!r} is not a server field")
            if rule_.whitelist and key not in self.resolvable:
                raise RuleContractError(
                    f"{rule_.name}: {[key]} not model-overridable; declarations are "
                    "limited to the resolvable fields"
                )
        for key, new in declared.items():
            if isinstance(key, Env):
                self.env[key.name] = str(new)
                continue
            old = self.values[key]
            overrode = key in self.explicit and new != self.user[key]
            if overrode and key not in rule_.overrides:
                raise RuleContractError(
                    f"{rule_.name} changed {key}, which the user set explicitly "
                    f"({self.user[key]!r} -> {new!r}), without declaring the override"
                )
            self.values[key] = new
            self.provenance.append(Change(key, old, new, rule_.name, rule_.reason, overrode))


def _call(rule_: Rule, view: View, model: Any, platform: Any) -> Mapping[Any, Any]:
    declared = rule_.fn(view, model, platform)
    if declared is None:
        return {}
    if not isinstance(declared, Mapping):
        raise RuleContractError(
            f"rule {rule_.name} must return a mapping, got {type(declared).__name__}"
        )
    return declared


@dataclass(frozen=True)
class Outcome:
    """What a run of the engine produced (the inputs of ``ResolvedConfig``)."""

    values: dict[str, Any]
    env: dict[str, str]
    provenance: tuple[Change, ...]


def run(
    catalog: Sequence[tuple[Phase, Sequence[Step]]],
    *,
    user: Mapping[str, Any],
    explicit: frozenset[str],
    defaults: Mapping[str, Any],
    resolvable: frozenset[str],
    model: Any,
    platform: Any,
) -> Outcome:
    """Run every step of ``catalog`` in order and return the outcome.

    Raises :class:`ResolutionError` listing every violation found.
    """
    state = _State(dict(user), {}, explicit, defaults, resolvable, user)
    for _phase, steps in catalog:
        for step in steps:
            try:
                if isinstance(step, ProviderGroup):
                    snapshot = state.view()
                    results = [(r, _call(r, snapshot, model, platform)) for r in step.select(model)]
                    for r, declared in results:
                        state.apply(r, declared)
                else:
                    state.apply(step, _call(step, state.view(), model, platform))
            except Violation as violation:
                violation.rule = getattr(step, "name", "")
                state.violations.append(violation)
            except RuleContractError:
                raise
            except Exception as exc:  # a rule crashed on a state earlier violations left behind
                if not state.violations:
                    raise
                del exc
    if state.violations:
        raise ResolutionError(tuple(state.violations))
    return Outcome(state.values, state.env, tuple(state.provenance))
