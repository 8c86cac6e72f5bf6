"""Block-FP8 weights that flotilla runs in the model dtype: dequantized while the checkpoint loads.

An FP8 checkpoint (DeepSeek-V3/V3.2/R1, GLM-5-FP8) quantizes every projection, also those
flotilla does not build as FP8 layers: MLA's low-rank projections (``q_a_proj``, ``q_b_proj``,
``kv_a_proj_with_mqa``, V2-Lite's ``q_proj``), ``kv_b_proj`` (split at load into the absorbed
``w_kc`` / ``w_vc``, which needs the real weight) and the DSA indexer's ``wq_b`` / ``wk``.
:func:`dequantize_on_load` pairs each such ``<module>.weight`` (float8_e4m3fn) with its
``<module>.weight_scale_inv`` wherever the two sit in the stream (shards may split them) and
hands on ``weight * scale`` blockwise, in float32, under the weight's name: exactly the weight the
checkpoint means, which the model's loaders then cast to the model dtype. Weights the model
keeps in FP8 (its FP8 layers' ``weight`` and ``weight_scale_inv``) pass through untouched.
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from flotilla.kernels.fp8 import dequantize_block_fp8

FP8 = torch.float8_e4m3fn
_WEIGHT, _SCALE = ".weight", ".weight_scale_inv"


class Fp8Pairing:
    """The pairing behind :func:`dequantize_on_load`, one tensor at a time (for a loader that
    is handed tensors rather than iterating a stream): :meth:`push` returns what to load now,
    :meth:`finish` raises for what never paired."""

    def __init__(self, keeps_fp8: Callable[[str], bool]):
        self.keeps_fp8 = keeps_fp8
        self._weights: dict[str, torch.Tensor] = {}
        self._scales: dict[str, torch.Tensor] = {}

    def push(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors to load now for ``(name, tensor)``: itself, the dequantized weight once
        both halves of a pair arrived, or nothing while one is held."""
        if name.endswith(_WEIGHT) and tensor.dtype == FP8 and not self.keeps_fp8(name[: -len(_WEIGHT)]):
            module = name[: -len(_WEIGHT)]
            scale = self._scales.pop(module, None)
            if scale is None:
                self._weights[module] = tensor
                return []
            return [(name, dequantize_block_fp8(tensor, scale))]
        if name.endswith(_SCALE) and not self.keeps_fp8(name[: -len(_SCALE)]):
            module = name[: -len(_SCALE)]
            weight = self._weights.pop(module, None)
            if weight is None:
                self._scales[module] = tensor
                return []
            return [(module + _WEIGHT, dequantize_block_fp8(weight, tensor))]
        return [(name, tensor)]

    def finish(self) -> None:
        """ValueError naming the modules whose weight or scale never arrived."""
        problems = [f"{m}.weight has no weight_scale_inv" for m in sorted(self._weights)]
        problems += [f"{m}.weight_scale_inv has no float8 {m}.weight" for m in sorted(self._scales)]
        if problems:
            raise ValueError(
                f"the FP8 checkpoint is incomplete: {'; '.join(problems[:5])}"
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                + ": every quantized <module>.weight needs its <module>.weight_scale_inv"
            )


def dequantize_on_load(
    weights: Iterable[tuple[str, torch.Tensor]], keeps_fp8: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every float8 ``<module>.weight`` whose module the model does not keep in
    FP8 (``keeps_fp8(module)`` False; ``module`` is the checkpoint name, e.g.
    ``model.layers.0.self_attn.kv_b_proj``) replaced by its dequantized float32 weight, and its
    ``weight_scale_inv`` consumed. ValueError, after the stream ends, naming the modules whose
    weight or scale never arrived."""
    pairing = Fp8Pairing(keeps_fp8)
    for name, tensor in weights:
        yield from pairing.push(name, tensor)
    pairing.finish()
