"""Every process a server started ends with it: Ray's, HAProxy, engine processes.

The watchdog is a small process in a session of its own, started by the server before it
starts Ray (`python -I reaper.py SERVER_PID FILES_DIR`). The server then names the processes
Ray started (`track`); until it does, the watchdog follows every process the server starts.
The watchdog follows the named processes and all they start, looking twice a second, and a
tracked process stays tracked when its parent dies and it is re-parented (Ray's agents and
HAProxy outlive their parents that way). When the server closes the watchdog's stdin (a
clean stop; after a line "now", a stop at once), or exits however it exits (kill -9 too: the
pipe closes with it), the watchdog ends every tracked process still running (SIGTERM, then
SIGKILL after a grace; at once: SIGKILL), removes the server's files and exits.
"""
from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

POLL_S = 0.5
KILL_WAIT_S = 10.0
GRACE_S = 2.0  # from SIGTERM to SIGKILL at a clean stop
AT_ONCE = b"now"  # a line that makes the stop SIGKILL at once (a server stopping at once)
_PROC = Path("/proc")

Process = tuple[int, int]  # (pid, start time in clock ticks since boot): one process, even after pid reuse


def start_watchdog(files_dir: str | os.PathLike) -> subprocess.Popen:
    """A watchdog for processes this one will start (see the module's doc)."""
    # run as a script (-I: stdlib only), so that it watches at once instead of importing the package
    return subprocess.Popen([sys.executable, "-I", __file__, str(os.getpid()), str(files_dir)],
                            stdin=subprocess.PIPE, start_new_session=True)  # a signal to our group misses it


def track(watchdog: subprocess.Popen, processes: Iterable[Process]) -> None:
    """Have the watchdog follow `processes` and all they start."""
    watchdog.stdin.write(b"".join(b"%d %d\n" % p for p in processes))
    watchdog.stdin.flush()


def stop_watchdog(watchdog: subprocess.Popen, timeout_s: float = 30.0, at_once: bool = False) -> None:
    """Let the watchdog end what is left of the tracked processes, and wait until it has
    (at_once: SIGKILL with no grace; Ray's GCS and raylet can take their SIGTERM for 10 s and more)."""
    if watchdog.stdin:
        with contextlib.suppress(OSError):  # a watchdog already gone has nothing left to end
            if at_once:
                watchdog.stdin.write(AT_ONCE + b"\n")
            watchdog.stdin.close()
    watchdog.wait(timeout_s)


def watch(server_pid: int, files_dir: str) -> None:
    """The watchdog's work: track what stdin names (lines 'PID START') until it closes, then end it all."""
    tracked: set[Process] = set()
    pending, told, grace_s = b"", False, GRACE_S
    born = _start_ticks(os.getpid())
    while True:
        readable, _, _ = select.select([sys.stdin.fileno()], [], [], POLL_S)
        data = os.read(sys.stdin.fileno(), 1 << 16) if readable else None
        if data == b"":
            break
        *lines, pending = (pending + (data or b"")).split(b"\n")
        if AT_ONCE in lines:
            grace_s = 0.0
        named = {(int(pid), int(start)) for pid, start in (line.split() for line in lines
                                                          if line.strip() and line != AT_ONCE)}
        told |= bool(named)
        if not told:  # Ray is starting: whatever the server starts now is Ray's
            named = {p for p in descendants({server_pid}) if p[1] >= born and p[0] != os.getpid()}
        tracked |= running(tracked | named)
    ended = end(tracked, grace_s)
    if ended:
        print(f"adapterserve watchdog: ended {len(ended)} processes the server left running", file=sys.stderr)
    shutil.rmtree(files_dir, ignore_errors=True)


def end(tracked: Iterable[Process], grace_s: float = GRACE_S) -> set[Process]:
    """SIGTERM the tracked processes still running and their descendants, SIGKILL those left
    after `grace_s` (0: SIGKILL alone); returns them once they are gone."""
    tracked = set(tracked)
    ended = running(tracked)
    if grace_s > 0:
        _signal(ended, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while (left := running(tracked)) and time.monotonic() < deadline:
        time.sleep(0.05)
    deadline = time.monotonic() + KILL_WAIT_S
    while (left := running(tracked)) and time.monotonic() < deadline:
        _signal(left, signal.SIGKILL)
        ended |= left
        time.sleep(0.05)
    return ended


def running(tracked: set[Process]) -> set[Process]:
    """The tracked processes still running, and every live process below them."""
    alive_now = {p for p in tracked if alive(p)}
    return alive_now | descendants({pid for pid, _ in alive_now})


def descendants(roots: set[int]) -> set[Process]:
    """Every live process below `roots` (children, their children, ...)."""
    children: dict[int, list[Process]] = {}
    for proc in _PROC.iterdir():
        stat = _stat(proc.name)
        if stat and stat[0] not in "ZX":
            children.setdefault(int(stat[1]), []).append((int(proc.name), int(stat[19])))
    found: set[Process] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child[0])
    return found


def named(processes: Iterable[Process], names: Iterable[str]) -> set[Process]:
    """Those of `processes` whose command name (/proc/PID/stat's) is one of `names`."""
    wanted = set(names)
    return {p for p in processes if _command_name(p[0]) in wanted}


def _command_name(pid: int) -> str | None:
    try:
        return (_PROC / str(pid) / "stat").read_text().partition("(")[2].rpartition(")")[0]
    except OSError:
        return None


def alive(process: Process) -> bool:
    """Running, or exiting: a dead group leader (a zombie) whose other threads are still ending
    holds its files and sockets until the last one is gone."""
    stat = _stat(str(process[0]))
    if not stat or int(stat[19]) != process[1]:
        return False
    return stat[0] not in "ZX" or any(state not in "ZX" for state in _thread_states(process[0]))


def _thread_states(pid: int) -> list[str]:
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except OSError:
        return []
    states = []
    for task in tasks:
        try:
            states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
        except OSError:
            continue
    return states


def _start_ticks(pid: int) -> int:
    stat = _stat(str(pid))
    return int(stat[19]) if stat else 0


def _stat(pid: str) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    if not pid.isdigit():
        return None
    try:
        return (_PROC / pid / "stat").read_text().rpartition(")")[2].split()
    except OSError:  # gone meanwhile
        return None


def _signal(processes: Iterable[Process], sig: signal.Signals) -> None:
    for pid, _ in processes:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), sys.argv[2])
