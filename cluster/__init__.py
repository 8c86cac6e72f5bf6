"""flotilla.cluster: see docs/structure.md for this package's contract."""
