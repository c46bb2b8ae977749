"""Direct mode's pieces without a cluster: the `direct` setting's decision, the application
graph built for each mode, and the local handle's calls (served behaviour:
test_direct_served.py; hostile values: tests/reliability/test_hostile_direct_settings.py)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from adapterserve.server.app import build_app
from adapterserve.server.direct_settings import runs_direct
from adapterserve.server.limits import RESERVED_CALLS
from adapterserve.server.local_handle import LocalHandle
from adapterserve.server.settings import DEFAULTS, merge_config

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
SCALING = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}


@pytest.mark.parametrize("direct, replica, expected", [
    ("auto", {}, True),
    ("auto", {"num_replicas": 2}, False),
    ("auto", {"autoscaling_config": SCALING}, False),
    (True, {"num_replicas": 3}, True),
    (True, {"autoscaling_config": SCALING}, True),
    (False, {}, False),
])
def test_auto_is_direct_with_one_fixed_replica(direct, replica, expected):
    assert DEFAULTS["direct"] == "auto"
    assert runs_direct(merge_config({"direct": direct, "replica": replica})) is expected


def _deployments(app) -> dict:
    from ray.serve._private.build_app import build_app as built

    return {d.name: d for d in built(app, name="graph").deployments}


def test_direct_app_has_one_deployment_that_runs_the_engine():
    found = _deployments(build_app({"model": str(MODEL), "encoder": False,
                                    "replica": {"health_check_period_s": 2.0}}))
    assert sorted(found) == ["Ingress", "MetricsHub"]
    ingress = found["Ingress"]
    assert ingress.func_or_class.__name__ == "DirectIngress"
    assert ingress.ray_actor_options == {"num_cpus": 1, "num_gpus": 0}  # the engine replica's
    config = ingress._deployment_config
    assert config.num_replicas == 1 and config.health_check_period_s == 2.0
    # room for what admission admits, and at least what the engine runs or queues
    assert config.max_ongoing_requests >= DEFAULTS["ingress"]["max_ongoing_requests"]
    assert config.max_ongoing_requests >= 256 + RESERVED_CALLS
    assert config.request_router_config.request_router_class != "adapterserve.server.routing.AdapterAffinityRouter"


def test_two_tier_app_has_the_engine_deployment_behind_the_ingress():
    found = _deployments(build_app({"model": str(MODEL), "encoder": False, "direct": False}))
    assert sorted(found) == ["EngineReplica", "Ingress", "MetricsHub"]
    assert found["Ingress"].func_or_class.__name__ == "Ingress"
    router = found["EngineReplica"]._deployment_config.request_router_config.request_router_class
    assert router.endswith("AdapterAffinityRouter")


def test_direct_with_several_replicas_and_tensor_parallel_places_each_group():
    found = _deployments(build_app({"model": str(MODEL), "encoder": False, "direct": True,
                                    "replica": {"num_replicas": 2},
                                    "engine": {"tensor_parallel_size": 2}}))
    assert sorted(found) == ["Ingress", "MetricsHub"]
    ingress = found["Ingress"]
    assert ingress._deployment_config.num_replicas == 2
    placed = ingress._replica_config
    assert placed.placement_group_strategy == "STRICT_PACK" and len(placed.placement_group_bundles) == 2


class _Replica:
    """A stand-in engine replica: a stream that records how it ended, and a slow unary call."""

    def __init__(self) -> None:
        self.ended: str | None = None

    async def generate(self, request: dict):
        try:
            for i in range(request["n"]):
                yield {"i": i}
            self.ended = "done"
        except GeneratorExit:
            self.ended = "closed"
            raise

    async def describe(self) -> dict:
        await asyncio.sleep(30)
        return {}

    async def health(self) -> None:
        return None


def test_the_local_handle_streams_calls_and_cancels():
    async def run() -> None:
        replica = _Replica()
        handle = LocalHandle("EngineReplica", replica)
        assert await handle.health.remote() is None and handle.deployment_name == "EngineReplica"
        stream = handle.options(stream=True, multiplexed_model_id="abc").generate.remote({"n": 3})
        assert [c["i"] async for c in stream] == [0, 1, 2] and replica.ended == "done"
        stream = handle.options(stream=True).generate.remote({"n": 100})
        assert (await stream.__anext__()) == {"i": 0}
        stream.cancel()  # the caller left: the replica's stream is closed
        await asyncio.sleep(0.05)
        assert replica.ended == "closed"
        slow = handle.describe.remote()  # started at once; cancel() stops it
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slow, 0.05)
        assert slow.cancelled()

    asyncio.run(run())
