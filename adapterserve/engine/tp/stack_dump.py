"""Where a tensor-parallel process is stuck: every thread's Python stack on SIGUSR1.

Rank 0 and every worker register faulthandler for SIGUSR1, so ``kill -USR1 <pid>`` prints
all of that process's threads' stacks to its stderr (file descriptor 2). faulthandler writes
from the signal handler itself, without the GIL: it shows a process whose thread holds the
GIL while blocked in C code (a CUDA call, a lock wait), where no Python thread of its own
(a timer) could run. A process that already handled SIGUSR1 keeps its handler: it runs after
the dump.
"""
from __future__ import annotations

import faulthandler
import signal

STACK_SIGNAL: int | None = getattr(signal, "SIGUSR1", None)  # None where the platform has none
_STDERR_FD = 2


def dump_stacks_on_signal() -> bool:
    """Register the dump for STACK_SIGNAL in this process (again: no change); False where the
    platform has no SIGUSR1."""
    if STACK_SIGNAL is None:
        return False
    previous = signal.getsignal(STACK_SIGNAL)  # None: a handler installed outside Python
    faulthandler.register(STACK_SIGNAL, file=_STDERR_FD, all_threads=True,
                          chain=previous not in (signal.SIG_DFL, signal.SIG_IGN))
    return True
