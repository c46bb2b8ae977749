"""Where a server's processes spend their CPU while a benchmark runs (`server_overhead.py --profile`).

    with ProcessProfile(server_pid, out_dir) as profile:   # py-spy records each Python process
        ...                                                 # the phase to look at
    profile.report(requests)                                # per process: CPU, threads, top functions

Every Python process under the server's (its Ray's Serve controller and replicas, the engine
process of each replica) is sampled by `py-spy record` without pausing it (--nonblocking),
counting only threads that hold the GIL (--gil), thread by thread (--threads): the Python
work, and native code that runs holding the GIL (uvloop, grpc's Cython: own time of
Thread.run); native work without the GIL (torch's kernels, grpc's core threads) shows in
the process's CPU seconds only. Those come from the kernel (user + system, all threads)
for every process under the server's, HAProxy and Ray's own included, so the table shows
which process is busy and what Python it runs. The raw stacks (py-spy's folded format)
stay in `out_dir` for a closer look.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

MIN_SHARE = 0.02  # processes below this share of one core over the phase are left out of the report


def py_spy_binary() -> str:
    """The py-spy executable: beside this Python, in its scripts folder, under a sys.path entry
    (pip install --target DIR puts it in DIR/bin), else on PATH."""
    places = [Path(sys.executable).parent, Path(sysconfig.get_path("scripts")),
              *(Path(entry) / "bin" for entry in sys.path if entry)]
    for place in places:
        if (place / "py-spy").is_file():
            return str(place / "py-spy")
    found = shutil.which("py-spy")
    if found is None:
        raise RuntimeError("--profile needs py-spy (pip install py-spy): not found beside this Python, under "
                           "sys.path's bin folders or on PATH")
    return found


def server_processes(root_pid: int) -> dict[int, tuple[str, bool]]:
    """pid -> (label, whether it runs Python) of every process under `root_pid` (itself
    included): Ray workers by their title (ray::...), an engine process as `<its replica> /
    engine`, other Python processes by module, the rest by name."""
    root = psutil.Process(root_pid)
    found: dict[int, tuple[str, bool]] = {}
    for proc in [root, *root.children(recursive=True)]:
        try:
            found[proc.pid] = _label(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _label(proc: psutil.Process) -> tuple[str, bool]:
    cmd = proc.cmdline()
    if cmd and cmd[0].startswith("ray::"):
        return " ".join(cmd).strip()[:60], True
    if not cmd or "python" not in Path(cmd[0]).name:
        return proc.name(), False
    if "spawn_main" in " ".join(cmd):
        return f"{_label(proc.parent())[0]} / engine", True
    module = cmd[cmd.index("-m") + 1] if "-m" in cmd else Path(cmd[1]).name if len(cmd) > 1 else cmd[0]
    return f"python {module}"[:60], True


@dataclass
class _Recording:
    label: str
    proc: psutil.Process
    spy: subprocess.Popen | None  # None: not Python (CPU seconds only)
    raw: Path
    cpu_start: float
    cpu_s: float = 0.0
    own: Counter = field(default_factory=Counter)
    threads: Counter = field(default_factory=Counter)
    samples: int = 0


class ProcessProfile:
    """py-spy on every Python process under `root_pid` for the length of a `with` block."""

    def __init__(self, root_pid: int, out_dir: Path, rate: int = 200, top: int = 12) -> None:
        self.root_pid, self.out_dir, self.rate, self.top = root_pid, Path(out_dir), rate, top
        self.recordings: list[_Recording] = []
        self.wall_s = 0.0

    def __enter__(self) -> ProcessProfile:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        spy = py_spy_binary()
        for pid, (label, python) in server_processes(self.root_pid).items():
            raw = self.out_dir / f"{pid}.txt"
            command = [spy, "record", "--pid", str(pid), "--format", "raw", "--nolineno", "--nonblocking", "--gil",
                       "--threads", "--rate", str(self.rate), "--output", str(raw)]
            proc = psutil.Process(pid)
            with open(raw.with_suffix(".log"), "wb") as log:  # py-spy's own messages (why it recorded nothing)
                recorder = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) if python else None
            self.recordings.append(_Recording(label, proc, recorder, raw, _cpu_s(proc)))
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._start
        for rec in self.recordings:
            rec.cpu_s = max(0.0, _cpu_s(rec.proc) - rec.cpu_start)  # 0: it ended meanwhile
            if rec.spy is not None:
                rec.spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        for rec in self.recordings:
            if rec.spy is not None:
                try:
                    rec.spy.wait(30)
                except subprocess.TimeoutExpired:
                    rec.spy.kill()
                rec.own, rec.threads, rec.samples = _own_samples(rec.raw)

    def report(self, requests: int) -> None:
        """Per busy process: its CPU over the phase (and per request of the `requests` the server
        ran in it), then its top functions by own samples holding the GIL."""
        busy = sorted((r for r in self.recordings if r.cpu_s >= MIN_SHARE * self.wall_s), key=lambda r: -r.cpu_s)
        total = sum(r.cpu_s for r in self.recordings)
        print(f"CPU over {self.wall_s:.1f} s of the profiled phase ({requests} requests through this server): "
              f"{total:.2f} CPU-s in the server's processes, {total / requests * 1e3:.2f} ms per request")
        print(f"per process: CPU ms per request (user + system, all threads); py-spy at {self.rate} Hz, samples "
              f"of threads holding the GIL: their share by thread, top functions by own samples (own time of "
              f"Thread.run: native code under it, such as uvloop's loop and grpc's Cython); raw stacks in "
              f"{self.out_dir}")
        for rec in busy:
            self._print_process(rec, requests)

    def _print_process(self, rec: _Recording, requests: int) -> None:
        held = f", {rec.samples / self.rate:.2f} s holding the GIL" if rec.spy is not None else ""
        print(f"\n{rec.label} (pid {rec.proc.pid}): {rec.cpu_s / requests * 1e3:.2f} CPU ms per request "
              f"({rec.cpu_s / self.wall_s:.0%} of a core){held}")
        if not rec.samples:
            said = rec.raw.with_suffix(".log").read_text(errors="replace").splitlines()
            errors = [line for line in said if "rror" in line]
            if errors:
                print(f"py-spy failed: {errors[-1]}")
            return
        print("threads: " + ", ".join(f"{name} {count / rec.samples:.0%}" for name, count in rec.threads.most_common(4)))
        print("| own % | function (file) |")
        print("|---|---|")
        for function, count in rec.own.most_common(self.top):
            print(f"| {count / rec.samples:.1%} | {function} |")


def _cpu_s(proc: psutil.Process) -> float:
    try:
        times = proc.cpu_times()
        return times.user + times.system
    except psutil.NoSuchProcess:
        return 0.0


def _own_samples(raw: Path) -> tuple[Counter, Counter, int]:
    """Samples per leaf function (own time), per thread, and in all, from py-spy's folded stacks
    ("thread (tid): name;frame;...;leaf count" a line)."""
    own: Counter = Counter()
    threads: Counter = Counter()
    if not raw.exists():
        return own, threads, 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        threads[thread.partition(": ")[2] or thread] += int(count)
        own[_short(frames[-1] if frames else thread)] += int(count)
    return own, threads, sum(own.values())


def _short(frame: str) -> str:
    """`function (path)` with the path cut to its package part."""
    function, _, where = frame.partition(" (")
    where = where.rstrip(")")
    for marker in ("site-packages/", "adapterserve/", "lib/python3"):
        if marker in where:
            where = where.split(marker, 1)[1]
            break
    return f"{function} ({os.path.basename(where) if where.startswith('/') else where})"
