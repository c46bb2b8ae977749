"""Where a tensor-parallel process is stuck (engine/tp/stack_dump.py, benchmarks/stall_watch.py):
SIGUSR1 prints every thread's stack of a process whose main thread holds the GIL while blocked
in C code, a handler the process had for SIGUSR1 still runs after the dump, and the watcher
process prints every thread's stack of every rank of a TP=2 engine (CPU, gloo)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from adapterserve import Engine
from benchmarks import stall_watch
from tests.engine.test_tp_engine import MODEL, SETTINGS

WAIT_S = 60.0  # for a process's output to show (not a timing assertion: it normally takes milliseconds)

# main thread blocked in the regex engine (C code that never releases the GIL), a second thread waiting
BLOCKED_IN_C = textwrap.dedent("""
    import re, threading
    from adapterserve.engine.tp.stack_dump import dump_stacks_on_signal
    dump_stacks_on_signal()
    def side_thread_waits():
        threading.Event().wait()
    threading.Thread(target=side_thread_waits, daemon=True).start()
    def main_thread_holds_the_gil():
        print("blocked", flush=True)
        re.match(r"(a+)+$", "a" * 64 + "b")
    main_thread_holds_the_gil()
""")

# a process with its own SIGUSR1 handler: the dump, then its handler, then it goes on
OWN_HANDLER = textwrap.dedent("""
    import signal, sys, threading
    from adapterserve.engine.tp.stack_dump import dump_stacks_on_signal
    handled = threading.Event()
    signal.signal(signal.SIGUSR1, lambda signum, frame: handled.set())
    dump_stacks_on_signal()
    print("ready", flush=True)
    while not handled.wait(0.05):
        pass
    print("own handler ran", flush=True)
""")


class _Output:
    """A stream's text, read on a thread as it comes."""

    def __init__(self, stream) -> None:
        self.text = ""
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            self.text += line

    def wait_for(self, *parts: str) -> bool:
        deadline = time.monotonic() + WAIT_S
        while not all(part in self.text for part in parts):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


def _python(code: str) -> tuple[subprocess.Popen, _Output, _Output]:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    return process, _Output(process.stdout), _Output(process.stderr)


def test_a_process_blocked_in_c_with_the_gil_prints_every_threads_stack():
    process, out, err = _python(BLOCKED_IN_C)
    try:
        assert out.wait_for("blocked"), err.text
        process.send_signal(signal.SIGUSR1)
        assert err.wait_for("main_thread_holds_the_gil", "side_thread_waits"), err.text
        assert err.text.count("(most recent call first)") >= 2 and process.poll() is None  # all threads; it lives on
    finally:
        process.kill()
        process.wait()


def test_a_handler_the_process_had_still_runs_after_the_dump():
    process, out, err = _python(OWN_HANDLER)
    try:
        assert out.wait_for("ready"), err.text
        process.send_signal(signal.SIGUSR1)
        assert out.wait_for("own handler ran"), err.text
        assert process.wait(WAIT_S) == 0
        assert "(most recent call first)" in err.text
    finally:
        process.kill()
        process.wait()


def test_the_watcher_prints_every_threads_stack_of_every_rank(capfd):
    engine = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **SETTINGS)  # the worker writes to capfd
    try:
        pids = {"rank 0": os.getpid(), "rank 1": engine.lockstep.workers[0].pid}
        seen = ""
        with stall_watch.watching(pids, after_s=0.1, label="idle engine", again_s=600):
            deadline = time.monotonic() + WAIT_S
            while not all(part in seen for part in _EVERY_RANK) and time.monotonic() < deadline:
                time.sleep(0.05)  # rank 0's main thread: here, in this test, when its signal comes
                captured = capfd.readouterr()
                seen += captured.out + captured.err
        assert all(part in seen for part in _EVERY_RANK), seen
        assert f"rank 1 (pid {pids['rank 1']}): SIGUSR1" in seen
    finally:
        engine.close()


_EVERY_RANK = (
    "test_the_watcher_prints_every_threads_stack_of_every_rank",  # rank 0's main thread
    "in _serve",  # the worker's command loop
    "in _receive",  # the worker's inbox thread
)
