"""Host-to-device copies that never make the host wait for the GPU.

A plain ``torch.tensor(values, device="cuda")`` copies from pageable memory and
synchronises the stream, which would stall the host behind the step still running
on the GPU. Staging through pinned memory makes the copy asynchronous; the caching
host allocator keeps each staging buffer alive until its copy has run.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A list, numpy array or CPU tensor as a tensor on ``device``, without a host sync."""
    host = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values), dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return pinned_copy(host).to(device, non_blocking=True)


def pinned_copy(host: torch.Tensor) -> torch.Tensor:
    """A copy of a CPU tensor in pinned memory from the caching host allocator. Not
    ``host.pin_memory()``, which in tensor-parallel engines cost over ten times as much a call
    (benchmarks/host_pinning.py compares them; BENCHMARKS.md has the figures)."""
    return torch.empty(host.shape, dtype=host.dtype, pin_memory=True).copy_(host)


class PinnedStaging:
    """Pinned host mirrors of fixed device buffers (CUDA-graph inputs), filled and copied from
    without a host sync and without pinning memory per copy. Pinning a fresh tensor may call
    cudaHostAlloc, which can wait for the device: under tensor parallelism that made every
    rank's host wait for the step before, whose collectives wait for the slowest rank.
    Each buffer has DEPTH mirrors used in turn; a mirror is written again only once the copy
    that last read it has run (an event), which with DEPTH mirrors is long past."""

    DEPTH = 3

    def __init__(self) -> None:
        self._rings: dict[int, _Ring] = {}

    def copy_into(self, buffer: torch.Tensor, values: np.ndarray) -> None:
        """Fill a contiguous device buffer (or a leading slice of one) from a host array."""
        if not buffer.is_contiguous():
            raise ValueError(f"staged copies need a contiguous buffer, got shape {tuple(buffer.shape)} "
                             f"with strides {buffer.stride()}")
        host = torch.from_numpy(np.ascontiguousarray(values))
        if not buffer.is_cuda:
            buffer.copy_(host)
            return
        storage = buffer.untyped_storage()
        ring = self._rings.get(storage.data_ptr())
        if ring is None:
            ring = self._rings[storage.data_ptr()] = _Ring(storage.nbytes(), self.DEPTH)
        ring.copy(buffer, host)


class _Ring:
    """The pinned mirrors of one device storage, and the events of the copies that read them."""

    def __init__(self, nbytes: int, depth: int) -> None:
        self.mirrors = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.turn = 0

    def copy(self, buffer: torch.Tensor, host: torch.Tensor) -> None:
        turn, self.turn = self.turn, (self.turn + 1) % len(self.mirrors)
        event = self.events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this mirror (normally done long ago)
        size = buffer.element_size()
        start = buffer.storage_offset() * size
        mirror = self.mirrors[turn][start: start + buffer.numel() * size].view(buffer.dtype).view(buffer.shape)
        mirror.copy_(host)
        buffer.copy_(mirror, non_blocking=True)
        if event is None:
            event = self.events[turn] = torch.cuda.Event()
        event.record()


@contextmanager
def on_copy_stream(copy_stream: torch.cuda.Stream | None, landed: list[torch.cuda.Event]) -> Iterator[None]:
    """Device writes inside run on ``copy_stream``, behind the work the current stream has queued;
    the event of their completion is appended to ``landed`` (for the step that must wait for
    them). Without a copy stream (CPU) they run in place."""
    if copy_stream is None:
        yield
        return
    copy_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(copy_stream):
        yield
    event = torch.cuda.Event()
    event.record(copy_stream)
    landed.append(event)
