"""Paged KV-cache bookkeeping: free blocks and per-request block tables (no torch)."""
from __future__ import annotations

from collections import deque

from adapterserve.errors import CapacityError


class BlockManager:
    """Hands out fixed-size KV blocks; a request's blocks hold its tokens in order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

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
            blocks.append(self._free.popleft())

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
        blocks.clear()

    def slot(self, blocks: list[int], position: int) -> int:
        """Flat cache slot of a token position in a request's block table."""
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
