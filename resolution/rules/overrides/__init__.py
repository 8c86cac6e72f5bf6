"""Rules of the model phase: model overrides (constant table, exact-architecture
providers, predicate providers) and the per-architecture passes, in order (STEPS)."""

STEPS: list = []
