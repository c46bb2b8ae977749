"""Programmatic dependent launch (PDL, CUDA sm_90+) for the decode kernels.

With PDL a kernel is launched while the kernel before it in the stream is finishing:
its programs read what the step's kernels never write (weights, adapter rows, step
metadata) and then wait (``pdl_wait``) for the kernel before to complete before they
read an activation or write anything. CUDA graphs keep these programmatic edges.

Off unless switched on, process-wide: ``set_pdl("early")`` / ``set_pdl("exit")`` or the
environment variable ADAPTERSERVE_PDL=early|exit (1 means early). "early": a program lets
the next kernel launch right after its wait; "exit": only as its programs exit. Always
off on CPU tensors, below sm_90 and under TRITON_INTERPRET (the interpreter has no grid
dependency ops). Off, a kernel's USE_PDL constexpr is 0 and it runs today's code.

Every kernel with a USE_PDL path keeps three rules:
- before ``pdl_wait``: loads of weights, adapter pools and step metadata only (nothing
  the kernel just before writes), and no store;
- every program reaches ``pdl_wait`` before it exits, early exits included, so a kernel
  completes only after the kernel before it (the later kernels' pre-wait loads rely on it);
- the next kernel is let launch only after the wait (``pdl_wait`` does both).

Weight prefetch (our decode GEMMs, kernels/decode_gemm.py and kernels/stacked_fused.py): with
PDL on, a program may ask L2 for the first K chunks of its weight rows before its wait, so the
weight bytes stream while the kernel before finishes (a norm, SiLU-mul, attention's tail). Off
unless asked: ``set_prefetch(chunks)`` or ADAPTERSERVE_PREFETCH=chunks (0 to MAX_PREFETCH);
with PDL off for a launch there is no prefetch either.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from adapterserve.config import MAX_WEIGHT_PREFETCH as MAX_PREFETCH  # K chunks a program may prefetch

MODES = {"off": 0, "early": 1, "exit": 2}  # the USE_PDL constexpr of each mode
ENV = "ADAPTERSERVE_PDL"
PREFETCH_ENV = "ADAPTERSERVE_PREFETCH"

_mode: str | None = None  # set_pdl's choice; None: the environment's
_prefetch: int | None = None  # set_prefetch's choice; None: the environment's
_capable: dict[int, bool] = {}  # device index -> sm_90 or later


def set_pdl(mode: str | bool | None) -> None:
    """Switch PDL for every later launch: "off", "early" or "exit" (True: "early"; None:
    as ADAPTERSERVE_PDL says)."""
    global _mode
    _mode = None if mode is None else _parse(mode, "set_pdl")


def pdl_mode() -> str:
    """The mode asked for (set_pdl, else ADAPTERSERVE_PDL, else "off"), device aside."""
    return _mode if _mode is not None else _parse(os.environ.get(ENV, "off"), ENV)


def _parse(mode: str | bool, where: str) -> str:
    if isinstance(mode, bool):
        return "early" if mode else "off"
    named = {"0": "off", "1": "early", "": "off"}.get(mode, mode)
    if named not in MODES:
        raise ValueError(f"{where}: PDL mode must be one of {sorted(MODES)} (or 0/1), got {mode!r}")
    return named


def use_pdl(t: torch.Tensor) -> int:
    """The USE_PDL constexpr for a launch on t's device: 0 (off), 1 (early) or 2 (exit)."""
    if not t.is_cuda:
        return 0
    mode = MODES[pdl_mode()]
    if mode == 0 or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return mode if _capable[index] else 0


def pdl_args(t: torch.Tensor, prefetch: bool = False) -> dict:
    """Launch keywords of a kernel with a USE_PDL constexpr: empty when PDL is off (the
    kernel's default, today's launch), else USE_PDL and launch_pdl; with ``prefetch`` (a kernel
    with a PREFETCH constexpr) also PREFETCH, the chunks asked for, where that is not 0 (without
    PDL nothing runs before the kernel starts, so there is nothing for a prefetch to overlap)."""
    mode = use_pdl(t)
    if not mode:
        return {}
    chunks = prefetch_setting() if prefetch else 0
    return {"USE_PDL": mode, "launch_pdl": True, **({"PREFETCH": chunks} if chunks else {})}


def set_prefetch(chunks: int | None) -> None:
    """K chunks of its weight rows each program of our decode GEMMs asks L2 for before its
    PDL wait, for every later launch (0: none; None: as ADAPTERSERVE_PREFETCH says)."""
    global _prefetch
    _prefetch = None if chunks is None else _parse_chunks(chunks, "set_prefetch")


def prefetch_setting() -> int:
    """The chunks asked for (set_prefetch, else ADAPTERSERVE_PREFETCH, else 0), device aside."""
    return _prefetch if _prefetch is not None else _parse_chunks(os.environ.get(PREFETCH_ENV, "0"), PREFETCH_ENV)


def _parse_chunks(chunks: int | str, where: str) -> int:
    text = chunks.strip() if isinstance(chunks, str) else chunks
    if isinstance(text, bool) or not (isinstance(text, int) or (isinstance(text, str) and text.isdigit())) \
            or not 0 <= int(text) <= MAX_PREFETCH:
        raise ValueError(f"{where}: prefetch chunks must be an integer from 0 to {MAX_PREFETCH}, got {chunks!r}")
    return int(text)


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the kernel before to complete (its writes visible), then, in mode 1, let
    the next kernel launch. Nothing when USE_PDL is 0."""
    if USE_PDL != 0:
        tl.extra.cuda.gdc_wait()
    if USE_PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
