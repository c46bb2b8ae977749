"""First-fit allocation of contiguous row ranges in a fixed pool (no torch)."""
from __future__ import annotations


class RowAllocator:
    """Contiguous ranges of rows in [0, capacity). Freed ranges merge with neighbours."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, length)

    @property
    def free_rows(self) -> int:
        return sum(n for _, n in self._free)

    def alloc(self, rows: int) -> int | None:
        """Start of a free range of `rows` rows, or None if no range is long enough."""
        if rows == 0:
            return 0
        for i, (start, length) in enumerate(self._free):
            if length >= rows:
                if length == rows:
                    self._free.pop(i)
                else:
                    self._free[i] = (start + rows, length - rows)
                return start
        return None

    def free(self, start: int, rows: int) -> None:
        if rows == 0:
            return
        self._free.append((start, rows))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for s, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged
