"""Adapters' loading copies (the pools' pinned, packed host copies an adapter is placed from):
making them, and keeping only the most recent ones. Rank 0 (AdapterHost) and each
tensor-parallel worker (tp/inbox.py) keep theirs this way."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

from adapterserve.adapters_store.cache import tensor_nbytes
from adapterserve.adapters_store.formats.families import Adapter


def stage(pools: Iterable, adapter: Adapter) -> None:
    """Each pool's loading copy of the adapter (pools without one copy at placement)."""
    for pool in pools:
        prepare = getattr(pool, "prepare", None)
        if prepare is not None:
            prepare(adapter)


def trim_staged(staged: OrderedDict[Hashable, Adapter], max_adapters: int, max_bytes: int) -> None:
    """Drop the oldest adapters' loading copies (and their entries) past max_adapters or
    max_bytes; the newest is kept even alone over the bytes (it is being placed)."""
    sizes = {key: tensor_nbytes(adapter.staged) for key, adapter in staged.items()}
    total = sum(sizes.values())
    while len(staged) > 1 and (len(staged) > max_adapters or total > max_bytes):
        key, oldest = staged.popitem(last=False)
        oldest.staged.clear()
        total -= sizes[key]
