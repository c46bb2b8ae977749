"""A worker's inbox (engine/tp/inbox.py) over a real connection: each part is staged as it
arrives, before it can be taken; only the most recent parts keep their staged copies (by count
and by bytes); taking a part hands its copies to the placement, forgetting one drops them; a
part that cannot be staged still arrives, unstaged, for its placement to stage; a part too large
to hold is answered "failed"; an inbox stopped by an error fails a placement at once."""
from __future__ import annotations

import multiprocessing
import pickle

import pytest
import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.types import LoraAdapter, LoraModule
from adapterserve.engine.tp.adapter_post import pack
from adapterserve.engine.tp import inbox as inbox_module
from adapterserve.engine.tp.inbox import AdapterInbox

STAGED_BYTES = 4 * 1024  # each part's staged copy here
REPLY_WAIT_S = 30.0  # for the inbox's reply or end (normally milliseconds; not a timing assertion)


def _part(seed: int, scaling: float = 1.0) -> Adapter:
    gen = torch.Generator().manual_seed(seed)
    module = LoraModule(torch.randn(2, 8, generator=gen), torch.randn(8, 2, generator=gen), scaling)
    return Adapter("lora", lora=LoraAdapter({(0, "q_proj"): module}, {"r": 2}))


def _stage(adapter: Adapter) -> None:
    """A stand-in for the pools' prepare: a staged copy of STAGED_BYTES."""
    if adapter.lora.modules[0, "q_proj"].scaling < 0:
        raise ValueError("cannot stage this part")
    adapter.staged["lora"] = [{"q_proj": torch.zeros(STAGED_BYTES // 4)}]


@pytest.fixture
def linked():
    """(the parts staged so far, the inbox, a send(key, part) that waits for the worker's reply)."""
    rank0, worker_end = multiprocessing.Pipe()
    inbox = AdapterInbox(worker_end, rank=1, max_staged=3, max_staged_bytes=1 << 30)
    assert rank0.recv()[:2] == (1, "adapters")  # the hello names its rank and channel
    staged: list[Adapter] = []
    inbox.prepare = lambda adapter: (_stage(adapter), staged.append(adapter))

    def send(key: int, part: Adapter) -> None:
        packed = pack(part)
        rank0.send_bytes(pickle.dumps(("inline", key, packed.header)))
        rank0.send_bytes(packed.blob().numpy())
        assert rank0.poll(30) and rank0.recv() == ("ok", key)

    yield staged, inbox, send
    rank0.close()


def test_parts_arrive_staged_and_only_the_newest_keep_their_copies(linked):
    _, inbox, send = linked
    for key in range(5):
        send(key, _part(key))
    first = inbox.take(4)  # waits for the part to be in: staged before it could be taken
    assert "lora" in first.staged
    assert inbox.staged_keys() == [2, 3]  # 4 was taken: its copies are the placement's now
    assert not inbox.take(0).staged and not inbox.take(1).staged  # dropped past max_staged
    assert torch.equal(inbox.take(2).lora.modules[0, "q_proj"].a, _part(2).lora.modules[0, "q_proj"].a)


def test_the_bytes_limit_keeps_the_newest_part_staged(linked):
    _, inbox, send = linked
    inbox.max_staged_bytes = STAGED_BYTES + 1
    for key in range(3):
        send(key, _part(key))
    inbox.take(2)
    assert inbox.staged_keys() == []
    assert "lora" in inbox.take(2).staged and not inbox.take(1).staged


def test_forgetting_a_part_drops_its_staged_copy(linked):
    staged, inbox, send = linked
    send(0, _part(0))
    held = inbox.take(0)
    send(1, _part(1))
    send(2, _part(2))  # the inbox takes parts in order: 1 is in once 2's reply came
    inbox.forget(1)
    assert 1 not in inbox.staged_keys()
    assert not staged[1].staged  # forgotten: its copy dropped
    assert "lora" in held.staged  # a taken part's copies are left to its placement


def test_a_part_that_cannot_be_staged_still_arrives_unstaged(linked):
    _, inbox, send = linked
    send(0, _part(0, scaling=-1.0))
    got = inbox.take(0)
    assert not got.staged and got.lora.modules[0, "q_proj"].scaling == -1.0
    assert inbox.staged_keys() == []


def test_a_part_forgotten_before_it_is_in_is_dropped_on_arrival(linked, monkeypatch):
    """Rank 0 may send a forget once it has the worker's reply, before the inbox has stored the
    part it is still staging: the part must not stay (it would hold its copies for ever)."""
    staged, inbox, send = linked
    inbox.forget(0)  # the forget overtakes the part
    send(0, _part(0))
    send(1, _part(1))  # the inbox takes parts in order: 0 has been handled once 1's reply came
    assert inbox.take(1) is not None
    assert 0 not in inbox.staged_keys() and not staged[0].staged
    monkeypatch.setattr(inbox_module, "COLLECTIVE_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="did not arrive"):
        inbox.take(0)


@pytest.fixture
def raw_link():
    """(rank 0's end, the inbox) with nothing staged: rank 0's messages written by hand."""
    rank0, worker_end = multiprocessing.Pipe()
    inbox = AdapterInbox(worker_end, rank=1)
    assert rank0.recv()[:2] == (1, "adapters")
    yield rank0, inbox
    rank0.close()


def test_a_part_too_large_to_hold_is_answered_failed(raw_link, tmp_path):
    """No memory for the blob: rank 0 hears why (it then sends the part inline, or gives up),
    and the inbox goes on."""
    rank0, _ = raw_link
    header = pickle.dumps((pickle.dumps(None), [], 1 << 62))  # a blob of 4 EiB
    rank0.send_bytes(pickle.dumps(("file", 0, header, str(tmp_path / "part"))))
    assert rank0.poll(REPLY_WAIT_S), "no reply"
    kind, key, why = rank0.recv()
    assert (kind, key) == ("failed", 0) and "allocate" in why
    packed = pack(_part(1))  # the inbox goes on
    rank0.send_bytes(pickle.dumps(("inline", 1, packed.header)))
    rank0.send_bytes(packed.blob().numpy())
    assert rank0.poll(REPLY_WAIT_S) and rank0.recv() == ("ok", 1)


def test_a_placement_fails_at_once_when_the_inbox_has_stopped(raw_link, monkeypatch):
    """An error the inbox's thread did not expect ends it; a placement then raises its cause at
    once instead of waiting (COLLECTIVE_TIMEOUT_S) with every rank's step behind it."""
    rank0, inbox = raw_link
    monkeypatch.setattr(inbox_module, "COLLECTIVE_TIMEOUT_S", REPLY_WAIT_S)
    rank0.send_bytes(pickle.dumps(("inline",)))  # not a message rank 0 sends: the thread ends on it
    with pytest.raises(RuntimeError, match="inbox stopped .ValueError"):
        inbox.take(0)
