"""How long the `adapterserve` command takes for a user: `adapterserve list` against a
running local server, run as a fresh process each time, and what its imports cost.

    PYTHONPATH=. python benchmarks/cli_startup.py                      # this tree, 20 runs per row
    PYTHONPATH=. python benchmarks/cli_startup.py --also /tmp/old      # and another tree's CLI beside it

The server is the embedded default (`adapterserve serve` without flags: a tiny random Llama,
all-MiniLM-L6-v2 with its two example adapters, local Ray) on free ports, started in this
process. Each row runs a command `--runs` times after two warm-ups and reports the median
and the 90th percentile of its wall time and the median of its CPU time (user + system,
the process alone). Rows: the bare interpreter (`python -c pass`), importing the CLI
(`-X importtime`, the import of `adapterserve.clients.cli` alone), `adapterserve --help`
(imports and argument parsing), `adapterserve list` (the whole command), and the ListAdapters
call from an open channel (the server's share of `list`). Commands run as
`python -m adapterserve.clients.cli`, what the `adapterserve` script runs, with the tree first
on PYTHONPATH. `--also TREE` times another source tree's CLI the same way, interleaved run by
run with this tree's (e.g. `mkdir /tmp/old && git archive OLD adapterserve | tar -x -C /tmp/old`).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).parents[1]


@dataclass
class Row:
    code: str
    what: str
    wall_s: list[float]
    cpu_s: list[float]


def _timed(argv: list[str], tree: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the child, stderr) of one run of `argv` with `tree` first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    child = subprocess.Popen(argv, env=env, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {child.returncode}: {err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, err


def _import_s(stderr: str) -> float:
    """Cumulative import time of adapterserve.clients.cli from `-X importtime` output."""
    match = re.search(r"\|\s*(\d+)\s*\|\s*adapterserve\.clients\.cli\s*$", stderr, re.M)
    if match is None:
        raise RuntimeError("no adapterserve.clients.cli line in -X importtime output")
    return int(match.group(1)) / 1e6


def _commands(grpc_address: str) -> dict[str, tuple[list[str], Callable[[float, float, str], tuple[float, float]]]]:
    """what -> (argv, (wall, cpu, stderr) -> the (wall, cpu) to report)."""
    cli = [sys.executable, "-m", "adapterserve.clients.cli"]
    whole = lambda wall, cpu, err: (wall, cpu)  # noqa: E731
    return {
        "python -c pass": ([sys.executable, "-c", "pass"], whole),
        "import adapterserve.clients.cli": ([sys.executable, "-X", "importtime", "-c", "import adapterserve.clients.cli"],
                                            lambda wall, cpu, err: (_import_s(err), float("nan"))),
        "adapterserve --help": ([*cli, "--help"], whole),
        "adapterserve list": ([*cli, "list", "--server", grpc_address], whole),
    }


def _measure(trees: dict[str, Path], grpc_address: str, runs: int) -> list[Row]:
    rows = []
    for what, (argv, keep) in _commands(grpc_address).items():
        by_code = {code: Row(code, what, [], []) for code in trees}
        for i in range(runs + 2):  # two warm-ups (page cache, .pyc files)
            for code, tree in trees.items():  # interleaved: drift falls on every tree alike
                wall, cpu = keep(*_timed(argv, tree))
                if i >= 2:
                    by_code[code].wall_s.append(wall)
                    by_code[code].cpu_s.append(cpu)
        rows += by_code.values()
    return rows


def _rpc_row(grpc_address: str, runs: int) -> Row:
    from adapterserve.clients.client import Client

    row = Row("-", "ListAdapters call (server's share)", [], [])
    with Client(grpc_address) as client:
        client.list_adapters()
        for _ in range(runs):
            start = time.perf_counter()
            client.list_adapters()
            row.wall_s.append(time.perf_counter() - start)
            row.cpu_s.append(float("nan"))
    return row


def _ms(values: list[float], q: float | None = None) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    if q is None:
        return f"{1e3 * statistics.median(values):.1f}"
    return f"{1e3 * statistics.quantiles(values, n=10)[int(q * 10) - 1]:.1f}"


def _report(rows: list[Row], runs: int) -> None:
    print(f"\n{_machine()}; {runs} runs per row after 2 warm-ups; milliseconds")
    print("| code | what | wall median | wall p90 | CPU median |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.code} | {r.what} | {_ms(r.wall_s)} | {_ms(r.wall_s, 0.9)} | {_ms(r.cpu_s)} |")


def _machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "CPU")
    return f"{model}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="another source tree whose CLI to time beside this one's (repeatable)")
    args = parser.parse_args()
    from adapterserve.server import launch
    from adapterserve.server.serve_env import free_port

    config = {"store": tempfile.mkdtemp(prefix="cli-startup-store-")}
    endpoints = launch.start(config, grpc_port=free_port(), http_port=free_port())
    try:
        trees = {"this tree": ROOT, **{str(t): t.resolve() for t in args.also}}
        rows = _measure(trees, endpoints.grpc, args.runs) + [_rpc_row(endpoints.grpc, args.runs)]
    finally:
        launch.shutdown()
    _report(rows, args.runs)


if __name__ == "__main__":
    main()
