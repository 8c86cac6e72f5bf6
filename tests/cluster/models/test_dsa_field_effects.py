"""What the DSA kernel fields change (the runtime-support table's evidence for
``dsa_prefill_backend``, ``dsa_decode_backend`` and ``dsa_topk_backend``).

Resolution sets them (the ``cpu`` platform: ``torch``, flotilla's reference); the runner reads them
once at start: the torch values (and the CUDA names, where attention runs the reference they stand
in for) build the DSA layers on the torch ops, while a CUDA DSA kernel under CUDA attention stops
the start naming the field and value.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flotilla import LLM
from flotilla.cluster.engine.kernel_backends import KernelBackends, dsa_backend_for
from flotilla.cluster.models.dsa import DSAttention
from flotilla.kernels import registry
from helpers.tiny_dsa import save_tiny_dsa

CUDA_ATTENTION = KernelBackends(attention="flashinfer", chosen_by={"attention": "attention_backend='dsa'"})
TORCH_ATTENTION = KernelBackends(chosen_by={"attention": "device='cpu'"})


def _config(**fields):
    return SimpleNamespace(**{"dsa_prefill_backend": None, "dsa_decode_backend": None, "dsa_topk_backend": "sgl-kernel", **fields})


def test_the_cpu_platforms_torch_backends_build_the_dsa_layers_on_the_torch_ops(tmp_path):
    save_tiny_dsa(tmp_path, "glm5")
    llm = LLM(str(tmp_path), max_total_tokens=256)
    assert (llm.config.dsa_prefill_backend, llm.config.dsa_decode_backend, llm.config.dsa_topk_backend) == ("torch",) * 3
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, DSAttention)]
    assert layers and all(layer._attend is registry.get("dsa_sparse_mla", "torch") for layer in layers)
    indexers = [layer.indexer for layer in layers if layer.indexer is not None]
    assert indexers and all(ix._select is registry.get("dsa_indexer", "torch") for ix in indexers)
    assert llm.engine.runner.startup_report()["dsa_backend"] == "torch"


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="fa3"), "dsa_prefill_backend='flashmla_sparse', dsa_decode_backend='fa3'"),
        (dict(dsa_decode_backend="trtllm"), "dsa_decode_backend='trtllm'"),
        (dict(dsa_prefill_backend="torch", dsa_decode_backend="torch", dsa_topk_backend="flashinfer"), "dsa_topk_backend='flashinfer'"),
    ],
)
def test_a_cuda_dsa_kernel_under_cuda_attention_stops_the_start_naming_it(fields, named):
    with pytest.raises(ValueError, match=rf"\({named} name CUDA DSA kernels, which are not built yet\).*attention_backend='dsa'"):
        dsa_backend_for(_config(**fields), CUDA_ATTENTION)


def test_the_torch_values_and_a_reference_attention_run_the_torch_dsa_ops():
    assert dsa_backend_for(_config(dsa_prefill_backend="torch", dsa_decode_backend="torch", dsa_topk_backend="torch"), TORCH_ATTENTION) == "torch"
    # CUDA names resolved for a GPU platform, run where attention runs the reference (--device cpu).
    assert dsa_backend_for(_config(dsa_prefill_backend="flashmla_sparse", dsa_decode_backend="fa3"), TORCH_ATTENTION) == "torch"
    with pytest.raises(ValueError, match=r"the CUDA DSA kernels are not built yet"):
        dsa_backend_for(_config(dsa_prefill_backend="torch", dsa_decode_backend="torch", dsa_topk_backend="torch"), CUDA_ATTENTION)
