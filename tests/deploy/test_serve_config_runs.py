"""deploy/serve_config.yaml really runs: deployed on a local Ray the way KubeRay deploys a
RayService's serveConfigV2 (the dashboard's PUT /api/serve/applications: start Serve with
the file's proxy options, then deploy_apps), it answers gRPC Generate and a health check.

Only what a CPU-only machine needs is overridden (`on_cpu`): loopback ports, a tiny
model, a local store, a key file, CPU instead of GPU, one replica of each deployment.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import pytest
import yaml

from adapterserve.server.serve_env import free_port
from deploy import render_serve_config as rsc

API_KEY = "deploy-test-key-0123"
DEPLOY_TIMEOUT_S = 300


@dataclass(frozen=True)
class Deployed:
    grpc: str
    metrics: str  # the metrics port's URL
    config: dict


def on_cpu(config: dict, *, model: str, store: str, keys: str, grpc_port: int, http_port: int,
           metrics_port: int) -> dict:
    """serve_config.yaml with CPU resources and local paths; nothing else changes."""
    config = copy.deepcopy(config)
    config["http_options"].update(host="127.0.0.1", port=http_port)
    config["grpc_options"]["port"] = grpc_port
    app = rsc.application(config)
    app["args"].update(model=model, store=store, api_keys_file=keys, store_options={})  # cache_dir: S3 only
    app["args"]["metrics"].update(host="127.0.0.1", port=metrics_port)
    app["args"]["engine"].update(device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=8)
    for dep in app["deployments"]:
        dep["ray_actor_options"] = {"num_cpus": 1 if dep["name"] == rsc.ENGINE else 0, "num_gpus": 0}
        if "autoscaling_config" in dep:
            dep["autoscaling_config"].update(min_replicas=1, max_replicas=1)
        else:
            dep["num_replicas"] = 1
    return config


@pytest.fixture(scope="module")
def local_ray(request):
    """The session's Ray (a `ray_session` fixture, when the suite has one, or a Ray already
    running in this process), else one of our own. Serve is ours while this module runs:
    its proxy ports are per cluster, so Serve is shut down before and after."""
    import ray
    from ray import serve

    try:
        request.getfixturevalue("ray_session")
        owned = False
    except pytest.FixtureLookupError:
        owned = not ray.is_initialized()
    if owned:
        ray.init(num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=False)
    serve.shutdown()  # a server left by earlier tests would keep its own ports
    try:
        yield
    finally:
        serve.shutdown()
        if owned:
            ray.shutdown()


@pytest.fixture(scope="module")
def deployed(local_ray, tmp_path_factory) -> Deployed:
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    from adapterserve.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("serve-config")
    (root / "keys").write_text(f"{API_KEY} deploy-test\n")
    model = write_tiny_checkpoint(root / "tiny-llama", "llama", seed=3)
    grpc_port, metrics_port = free_port(), free_port()
    raw = on_cpu(yaml.safe_load(rsc.read_serve_config()), model=str(model), store=str(root / "store"),
                 keys=str(root / "keys"), grpc_port=grpc_port, http_port=free_port(), metrics_port=metrics_port)
    config = ServeDeploySchema.model_validate(raw)
    client = serve_start(http_options=config.http_options.model_dump(), grpc_options=config.grpc_options.model_dump(),
                         proxy_location=config.proxy_location, global_logging_config=config.logging_config)
    client.deploy_apps(config)
    _wait_running(rsc.APP)
    return Deployed(f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics", raw)


def _wait_running(name: str) -> None:
    from ray import serve

    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    while time.monotonic() < deadline:
        status = serve.status().applications.get(name)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            pytest.fail(f"serve_config.yaml failed to deploy: {status.message}")
        time.sleep(0.5)
    pytest.fail(f"application {name!r} not RUNNING after {DEPLOY_TIMEOUT_S}s: {serve.status()}")


def test_overrides_are_only_cpu_and_local_paths(deployed):
    original = yaml.safe_load(rsc.read_serve_config())
    servicers = original["grpc_options"]["grpc_servicer_functions"]
    assert deployed.config["grpc_options"]["grpc_servicer_functions"] == servicers
    assert rsc.application(original)["import_path"] == rsc.application(deployed.config)["import_path"]
    assert [d["name"] for d in rsc.application(original)["deployments"]] == ["Ingress", rsc.ENGINE]


def test_answers_generate_and_health(deployed):
    from adapterserve.clients.client import Client

    with Client(deployed.grpc, api_key=API_KEY, timeout=120) as client:
        assert client.health() == "SERVING"
        completion = client.generate("Hello", max_tokens=4, temperature=0.0)
    assert 1 <= len(completion.token_ids) <= 4
    assert completion.finish_reason in ("stop", "length")


def test_the_metrics_port_counts_the_call(deployed):
    """The port the PodMonitor scrapes (metrics.port) serves the hub's totals."""
    from adapterserve.clients.client import Client

    with Client(deployed.grpc, api_key=API_KEY, timeout=120) as client:
        client.generate("Hello", max_tokens=2, temperature=0.0)
    sample = 'adapterserve_requests_total{adapter="_base",code="OK",method="Generate"}'
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = _scrape(deployed.metrics)
        counted = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(sample + " ")]
        if counted and counted[0] >= 1:
            break
        time.sleep(0.5)
    assert counted and counted[0] >= 1, text[:2000]
    assert "adapterserve_tenant_requests_total" in text  # the full view


def _scrape(url: str) -> str:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return ""  # the hub binds its port moments after it starts
