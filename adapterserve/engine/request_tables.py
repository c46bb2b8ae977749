"""Device tables with one row per request, kept across steps.

The tensors share their first dimension: a request given a row holds it until it
has finished; later requests reuse the row (the caller fills it anew). When more
requests hold rows than the tensors have, they grow, doubling, keeping every row.
"""
from __future__ import annotations

import torch

from adapterserve.engine.request import Request

_MIN_ROWS = 8


class RequestTables:
    def __init__(self, device: torch.device, columns: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """columns: name -> (shape of one row, dtype)."""
        self.device = device
        self.tensors = {name: torch.zeros(0, *shape, dtype=dtype, device=device)
                        for name, (shape, dtype) in columns.items()}
        self.rows: dict[Request, int] = {}  # request -> its row
        self.free: list[int] = []

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def capacity(self) -> int:
        return len(self.rows) + len(self.free)

    def assign(self, requests: list[Request]) -> list[int]:
        """Rows for `requests` (none of which holds one), in order; their contents are stale."""
        if len(self.free) < len(requests):
            self._grow(self.capacity + len(requests))
        rows = [self.free.pop() for _ in requests]
        self.rows.update(zip(requests, rows))
        return rows

    def release_finished(self) -> None:
        for request in [r for r in self.rows if r.finished]:
            self.free.append(self.rows.pop(request))

    def _grow(self, needed: int) -> None:
        old = self.capacity
        size = max(needed, 2 * old, _MIN_ROWS)
        for name, table in self.tensors.items():
            grown = torch.zeros(size, *table.shape[1:], dtype=table.dtype, device=self.device)
            grown[:old] = table
            self.tensors[name] = grown
        self.free.extend(range(size - 1, old - 1, -1))
