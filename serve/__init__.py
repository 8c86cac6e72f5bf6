"""flotilla.serve: see docs/structure.md for this package's contract."""
