"""`adapterserve serve` as a user runs it: a subprocess (in a session of its own, so that every
process it starts can be found by its session id, independently of the server's own
bookkeeping), with its own Ray, free ports, the tiny model and no encoder."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapterserve.server.ports import BLOCKS_END, BLOCKS_START, bind_problem, free_port

READY_TIMEOUT_S = 300.0  # a Ray start and the model's warm-up on a loaded 2-core CI machine


@dataclass
class ServeProcess:
    popen: subprocess.Popen
    log: Path
    grpc_port: int
    http_port: int
    watchdog: tuple[int, int] | None = None  # (pid, start): the server's watchdog, found once ready
    seen: set[tuple[int, int]] = field(default_factory=set)  # every process of the server seen running

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @classmethod
    def start(cls, model: Path, root: Path, *flags: str) -> ServeProcess:
        """Start the server and wait until it serves (AssertionError with its log if it does not)."""
        root.mkdir(parents=True, exist_ok=True)
        log = root / "serve.log"
        grpc_port, http_port = free_port(), free_port()
        argv = [sys.executable, "-m", "adapterserve.clients.cli", "serve", "--model", str(model), "--no-encoder",
                "--store", str(root / "store"), "--grpc-port", str(grpc_port), "--http-port", str(http_port), *flags]
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        served = cls(popen, log, grpc_port, http_port)
        served.wait_for("adapterserve is serving", READY_TIMEOUT_S)
        served.watchdog = next((p for p in _processes() if p[0] in _children(popen.pid) and
                                b"adapterserve/server/reaper.py" in _cmdline(p[0])), None)
        served.seen = served.processes()
        return served

    def wait_for(self, text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output():
            assert self.popen.poll() is None, f"serve exited with {self.popen.returncode}:\n{self.output()[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s} s:\n{self.output()[-3000:]}"
            time.sleep(0.2)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self) -> set[tuple[int, int]]:
        """The server's processes running now: its session's, and its watchdog."""
        running = {p for p in _processes() if _session(p[0]) == self.popen.pid}
        return running | ({self.watchdog} if self.watchdog and _alive(self.watchdog) else set())

    def listening_ports(self) -> set[int]:
        """Ports its processes listen on that are the server's own: the user's and its block's."""
        import psutil

        found = set()
        for pid, _ in self.processes():
            try:
                found |= {c.laddr.port for c in psutil.Process(pid).net_connections("inet") if c.status == "LISTEN"}
            except psutil.Error:
                continue
        return {p for p in found if p in (self.grpc_port, self.http_port) or BLOCKS_START <= p < BLOCKS_END}

    def left_running(self, timeout_s: float) -> set[tuple[int, int]]:
        """What is still running of the server after up to `timeout_s` (empty once all is gone)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.processes() | {p for p in self.seen if _alive(p)}) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill_all(self) -> None:
        """Test cleanup: whatever of the server still runs, killed."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait()
        for pid, _ in self.left_running(30.0):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def still_listening(ports: set[int], timeout_s: float) -> set[int]:
    """Which of `ports` something on this host still listens on after up to `timeout_s` (the
    kernel closes a killed process's sockets once its last thread is gone)."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        listening = {c.laddr.port for c in psutil.net_connections("inet") if c.status == "LISTEN"} & ports
        if not listening or time.monotonic() > deadline:
            return listening
        time.sleep(0.2)


def unbindable(host: str, ports: set[int]) -> dict[int, str]:
    """{port: why} for each of `ports` a new server could not listen on at `host` now."""
    return {port: problem for port in ports if (problem := bind_problem(port, host))}


def _processes() -> set[tuple[int, int]]:
    """Every process running (or still ending) on this host."""
    found = set()
    for proc in Path("/proc").iterdir():
        stat = _stat(proc.name)
        if stat and _alive((int(proc.name), int(stat[19]))):
            found.add((int(proc.name), int(stat[19])))
    return found


def _alive(process: tuple[int, int]) -> bool:
    stat = _stat(str(process[0]))
    return bool(stat) and int(stat[19]) == process[1] and (stat[0] not in "ZX" or _threads_running(process[0]))


def _threads_running(pid: int) -> bool:
    """Whether a zombie group leader's other threads are still ending (holding its sockets)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return False
    return any((_stat_file(t / "stat") or ["Z"])[0] not in "ZX" for t in tasks)


def _children(pid: int) -> set[int]:
    return {p for p, _ in _processes() if (_stat(str(p)) or ["", ""])[1] == str(pid)}


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stat(pid: str) -> list[str] | None:
    return _stat_file(Path(f"/proc/{pid}/stat")) if pid.isdigit() else None


def _stat_file(path: Path) -> list[str] | None:
    try:
        return path.read_text().rpartition(")")[2].split()
    except OSError:
        return None
