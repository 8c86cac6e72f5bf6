"""Rules of the validate phase, in the order they run (see STEPS)."""

STEPS: list = []
