"""Decode step time of a tensor-parallel engine: TP=1 against TP=2 (or any sizes given),
an 8B-shaped (or 70B-shaped) random-weight backbone (each rank draws its shard on its own
GPU: no checkpoint), B requests decoding, base alone and with one distinct rank-16 LoRA
per request, under each all-reduce setting given (EngineConfig.tensor_parallel_all_reduce:
"nccl", "auto" = symmetric memory where it runs). One table: the median full-batch
decode step, its per-GPU floor (what one GPU must read: its shard of the weights, of the
KV cache and of the adapters, at the copy bandwidth measured on that GPU) and the ratio,
the adapter tax at each size, and each all-reduce setting's speed-up over "nccl".
--micro first prints the all-reduce latency table of benchmarks/allreduce_micro.py.

    python -m benchmarks.tp_decode                     # 8B, TP 1 and 2, B=64, nccl and auto
    python -m benchmarks.tp_decode --sizes 2,4 --micro # and the all-reduce table at 2 and 4 GPUs
    python -m benchmarks.tp_decode --shape 70b --sizes 4 --adapters 0
    python -m benchmarks.tp_decode --smoke             # tiny shape on CPU (gloo), seconds

Every variant runs once untimed first (kernels compiled, decode graphs captured).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import tempfile
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.tp.worker import PROFILE_ENV
from adapterserve.layers.parallel import TensorParallel
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.decoder_config import read_decoder_config
from benchmarks import allreduce_micro, stall_watch
from benchmarks.checkpoints import SHAPES, ModelShape
from benchmarks.measure import (
    Floor,
    StepTrace,
    copy_bandwidth,
    decode_summary,
    run_requests,
)
from benchmarks.random_adapters import AdapterFactory, decode_read_bytes

WEIGHT_STD = 0.02
SHAPE_70B = ModelShape("70b", 8192, 80, 64, 8, 28672, 128256, tied=False)  # Llama-3 70B's dimensions
ALL_SHAPES = {**SHAPES, "70b": SHAPE_70B}

WARM_UP_STALL_S = 180.0  # the warm-up places every adapter on every rank: a 70B's take long
CLOSE_DUMP_S = 30.0  # with --stall-dump: the stacks of an engine's close still running after this


@dataclass(frozen=True)
class Config:
    shape: ModelShape
    device: str
    dtype: str
    sizes: tuple[int, ...]
    batch: int
    adapters: int
    rank: int
    targets: tuple[str, ...] | None
    prompt: int
    tokens: int
    all_reduces: tuple[str, ...]
    micro: bool
    profile: bool
    stall_dump_s: float = 0.0


def parse_args(argv: list[str] | None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="8b", choices=sorted(ALL_SHAPES))
    p.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--adapters", type=int, default=64,
                   help="distinct LoRA adapters (one per request, cycling); 0: base only")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--targets", default=None,
                   help="LoRA target projections, comma-separated (default: all seven, as engine_throughput.py)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    p.add_argument("--all-reduce", default="auto,nccl",
                   help="EngineConfig.tensor_parallel_all_reduce settings to compare, comma-separated")
    p.add_argument("--micro", action="store_true", help="first the all-reduce latency table at each size > 1")
    p.add_argument("--profile", action="store_true",
                   help="after each base row, rank 0's kernels of a short run (torch.profiler), top 12 per step")
    p.add_argument("--stall-dump", type=float, default=0.0, metavar="S",
                   help="a workload still running after S seconds: every rank's stacks (SIGUSR1 to each, from a "
                        "watcher process; py-spy --native where installed), and again 20 s later")
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, a few tokens: the script runs")
    args = p.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    all_reduces = tuple(args.all_reduce.split(","))
    targets = tuple(args.targets.split(",")) if args.targets else None
    if args.smoke:
        return Config(SHAPES["tiny"], "cpu", "float32", sizes, 4, 4, 4, targets, 8, 4, all_reduces, args.micro,
                      args.profile, args.stall_dump)
    return Config(ALL_SHAPES[args.shape], "cuda", "bfloat16", sizes, args.batch, args.adapters, args.rank, targets,
                  args.prompt, args.tokens, all_reduces, args.micro, args.profile, args.stall_dump)


def random_shard(config_dir: str, dtype: torch.dtype, seed: int, tp: TensorParallel, device: str) -> DecoderModel:
    """This rank's shard of a random-weight backbone, drawn on its device (a ModelBuilder)."""
    cfg = read_decoder_config(config_dir)
    model = DecoderModel(cfg, 8192, dtype, device, tp=tp)
    gen = torch.Generator(device=device).manual_seed(seed + tp.rank)
    with torch.no_grad():
        for param in {id(p): p for p in model.parameters()}.values():
            if param.dim() == 1:
                param.fill_(1.0)  # norms
            else:
                param.normal_(0.0, WEIGHT_STD, generator=gen)
    return model.eval()


