"""The replica's registered adapters bounded by bytes (registered_adapter_bytes), without Ray:
a real engine (in this process, supervised), a real local store and host cache. A registry
larger than the budget is served request by request with the tokens of an engine holding
every adapter; the bytes held never exceed the budget; an adapter in use is never evicted;
each eviction is counted as an adapter unload."""
from __future__ import annotations

import asyncio
from functools import partial
from pathlib import Path

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.cache import HostAdapterCache, host_copy_bytes
from adapterserve.adapters_store.formats.read import read_adapter
from adapterserve.adapters_store.servable import check_servable
from adapterserve.adapters_store.store import open_store
from adapterserve.errors import CapacityError
from adapterserve.server.engine_process import EngineSupervisor, start_engine
from adapterserve.server.metrics import series as s
from adapterserve.server.metrics.replica_metrics import ReplicaMetrics
from adapterserve.server.registrations import Advertised, EngineRegistry
from tests.helpers.lora import make_peft_lora

ENGINE = {"max_lora_rank": 8, "max_loras": 4, "num_kv_blocks": 32}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [5, 6, 7, 8]
NAMES = [f"a{i}" for i in range(5)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("registry")
    return {name: make_peft_lora(tiny_model, root / name, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                 seed=i) for i, name in enumerate(NAMES)}


@pytest.fixture(scope="module")
def expected(tiny_model, adapter_dirs) -> dict[str, list[int]]:
    """Each adapter's greedy tokens from an engine with every adapter registered."""
    engine = Engine.from_pretrained(tiny_model, **ENGINE)
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    outs = engine.generate([PROMPT] * len(NAMES), GREEDY, adapter_ids=NAMES)
    return {name: out.token_ids for name, out in zip(NAMES, outs)}


class Replica:
    """What EngineReplica builds around its registry: engine, store, host cache, metrics."""

    def __init__(self, tiny_model: Path, adapter_dirs: dict[str, Path], store_dir: Path, budget_adapters: float,
                 room_wait_s: float) -> None:
        self.engine = EngineSupervisor(partial(start_engine, tiny_model, ENGINE, False), restartable=False,
                                       stall_timeout_s=60.0, start_timeout_s=120.0)
        store = open_store(str(store_dir))
        self.versions = {}
        for name, path in adapter_dirs.items():
            store.publish(name, path, tenant=None, public=True)
            self.versions[name] = store.resolve(name, tenant=None)
        self.cache = HostAdapterCache(1 << 30, self._read, fetch=store.fetch)
        self.one = host_copy_bytes(self.cache.get_or_load(self.versions["a0"]))
        self.budget = int(budget_adapters * self.one)
        self.metrics = ReplicaMetrics(None, "model", "tiny", 1.0, self.engine.stats)
        self.registry = EngineRegistry(self.engine, self.cache, self.metrics, self.budget, room_wait_s=room_wait_s)
        self.totals: dict[str, float] = {}

    def _read(self, path):
        facts = self.engine.facts
        adapter = read_adapter(path, facts.backbone_spec, facts.adapter_limits, dtype=facts.host_dtype)
        check_servable(adapter, Path(path).name, facts.serving_rules)
        return adapter

    async def tokens(self, engine_id: str) -> list[int]:
        return [t async for out in self.engine.stream(PROMPT, GREEDY, engine_id) for t in out.token_ids]

    async def serve(self, name: str) -> list[int]:
        """One request as EngineReplica.generate makes it: acquire, stream, release."""
        loaded = await self.registry.acquire(self.versions[name])
        try:
            return await self.tokens(loaded.engine_id)
        finally:
            loaded.release()

    def engine_bytes(self) -> int:
        """Bytes of the host copies the engine holds now (what the budget bounds)."""
        return self.engine.engine.engine.registered_bytes

    def registered(self) -> set[str]:
        names = {v.content_hash: n for n, v in self.versions.items()}
        return {names[key] for key in self.registry.registered()}

    def counted(self, series) -> float:
        """The series' count so far (the recorder hands out deltas: kept here)."""
        counters, _ = self.metrics.recorder.take()
        for (name, _, _), value in counters.items():
            self.totals[name] = self.totals.get(name, 0.0) + value
        return self.totals.get(series.name, 0.0)


def _replica(tiny_model, adapter_dirs, tmp_path, budget_adapters=2.5, room_wait_s=0.2) -> Replica:
    return Replica(tiny_model, adapter_dirs, tmp_path / "store", budget_adapters, room_wait_s)


def test_a_registry_larger_than_the_budget_serves_every_adapter(tiny_model, adapter_dirs, expected, tmp_path):
    async def scenario():
        replica = _replica(tiny_model, adapter_dirs, tmp_path)
        order = ["a0", "a1", "a2", "a0", "a3", "a4", "a1", "a1", "a2", "a4", "a0"]
        for name in order:
            assert await replica.serve(name) == expected[name], name
            assert replica.registry.bytes <= replica.budget
            assert replica.engine_bytes() <= replica.budget
            assert name in replica.registered()
        loads, unloads = replica.counted(s.ADAPTER_LOADS), replica.counted(s.ADAPTER_UNLOADS)
        return replica, loads, unloads

    replica, loads, unloads = asyncio.run(scenario())
    assert len(replica.registered()) == 2  # 2.5 adapters' bytes hold two
    assert replica.registered() == {"a4", "a0"}  # the two most recently used
    assert loads == 10  # every request but the second a1's: each adapter registered again after its eviction
    assert unloads == loads - 2  # every eviction counted


def test_an_adapter_in_use_is_never_evicted(tiny_model, adapter_dirs, expected, tmp_path):
    async def scenario():
        replica = _replica(tiny_model, adapter_dirs, tmp_path)
        v = replica.versions
        held0, held1 = await replica.registry.acquire(v["a0"]), await replica.registry.acquire(v["a1"])
        with pytest.raises(CapacityError, match="registered_adapter_bytes"):
            await replica.registry.acquire(v["a2"])  # the budget is full of adapters in use
        refused = replica.registered()
        still = await replica.tokens(held0.engine_id)
        # a registration waiting for room gets it when a request ends: the idle one goes, not the used one
        replica.registry.room_wait_s = 120.0
        waiting = asyncio.create_task(replica.registry.acquire(v["a2"]))
        await asyncio.sleep(0.05)
        held1.release()
        held2 = await asyncio.wait_for(waiting, 120.0)
        after = replica.registered()
        tokens2 = await replica.tokens(held2.engine_id)
        held0.release(), held2.release()
        return replica, refused, still, after, tokens2

    replica, refused, still, after, tokens2 = asyncio.run(scenario())
    assert refused == {"a0", "a1"}, "a refused registration changes nothing"
    assert still == expected["a0"]
    assert after == {"a0", "a2"}
    assert tokens2 == expected["a2"]
    assert replica.counted(s.ADAPTER_UNLOADS) == 1


def test_an_adapter_over_the_whole_budget_is_refused(tiny_model, adapter_dirs, tmp_path):
    async def scenario():
        replica = _replica(tiny_model, adapter_dirs, tmp_path, budget_adapters=0.5)
        with pytest.raises(CapacityError, match="more than registered_adapter_bytes"):
            await replica.registry.acquire(replica.versions["a0"])
        return replica

    replica = asyncio.run(scenario())
    assert replica.registered() == set() and replica.engine_bytes() == 0 and replica.registry.bytes == 0


def test_the_multiplexer_dropping_an_adapter_unregisters_it_once_idle(tiny_model, adapter_dirs, expected, tmp_path):
    async def scenario():
        replica = _replica(tiny_model, adapter_dirs, tmp_path, budget_adapters=4.5)
        version = replica.versions["a0"]
        loaded = await replica.registry.acquire(version)
        advertised = Advertised(version.content_hash, replica.registry)
        advertised.__del__()  # what Serve's multiplexer calls on eviction
        kept = replica.registered()
        loaded.release()
        dropped = replica.registered()
        advertised.__del__()  # again at garbage collection: a registration made since stays
        again = await replica.registry.acquire(version)
        Advertised.__del__(advertised)
        tokens = await replica.tokens(again.engine_id)
        again.release()
        return replica, kept, dropped, loaded.engine_id, again.engine_id, tokens

    replica, kept, dropped, first_id, second_id, tokens = asyncio.run(scenario())
    assert kept == {"a0"} and dropped == set()
    assert second_id != first_id and tokens == expected["a0"]
    assert replica.registered() == {"a0"}
    assert replica.counted(s.ADAPTER_UNLOADS) == 1
