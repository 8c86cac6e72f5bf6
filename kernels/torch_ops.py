"""Importing this module registers every op's ``torch`` reference backend."""

from flotilla.kernels import attention  # noqa: F401
