"""A Ray started by this process for one server: ports and files of its own, and nothing of
it left running after it stops, or after this process dies (reaper.py's watchdog).

    local = LocalRay.start("127.0.0.1", {"--grpc-port": 50051, "--http-port": 8000})
    ...
    local.stop()  # Ray shut down, its leftovers ended, its ports and files given back
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ray

from adapterserve.server import ports, reaper
from adapterserve.server.serve_env import local_serve_env


# without them the cluster is gone. The dashboard agent (its command name, cut to 15 characters) ends at
# once on a signal to the whole process group, where the GCS and raylet outlast a drain's wait; its
# raylet treats the agent's end as fatal
CORE_PROCESSES = ("gcs_server", "raylet", "ray::DashboardA")


@dataclass
class LocalRay:
    files_dir: Path  # HAProxy's config, sockets and state
    block: ports.PortBlock | None  # Serve's and HAProxy's ports
    watchdog: subprocess.Popen
    env_keys: list[str] = field(default_factory=list)  # set in os.environ for this Ray
    core: set[reaper.Process] = field(default_factory=set)  # its GCS, raylet and dashboard agent

    @classmethod
    def start(cls, host: str, user_ports: Mapping[str, int]) -> LocalRay:
        """Check that `user_ports` ({flag: port}) are free (ports.PortInUse if not), then start Ray."""
        ports.check_free(host, user_ports)
        block = ports.claim_block()
        files_dir = Path(tempfile.mkdtemp(prefix="adapterserve-"))
        local = cls(files_dir, block, reaper.start_watchdog(files_dir))
        env = {k: v for k, v in local_serve_env(files_dir, block).items() if k not in os.environ}
        os.environ.update(env)  # read by the Serve actors this Ray starts; the user's own values win
        local.env_keys = list(env)
        before = reaper.descendants({os.getpid()})
        try:
            ray.init(include_dashboard=False, configure_logging=False)
        except BaseException:
            reaper.track(local.watchdog, reaper.descendants({os.getpid()}) - before)  # what it started halfway
            local.kill()
            raise
        started = reaper.descendants({os.getpid()}) - before
        reaper.track(local.watchdog, started)
        local.core = reaper.named(started, CORE_PROCESSES)
        return local

    def lost(self) -> bool:
        """Whether its GCS or raylet has exited (a signal to the whole process group, or a
        service manager stopping every process of the unit, reaches them too)."""
        return any(not reaper.alive(p) for p in self.core)

    def stop(self) -> None:
        """Shut Ray down; the watchdog ends whatever of it is still running."""
        try:
            ray.shutdown()
        finally:
            self.kill()

    def kill(self, at_once: bool = False) -> None:
        """End every process of this Ray without asking Ray (SIGTERM, SIGKILL after a grace, or
        at_once SIGKILL); give back its ports and files."""
        reaper.stop_watchdog(self.watchdog, at_once=at_once)
        for key in self.env_keys:
            os.environ.pop(key, None)
        if self.block:
            ports.release(self.block)
            self.block = None
