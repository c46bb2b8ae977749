"""All-reduce latency by message size across the GPUs of this host: NCCL (eager, and
captured in a CUDA graph) against the symmetric-memory one-shot and two-shot of
layers/symm_allreduce.py (captured in a CUDA graph), bf16. Each graph holds OPS_PER_GRAPH
back-to-back all-reduces and is replayed after a warm-up; a cell is the slowest rank's
time per all-reduce. On CPU (--smoke) only gloo's eager all-reduce runs.

    python -m benchmarks.allreduce_micro --worlds 2,4      # GPUs
    python -m benchmarks.allreduce_micro --smoke           # CPU, gloo, seconds

benchmarks/tp_decode.py --micro prints the same table before its decode table.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapterserve.layers.symm_allreduce import (
    TWO_SHOT_WORLD_SIZES,
    SymmetricAllReduce,
    choose_path,
)

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 128 * KiB, 256 * KiB, 512 * KiB, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB)
SMOKE_SIZES = (64 * KiB, 1 * MiB)
OPS_PER_GRAPH = 20
WARM_REPLAYS, TIMED_REPLAYS = 5, 20
VARIANTS = ("nccl eager", "nccl graph", "one-shot graph", "two-shot graph")


def measure(worlds: tuple[int, ...], smoke: bool) -> dict[int, dict[int, dict[str, float]]]:
    """{world: {bytes: {variant: us per all-reduce, slowest rank}}}, each world in its own processes."""
    sizes = SMOKE_SIZES if smoke else SIZES
    found = {}
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_rank_main, args=(world, Path(tmp), sizes, smoke), nprocs=world, start_method="spawn")
            per_rank = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]
        found[world] = {size: {v: max(rank[str(size)][v] for rank in per_rank) for v in per_rank[0][str(size)]}
                        for size in sizes}
    return found


def _rank_main(rank: int, world: int, root: Path, sizes: tuple[int, ...], smoke: bool) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"file://{root / 'store'}", rank=rank,
                            world_size=world)
    symmetric = None if smoke else SymmetricAllReduce.create(dist.group.WORLD, device, max(sizes))
    times = {}
    for size in sizes:
        x = torch.zeros(size // 2, dtype=torch.bfloat16, device=device)  # values do not change the time
        times[size] = {name: time_per_call(run, graph=name.endswith("graph"), device=device)
                       for name, run in _variants(x, symmetric, world).items()}
    (root / f"{rank}.json").write_text(json.dumps(times))
    symmetric = None  # its peer mappings released while the group still stands
    dist.destroy_process_group()


def _variants(x: torch.Tensor, symmetric: SymmetricAllReduce | None, world: int) -> dict[str, Callable[[], object]]:
    """What runs on x: NCCL (gloo on CPU), and with a symmetric buffer its one- and two-shot."""
    runs: dict[str, Callable[[], object]] = {"nccl eager": lambda: dist.all_reduce(x)}
    if symmetric is None:
        return runs
    out = torch.empty_like(x)
    runs["nccl graph"] = runs["nccl eager"]
    runs["one-shot graph"] = lambda: symmetric.one_shot(x, out)
    if world in TWO_SHOT_WORLD_SIZES:
        runs["two-shot graph"] = lambda: symmetric.two_shot(x, out)
    return runs


def time_per_call(run: Callable[[], object], graph: bool, device: torch.device) -> float:
    """Microseconds per call: OPS_PER_GRAPH calls per replay (or per eager round), warmed up, the
    ranks lined up by a barrier before the timed replays."""
    def round_() -> None:
        for _ in range(OPS_PER_GRAPH):
            run()

    round_()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            round_()
        round_ = captured.replay
    for _ in range(WARM_REPLAYS):
        round_()
    sync(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(TIMED_REPLAYS):
        round_()
    sync(device)
    return (time.perf_counter() - start) / (TIMED_REPLAYS * OPS_PER_GRAPH) * 1e6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def table(found: dict[int, dict[int, dict[str, float]]], device_name: str, smoke: bool = False) -> str:
    """One row per (GPUs, size); 'auto path' is what the engine's "auto" setting runs there."""
    lines = [f"all-reduce, bf16, us per call (slowest rank), {OPS_PER_GRAPH} per graph; {device_name}",
             f"{'gpus':>4} {'size':>8} " + " ".join(f"{v:>14}" for v in VARIANTS)
             + f" {'nccl/1-shot':>11} {'auto path':>9}"]
    for world, by_size in found.items():
        for size, cells in by_size.items():
            row = " ".join(f"{cells[v]:>14.1f}" if v in cells else f"{'-':>14}" for v in VARIANTS)
            ratio = f"{cells['nccl graph'] / cells['one-shot graph']:.2f}x" if "one-shot graph" in cells else "-"
            path = "gloo" if smoke else choose_path(size, torch.bfloat16, True, world, 1 << 40)
            lines.append(f"{world:>4} {_size(size):>8} {row} {ratio:>11} {path:>9}")
    return "\n".join(lines)


def device_name(smoke: bool) -> str:
    if smoke or not torch.cuda.is_available():
        return "CPU (gloo)"
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4", help="GPU counts, comma-separated")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, two ranks, two sizes")
    args = p.parse_args(argv)
    worlds = (2,) if args.smoke else tuple(int(w) for w in args.worlds.split(","))
    found = measure(worlds, args.smoke)
    print(json.dumps({str(w): by_size for w, by_size in found.items()}))
    print(table(found, device_name(args.smoke), args.smoke))


if __name__ == "__main__":
    main()
