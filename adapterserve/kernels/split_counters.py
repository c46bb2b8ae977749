"""Per-device split-K tile counters and multiprocessor counts, shared by our split-K GEMMs
(kernels/decode_gemm.py, kernels/stacked_fused.py, kernels/fp8_w8a8.py).

A split-K launch counts finished splits per output tile; the last one to finish sums the
partials and sets its counter back to zero, so one zeroed array serves every launch of a
stream, CUDA-graph replays included. Launches on one stream follow each other, so they
can share it.
"""
from __future__ import annotations

import functools

import torch

COUNTERS = 1 << 16  # tiles (and step counters) one launch may use
INDEX_LIMIT = 2**31  # these kernels index a weight's elements in 32 bits

_ARRAYS: dict[torch.device, torch.Tensor] = {}


def prepare_split_counters(device: torch.device | str) -> None:
    """Allocate the device's counters (zeroed). Call before CUDA-graph capture: a capture
    cannot initialize memory."""
    device = _indexed(torch.device(device))
    if device not in _ARRAYS:
        _ARRAYS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's counters (allocated on first use, outside a capture)."""
    device = _indexed(device)
    if device not in _ARRAYS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K GEMM: call prepare_split_counters(device) before capturing a CUDA graph")
        prepare_split_counters(device)
    return _ARRAYS[device]


def split_span(k: int, split: int, block_k: int) -> int:
    """The K columns each of ``split`` splits covers: whole K chunks, the last split the rest."""
    per_split = -(-k // split)  # ceil(k / split)
    return -(-per_split // block_k) * block_k  # rounded up to whole chunks


def _indexed(device: torch.device) -> torch.device:
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def sms_of(device: torch.device) -> int:
    """Multiprocessors of the device (a few for the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count
