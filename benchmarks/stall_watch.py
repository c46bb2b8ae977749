"""A watcher process: where a benchmark's processes are stuck, when a block of work runs too long.

    with watching({"rank 0": os.getpid(), "rank 1": worker_pid}, after_s=100, label="distinct64"):
        run the workload

If the block still runs after ``after_s`` seconds, the watcher (a process of its own, so it
needs no thread, and no GIL, of the processes it watches) sends each process SIGUSR1: every
tensor-parallel rank prints all its threads' Python stacks to its stderr then
(adapterserve/engine/tp/stack_dump.py). It does so again ``again_s`` later (the same stacks
twice: stuck; other ones: slow), then, where py-spy is found (on PATH or beside this Python),
prints ``py-spy dump --native`` of each, C frames included. The watcher is killed when the
block ends. This file imports nothing but the standard library: it runs as
``python stall_watch.py --after S --pid NAME=PID ...``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

AGAIN_S = 20.0  # between the two dumps
SIGNAL_GAP_S = 1.0  # between signalling one process and the next (their dumps share a stderr)
PY_SPY_TIMEOUT_S = 60.0


@contextmanager
def watching(pids: dict[str, int], after_s: float, label: str, again_s: float = AGAIN_S) -> Iterator[None]:
    """Run the block with a watcher process that dumps ``pids``' stacks (name -> process id) if
    it still runs after ``after_s`` seconds (0: no watcher)."""
    if after_s <= 0:
        yield
        return
    command = [sys.executable, os.path.abspath(__file__), "--after", str(after_s), "--again", str(again_s),
               "--label", label, *(f"--pid={name}={pid}" for name, pid in pids.items())]
    watcher = subprocess.Popen(command, start_new_session=True)  # its own group: py-spy ends with it
    try:
        yield
    finally:
        try:
            os.killpg(watcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        watcher.wait()


def python_stacks(pids: dict[str, int], label: str, waited_s: float) -> None:
    """Every process's threads' Python stacks (SIGUSR1: faulthandler writes them to its stderr)."""
    say(f"{label}: still running after {waited_s:g} s; Python stacks of {pids}")
    for name, pid in pids.items():
        say(f"--- {name} (pid {pid}): SIGUSR1, its threads' stacks follow on its stderr")
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            say(f"--- {name} (pid {pid}) has exited")
        time.sleep(SIGNAL_GAP_S)


def native_stacks(pids: dict[str, int]) -> None:
    """Every process's threads' stacks with their C frames (py-spy dump --native), where py-spy is found."""
    py_spy = find_py_spy()
    if py_spy is None:
        say("py-spy not found (on PATH or beside this Python): no native stacks")
        return
    for name, pid in pids.items():
        say(f"--- {name} (pid {pid}): py-spy dump --native")
        try:
            out = subprocess.run([py_spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                 check=False, timeout=PY_SPY_TIMEOUT_S)
            print(out.stdout[-12000:] or out.stderr[-3000:], flush=True)
        except (OSError, subprocess.TimeoutExpired) as exc:
            say(f"py-spy on {pid}: {exc}")


def find_py_spy() -> str | None:
    """py-spy on PATH, else beside this Python (a venv's bin); None if neither."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return shutil.which("py-spy") or (beside if os.access(beside, os.X_OK) else None)


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] stall watch: {line}", flush=True)


def _pid(text: str) -> tuple[str, int]:
    name, _, pid = text.rpartition("=")
    if not name or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"--pid takes NAME=PID, got {text!r}")
    return name, int(pid)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--after", type=float, required=True, help="seconds before the first dump")
    p.add_argument("--again", type=float, default=AGAIN_S, help="seconds between the first and second dump")
    p.add_argument("--label", default="work")
    p.add_argument("--pid", type=_pid, action="append", required=True, help="NAME=PID, one per process")
    args = p.parse_args(argv)
    pids = dict(args.pid)
    time.sleep(args.after)
    python_stacks(pids, args.label, args.after)
    time.sleep(args.again)
    python_stacks(pids, args.label, args.after + args.again)
    native_stacks(pids)


if __name__ == "__main__":
    main()
