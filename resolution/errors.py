"""Errors of configuration resolution. All are plain, picklable exceptions."""

from __future__ import annotations


class Violation(Exception):
    """One violated invariant, with the message a user can act on.

    ``kind`` is the exception class the seed rule raises for it
    (``ValueError`` or ``AssertionError``); ``rule`` names the rule that found it.
    """

    def __init__(self, message: str, *, kind: str = "ValueError", rule: str = ""):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.rule = rule

    def __reduce__(self):
        return (_violation, (self.message, self.kind, self.rule))


def _violation(message: str, kind: str, rule: str) -> Violation:
    return Violation(message, kind=kind, rule=rule)


class ResolutionError(ValueError):
    """The launch was rejected: every violated invariant found, one per line."""

    def __init__(self, violations: tuple[Violation, ...]):
        self.violations = tuple(violations)
        super().__init__("\n".join(v.message for v in self.violations))

    def __reduce__(self):
        return (ResolutionError, (self.violations,))


class RuleContractError(RuntimeError):
    """A rule broke the engine's contract (a programming error, not user input):
    it declared an unknown or non-resolvable field, changed a field the user set
    without declaring the override, or returned something other than a mapping."""


class ArgumentError(ValueError):
    """A flag, flag value or input file the user gave is not acceptable."""


class ModelConfigError(ArgumentError):
    """The model's config.json is unreadable or not a valid HF config."""