def _engine(cfg: Config, config_dir: Path, size: int, all_reduce: str) -> Engine:
    blocks = cfg.batch * (-(-(cfg.prompt + cfg.tokens) // 16) + 1)
    engine_config = EngineConfig(
        device=cfg.device, dtype=cfg.dtype, max_loras=max(cfg.adapters, 1) + 1, max_lora_rank=cfg.rank,
        max_num_seqs=cfg.batch, max_num_batched_tokens=max(cfg.batch * cfg.prompt, 256), num_kv_blocks=blocks,
        warmup=False, tensor_parallel_size=size, tensor_parallel_launch="local", tensor_parallel_all_reduce=all_reduce,
    )
    build = partial(random_shard, str(config_dir), engine_config.torch_dtype, 0)
    return Engine.from_model(build, read_decoder_config(config_dir), None, engine_config)


def _floor(engine: Engine, size: int, adapter_bytes: dict[str, int], bandwidth: float) -> Floor:
    """One GPU's bytes: rank 0's own parameters (its shard), 1/size of the KV and of each adapter."""
    model, mcfg = engine.model, engine.model_config
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    if not mcfg.tie_word_embeddings:  # a step reads B rows of the input embedding, not all of it
        embed = model.embed_tokens.weight
        weights -= embed.numel() * embed.element_size()
    kv = mcfg.num_layers * 2 * mcfg.kv_size * model.embed_tokens.weight.element_size() // size
    return Floor(weights, kv, {a: b // size for a, b in adapter_bytes.items()}, bandwidth)


def _workload(engine: Engine, cfg: Config, adapter_ids: list[str | None], floor: Floor) -> dict:
    gen = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab, (cfg.prompt,), generator=gen).tolist() for _ in range(cfg.batch)]
    trace = StepTrace(engine)
    started = time.perf_counter()
    run_requests(engine, trace, prompts, adapter_ids, [cfg.tokens] * cfg.batch,  # compiles, captures, places
                 max_stall_s=WARM_UP_STALL_S)
    progress(f"  warm-up run (adapters placed) in {time.perf_counter() - started:.1f} s")
    return decode_summary(run_requests(engine, trace, prompts, adapter_ids, [cfg.tokens] * cfg.batch),
                          cfg.batch, floor)


def run_size(cfg: Config, config_dir: Path, size: int, all_reduce: str, factory: AdapterFactory,
             bandwidth: float) -> list[dict]:
    """Base measured first, then the adapters added (timed) and the distinct workload: a
    variant cut short still leaves its base row and the build and hot-load times."""
    started = time.perf_counter()
    engine = _engine(cfg, config_dir, size, all_reduce)
    label = all_reduce if size > 1 else "-"
    progress(f"tp={size} {label}: engine built in {time.perf_counter() - started:.1f} s; {host_cpus()}")
    try:
        names = [f"lora{i}" for i in range(cfg.adapters)]
        adapters = [factory.lora(i, cfg.rank, cfg.targets) for i in range(cfg.adapters)]
        adapter_bytes = {name: decode_read_bytes(a, model_element_size(cfg)) for name, a in zip(names, adapters)}
        floor = _floor(engine, size, adapter_bytes, bandwidth)
        rows = [_row(engine, cfg, size, label, "base", [None] * cfg.batch, floor)]
        if cfg.profile:
            profile_steps(engine, cfg)
        if names:
            add_adapters(engine, dict(zip(names, adapters)), f"tp={size} {label}", cfg.profile)
            ids = [names[i % len(names)] for i in range(cfg.batch)]
            rows.append(_row(engine, cfg, size, label, f"distinct{cfg.adapters}", ids, floor))
        return rows
    finally:
        closing = time.perf_counter()
        with stall_dump(engine, CLOSE_DUMP_S if cfg.stall_dump_s > 0 else 0.0, f"tp={size} {label} close"):
            engine.close()
        progress(f"tp={size} {label}: closed in {time.perf_counter() - closing:.1f} s")
        del engine
        gc.collect()
        if cfg.profile and size > 1:
            print_worker_profiles(Path(os.environ[PROFILE_ENV]))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def stall_dump(engine: Engine, after_s: float, label: str) -> AbstractContextManager[None]:
    """A context: if the block still runs after after_s seconds (0: never), a watcher process
    prints the stacks of rank 0 and each local TP worker (benchmarks/stall_watch.py)."""
    workers = engine.lockstep.workers if engine.lockstep else []
    pids = {"rank 0": os.getpid(), **{f"rank {w.rank}": w.pid for w in workers if w.pid}}
    return stall_watch.watching(pids, after_s, label)


def add_adapters(engine: Engine, adapters: dict[str, Adapter], label: str, profile: bool) -> None:
    """Add the adapters (timed, with progress every 16); ``profile``: rank 0's busiest functions."""
    host = cProfile.Profile()
    started = time.perf_counter()
    if profile:
        host.enable()
    for i, (name, adapter) in enumerate(adapters.items(), 1):
        engine.add_adapter(name, adapter)
        if i % 16 == 0 or i == len(adapters):
            progress(f"{label}: {i} adapters added in {time.perf_counter() - started:.1f} s")
    host.disable()
    if profile:
        print("  rank 0's host adding them, by own time:")
        stats = pstats.Stats(host).stats
        for (file, line, function), (calls, _, own, cum, _) in sorted(stats.items(), key=lambda i: -i[1][2])[:14]:
            print(f"    {own:8.3f} s own {cum:8.3f} s cum {calls:7d} calls  {function} ({Path(file).name}:{line})")


def _row(engine: Engine, cfg: Config, size: int, label: str, workload: str, adapter_ids: list[str | None],
         floor: Floor) -> dict:
    started = time.perf_counter()
    with stall_dump(engine, cfg.stall_dump_s, f"tp={size} {label} {workload}"):
        row = {"tp": size, "all_reduce": label, "workload": workload, **_workload(engine, cfg, adapter_ids, floor)}
    progress(f"tp={size} {label} {workload}: step {row.get('decode_ms', float('nan')):.2f} ms, "
             f"{row.get('x_floor', float('nan')):.2f}x floor ({time.perf_counter() - started:.1f} s with warm-up)")
    return row


def profile_steps(engine: Engine, cfg: Config, tokens: int = 24) -> None:
    """Rank 0's busiest kernels (torch.profiler) and Python functions (cProfile) over a short
    base run of short prompts (decode steps), per step."""
    from torch.profiler import ProfilerActivity, profile
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, engine.model_config.vocab_size, (min(cfg.prompt, 16),), generator=gen).tolist()
               for _ in range(cfg.batch)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device == "cuda" else [])
    host = cProfile.Profile()
    with profile(activities=activities) as prof:
        host.enable()
        run = run_requests(engine, StepTrace(engine), prompts, [None] * cfg.batch, [tokens] * cfg.batch)
        host.disable()
    steps = max(len(run.steps), 1)
    key = "self_device_time_total" if cfg.device == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:12]
    total = sum(getattr(e, key) for e in prof.key_averages()) / steps / 1e3
    print(f"  profile: {steps} steps, {sum(s.seconds for s in run.steps) / steps * 1e3:.2f} ms wall per step, "
          f"{total:.2f} ms {'GPU' if cfg.device == 'cuda' else 'CPU'} per step (rank 0)")
    for e in events:
        print(f"    {getattr(e, key) / steps / 1e3:8.3f} ms/step {e.count / steps:7.1f} calls/step  {e.key[:90]}")
    if cfg.device == "cuda":
        print(collective_spread(prof, steps))
    print("  rank 0's host, by own time:")
    stats = pstats.Stats(host).stats  # {(file, line, function): (calls, primitive calls, own s, cumulative s, callers)}
    for (file, line, function), (calls, _, own, _, _) in sorted(stats.items(), key=lambda i: -i[1][2])[:12]:
        print(f"    {1e3 * own / steps:8.3f} ms/step {calls / steps:7.1f} calls/step  "
              f"{function} ({Path(file).name}:{line})")


