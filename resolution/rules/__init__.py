"""The rule catalog: every rule, grouped by phase, in the order it runs.

Each phase package lists its steps in ``STEPS``; this module fixes the phase
order. Adding a rule means writing a function in the right phase package and
placing it in that package's ``STEPS`` (see docs/resolution.md).
"""

from flotilla.resolution.engine import Phase
from flotilla.resolution.rules import normalise, overrides, parallel, passes, validate

CATALOG = (
    (Phase.NORMALISE, tuple(normalise.STEPS)),
    (Phase.MODEL, tuple(overrides.STEPS)),
    (Phase.PASSES, tuple(passes.STEPS)),
    (Phase.PARALLEL, tuple(parallel.STEPS)),
    (Phase.VALIDATE, tuple(validate.STEPS)),
)
