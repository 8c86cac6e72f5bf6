"""Importing this module registers every op's ``torch`` reference backend."""

from flotilla.kernels import activation  # noqa: F401
from flotilla.kernels import attention  # noqa: F401
from flotilla.kernels import dsa  # noqa: F401
from flotilla.kernels import merge  # noqa: F401
from flotilla.kernels import mla  # noqa: F401
from flotilla.kernels import moe  # noqa: F401
from flotilla.kernels import norm  # noqa: F401
from flotilla.kernels import rotary  # noqa: F401
from flotilla.kernels import fp8  # noqa: F401
from flotilla.kernels import linear  # noqa: F401
from flotilla.kernels import sampling  # noqa: F401
