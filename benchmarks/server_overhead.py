"""What the server path adds: the same streamed requests through Ray Serve + gRPC
and through the in-process engine, on one machine, interleaved group by group.

    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --device cuda
    PYTHONPATH=. python benchmarks/server_overhead.py --smoke          # CPU, tiny model
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --no-inproc --relay-chunk-ms 0.2  # pacing
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --trace   # per-hop medians (server_hops.py)
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --direct on   # one path only (default: both)
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --direct on --no-inproc --profile /tmp/prof
                                                   # py-spy: each server process's CPU, top functions
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --direct on --no-inproc \
        --via haproxy replica-port own             # the same server through each of its gRPC doors
    PYTHONPATH=. python benchmarks/server_overhead.py --model 1b --direct on --no-inproc --via own \
        --front-workers 0 4 --connections 16       # the own port served by the replica, then by 4 workers

Each server is `adapterserve serve` in a process (and a Ray) of its own. It runs its engine
in a child process of the replica (`engine_process: true`, rows "server ..."), and, unless
--no-inproc, a second server runs it inside the replica's process as before the split
(rows "server-inproc ..."). --direct picks the servers' path (setting `direct`,
server/direct_settings.py): "off", two tiers (HAProxy -> Ingress replica -> Serve handle ->
EngineReplica); "on", one hop (the Ingress replica runs the engine); "auto", as the server
decides; "both" (the default), a server of each. On a CPU the in-process engine runs one
thread, as the replica's engine does (its Ray actor has one CPU).

--via picks where the client calls each server: "haproxy" (its gRPC port, the default), "replica-port"
(Serve's own port of the Ingress replica, where HAProxy forwards; pinned for the benchmark through
Serve's direct-ingress port range) or "own" (the replica's own listener, setting `replica_grpc`,
direct mode only). Several: one server answers on each, and each is a path of its own.

--client-processes K sends the servers' streams from K processes of their own (a group's
streams dealt out among them, all starting at one instant), as K users would, so the
benchmark process's own gRPC work is not counted as the server's.

--front-workers runs a server per value of `replica_grpc.workers` (0: the replica's loop serves its
own port; N: N front worker processes share it, server/front/); --connections opens that many
client connections per path and sends a group's streams over them in turn (the kernel spreads
connections, not calls, over front workers: one connection reaches one worker).

Every path is up at once (the in-process engine beside the servers); each group of prompts
goes through each path in turn, the order rotating, so drift of clocks and caches falls on
all alike. Reports medians of time to first token, whole-request latency and the gap
between streamed chunks, for one request at a time (latency) and for a concurrent batch,
and medians of the per-prompt differences: what each server adds to the first token, to
the whole request (with a 90% bootstrap interval that resamples whole groups: at 16 streams
64 requests are only four groups, so use several hundred), and to each later streamed token,
and direct minus two-tier. Before those,
the engine steps per group at each concurrency, in this process's engine and in each server's
(from its /metrics): a server whose group takes more steps than the engine here received the
group's requests spread over several steps, not at once.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, AsyncExitStack, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from adapterserve.server.serve_env import free_port
from benchmarks.client_processes import ClientProcesses, timed


def _checkpoint(model: str, device: str) -> Path:
    if model == "tiny":
        from adapterserve.models.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama")
    from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint

    shape = SHAPES[model]
    return write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()), device)


@dataclass
class Timed:
    """One streamed request: seconds from its start to the first chunk and to the last, the
    gaps between chunks, and the tokens received (a chunk may carry several)."""

    first: float
    total: float
    gaps: list[float]
    tokens: int


async def _timed(stream) -> Timed:
    return Timed(*await timed(stream, time.perf_counter()))


async def _group(open_stream, prompts: list[list[int]]) -> list[Timed]:
    return list(await asyncio.gather(*[_timed(open_stream(p)) for p in prompts]))


async def _interleaved(groups: dict[str, Callable], prompts: list[list[int]], concurrency: int,
                       measuring: AbstractContextManager | None = None) -> dict[str, list[Timed]]:
    """Each group of `concurrency` prompts through every path (the in-process engine, each
    server; `groups`: label -> an async function of a group's prompts to their timings), the
    order rotating group by group, so drift (clocks, caches) falls on all alike. `measuring`
    is entered after the warm-up, for the measured groups."""
    for run_group in groups.values():  # warm-up
        await run_group(prompts[:concurrency])
    results: dict[str, list[Timed]] = {label: [] for label in groups}
    labels = list(groups)
    with measuring or nullcontext():
        for n, i in enumerate(range(0, len(prompts), concurrency)):
            group = prompts[i : i + concurrency]
            for label in labels[n % len(labels):] + labels[: n % len(labels)]:
                results[label] += await groups[label](group)
    return results


def _summary(results: list[Timed]) -> dict[str, float]:
    gaps = [g for r in results for g in r.gaps]
    return {"ttft": statistics.median(r.first for r in results) * 1e3,
            "total": statistics.median(r.total for r in results) * 1e3,
            "gap": statistics.median(gaps) * 1e3 if gaps else float("nan")}


def _added(local: list[Timed], served: list[Timed]) -> dict[str, float]:
    """Medians over the same prompts of server minus engine: first token, whole request, and
    each later token ((whole - first) / (tokens - 1): what the server adds per streamed token)."""
    pairs = list(zip(local, served))

    def per_token(l: Timed, s: Timed) -> float:
        tokens = min(l.tokens, s.tokens)
        return ((s.total - s.first) - (l.total - l.first)) / max(tokens - 1, 1)

    return {"ttft": statistics.median(s.first - l.first for l, s in pairs) * 1e3,
            "total": statistics.median(s.total - l.total for l, s in pairs) * 1e3,
            "token": statistics.median(per_token(l, s) for l, s in pairs) * 1e3}


def median_interval(differences: list[float], group: int, resamples: int = 2000,
                    seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of the median of per-prompt differences, resampling whole
    groups of `group` consecutive prompts (a group's requests ran together, so their
    differences move together)."""
    groups = [differences[i:i + group] for i in range(0, len(differences), group)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(x for g in rng.choices(groups, k=len(groups)) for x in g)
                     for _ in range(resamples))
    return medians[int(0.05 * resamples)], medians[int(0.95 * resamples) - 1]


def _interval_said(local: list[Timed], served: list[Timed], group: int) -> str:
    low, high = median_interval([(mine.total - engine.total) * 1e3 for engine, mine in zip(local, served)], group)
    return f"(90% interval over groups {low:.2f} to {high:.2f})"


DIRECT = {"auto": ("auto",), "on": (True,), "off": (False,), "both": (False, True)}  # --direct: server paths
PATH_NAMES = {"auto": "", True: " direct", False: " two-tier"}
ENGINE = "engine"  # the in-process engine's label


def _measure(path: Path, engine_cfg: dict, prompts, max_tokens: int, batches: list[int],
             servers: dict[str, dict], vias: tuple[str, ...] = ("haproxy",),
             profile_dir: Path | None = None, connections: int = 1,
             client_processes: int = 0) -> dict[int, dict[str, list[Timed]]]:
    """Per concurrency: path label -> its results of the same prompts, through the in-process
    engine and each of `servers` (label -> config overrides), all up at once, interleaved.
    `vias`: where the client calls each server (several: a path each, "<label> via <via>").
    `profile_dir`: py-spy records every server's processes during the highest concurrency's
    measured groups (server_profile.py) and prints where their CPU went. `client_processes`: the
    servers' streams come from that many processes of their own (client_processes.py), not this one."""
    from adapterserve import Engine, SamplingParams
    from adapterserve.clients.client import AsyncClient

    with ExitStack() as running:
        served = {label: running.enter_context(_serving({"model": str(path), "engine": engine_cfg,
                                                         "encoder": False, **overrides}, vias))
                  for label, overrides in servers.items()}
        remote = running.enter_context(ClientProcesses(client_processes)) if client_processes else None
        engine = Engine.from_pretrained(path, **engine_cfg)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def run(concurrency: int) -> dict[str, list[Timed]]:
            async with AsyncExitStack() as clients:
                groups = {ENGINE: partial(_group, lambda p: engine.stream(p, params))}
                for label, server in served.items():
                    for via, address in server.addresses.items():
                        if remote is not None:
                            groups[_via_label(label, via, vias)] = partial(_remote_group, remote, address, max_tokens)
                            continue
                        opened = [await clients.enter_async_context(AsyncClient(address, timeout=600))
                                  for _ in range(connections)]  # each its own connection
                        groups[_via_label(label, via, vias)] = partial(_group, _in_turn(
                            [partial(c.stream, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                             for c in opened]))
                return await _interleaved(groups, prompts, concurrency, measuring(concurrency))

        def measuring(concurrency: int) -> AbstractContextManager:
            groups = -(-len(prompts) // concurrency)
            counted = _steps_counted(engine, served, groups * len(vias), groups, concurrency)
            if profile_dir is None or concurrency != max(batches):
                return counted
            return _both(counted, _profiled({label: server.pid for label, server in served.items()}, profile_dir,
                                            len(prompts)))

        try:
            return {c: asyncio.run(run(c)) for c in batches}
        finally:
            engine = None  # its GPU memory goes before the servers stop
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


async def _remote_group(remote: ClientProcesses, address: str, max_tokens: int, prompts: list[list[int]]
                        ) -> list[Timed]:
    return [Timed(*timing) for timing in await remote.group(address, prompts, max_tokens)]


def _in_turn(openers: list[Callable]) -> Callable:
    """A stream opener that uses `openers` (one per client connection) in turn."""
    turn = itertools.count()
    return lambda prompt: openers[next(turn) % len(openers)](prompt)


STEPS_METRIC = "adapterserve_engine_step_seconds_count"  # engine steps that ran a batch (engine/stats.py)
METRICS_SETTLE_S = 2.5  # replicas push their counts every push_interval_s (1 s): read past the next push


def _server_steps(server: Served) -> float:
    """The server's engine steps so far, from its /metrics."""
    with urllib.request.urlopen(f"http://{server.http}/metrics", timeout=30) as reply:
        lines = reply.read().decode().splitlines()
    ours = (STEPS_METRIC + "{", STEPS_METRIC + " ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(ours))


@contextmanager
def _steps_counted(engine, served: dict[str, Served], server_groups: int, engine_groups: int,
                   concurrency: int) -> Iterator[None]:
    """Engine steps per group of `concurrency` requests over the block, in this process's engine and
    in each server's (a server's engine runs its groups of every --via): how many steps a group's
    requests took to pass through, arriving together (here) or as the server hands them over."""
    def counts() -> dict[str, float]:
        time.sleep(METRICS_SETTLE_S)
        return {ENGINE: engine.stats.snapshot().step_seconds.count,
                **{label: _server_steps(server) for label, server in served.items()}}

    before = counts()
    yield
    after = counts()
    per_group = {label: (after[label] - before[label]) / (engine_groups if label == ENGINE else server_groups)
                 for label in after}
    print(f"engine steps per group of {concurrency}: " + ", ".join(f"{label} {n:.2f}"
                                                                  for label, n in per_group.items()))


@contextmanager
def _both(first: AbstractContextManager, second: AbstractContextManager) -> Iterator[None]:
    with first, second:
        yield


def _via_label(label: str, via: str, vias: tuple[str, ...]) -> str:
    return label if vias == ("haproxy",) else f"{label} via {via}"


@contextmanager
def _profiled(server_pids: dict[str, int], out_dir: Path, requests: int) -> Iterator[None]:
    """py-spy over each server's processes for the block (which sends `requests` through each);
    then each server's table."""
    from benchmarks.server_profile import ProcessProfile

    with ExitStack() as profiles:
        running = {label: profiles.enter_context(ProcessProfile(pid, out_dir / label.replace(" ", "_")))
                   for label, pid in server_pids.items()}
        yield
    for label, profile in running.items():
        print(f"\n## {label}: where the server's processes spent their CPU")
        profile.report(requests)


@dataclass
class Served:
    addresses: dict[str, str]  # gRPC host:port by --via
    pid: int  # the `adapterserve serve` process (its Ray and replicas run under it)
    http: str  # its HTTP host:port (GET /metrics)


VIAS = ("haproxy", "replica-port", "own")


@dataclass
class Doors:
    """The ports a server answers gRPC on, by --via, and what the server needs to open them."""

    ports: dict[str, int]

    @classmethod
    def pick(cls, vias: tuple[str, ...]) -> Doors:
        return cls({via: free_port() for via in vias})

    def config(self, workers: int = 0) -> dict:
        """Overrides: the replica's own listener (served by `workers` front workers)."""
        return {"replica_grpc": {"port": self.ports["own"], "workers": workers}} if "own" in self.ports else {}

    def env(self) -> dict[str, str]:
        """Serve's direct-ingress gRPC port range narrowed to one port: the Ingress replica's."""
        port = self.ports.get("replica-port")
        if port is None:
            return {}
        return {"RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(port), "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT":
                str(port + 1)}

    def addresses(self) -> dict[str, str]:
        return {via: f"127.0.0.1:{port}" for via, port in self.ports.items()}


@contextmanager
def _serving(config: dict, vias: tuple[str, ...]) -> Iterator[Served]:
    """`adapterserve serve` with `config` in a process (and Ray) of its own, answering on `vias`;
    config's "front_workers": replica_grpc.workers."""
    root = Path(tempfile.mkdtemp())
    doors = Doors.pick(vias)
    config = dict(config)
    settings = doors.config(config.pop("front_workers", 0))
    (root / "config.json").write_text(json.dumps({"store": str(root / "store"), **config, **settings}))
    grpc_port, http_port = doors.ports.get("haproxy", free_port()), free_port()
    log = root / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "adapterserve.clients.cli", "serve", "--config",
                                   str(root / "config.json"), "--grpc-port", str(grpc_port), "--http-port",
                                   str(http_port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  env={**os.environ, **doors.env()})
    try:
        deadline = time.monotonic() + 900
        while b"adapterserve is serving" not in log.read_bytes():
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
        yield Served(doors.addresses(), server.pid, f"127.0.0.1:{http_port}")
    finally:
        server.send_signal(signal.SIGTERM)  # drains, stops Ray
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def _lora(model: str, path: Path, device: str) -> Path:
    """A random LoRA (rank 8, every linear) for the benchmark's backbone, as PEFT writes it."""
    out = Path(tempfile.mkdtemp()) / "lora"
    if model == "tiny":
        from tests.helpers.lora import make_peft_lora

        return make_peft_lora(path, out, r=8, lora_alpha=16, target_modules="all-linear")
    from benchmarks.checkpoints import SHAPES
    from benchmarks.random_adapters import write_peft_lora

    return write_peft_lora(SHAPES[model], out, device, rank=8)


def _trace(path: Path, engine_cfg: dict, prompts, max_tokens: int, batches: list[int], relay_chunk_ms: float,
           adapter: Path | None, by_version: bool, direct: bool | str, vias: tuple[str, ...] = ("haproxy",),
           workers: int = 0, client_processes: int = 0) -> dict[str, dict[int, dict[str, list[float]]]]:
    """Per via, per concurrency: each hop's times (ms) of every call, from the server's spans
    (server_hops.py); with `adapter`, every call names it (uploaded as "bench"; `by_version`:
    named `bench@N`). One server answers on every via; they take turns, concurrency by concurrency.
    `workers`: replica_grpc.workers (--via own); `client_processes`: the calls come from that many
    processes of their own."""
    from adapterserve.clients.client import Client
    from adapterserve.server import launch
    from benchmarks.server_hops import collect_hops, traced_calls
    from tests.helpers.otlp_collector import collecting

    with collecting("grpc") as collector:
        doors = Doors.pick(vias)
        config = {"model": str(path), "engine": engine_cfg, "encoder": False, "store": tempfile.mkdtemp(),
                  "engine_process": True, "relay_chunk_ms": relay_chunk_ms, "direct": direct,
                  "tracing": {"otlp_endpoint": collector.endpoint}, **doors.config(workers)}
        os.environ.update(doors.env())  # read by the Ray launch.start starts here
        endpoints = launch.start(config, grpc_port=doors.ports.get("haproxy", free_port()), http_port=free_port())
        try:
            ref = None
            if adapter is not None:
                with Client(endpoints.grpc, timeout=600) as client:
                    ref = client.upload(adapter, "bench").ref if by_version else "bench"
            addresses = doors.addresses()
            with ClientProcesses(client_processes) if client_processes else nullcontext() as clients:
                sent = {c: {via: asyncio.run(traced_calls(addresses[via], prompts, max_tokens, c, ref, clients))
                            for via in vias} for c in batches}
            return {via: {c: collect_hops(collector, by_via[via], c) for c, by_via in sent.items()} for via in vias}
        finally:
            launch.shutdown()
            for key in doors.env():
                os.environ.pop(key, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--no-inproc", action="store_true", help="skip the server with the engine in the replica")
    parser.add_argument("--relay-chunk-ms", type=float, default=0.5, help="the server's chunk pacing (relay.py)")
    parser.add_argument("--trace", action="store_true",
                        help="per-hop medians from the server's spans instead of the paired run")
    parser.add_argument("--concurrency", type=int, nargs="+", help="concurrency levels (default 1 and 16)")
    parser.add_argument("--adapter", choices=("none", "name", "version"), default="none",
                        help="--trace: calls name a LoRA by bare name (resolved through the TTL cache) "
                             "or as name@N, or none")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="py-spy (pip install py-spy) records every server's processes during the highest "
                             "concurrency's measured groups; prints each busy process's CPU and top functions by "
                             "own time; raw stacks under DIR")
    parser.add_argument("--via", choices=VIAS, nargs="+", default=["haproxy"],
                        help="where the client calls the server: HAProxy's gRPC port, Serve's port of the Ingress "
                             "replica, or the replica's own listener (replica_grpc; --direct on); several: one server "
                             "answers on each, a path each")
    parser.add_argument("--direct", choices=tuple(DIRECT), default="both",
                        help="the server's path: two tiers (off), the engine in the ingress replica (on), the "
                             "server's choice (auto), or off then on (both)")
    parser.add_argument("--front-workers", type=int, nargs="+", default=[0],
                        help="replica_grpc.workers of the servers (--via own): a server per value")
    parser.add_argument("--connections", type=int, default=1, help="client connections per path")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="send the servers' streams from this many processes of their own (a connection "
                             "each per path, one agreed start per group) instead of from this one")
    args = parser.parse_args()
    vias = tuple(dict.fromkeys(args.via))
    if "own" in vias and args.direct != "on":
        parser.error("--via own needs --direct on (the replica's own listener is a direct replica's)")
    if args.smoke:
        args.model, args.device, args.requests, args.max_tokens = "tiny", "cpu", 8, 8
    if args.device == "cpu":
        torch.set_num_threads(1)  # the replica's engine gets one thread (its actor has one CPU): the same here
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine_cfg = {"device": args.device, "dtype": dtype, "max_num_seqs": 64, "num_kv_blocks": 2048,
                  "max_model_len": 1024}
    path = _checkpoint(args.model, args.device)
    vocab = 500 if args.model == "tiny" else 32000
    prompts = [torch.randint(3, vocab, (256 if args.model != "tiny" else 16,)).tolist() for _ in range(args.requests)]
    batches = args.concurrency or [1, min(16, args.requests)]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    if args.trace:
        lora = None if args.adapter == "none" else _lora(args.model, path, args.device)
        from benchmarks.server_hops import report_hops

        traced = {mode: _trace(path, engine_cfg, prompts, args.max_tokens, batches, args.relay_chunk_ms, lora,
                               args.adapter == "version", mode, vias, args.front_workers[0], args.client_processes)
                  for mode in DIRECT[args.direct]}
        for mode, by_via in traced.items():
            for via, hops in by_via.items():
                print(f"\n{name}; {args.model}; {args.max_tokens} output tokens; {len(prompts)} requests per "
                      f"concurrency; adapter: {args.adapter}; engine in its own process; direct: {mode}; "
                      f"via {via}; relay_chunk_ms {args.relay_chunk_ms}; front workers {args.front_workers[0]}; "
                      f"{_clients_said(args)}; traces on")
                report_hops(hops)
        return
    servers = {}
    for mode in DIRECT[args.direct]:
        for label, own_process in (("server", True), ("server-inproc", False)):
            for workers in args.front_workers:
                if own_process or not args.no_inproc:
                    named = label + PATH_NAMES[mode] + (f" w{workers}" if len(args.front_workers) > 1 else "")
                    servers[named] = {"engine_process": own_process, "direct": mode,
                                      "relay_chunk_ms": args.relay_chunk_ms, "front_workers": workers}
    results = _measure(path, engine_cfg, prompts, args.max_tokens, batches, servers, vias, args.profile,
                       args.connections, args.client_processes)
    print(f"\n{name}; {args.model}; {args.max_tokens} output tokens; {len(prompts)} requests per concurrency, "
          f"each through every path ({', '.join(servers)} and the engine in this process), interleaved; "
          f"{_clients_said(args)}; relay_chunk_ms {args.relay_chunk_ms}; medians in ms")
    _report(results)


def _clients_said(args: argparse.Namespace) -> str:
    if args.client_processes:
        return f"the servers' streams from {args.client_processes} client processes, a connection each"
    return f"{args.connections} client connection(s) per path"


def _report(results: dict[int, dict[str, list[Timed]]]) -> None:
    print("| conc | path | TTFT | whole request | gap between chunks |")
    print("|---|---|---|---|---|")
    for c, by_path in results.items():
        for label, runs in by_path.items():
            r = _summary(runs)
            print(f"| {c} | {label} | {r['ttft']:.2f} | {r['total']:.2f} | {r['gap']:.3f} |")
    for c, by_path in results.items():
        for label, served in by_path.items():
            if label != ENGINE:
                a = _added(by_path[ENGINE], served)
                print(f"{label}, concurrency {c}, paired by prompt: adds {a['ttft']:.2f} ms to the first token, "
                      f"{a['total']:.2f} ms per request {_interval_said(by_path[ENGINE], served, c)}, "
                      f"{a['token']:.3f} ms per later streamed token "
                      f"(targets < 2 ms per request, < 0.5 ms per token; direct: < 2 ms at 1, < 5 ms at 16)")
        for label in by_path:
            if " via " in label and not label.endswith(" via haproxy"):
                base = label.rsplit(" via ", 1)[0] + " via haproxy"
                if base in by_path:
                    a = _added(by_path[base], by_path[label])
                    print(f"{label} minus via haproxy, concurrency {c}, paired by prompt: {a['ttft']:.2f} ms to "
                          f"the first token, {a['total']:.2f} ms per request, {a['token']:.3f} ms per later token")
        if {"server two-tier", "server direct"} <= set(by_path):
            a = _added(by_path["server two-tier"], by_path["server direct"])
            print(f"direct minus two-tier, concurrency {c}, paired by prompt: {a['ttft']:.2f} ms to the first "
                  f"token, {a['total']:.2f} ms per request, {a['token']:.3f} ms per later streamed token")


if __name__ == "__main__":
    main()
