"""Rank 0's ordered channel to the other tensor-parallel ranks.

Everything that changes a rank's device state goes through it, in the order rank 0
does it: each step's host inputs (``StepInputs``), slot fills and clears, KV block
copies, decode-graph setup and capture, shutdown. One pickled message per command,
sent to every worker over its own connection; workers run them in order, so their
collectives meet rank 0's. Adapters' tensors travel apart, on a second connection, when
an adapter is added (``share``): a slot fill then names the adapter by key. Each worker
receives only its part of an adapter (``cut``, an AdapterCutter set by the engine), all
workers at once, through shared memory where it runs on rank 0's host (adapter_post.py).

A worker that raises sends its error and exits; one that dies closes its connection.
Rank 0 looks for either before every command and while it waits for a step's
results, and raises EngineBroken naming the worker; it never waits longer than
COLLECTIVE_TIMEOUT_S for a step. The engine then refuses all later calls (the
replica's health check replaces it).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from multiprocessing.connection import Connection

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.engine.step_device import StepInputs
from adapterserve.engine.tp import adapter_post
from adapterserve.engine.tp.adapter_post import InFlight, Packed, PartRefused
from adapterserve.engine.tp.group import COLLECTIVE_TIMEOUT_S, LEAVE_WAIT_S, leave_in_background
from adapterserve.errors import EngineBroken
from adapterserve.layers.parallel import TensorParallel

log = logging.getLogger("adapterserve.engine")

_POLL_S = 20e-6  # between looks at a step's completion event while waiting for it
_CHECK_S = 1e-3  # between looks at the workers meanwhile
_CLOSE_WAIT_S = 10.0


@dataclasses.dataclass
class WorkerLink:
    """One worker: its rank, its command connection, and how to see it alive and stop it."""

    rank: int
    conn: Connection  # commands, in order
    adapters: Connection  # adapters' tensors, sent ahead of their placement
    describe: str  # e.g. "local process 1234", "Ray actor abc"
    exit_code: Callable[[], int | None]  # None while it runs (or when that cannot be known)
    stop: Callable[[float], None]  # wait up to the seconds given for it to end, then end it
    pid: int | None = None  # its process id, where it is a local process
    host: str | None = None  # its host, as it told (adapter_post.host_identity); None: unknown


class Lockstep:
    def __init__(self, tp: TensorParallel, workers: list[WorkerLink]) -> None:
        self.tp = tp
        self.workers = workers
        self.broken: str | None = None  # why the group broke; None while it works
        self.prefix_pages: Callable[[int], list[int]] = lambda slot: []  # slot -> its prefix's KV blocks (engine)
        self._lock = threading.Lock()  # the command connections' sends
        self._check_lock = threading.Lock()  # their receives (a worker's error or end)
        self._adapters_lock = threading.Lock()
        self._keys: dict[int, int] = {}  # id(adapter) -> the key workers know it by
        self._next_key = 0
        # what worker `rank` receives of an adapter: the engine sets its AdapterCutter (the
        # rank's part only); until then the whole adapter, which the worker's pools cut
        self.cut: Callable[[Adapter, int], Adapter] = lambda adapter, rank: dataclasses.replace(adapter, staged={})
        self.adapter_bytes: Counter[int] = Counter()  # rank -> bytes of adapters' messages sent to it
        self._bytes_lock = threading.Lock()
        # where adapters' parts go as files for workers on this host; None: over the connections
        self.shared_dir: str | None = adapter_post.default_shared_dir()
        self.parts_sent: Counter[tuple[int, str]] = Counter()  # (rank, "file" or "connection") -> parts
        self._host = adapter_post.host_identity()
        self._no_file: set[int] = set()  # ranks that could not read a file rank 0 wrote (another filesystem)
        self._leaving: threading.Thread | None = None  # this rank's leaving of the group, from the first close
        self._in_flight: dict[int, InFlight] = {}  # rank -> its part posted and not yet acknowledged
        self._senders = ThreadPoolExecutor(max_workers=max(1, len(workers)), thread_name_prefix="tp-share")
        for worker in workers:  # steps and parts leave at once (a message over 16 KiB is two writes)
            adapter_post.send_at_once(worker.conn)
            adapter_post.send_at_once(worker.adapters)

    # commands

    def step(self, inputs: StepInputs) -> None:
        self._send(("step", inputs))

    def share(self, adapter: Adapter) -> None:
        """Send each worker its part of an adapter now (when it is added, not in the step that
        places it), to all of them at once, on the adapter connections; its placements then
        name it by key. Returns once the parts are sent: each worker's reply is awaited before
        its next part and before a forget (``settle``); a placement waits in the worker's inbox.
        A part that cannot be cut raises (a ValueError naming why) before anything is sent."""
        with self._adapters_lock:
            key, self._next_key = self._next_key, self._next_key + 1
            packed = self._on_each_worker(lambda worker: adapter_post.pack(self.cut(adapter, worker.rank)))
            parts = {worker.rank: part for worker, part in zip(self.workers, packed)}
            self._on_each_worker(lambda worker: self._post(worker, key, parts[worker.rank]))
            self._keys[id(adapter)] = key

    def settle(self) -> None:
        """Wait until every worker holds the parts sent to it (their files then removed)."""
        if self._in_flight:
            with self._adapters_lock:
                self._on_each_worker(self._settle)

    def forget(self, adapter: Adapter) -> None:
        """Workers drop their copy of a shared adapter (its slot, if any, stays as placed)."""
        key = self._keys.pop(id(adapter), None)
        if key is not None and self.broken is None:
            self.settle()  # a part still on its way would arrive after its forget, and stay
            self._send(("forget", key))

    def place(self, slot: int, adapter: Adapter) -> None:
        """The adapter placed in `slot` on rank 0 (its prefix in the KV blocks rank 0 chose):
        by key when shared, else each worker's part with the command."""
        key = self._keys.get(id(adapter))
        pages = list(self.prefix_pages(slot))
        if key is not None:  # not settled here: the worker's inbox waits for the part, and a step
            self._send(("place", slot, key, pages))  # never waits for another adapter's share
            return
        with self._lock:
            self.check()
            for worker in self.workers:
                self._send_adapter(worker, worker.conn, lambda part: ("place", slot, part, pages), adapter)

    def clear(self, slot: int) -> None:
        self._send(("clear", slot))

    def copy_blocks(self, sources: list[int], copies: list[int]) -> None:
        self._send(("copy_blocks", sources, copies))

    def enable_cuda_graphs(self, max_batch: int, max_pages: int, mixed_tokens: int = 0, max_requests: int = 0
                           ) -> None:
        self._send(("enable_cuda_graphs", max_batch, max_pages, mixed_tokens, max_requests))

    def capture(self, bucket: int, families: tuple[bool, ...], signature: tuple, stacked_rows: int,
                mixed: bool = False) -> None:
        """mixed: a mixed-step graph of token bucket `bucket` (else a decode graph)."""
        self._send(("capture", bucket, families, signature, stacked_rows, mixed))

    # waiting and health

    def wait_ready(self, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        """Wait for every worker's "ready" (its shard loaded); EngineBroken if one fails or is late."""
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            while not worker.conn.poll(0.05):
                self._check_exited(worker)
                if time.monotonic() > deadline:
                    raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) did not load its "
                                      f"shard within {timeout_s:.0f} s")
            reply = self._receive(worker)
            if reply != ("ready",):
                raise self._break(f"tensor-parallel worker {worker.rank} sent {reply!r} instead of ready")

    def wait(self, event: torch.cuda.Event) -> None:
        """Wait for a step's completion event, watching the workers meanwhile."""
        now = time.monotonic()
        deadline, next_check = now + COLLECTIVE_TIMEOUT_S, now
        while not event.query():
            now = time.monotonic()
            if now >= next_check:
                self.check()
                next_check = now + _CHECK_S
            if now > deadline:
                raise self._break(f"a step did not finish within {COLLECTIVE_TIMEOUT_S:.0f} s (a rank is stuck)")
            time.sleep(_POLL_S)

    def check(self) -> None:
        """EngineBroken if the group broke or a worker failed, exited or closed its connection
        (from any thread: the step loop, health probes)."""
        with self._check_lock:
            if self.broken is not None:
                raise EngineBroken(f"the tensor-parallel group is broken: {self.broken}")
            for worker in self.workers:
                if worker.conn.poll():
                    raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) failed: "
                                      f"{self._receive(worker)}")
                self._check_exited(worker)

    def failed_worker(self, grace_s: float = 1.0) -> str | None:
        """After a step failed: why a worker is gone, if one is (waiting up to grace_s for it to
        show: a killed process is seen a moment after its peers' collectives fail); None if none is."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self.check()
            except EngineBroken as exc:
                return str(exc)
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)

    def close(self, wait_s: float = _CLOSE_WAIT_S, abort: bool = False) -> None:
        """Stop the workers (each given wait_s to finish its command, then killed) while this
        rank leaves the group beside them, as they do on "close" (a group's teardown may wait
        for its peers': leaving only after they had ended could wait for ever). A broken group,
        or any with ``abort``, is aborted instead. Every wait is bounded, so a close always returns."""
        with self._lock:
            for worker in self.workers:
                try:
                    worker.conn.send_bytes(pickle.dumps(("close",)))
                except OSError:
                    pass
            if self._leaving is None:  # a second close waits for the first one's leaving
                self._leaving = leave_in_background(abort=abort or self.broken is not None, tp=self.tp)
            leaving = self._leaving
            for worker in self.workers:
                worker.stop(wait_s)
                worker.conn.close()
                worker.adapters.close()
            self.workers = []
            self._senders.shutdown(wait=False, cancel_futures=True)
            self.broken = self.broken or "closed"
        with self._adapters_lock:  # a share under way fails now, its connections closed
            for flight in self._in_flight.values():
                if flight.path is not None:
                    adapter_post.remove_file(flight.path)
            self._in_flight.clear()
        leaving.join(LEAVE_WAIT_S)
        if leaving.is_alive():
            log.warning("rank 0 was still leaving its tensor-parallel group %.0f s after close; going on without "
                        "waiting (the leaving goes on on a daemon thread)", LEAVE_WAIT_S)

    # the channel

    def _send(self, message: tuple) -> None:
        with self._lock:
            self.check()
            self._send_all(message, lambda worker: worker.conn)

    def _send_all(self, message: object, connection: Callable[[WorkerLink], Connection]) -> None:
        """message, pickled once, to every worker on the connection chosen."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for worker in self.workers:
            self._send_bytes(worker, connection(worker), data)

    def _on_each_worker(self, work: Callable[[WorkerLink], object]) -> list:
        """work(worker) for every worker at once (a thread each); the results in worker order,
        or the first worker's error once all have ended."""
        futures = [self._senders.submit(work, worker) for worker in self.workers]
        errors = [future.exception() for future in futures]
        for error in errors:
            if error is not None:
                raise error
        return [future.result() for future in futures]

    def _post(self, worker: WorkerLink, key: int, part: Packed) -> None:
        """Send a worker its packed part (its last one settled first): as a file in shared_dir
        when it runs on this host (and could read the last one), else over its adapters connection."""
        self._settle(worker)
        on_host = self.shared_dir is not None and worker.host == self._host and worker.rank not in self._no_file
        with self._unreachable(worker):
            self._in_flight[worker.rank] = adapter_post.post(worker.adapters, key, part,
                                                             self.shared_dir if on_host else None)
        with self._bytes_lock:
            self.adapter_bytes[worker.rank] += part.nbytes

    def _settle(self, worker: WorkerLink) -> None:
        """Wait for the worker to take the part in flight to it, if any (its file then removed)."""
        flight = self._in_flight.pop(worker.rank, None)
        if flight is None:
            return
        with self._unreachable(worker):
            route = adapter_post.settle(worker.adapters, flight, lambda conn: self._reply(worker, conn))
        if route == adapter_post.UNREADABLE:
            self._no_file.add(worker.rank)
        with self._bytes_lock:
            self.parts_sent[worker.rank, "file" if route == adapter_post.FILE else "connection"] += 1

    @contextmanager
    def _unreachable(self, worker: WorkerLink) -> Iterator[None]:
        """EngineBroken for a worker whose adapters connection broke or that refused its part."""
        try:
            yield
        except (OSError, EOFError) as exc:
            self.check()  # the worker's own error, when it sent one
            raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) is unreachable: "
                              f"{type(exc).__name__}: {exc}") from exc
        except PartRefused as exc:
            raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) could not take its part of "
                              f"an adapter: {exc}") from exc

    def _reply(self, worker: WorkerLink, conn: Connection) -> tuple:
        """The worker's reply on its adapters connection; EngineBroken if it exits meanwhile."""
        return adapter_post.wait_reply_within(conn, COLLECTIVE_TIMEOUT_S, lambda: self._check_exited(worker))

    def _send_adapter(self, worker: WorkerLink, conn: Connection, message: Callable[[Adapter], object],
                      adapter: Adapter) -> None:
        """The message around the worker's part of `adapter`, pickled for it alone, counted in adapter_bytes."""
        data = pickle.dumps(message(self.cut(adapter, worker.rank)), protocol=pickle.HIGHEST_PROTOCOL)
        self._send_bytes(worker, conn, data)
        with self._bytes_lock:
            self.adapter_bytes[worker.rank] += len(data)

    def _send_bytes(self, worker: WorkerLink, conn: Connection, data: bytes) -> None:
        """An unreachable worker breaks the engine."""
        try:
            conn.send_bytes(data)
        except OSError as exc:
            raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) is unreachable: "
                              f"{type(exc).__name__}: {exc}") from exc

    def _receive(self, worker: WorkerLink) -> object:
        """A worker's next message: ("ready",), or its error's text, or why it has none."""
        try:
            message = pickle.loads(worker.conn.recv_bytes())
            return message[1] if message[0] == "error" else message
        except (EOFError, OSError):
            code = worker.exit_code()
            return f"it exited{f' with code {code}' if code is not None else ''} (its connection closed)"

    def _check_exited(self, worker: WorkerLink) -> None:
        code = worker.exit_code()
        if code is not None:
            raise self._break(f"tensor-parallel worker {worker.rank} ({worker.describe}) exited with code {code}")

    def _break(self, reason: str) -> EngineBroken:
        self.broken = reason
        return EngineBroken(f"the tensor-parallel group is broken: {reason}")
