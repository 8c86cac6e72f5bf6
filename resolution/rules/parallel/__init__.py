"""Rules of the parallel phase, in the order they run (see STEPS)."""

STEPS: list = []
