"""How often Python's interpreter lock may change hands between a server process's threads.

A replica's event loop, its engine process's reader thread and the engine's step thread
share one lock per process; a thread that wants it while another runs Python waits up to
the switch interval (Python's default: 5 ms) unless the other blocks first.
ADAPTERSERVE_GIL_SWITCH_MS sets that interval in each server process that calls
apply_gil_switch() (the replicas and the engine processes, which inherit it); unset: Python's.
"""
from __future__ import annotations

import logging
import math
import os
import sys

ENV = "ADAPTERSERVE_GIL_SWITCH_MS"


def apply_gil_switch() -> None:
    """Set the interval from ENV, if set (ValueError naming it for a value that is not a positive number)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not ms > 0 or math.isinf(ms):
        raise ValueError(f"{ENV} must be a positive number of milliseconds, got {value!r}")
    sys.setswitchinterval(ms / 1000)
    logging.getLogger("adapterserve.server").info("interpreter lock switch interval: %g ms (%s)", ms, ENV)
