"""Paged KV-cache bookkeeping: free blocks, per-request block tables, and the blocks kept
for reuse by the prefix cache (no torch).

A block is held by the requests (or prefix-tuning pages) whose tables list it; its
reference count says by how many. The n choices of one request share the blocks of its
prompt (`share`); each writes only to blocks of its own. A full block whose KV is known by its key (a hash
chain of its tokens: engine/prefix_cache.py) is *cached*: when its last holder lets it
go it is not freed but kept, least recently used first out, and handed to a request
with the same key. Cached blocks nobody holds count as free: they are reclaimed, oldest
first, only when the plain free blocks run out.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from adapterserve.errors import CapacityError


class BlockManager:
    """Hands out fixed-size KV blocks; a request's blocks hold its tokens in order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._block_of: dict[bytes, int] = {}  # key -> cached block
        self._key_of: dict[int, bytes] = {}  # cached block -> key
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first

    @property
    def num_free(self) -> int:
        """Blocks a request may take now: plain free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks known by a key (held or idle)."""
        return len(self._key_of)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, blocks: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(blocks) <= self.num_free

    def grow(self, blocks: list[int], num_tokens: int) -> None:
        """Extend a block table in place until it holds num_tokens tokens."""
        extra = self.blocks_needed(num_tokens) - len(blocks)
        if extra > self.num_free:
            raise CapacityError(f"KV cache full: need {extra} blocks, {self.num_free} free")
        for _ in range(extra):
            block = self._free.popleft() if self._free else self._reclaim()
            self._refs[block] = 1
            blocks.append(block)

    def share(self, blocks: list[int]) -> list[int]:
        """A new table holding the same blocks, each now held once more (a request's choices
        share its prompt's blocks)."""
        for block in blocks:
            self._refs[block] += 1
        return list(blocks)

    def holders(self, block: int) -> int:
        """How many tables hold the block now."""
        return self._refs[block]

    def release(self, blocks: list[int]) -> None:
        """Let a table's blocks go: a block nobody holds any more is freed, or kept idle if cached."""
        for block in reversed(blocks):  # a chain's tail goes idle first, so it is reclaimed first
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._key_of:
                self._idle[block] = None
            else:
                self._free.append(block)
        blocks.clear()

    # the prefix cache

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `keys` from the first, each now held once
        more (the caller's table takes them)."""
        found: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            self._idle.pop(block, None)
            self._refs[block] += 1
            found.append(block)
        return found

    def cache(self, block: int, key: bytes) -> None:
        """Know a full, held block by its key. A key already known keeps its first block
        (this one stays private to its table and is freed as usual)."""
        if key in self._block_of or block in self._key_of:
            return
        self._block_of[key] = block
        self._key_of[block] = key

    def forget_idle(self) -> int:
        """Forget every cached block nobody holds (engine warm-up's): each is a plain free
        block again, no key finds it. Returns how many."""
        idle = list(self._idle)
        self._idle.clear()
        for block in idle:
            del self._block_of[self._key_of.pop(block)]
            self._free.append(block)
        return len(idle)

    def _reclaim(self) -> int:
        """The least recently used idle cached block, forgotten by the cache."""
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._key_of.pop(block)]
        return block

    def slot(self, blocks: list[int], position: int) -> int:
        """Flat cache slot of a token position in a request's block table."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
