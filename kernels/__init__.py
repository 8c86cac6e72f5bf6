"""flotilla.kernels: see docs/structure.md for this package's contract."""
