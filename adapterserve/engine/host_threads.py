"""torch's CPU threads in a process that drives a GPU.

A GPU engine's host work is small tensor ops (staging an adapter, filling a step's
inputs). torch starts one intra-op thread per core; on many-core hosts, and worse with
several engine processes per host (tensor-parallel ranks, replicas), each parallel region
then waits for dozens of threads to be scheduled, at a cost of up to a hundred times the
work (BENCHMARKS.md, "The host's CPU threads"). So each process driving a GPU takes a
small share of the cores, unless the user set OMP_NUM_THREADS or EngineConfig.host_threads.
"""
from __future__ import annotations

import logging
import os

import torch

from adapterserve.config import EngineConfig

log = logging.getLogger("adapterserve.engine")

MAX_AUTO_THREADS = 8


def host_threads(config: EngineConfig, processes_on_host: int) -> int | None:
    """The torch threads an engine process should use, or None to leave torch's setting:
    config.host_threads if given; else on a GPU and without OMP_NUM_THREADS, this process's
    share of the cores (at most MAX_AUTO_THREADS); CPU engines keep torch's own (they compute there)."""
    if config.host_threads is not None:
        return config.host_threads
    if torch.device(config.device).type != "cuda" or "OMP_NUM_THREADS" in os.environ:
        return None
    return max(1, min(MAX_AUTO_THREADS, (os.cpu_count() or 1) // max(processes_on_host, 1)))


def apply_host_threads(config: EngineConfig, processes_on_host: int) -> None:
    """Set this process's torch threads as host_threads says (process-wide)."""
    threads = host_threads(config, processes_on_host)
    if threads is not None and threads != torch.get_num_threads():
        log.info("torch host threads: %d (was %d)", threads, torch.get_num_threads())
        torch.set_num_threads(threads)
