"""Fixtures shared across the suite: one local Ray per test session.

Without a GPU, Triton kernels run under Triton's CPU interpreter. TRITON_INTERPRET
must be set before anything imports triton (peft and transformers may), so it is
set here, in the first conftest pytest loads.
"""
import os

import pytest
import torch

pytest_plugins = ["tests.helpers.live_server"]  # the live server: tests/server, tests/reliability

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (2 CPUs, as CI has) for the whole session; yields its metrics URL.

    Workers report metrics every 0.5 s instead of 10 s. Shared by tests/server,
    tests/clients and tests/deploy."""
    import ray

    from adapterserve.server.serve_env import free_port, local_serve_env

    metrics_port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_metrics_report_interval_ms", "500")
        for key, value in local_serve_env().items():  # as `adapterserve serve` runs Serve
            mp.setenv(key, value)
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False,
                 _metrics_export_port=metrics_port)
    try:
        yield f"http://127.0.0.1:{metrics_port}/metrics"
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """tests/deploy runs first: it starts Serve again with its own proxy ports (Serve has one
    set per cluster), which would end the session's live server had a test started it before."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/deploy/"))  # stable: order kept otherwise
