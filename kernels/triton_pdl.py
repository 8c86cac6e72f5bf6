"""Programmatic dependent launch (PDL) for the Triton kernels of the decode path, on SM90+.

A kernel launched as a programmatic dependent may start while the kernel before it in the
stream is still running. In exchange it must call ``griddepcontrol.wait`` (``gdc_wait``)
before it reads anything that kernel wrote and before it writes anything at all (its output
buffer may be memory the kernel before still reads). It may do independent work first: the
decode GEMVs read their first weight tile. Each of our kernels also calls
``griddepcontrol.launch_dependents`` early, so the kernel after it may start in turn. Inside a
CUDA graph the launches become programmatic edges; at batch 1 they overlap one kernel's drain
with the next one's start (Llama-3.1-8B decode graph on the H200: 4.20 ms with, 4.38 ms
without, ``benchmarks/dev/decode_profile.py --without pdl``).

A kernel takes a ``PDL: tl.constexpr`` argument and the host passes ``**launch_options(device)``
(the constexpr plus Triton's ``launch_pdl``); :data:`ENABLED` turns it off process-wide for a
side-by-side measurement. Off in Triton's interpreter (no inline PTX there).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

ENABLED = True
_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _supports_pdl(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch_options(device: torch.device) -> dict[str, bool]:
    """A kernel's ``PDL`` constexpr and, when on, Triton's ``launch_pdl`` option for ``device``:
    on for CUDA devices of compute capability 9.0 and up while :data:`ENABLED`."""
    on = ENABLED and not _INTERPRETER and device.type == "cuda" and _supports_pdl(device)
    return {"PDL": on, **({"launch_pdl": True} if on else {})}


@triton.jit
def start_dependent(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the kernel before this one (no-op without PDL).
    Call it first in a kernel with nothing to read ahead of its inputs."""
    if PDL:
        tl_cuda.gdc_launch_dependents()
        tl_cuda.gdc_wait()