def collective_spread(prof, steps: int) -> str:
    """How rank 0's all-reduce kernel time spreads over its calls: a kernel that waits for the
    slowest rank's arrival runs long, so a few long calls a step mean the ranks start their
    steps apart, and a uniformly slow call means the sum itself is slow."""
    from torch.autograd import DeviceType
    calls = sorted((e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA
                    and ("all_reduce" in e.name.lower() or "allreduce" in e.name.lower())), reverse=True)
    if not calls:
        return "  all-reduce calls: none seen"
    longest, rest = calls[:steps], calls[steps:] or [0.0]
    return (f"  all-reduce calls: {len(calls) / steps:.1f} a step; the longest one a step: "
            f"{sum(longest) / steps / 1e3:.3f} ms/step (median {statistics.median(longest):.1f} µs); "
            f"the others: median {statistics.median(rest):.1f} µs, p90 {_quantile(rest, 0.9):.1f} µs, "
            f"{sum(rest) / steps / 1e3:.3f} ms/step")


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def print_worker_profiles(directory: Path, rows: int = 12) -> None:
    """The TP workers' busiest functions (their whole life: build, capture, runs), then forget them."""
    for path in sorted(directory.glob("tp_worker*.txt")):
        lines = path.read_text().splitlines()
        start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), len(lines))
        print(f"  {path.stem}, whole life, by own time:")
        for line in lines[start: start + 1 + rows]:
            print(f"    {line[:150]}")
        path.unlink()


