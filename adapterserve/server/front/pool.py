"""The replica's front workers (setting `replica_grpc.workers`): N processes serving the
replica's own gRPC port together, each forwarding its calls over a link to the replica,
which runs them (bridge.py).

The port is the replica's alone, as with one listener: the pool holds a lock named after
it (a second adapterserve server on the port fails to start, naming it), and after its
workers bind it checks that no other process listens there (port_audit.py; a process that
binds later with port sharing is reported at each health check). A worker that exits is
replaced; its calls end UNAVAILABLE for their callers, every other call goes on.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import adapterserve
from adapterserve.server.front import port_audit
from adapterserve.server.front.bridge import FrontBridge, handlers
from adapterserve.server.front.frames import FrameLink, LinkClosed
from adapterserve.server.ports import PortInUse, claim_port
from adapterserve.server.replica_grpc import BIND_RETRY_S, address
from adapterserve.server.replica_grpc_settings import SETTING

READY_TIMEOUT_S = 120.0  # a worker's start (imports, bind) on a busy host
RESPAWN_DELAY_S = 1.0
STOP_SLACK_S = 5.0  # beyond the grace: a worker that has not exited by then is killed
logger = logging.getLogger("adapterserve.server")


@dataclass
class _Worker:
    index: int
    process: subprocess.Popen
    link: FrameLink
    bridge: FrontBridge
    watching: asyncio.Task | None = field(default=None)  # held here: the loop keeps only weak references


class FrontPool:
    def __init__(self, servicer, host: str, port: int, workers: int) -> None:
        self.host, self.port, self.size = host, port, workers
        self._handlers = handlers(servicer)
        self._workers: dict[int, _Worker] = {}
        self._lock_fd: int | None = None
        self._stopping = False
        self._reported: list[str] = []

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    async def start(self, wait_s: float = 0.0) -> None:
        """Lock the port (waiting up to `wait_s` while a predecessor holds it), start the workers,
        check that they alone listen there. PortInUse naming the setting if not."""
        deadline = time.monotonic() + wait_s
        await self._lock(deadline)
        try:
            await asyncio.gather(*(self._spawn(i) for i in range(self.size)))
            await self._audit(deadline)
        except BaseException:
            await self.stop(0.0)
            raise

    async def _audit(self, deadline: float) -> None:
        """PortInUse if another process listens on the port, once the predecessor's workers (which
        leave when their replica goes) have had until `deadline` to leave."""
        while port_audit.supported() and (taken := port_audit.foreign(self.host, self.port, self.pids)):
            if time.monotonic() >= deadline:
                raise PortInUse(f"{SETTING}.port {self.port} on {self.host} is shared with another process that "
                                f"listens there with port sharing ({', '.join(taken)}): stop it or pick a free port")
            await asyncio.sleep(BIND_RETRY_S)

    def check(self) -> None:
        """Log (once per change) any other process that has come to share the port."""
        if self._stopping or not port_audit.supported():
            return
        taken = port_audit.foreign(self.host, self.port, self.pids)
        if taken and taken != self._reported:
            logger.error("%s.port %s: another process listens there with port sharing (%s) and takes a share "
                         "of the connections; stop it", SETTING, self.port, ", ".join(taken))
        self._reported = taken

    async def stop(self, grace_s: float) -> None:
        """Workers stop taking calls, finish theirs within `grace_s`, exit (killed after the slack)."""
        self._stopping = True
        workers = list(self._workers.values())
        for worker in workers:
            worker.link.send(("stop", grace_s))
        deadline = time.monotonic() + grace_s + STOP_SLACK_S
        await asyncio.gather(*(_ended(w.process, deadline) for w in workers))
        for worker in workers:
            worker.link.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    async def _lock(self, deadline: float) -> None:
        while (fd := claim_port(self.port)) is None:
            if time.monotonic() >= deadline:
                raise PortInUse(f"{SETTING}.port {self.port} on {self.host} cannot be bound (another adapterserve "
                                "server serves there): pick a free port")
            await asyncio.sleep(BIND_RETRY_S)
        self._lock_fd = fd

    async def _spawn(self, index: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "adapterserve.server.front.worker", "--fd", str(theirs.fileno()),
                 "--address", address(self.host, self.port)],
                pass_fds=[theirs.fileno()], env=_worker_env(), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        link = await FrameLink.over(ours)
        worker = _Worker(index, process, link, FrontBridge(self._handlers, link))
        try:
            started = await asyncio.wait_for(self._started(worker), READY_TIMEOUT_S)
        except (LinkClosed, asyncio.TimeoutError):
            process.kill()
            raise RuntimeError(f"front worker {index} did not start (exit code {process.poll()}); see the "
                               "replica's log") from None
        if started[0] == "failed":
            await asyncio.to_thread(process.wait)
            raise PortInUse(f"{SETTING}.port {self.port}: {started[1]}")
        if self._stopping:  # a replacement that came up while the pool stopped
            process.kill()
            link.close()
            return
        worker.watching = asyncio.get_running_loop().create_task(self._watch(worker))
        self._workers[index] = worker

    @staticmethod
    async def _started(worker: _Worker) -> tuple:
        """The worker's ("ready", pid) or ("failed", why); calls it forwarded before, to its bridge."""
        while True:
            frames = await worker.link.receive()
            said = [f for f in frames if f[0] in ("ready", "failed")]
            worker.bridge.on_batch([f for f in frames if f[0] not in ("ready", "failed")])
            if said:
                return said[0]

    async def _watch(self, worker: _Worker) -> None:
        await worker.link.pump(worker.bridge.on_batch)
        worker.bridge.lost()
        if self._stopping:
            return
        code = await asyncio.to_thread(worker.process.wait)
        logger.warning("front worker %d (pid %d) exited with code %s; its calls ended; starting another",
                       worker.index, worker.process.pid, code)
        self._workers.pop(worker.index, None)
        while not self._stopping:
            await asyncio.sleep(RESPAWN_DELAY_S)
            try:
                await self._spawn(worker.index)
                return
            except Exception:
                logger.exception("front worker %d could not be started again; retrying", worker.index)


async def _ended(process: subprocess.Popen, deadline: float) -> None:
    try:
        await asyncio.to_thread(process.wait, max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        process.kill()
        await asyncio.to_thread(process.wait)


def _worker_env() -> dict[str, str]:
    """This environment, with adapterserve importable wherever the replica runs it from."""
    root = str(Path(adapterserve.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
