"""GPU-only fixtures: a local Ray cluster that sees this machine's GPUs."""

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
