"""The block manager's side of prefix caching: reference counts, cached blocks kept idle
after their last holder lets them go, reclaimed least recently used first and only
when the plain free blocks run out."""
import pytest

from adapterserve.engine.kv_cache import BlockManager
from adapterserve.errors import CapacityError


def _held(manager: BlockManager, num_tokens: int, keys: list[bytes]) -> list[int]:
    """A table of num_tokens tokens whose first len(keys) blocks are cached under keys."""
    table: list[int] = []
    manager.grow(table, num_tokens)
    for block, key in zip(table, keys):
        manager.cache(block, key)
    return table


def test_a_cached_block_outlives_its_holder_and_is_found_again():
    manager = BlockManager(8, 4)
    table = _held(manager, 12, [b"a", b"b"])
    cached = table[:2]
    manager.release(table)
    assert manager.num_free == 8 and manager.num_cached == 2
    found = manager.lookup([b"a", b"b", b"c"])
    assert found == cached and manager.num_free == 6


def test_lookup_stops_at_the_first_unknown_key():
    manager = BlockManager(8, 4)
    manager.release(_held(manager, 12, [b"a", b"b", b"c"]))
    assert len(manager.lookup([b"a", b"x", b"c"])) == 1
    assert manager.lookup([b"x", b"a"]) == []


def test_a_shared_block_is_freed_only_when_every_holder_lets_it_go():
    manager = BlockManager(4, 4)
    first = _held(manager, 8, [b"a"])
    second = manager.lookup([b"a"])
    manager.grow(second, 8)
    assert second[0] == first[0] and manager.num_free == 1
    manager.release(first)
    assert manager.num_free == 2  # first's own second block; the shared one is still held
    manager.release(second)
    assert manager.num_free == 4 and manager.lookup([b"a"]) != []


def test_idle_cached_blocks_are_reclaimed_only_when_free_ones_run_out_oldest_first():
    manager = BlockManager(4, 4)
    old = _held(manager, 4, [b"old"])
    manager.release(old)
    new = _held(manager, 4, [b"new"])
    manager.release(new)
    table: list[int] = []
    manager.grow(table, 8)  # two plain free blocks: nothing reclaimed
    assert manager.num_cached == 2
    manager.grow(table, 12)  # one more: the least recently used cached block goes
    assert manager.lookup([b"old"]) == [] and len(manager.lookup([b"new"])) == 1
    with pytest.raises(CapacityError):
        manager.grow(table, 20)


def test_a_released_chain_loses_its_tail_first():
    manager = BlockManager(3, 4)
    manager.release(_held(manager, 12, [b"k0", b"k1", b"k2"]))
    table: list[int] = []
    manager.grow(table, 4)
    assert len(manager.lookup([b"k0", b"k1", b"k2"])) == 2  # k2, the chain's tail, was reclaimed


def test_a_key_already_known_keeps_its_first_block():
    manager = BlockManager(4, 4)
    first, second = _held(manager, 4, [b"a"]), _held(manager, 4, [b"a"])
    manager.release(second)
    assert manager.num_cached == 1 and manager.num_free == 3  # second's block went back as a plain free one
    block = first[0]
    manager.release(first)
    assert manager.lookup([b"a"]) == [block]
