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
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(buffer: torch.Tensor, values: np.ndarray) -> None:
    """Fill a device buffer (a fixed CUDA-graph input) from a host array, without a host sync."""
    host = torch.from_numpy(values)
    if buffer.is_cuda:
        host = host.pin_memory()
    buffer.copy_(host, non_blocking=True)


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
