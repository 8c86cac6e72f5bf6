"""cluster.platform.probe(): the one hardware probe."""

import subprocess

import torch

from flotilla.cluster import platform as probe_module
from flotilla.cluster.platform import nvidia_driver_version, probe
from flotilla.resolution import ModelFacts, ServerArgs, resolve


def test_probe_describes_this_machine_and_resolves():
    facts = probe()
    assert facts.device == ("cuda" if torch.cuda.is_available() and torch.version.hip is None else facts.device)
    if not torch.cuda.is_available():
        assert facts.device == "cpu" and facts.capability is None and facts.memory_mib is None
    model = ModelFacts.from_hf_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                                        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 128})
    assert resolve(ServerArgs.create(model_path="/m"), model, facts).device == facts.torch_device


def test_driver_version_is_parsed_and_unknown_without_nvidia_smi(monkeypatch):
    monkeypatch.setattr(probe_module.shutil, "which", lambda name: None)
    assert nvidia_driver_version() == (0,)
    monkeypatch.setattr(probe_module.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    done = subprocess.CompletedProcess([], 0, stdout="580.95.05\n", stderr="")
    monkeypatch.setattr(probe_module.subprocess, "run", lambda *a, **k: done)
    assert nvidia_driver_version() == (580, 95, 5)

    def hangs(*a, **k):
        raise subprocess.TimeoutExpired("nvidia-smi", 5)

    monkeypatch.setattr(probe_module.subprocess, "run", hangs)
    assert nvidia_driver_version() == (0,)


def test_library_presence_comes_from_find_spec(monkeypatch):
    present = {"flashinfer"}
    monkeypatch.setattr(probe_module.importlib.util, "find_spec", lambda name: object() if name in present else None)
    facts = probe()
    assert facts.flashinfer and not facts.triton_kernels and not facts.deep_gemm


def test_probe_on_workers_runs_as_a_ray_task_and_matches_the_local_probe(ray_cluster):
    """On this CPU box the worker nodes are this machine: the task's facts are the local ones."""
    from flotilla.cluster.platform import probe_for_workers, probe_on_workers

    remote = probe_on_workers(timeout_s=60)
    assert remote == probe()
    assert probe_for_workers() == remote  # connected to Ray: the task, not the driver, is probed


def test_probe_on_workers_asking_for_a_gpu_on_a_cpu_cluster_is_a_clear_error(ray_cluster):
    import pytest

    from flotilla.cluster.platform import probe_on_workers

    with pytest.raises(ValueError, match="on_gpu=True"):
        probe_on_workers(on_gpu=True)