def host_cpus() -> str:
    """This process's torch threads against the cores it may use (affinity, cgroup quota)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"rank 0's torch threads {torch.get_num_threads()}, cores {os.cpu_count()}, usable {usable}, "
            f"cgroup quota {_cgroup_cpus()}; CUDA module loading {os.environ.get('CUDA_MODULE_LOADING', 'default')}")


def _cgroup_cpus() -> str:
    """The CPU quota of this process's cgroup (v2, else v1), in CPUs."""
    v1 = Path("/sys/fs/cgroup/cpu")
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    (v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us")):
        try:
            fields = Path(quota_file).read_text().split()
            quota, period = fields[0], fields[1] if period_file is None else Path(period_file).read_text().strip()
            return "none" if quota in ("max", "-1") else f"{int(quota) / int(period):g} CPUs"
        except (OSError, IndexError, ValueError):
            continue
    return "unknown"


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def model_element_size(cfg: Config) -> int:
    return torch.empty(0, dtype=EngineConfig(dtype=cfg.dtype).torch_dtype).element_size()


def table(rows: list[dict], device: str) -> str:
    """One row per (tp, all-reduce, workload): tax against base under the same tp and
    all-reduce, speed-up against the smallest tp, and against "nccl" at the same tp."""
    base = {(r["tp"], r["all_reduce"]): r["decode_ms"] for r in rows if r["workload"] == "base"}
    smallest = min(r["tp"] for r in rows)
    one = {r["workload"]: r["decode_ms"] for r in rows if r["tp"] == smallest}
    nccl = {(r["tp"], r["workload"]): r["decode_ms"] for r in rows if r["all_reduce"] in ("nccl", "-")}
    lines = [f"tensor-parallel decode step, {device}",
             (f"{'tp':>3} {'all-reduce':<10} {'workload':<12} {'batch':>5} {'step ms':>8} {'floor ms/GPU':>12} "
              f"{'x floor':>7} {'tok/s':>8} {'tax':>6} {'vs tp' + str(smallest):>8} {'vs nccl':>8}")]
    for r in rows:
        tax = r["decode_ms"] / base[r["tp"], r["all_reduce"]] - 1
        speedup = one[r["workload"]] / r["decode_ms"]
        reference = nccl.get((r["tp"], r["workload"]))
        over_nccl = f"{reference / r['decode_ms']:>7.2f}x" if reference else f"{'-':>8}"
        lines.append(f"{r['tp']:>3} {r['all_reduce']:<10} {r['workload']:<12} {r.get('decode_batch', 0):>5.0f} "
                     f"{r['decode_ms']:>8.2f} {r['floor_ms']:>12.2f} {r['x_floor']:>7.2f} {r['decode_tok_s']:>8.0f} "
                     f"{100 * tax:>5.1f}% {speedup:>7.2f}x {over_nccl}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    device = allreduce_micro.device_name(cfg.device != "cuda")
    if cfg.micro:
        worlds = tuple(size for size in cfg.sizes if size > 1) if cfg.device == "cuda" else (2,)
        micro = allreduce_micro.table(allreduce_micro.measure(worlds, cfg.device != "cuda"), device,
                                      cfg.device != "cuda")
    bandwidth = copy_bandwidth(cfg.device, 1 << 30 if cfg.device == "cuda" else 1 << 24)
    factory = AdapterFactory(cfg.shape, cfg.device)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if cfg.profile:  # the local TP workers write their profiles here (engine/tp/worker.py)
            os.environ[PROFILE_ENV] = tmp
        cfg.shape.hf_config().save_pretrained(tmp)  # config.json only: the weights are drawn per rank
        for size in cfg.sizes:
            for all_reduce in cfg.all_reduces if size > 1 else cfg.all_reduces[:1]:
                print(f"tp={size}, all-reduce {all_reduce}: building {cfg.shape.name} on {size} device(s) ...",
                      flush=True)
                measured = run_size(cfg, Path(tmp), size, all_reduce, factory, bandwidth)
                print(json.dumps(measured, default=str), flush=True)  # kept if a later variant is cut short
                rows += measured
    if cfg.micro:
        print(micro)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s per GPU; {cfg.shape.name}, prompts {cfg.prompt}, "
          f"{cfg.tokens} output tokens, LoRA rank {cfg.rank} on {','.join(cfg.targets or ('all projections',))}")
    print(table(rows, device))


if __name__ == "__main__":
    main()
