"""flotilla.kernels: named kernel backends per op (see registry.py)."""
