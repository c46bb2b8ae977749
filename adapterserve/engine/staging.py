"""Adapters' loading copies (the pools' pinned, packed host copies an adapter is placed from):
making them, and keeping only the most recent ones. Rank 0 (AdapterHost) and each
tensor-parallel worker (tp/inbox.py) keep theirs this way."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

from adapterserve.adapters_store.cache import tensor_nbytes
from adapterserve.adapters_store.formats.families import Adapter


def stage(pools: Iterable, adapter: Adapter) -> None:
    """Each pool's loading copy of the adapter (pools without one copy at placement)."""
    for pool in pools:
        prepare = getattr(pool, "prepare", None)
        if prepare is not None:
            prepare(adapter)


def trim_staged(staged: OrderedDict[Hashable, Adapter], max_adapters: int, max_bytes: int,
                resident: Callable[[Hashable], bool] = lambda key: False) -> None:
    """Drop adapters' loading copies (and their entries) past max_adapters or max_bytes: first
    the oldest of those ``resident`` in a slot (a copy there is needed again only after an
    eviction), then the oldest of the rest; the newest is kept even alone over the bytes (it
    is being placed)."""
    sizes = {key: tensor_nbytes(adapter.staged) for key, adapter in staged.items()}
    total = sum(sizes.values())
    newest = next(reversed(staged), None)
    # oldest first, those in slots before the rest (a stable sort keeps each group's order)
    for key in sorted((key for key in staged if key != newest), key=lambda key: not resident(key)):
        if not (len(staged) > max_adapters or total > max_bytes):
            return
        staged.pop(key).staged.clear()
        total -= sizes[key]
