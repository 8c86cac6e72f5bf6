"""Rules of the normalise phase, in the order they run (see STEPS)."""

STEPS: list = []
