"""GPU-only fixtures: a local Ray cluster that sees this machine's GPUs.

The tier is collected only with ``FLOTILLA_GPU_TESTS=1`` (tests/conftest.py); each module
then gates itself (a module-level ``skipif(not torch.cuda.is_available())``, or this file's
``gpu_ray_cluster`` for 2-GPU tests), so the tier also collects and skips cleanly on a
machine without CUDA. A new module that touches CUDA needs that gate too."""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def gpu_ray_cluster():
    """One local Ray cluster for the session, with every visible GPU; skips below 2 GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield torch.cuda.device_count()
    ray.shutdown()
