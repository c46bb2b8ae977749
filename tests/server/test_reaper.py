"""The watchdog ends every process a server started: on a clean stop, when the server is
killed with SIGKILL, and when a process was orphaned (re-parented) before that."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adapterserve.server import reaper

def _tree(seconds: str) -> str:
    """A process tree like Ray's, of processes that ignore SIGTERM: three at once, one of which
    loses its parent 1.5 s later (as Ray's agents and HAProxy outlive theirs), and one started
    0.8 s later by a process already running."""
    return (f"trap '' TERM; sleep {seconds} & (sleep {seconds} & sleep 1.5) & (sleep 0.8; sleep {seconds} & wait) & "
            f"sleep {seconds}")


def _orphaned(seconds: str) -> bool:
    """Whether one of the `sleep SECONDS` processes has lost its parent (re-parented away from us)."""
    mine = {pid for pid, _ in reaper.descendants({os.getpid()})}
    return any(pid not in mine for pid in _pids_of(seconds))


def _seconds(tmp_path: Path) -> str:
    """A sleep duration no other test's processes use (it marks this test's sleeps)."""
    return f"600.{abs(hash(str(tmp_path))) % 10**9}"


def _pids_of(seconds: str) -> set[int]:
    """Live `sleep SECONDS` processes."""
    found = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "cmdline").read_bytes() == f"sleep\0{seconds}\0".encode():
                if (proc / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                    found.add(int(proc.name))
        except OSError:
            continue
    return found


def _wait_until(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_clean_stop_ends_the_tracked_tree_and_removes_the_files(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    watchdog = reaper.start_watchdog(files)
    before = reaper.descendants({os.getpid()})
    marker = _seconds(tmp_path)
    tree = subprocess.Popen(["bash", "-c", _tree(marker)])
    assert _wait_until(lambda: len(_pids_of(marker)) == 3)
    reaper.track(watchdog, reaper.descendants({os.getpid()}) - before)
    assert _wait_until(lambda: len(_pids_of(marker)) == 4 and _orphaned(marker))
    reaper.stop_watchdog(watchdog)
    assert watchdog.returncode == 0
    assert _pids_of(marker) == set()
    tree.wait(5)
    assert not files.exists()


def test_a_stop_at_once_sends_no_sigterm_first(tmp_path):
    """A server stopping at once (a second signal, Ray gone) has the watchdog SIGKILL what is left:
    no SIGTERM first, whose grace Ray's GCS and raylet would spend. A clean stop sends it first."""
    for at_once in (True, False):
        marker, got_term = _seconds(tmp_path / str(at_once)), tmp_path / f"term-{at_once}"
        files = tmp_path / f"files-{at_once}"  # the watchdog removes them as it ends
        files.mkdir()
        watchdog = reaper.start_watchdog(files)
        before = reaper.descendants({os.getpid()})
        tree = subprocess.Popen(["bash", "-c", f"trap 'touch {got_term}' TERM; sleep {marker} & wait; sleep {marker}"])
        assert _wait_until(lambda: len(_pids_of(marker)) == 1)
        reaper.track(watchdog, reaper.descendants({os.getpid()}) - before)
        time.sleep(2 * reaper.POLL_S)  # the watchdog has read the names
        reaper.stop_watchdog(watchdog, at_once=at_once)
        assert watchdog.returncode == 0 and _pids_of(marker) == set()
        tree.wait(5)
        assert got_term.exists() is not at_once


@pytest.mark.parametrize("told", [True, False], ids=["tracked", "killed-before-telling"])
def test_sigkill_of_the_server_ends_what_it_started(tmp_path, told):
    """A stand-in server: starts a watchdog, then a tree, tells the watchdog (or is killed
    before it could: Ray was still starting), and is killed -9."""
    marker = _seconds(tmp_path)
    script = f"""
import os, subprocess, sys, time
from adapterserve.server import reaper
watchdog = reaper.start_watchdog({str(tmp_path)!r})
before = reaper.descendants({{os.getpid()}})
subprocess.Popen(["bash", "-c", {_tree(marker)!r}])
time.sleep(0.3)
if {told}:
    reaper.track(watchdog, reaper.descendants({{os.getpid()}}) - before)
time.sleep(2.5)  # the late process has started and the orphan has lost its parent by now
print(watchdog.pid, flush=True)
time.sleep(600)
"""
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    watchdog_pid = int(server.stdout.readline())
    assert len(_pids_of(marker)) == 4 and _orphaned(marker)
    server.kill()
    server.wait()
    assert _wait_until(lambda: not _pids_of(marker)), f"left running: {_pids_of(marker)}"
    assert _wait_until(lambda: not Path(f"/proc/{watchdog_pid}/cmdline").exists() or
                       not Path(f"/proc/{watchdog_pid}/cmdline").read_bytes())
    assert not tmp_path.exists()


def test_a_recycled_pid_is_not_the_tracked_process():
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        (pid, start), = [p for p in reaper.descendants({os.getpid()}) if p[0] == sleeper.pid]
        assert reaper.running({(pid, start)}) == {(pid, start)}
        assert reaper.running({(pid, start + 1)}) == set()  # same pid, another process
    finally:
        sleeper.kill()
        sleeper.wait()
