"""Adapters' parts to tensor-parallel workers (engine/tp/adapter_post.py). A part packed as a
skeleton and one blob unpacks equal (types, dtypes, shapes, values), from memory and from a
file, which reading removes. Through the engine at TP=2 (CPU, gloo, a spawned worker): every
family's parts go as shared-memory files on this host, the greedy tokens equal TP=1's, and no
file is left after adds, unloads and close, nor when the worker died before reading its file;
with the directory missing, or the worker naming another host, the parts go over the
connection and the tokens are the same."""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.formats.families import Ia3Adapter, PrefixAdapter
from adapterserve.adapters_store.formats.types import LoraAdapter, LoraModule
from adapterserve.engine.adapter_shard import AdapterShard
from adapterserve.engine.tp.adapter_post import FILE_PREFIX, default_shared_dir, pack, read_file, receive, unpack
from adapterserve.engine.tp.lockstep import Lockstep
from adapterserve.errors import EngineBroken
from tests.engine import test_tp_engine
from tests.engine.test_tp_engine import MODEL, SETTINGS, _mixed_run

adapter_dirs = test_tp_engine.adapter_dirs  # the fixture: the same adapters as there

WAIT_S = 60.0  # for a thread receiving a part
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _a_shard() -> AdapterShard:
    """Every kind of tensor a part holds: bfloat16 and float32, a view of a larger tensor, one
    tensor twice, an empty one, a 0-dim one, and non-tensor fields around them."""
    base = torch.randn(6, 8)
    twice = torch.randn(3, 8, dtype=torch.bfloat16)
    lora = LoraAdapter({(0, "q_proj"): LoraModule(twice, torch.randn(5, 3, dtype=torch.bfloat16), 1.0),
                        (1, "o_proj"): LoraModule(base[:, 2:5].t(), base[1:4, :3], 0.5),
                        (1, "k_proj"): LoraModule(twice, torch.empty(0, 3, dtype=torch.bfloat16), 2.0)},
                       {"r": 3, "target_modules": ["q_proj"]})
    ia3 = Ia3Adapter({(0, "down_proj"): torch.tensor(1.5, dtype=torch.float64)}, frozenset({"down_proj"}))
    prefix = PrefixAdapter(torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8).half())
    return AdapterShard("lora", lora=lora, ia3=ia3, prefix=prefix, config={"peft_type": "LORA"}, rank=1,
                        world_size=2)


def _assert_same(got: object, want: object, where: str = "part") -> None:
    assert type(got) is type(want), where
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        assert torch.equal(got, want), where
    elif dataclasses.is_dataclass(want):
        for field in dataclasses.fields(want):
            _assert_same(getattr(got, field.name), getattr(want, field.name), f"{where}.{field.name}")
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_same(got[key], want[key], f"{where}[{key!r}]")
    else:
        assert got == want, where


def test_a_packed_part_unpacks_equal():
    shard = _a_shard()
    packed = pack(shard)
    got = unpack(packed.header, packed.blob())
    _assert_same(got, shard)
    assert len(packed.chunks) == 8  # the tensor held twice is sent once, and comes back one tensor
    assert got.lora.modules[0, "q_proj"].a is got.lora.modules[1, "k_proj"].a


def test_a_part_through_a_file_unpacks_equal_and_the_file_goes(tmp_path):
    shard = _a_shard()
    packed = pack(shard)
    path = packed.write_file(str(tmp_path))
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"  # adapters can be private: the owner's alone
    _assert_same(unpack(packed.header, read_file(path, packed.size)), shard)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_that_refuses_the_file_raises_and_leaves_nothing(tmp_path):
    with pytest.raises(OSError):
        pack(_a_shard()).write_file(str(tmp_path / "missing"))
    assert list(tmp_path.iterdir()) == []


def test_a_blob_of_the_wrong_size_is_refused():
    packed = pack(_a_shard())
    with pytest.raises(ValueError, match=f"where its header says {packed.size}"):
        unpack(packed.header, packed.blob()[:-64])


def test_a_worker_that_cannot_read_the_file_says_so_and_takes_the_part_inline(tmp_path):
    """The worker's side over a real connection: a file it cannot find is answered "failed";
    the same part, then sent inline, arrives equal and is answered "ok"."""
    shard = _a_shard()
    packed = pack(shard)
    rank0, worker = multiprocessing.Pipe()
    got: list[tuple[int, object]] = []
    receiving = threading.Thread(target=lambda: got.append(receive(worker)))
    receiving.start()
    rank0.send_bytes(pickle.dumps(("file", 7, packed.header, str(tmp_path / "gone"))))
    reply = rank0.recv()
    assert reply[:2] == ("failed", 7) and "FileNotFoundError" in reply[2]
    rank0.send_bytes(pickle.dumps(("inline", 7, packed.header)))
    rank0.send_bytes(packed.blob().numpy())
    assert rank0.recv() == ("ok", 7)
    receiving.join(WAIT_S)
    assert got[0][0] == 7
    _assert_same(got[0][1], shard)


