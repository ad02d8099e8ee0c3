"""The one local Ray cluster the room's tests share."""

import os

import pytest


@pytest.fixture(scope="module")
def ray_address(tmp_path_factory):
    """The one local Ray cluster of the test session (two CPUs, no
    dashboard, its files under the session's temporary directory), this
    process its driver; its GCS address, for drivers in other processes.
    Only tests/ray/test_ray.py uses it, and it ends with that module: its
    processes are this process's children, and a later module that checks
    it left none (tests/pool/test_faults.py) found Ray's GCS among them."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"  # else the first init writes ~/.ray/auth_token
    context = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                       _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield context.address_info["gcs_address"]
    ray.shutdown()
