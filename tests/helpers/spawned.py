"""Waiting for ranks started with torch.multiprocessing.start_processes(join=False)."""
from __future__ import annotations

import time


def join_within(ranks, seconds: float) -> bool:
    """Whether every rank exited within `seconds`; those still running then are killed
    (a hung collective must fail its test, not stall the run)."""
    deadline, exited = time.monotonic() + seconds, False
    while not exited and time.monotonic() < deadline:
        exited = ranks.join(timeout=5)
    if not exited:
        for process in ranks.processes:
            process.kill()
    return exited