# through the engine


def _files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(FILE_PREFIX))


@pytest.fixture(scope="module")
def one_rank_tokens(adapter_dirs) -> list[list[int]]:
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=1, **SETTINGS)
    try:
        return _served(engine, adapter_dirs)
    finally:
        engine.close()


def _served(engine: Engine, adapter_dirs: dict[str, Path]) -> list[list[int]]:
    """Every adapter registered, then one request each, another adapter loaded mid-run and unloaded."""
    for name, path in adapter_dirs.items():
        engine.load_adapter(name, path)
    names = [n for n in adapter_dirs if n != "head"] + ["late-lora"]
    return _mixed_run(engine, names, GREEDY, {"late-lora": adapter_dirs["lora-8"]})


def _two_ranks(shared_dir: Path, configure: Callable[[Lockstep], None] = lambda lockstep: None) -> Engine:
    """A TP=2 engine whose parts go as files to shared_dir (by default, to /dev/shm where it exists)."""
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)
    assert engine.lockstep.shared_dir == default_shared_dir()
    engine.lockstep.shared_dir = str(shared_dir)
    configure(engine.lockstep)
    return engine


@pytest.fixture
def shm_dir(tmp_path) -> Path:
    """A fresh directory in shared memory (/dev/shm) where this host has it."""
    base = default_shared_dir()
    path = Path(base) / f"test-{os.getpid()}-{time.monotonic_ns()}" if base else tmp_path / "shm"
    path.mkdir()
    yield path
    for name in os.listdir(path):
        os.unlink(path / name)
    path.rmdir()


def test_parts_go_through_shared_memory_and_leave_no_file(adapter_dirs, one_rank_tokens, shm_dir):
    assert default_shared_dir() == ("/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    engine = _two_ranks(shm_dir)
    try:
        sent = engine.lockstep.parts_sent
        tokens = _served(engine, adapter_dirs)
        assert _files(shm_dir) == []  # after adds, a hot load and an unload
        assert sent[1, "file"] == len(adapter_dirs) + 1 and sent[1, "connection"] == 0, sent
        assert tokens == one_rank_tokens
        assert len({tuple(t) for t in tokens}) > len(tokens) // 2, "adapters changed nothing: a vacuous check"
    finally:
        engine.close()
    assert _files(shm_dir) == []


@pytest.mark.parametrize("how", ["missing directory", "another host"])
def test_parts_go_over_the_connection_otherwise_and_serve_the_same(adapter_dirs, one_rank_tokens, shm_dir, how):
    if how == "missing directory":
        engine = _two_ranks(shm_dir / "missing")
    else:
        engine = _two_ranks(shm_dir, lambda lockstep: setattr(lockstep.workers[0], "host", "elsewhere/boot"))
    try:
        tokens = _served(engine, adapter_dirs)
        sent = engine.lockstep.parts_sent
        assert sent[1, "file"] == 0 and sent[1, "connection"] == len(adapter_dirs) + 1, sent
        assert tokens == one_rank_tokens
    finally:
        engine.close()
    assert _files(shm_dir) == []


def _stop(pid: int) -> None:
    """SIGSTOP pid and wait until each of its threads has stopped: kill() returns once the signal
    is queued, and a thread woken by a message before the group stop would still read it."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_S
    while not all(_thread_state(pid, task) in ("T", None) for task in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"process {pid} did not stop within {WAIT_S:.0f} s"
        time.sleep(0.01)


def _thread_state(pid: int, task: str) -> str | None:
    """A thread's state letter from /proc (None once it has gone)."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


@pytest.mark.parametrize("then", ["add", "close"])
def test_a_worker_dead_before_reading_its_file_leaves_none(adapter_dirs, shm_dir, then):
    """The worker stopped (SIGSTOP) when an adapter is added: its file is written and left
    unread, and the worker is killed. The next add fails naming it, or the engine closes; either
    way the file is gone."""
    engine = _two_ranks(shm_dir)
    try:
        worker = engine.lockstep.workers[0]
        _stop(worker.pid)
        engine.load_adapter("lora-8", adapter_dirs["lora-8"])
        flight = engine.lockstep._in_flight.get(worker.rank)
        assert len(_files(shm_dir)) == 1, (f"rank 0 wrote no file for the stopped worker (its part in flight: "
                                           f"{'none' if flight is None else flight.path or 'over the connection'})")
        os.kill(worker.pid, signal.SIGKILL)
        if then == "add":
            with pytest.raises(EngineBroken, match="worker 1"):
                engine.load_adapter("lora-2", adapter_dirs["lora-2"])
            assert _files(shm_dir) == []
            assert "lora-2" not in engine.adapters
    finally:
        engine.close()
    assert _files(shm_dir) == []
