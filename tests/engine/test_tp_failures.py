"""Tensor parallelism's failures (CPU, gloo): a killed worker makes the engine raise
EngineBroken (never a hang), so does a worker sent an adapter cut for another rank, and
hostile sizes are refused with errors naming the size."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.engine.tp.worker import checkpoint_shard
from adapterserve.errors import EngineBroken
from adapterserve.models.decoder_config import read_decoder_config
from tests.engine.test_tp_engine import MODEL, SETTINGS
from tests.engine.test_tp_gpu import GPU
from tests.helpers.lora import make_peft_lora

BREAK_WAIT_S = 60.0  # a killed worker must break the engine well within this


def _killed_worker_then_generate(engine: Engine) -> BaseException:
    """Kill rank 1's process, then generate: what that raised (within BREAK_WAIT_S)."""
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))[0].token_ids
    os.kill(engine.lockstep.workers[0].pid, signal.SIGKILL)
    caught: list[BaseException] = []

    def generate() -> None:
        try:
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0))
        except BaseException as exc:  # what the caller would see, whatever it is
            caught.append(exc)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(BREAK_WAIT_S)
    assert not thread.is_alive(), "the engine hung on a dead tensor-parallel worker"
    assert len(caught) == 1
    return caught[0]


def test_a_killed_worker_breaks_the_engine():
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    try:
        error = _killed_worker_then_generate(engine)
        assert isinstance(error, EngineBroken), error
        assert "worker 1" in str(error)
        with pytest.raises(EngineBroken):
            engine.add_request([1, 2], SamplingParams(max_tokens=1))
    finally:
        engine.close()


def test_a_worker_dead_while_idle_shows_in_health():
    """No request needed: the engine's health (what the replica's health check reads) names it."""
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    try:
        assert engine.broken is None
        os.kill(engine.lockstep.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + BREAK_WAIT_S
        while engine.broken is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.broken is not None and "worker 1" in engine.broken
        with pytest.raises(EngineBroken, match="worker 1"):
            engine.add_request([1, 2], SamplingParams(max_tokens=1))
    finally:
        engine.close()


def test_close_returns_with_a_frozen_worker_and_ends_every_worker():
    """A worker that never takes "close" (stopped: SIGSTOP) is ended by force; close still
    returns, and no worker process outlives it."""
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids
    pids = [worker.pid for worker in engine.lockstep.workers]
    os.kill(pids[0], signal.SIGSTOP)
    closing = threading.Thread(target=engine.lockstep.close, kwargs={"wait_s": 1.0}, daemon=True)
    closing.start()
    closing.join(BREAK_WAIT_S)
    assert not closing.is_alive(), "close hung on a frozen tensor-parallel worker"
    assert engine.lockstep.broken == "closed"
    for pid in pids:
        assert not _alive(pid), f"worker process {pid} outlived the close"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_part_cut_for_another_rank_breaks_the_engine(tmp_path):
    """The cut names its rank: a worker given rank 0's part refuses to place it."""
    lora = make_peft_lora(MODEL, tmp_path / "lora", r=4, lora_alpha=8, target_modules="all-linear")
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    try:
        cut = engine.lockstep.cut
        engine.lockstep.cut = lambda adapter, rank: cut(adapter, 0)
        engine.load_adapter("lora", lora)
        with pytest.raises(EngineBroken, match="rank 1 of 2 was sent the part of an adapter cut for rank 0 of 2"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0), ["lora"])
    finally:
        engine.close()


def _fails_on_rank_1(tp, device):
    """A ModelBuilder whose worker raises (rank 0 builds the real shard)."""
    if tp.rank == 1:
        raise RuntimeError("rank 1 cannot build its shard")
    return checkpoint_shard(str(MODEL), torch.float32, None, tp, device)


def test_the_group_s_port_listens_before_any_worker_starts(monkeypatch):
    """Rank 0's store is bound before the workers start, so no process started meanwhile (Ray
    starts many that bind port 0) can take the group's port before rank 0 listens on it."""
    from adapterserve.engine.tp import launch

    listening = []

    def start_workers(specs, config):
        host, port = specs[0].group_address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5):
            listening.append(port)
        raise RuntimeError("no workers in this test")

    monkeypatch.setattr(launch, "_start_local_workers", start_workers)
    with pytest.raises(Exception, match="no workers in this test"):
        Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    assert len(listening) == 1


def test_a_worker_that_raises_fails_the_start_with_its_error():
    config = EngineConfig(tensor_parallel_size=2, **SETTINGS)
    with pytest.raises(EngineBroken, match="rank 1 cannot build its shard"):
        Engine.from_model(_fails_on_rank_1, read_decoder_config(MODEL), None, config)


@pytest.mark.parametrize("size, message", [
    (0, "tensor_parallel_size must be an integer of at least 1"),
    (-2, "tensor_parallel_size must be an integer of at least 1"),
    ("2", "tensor_parallel_size must be an integer of at least 1"),
    (3, "num_attention_heads=4"),
])
def test_hostile_sizes_are_refused(size, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(MODEL, tensor_parallel_size=size)


def test_more_ranks_than_cores_is_refused(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match="needs a core per rank, but this host has 1"):
        Engine.from_pretrained(MODEL, tensor_parallel_size=2)


def test_ray_launch_without_ray_is_refused():
    try:
        import ray
    except ImportError:  # no Ray at all: refused the same way
        ray = None
    if ray is not None and ray.is_initialized():
        pytest.skip("Ray is initialized in this test session")
    with pytest.raises(ValueError, match='tensor_parallel_launch="ray" needs Ray initialized'):
        Engine.from_pretrained(MODEL, tensor_parallel_size=2, tensor_parallel_launch="ray")


def test_unknown_launch_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_launch must be one of"):
        Engine.from_pretrained(MODEL, tensor_parallel_size=2, tensor_parallel_launch="slurm")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_killed_gpu_worker_breaks_the_engine():
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, warmup=False, **GPU)
    try:
        error = _killed_worker_then_generate(engine)
        assert isinstance(error, EngineBroken) and "worker 1" in str(error), error
    finally:
        engine.close()


def test_more_ranks_than_gpus_is_refused():
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has 2 GPUs")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs 2 GPUs, one per rank, but this host has"):
        Engine.from_pretrained(MODEL, device="cuda", tensor_parallel_size=2, tensor_parallel_launch="local")
