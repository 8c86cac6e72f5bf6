"""Block-FP8 checkpoints: what ``config.json`` says, and which modules it quantizes.

A DeepSeek-V3 / Qwen3-*-FP8 style checkpoint has::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

and stores every quantized linear as ``<module>.weight`` (``float8_e4m3fn``) plus
``<module>.weight_scale_inv`` (float32 or bfloat16, one multiplier per 128x128 block).
:class:`BlockFp8Config` is that section, checked; :meth:`BlockFp8Config.quantizes` answers
whether a module (by its HF checkpoint name) is stored in FP8.

Only the projections flotilla builds as FP8 layers are ever quantized here (attention q/k/v/o,
MLP gate/up/down, routed experts: :data:`QUANTIZED_PROJECTIONS`); embeddings, the LM head,
norms and MoE routers stay in the model dtype whatever the section says.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

FP8_BLOCK = 128  # rows and columns of one scale block (the only weight_block_size the kernels take)

# The checkpoint module names (last component) of the linears flotilla builds as FP8 layers.
QUANTIZED_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})

# A name matches a skip pattern at a module boundary, as transformers' ``should_convert_module``
# reads ``modules_to_not_convert``: "layers.1" skips "layers.1.mlp" but not "layers.11.mlp",
# "mlp.gate" does not skip "mlp.gate_proj".
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class BlockFp8Config:
    """A checkpoint's block-FP8 quantization (``quantization_config`` with ``quant_method: fp8``).

    Attributes:
        skip: ``modules_to_not_convert`` and ``ignored_layers`` together: checkpoint module
            names (or patterns, as transformers reads them) kept in the model dtype.
    """

    skip: tuple[str, ...] = ()
    _skip_re: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # NOTE: one alternation for every pattern: a large MoE asks about every expert matrix.
        try:
            pattern = re.compile("|".join(f"(?:{p}){_BOUNDARY}" for p in self.skip)) if self.skip else None
        except re.error as exc:
            raise ValueError(
                f"quantization_config.modules_to_not_convert/ignored_layers {list(self.skip)} holds an entry that is "
                f"not a valid module name or pattern ({exc})"
            ) from None
        object.__setattr__(self, "_skip_re", pattern)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> "BlockFp8Config | None":
        """The section of an HF config dict, or None when the checkpoint is not FP8-quantized.

        Raises ValueError naming the field and its value for a variant flotilla cannot load:
        per-tensor FP8 (no ``weight_block_size``), blocks other than ``[128, 128]``, ``fmt``
        other than ``e4m3``, static activation scales.
        """
        section = hf.get("quantization_config")
        if not isinstance(section, Mapping) or str(section.get("quant_method", "")).lower() != "fp8":
            return None
        fmt = section.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(
                f"quantization_config.fmt={fmt!r} is not supported: flotilla loads float8_e4m3fn FP8 weights "
                f"(fmt 'e4m3')"
            )
        scheme = section.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(
                f"quantization_config.activation_scheme={scheme!r} is not supported: flotilla runs FP8 weights with "
                f"unquantized activations and reads no input_scale (activation_scheme 'dynamic')"
            )
        block = section.get("weight_block_size")
        if block is None:
            raise ValueError(
                "quantization_config has quant_method='fp8' but no weight_block_size: per-tensor FP8 checkpoints are "
                f"not supported; flotilla loads block-quantized FP8 (weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}])"
            )
        if list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(
                f"quantization_config.weight_block_size={list(block)} is not supported: flotilla's FP8 kernels take "
                f"{FP8_BLOCK}x{FP8_BLOCK} blocks (weight_block_size [{FP8_BLOCK}, {FP8_BLOCK}])"
            )
        skip = [str(p) for key in ("modules_to_not_convert", "ignored_layers") for p in (section.get(key) or ())]
        return cls(tuple(dict.fromkeys(skip)))

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint stores module ``module`` (its HF name, e.g.
        ``model.layers.0.self_attn.q_proj``) as FP8: a projection flotilla quantizes that no
        skip pattern names."""
        if module.rsplit(".", 1)[-1] not in QUANTIZED_PROJECTIONS:
            return False
        return self._skip_re is None or not (self._skip_re.match(module) or module.endswith(self.skip))

    def quantizes_all(self, prefix: str, parts: Sequence[str]) -> bool:
        """Whether the modules ``prefix.part`` that flotilla stacks into one matrix (q/k/v,
        gate/up, a layer's experts) are all FP8 (True) or all unquantized (False); ValueError
        naming them when the checkpoint mixes the two."""
        names = [f"{prefix}.{part}" for part in parts]
        quantized = [name for name in names if self.quantizes(name)]
        if quantized and len(quantized) != len(names):
            plain = [name for name in names if name not in quantized]
            raise ValueError(
                f"the checkpoint quantizes {quantized[:3]} but not {plain[:3]} (modules_to_not_convert); flotilla "
                f"stacks them into one matrix, which is either FP8 or not"
            )
        return bool(quantized)

    def quantizes_tensor(self, name: str, shape: Sequence[int]) -> bool:
        """Whether a full-precision tensor named ``name`` (a checkpoint name, e.g.
        ``model.layers.0.mlp.down_proj.weight``) of ``shape`` is stored as FP8 in this
        checkpoint (for writing random FP8 weights; see ``dummy_weights``)."""
        return name.endswith(".weight") and len(shape) == 2 and self.quantizes(name.removesuffix(".weight"))


def refuse_unloadable_quantization(hf: Mapping[str, Any], model_dir: str | Path | None = None) -> None:
    """ValueError for a checkpoint quantized in a format flotilla does not load: anything but
    block FP8 (:class:`BlockFp8Config`). A ModelOpt checkpoint (``quant_method: modelopt``, a
    ``quant_algo`` in ``quantization_config``, or ModelOpt's ``hf_quant_config.json`` beside
    config.json) is named by its ``quant_algo`` (``NVFP4``, ``FP8``, ``MIXED_PRECISION``, ...);
    others by their ``quant_method``."""
    section = hf.get("quantization_config")
    section = dict(section) if isinstance(section, Mapping) else {}
    exported = Path(model_dir) / "hf_quant_config.json" if model_dir is not None else None
    if exported is not None and exported.is_file():
        try:
            quant = json.loads(exported.read_text()).get("quantization") or {}
        except (json.JSONDecodeError, AttributeError):
            quant = {}
        section = {"quant_method": "modelopt", **section, **({"quant_algo": quant["quant_algo"]} if "quant_algo" in quant else {})}
    method = str(section.get("quant_method", "")).lower()
    if not section or (method == "fp8" and "quant_algo" not in section):
        return
    if method == "modelopt" or "quant_algo" in section:
        algo = section.get("quant_algo")
        raise ValueError(
            f"the checkpoint is quantized by NVIDIA ModelOpt (quant_algo={algo!r}); flotilla does not load ModelOpt "
            f"checkpoints (NVFP4 and the ModelOpt FP8 formats need kernels it does not build): serve the model's "
            f"bfloat16 or block-FP8 release (quantization_config.quant_method 'fp8', weight_block_size [128, 128])"
        )
    raise ValueError(
        f"quantization_config.quant_method={section.get('quant_method')!r} is not supported: flotilla loads unquantized "
        f"checkpoints and block-FP8 ones (quant_method 'fp8', weight_block_size [128, 128]); serve one of those"
    )
