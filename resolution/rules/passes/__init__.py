"""Rules of the passes phase, in the order they run (see STEPS)."""

STEPS: list = []
