"""How the engine takes a group of requests that arrive spread out, not at once, as a server's
replica hands them over one by one (`server_overhead.py --trace`: a group of 16 calls sent
together reaches the engine spread over several ms).

    PYTHONPATH=. python benchmarks/arrival_spread.py --model 1b --spreads 0 3 6 10
    PYTHONPATH=. python benchmarks/arrival_spread.py --smoke       # CPU, tiny model
    PYTHONPATH=. python benchmarks/arrival_spread.py --model 1b --cached --no-one-by-one --child-host-threads 1 2
                                       # beside them, engine processes with 1 and 2 torch host threads

Each group of --concurrency prompts starts its requests evenly over the spread (the first at
the group's start, the last at start + spread), through the engine in this process and through
the engine in a child process of its own (EngineProcess, as a replica runs it; "one by one": without
its coalescing of starts, a message per stream), in turn; each row
with prompts of its own (--cached: computed once before the row, so prefills hit the prefix
cache). For
each path and spread: the medians (and p90) of a request's time from its own start to its first
token and to its end, the engine's steps per group, and the whole group's time from its first
start to its last end.
"""
from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapterserve.engine.request import RequestTimes
from benchmarks.client_processes import timed


@dataclass
class Run:
    first: list[float]  # per request: seconds from its start to its first token
    total: list[float]  # ... to its end
    group: list[float]  # per group: first start -> last end
    steps: float  # engine steps per group
    stages: dict[str, list[float]]  # STAGES: seconds per request


# (row, from, to): a request's stages, from its start (time.time_ns() at the stream's opening),
# the engine's RequestTimes, and the first chunk's arrival here
STAGES = (("start -> added in the engine", "start", "added_ns"),
          ("added -> scheduled", "added_ns", "scheduled_ns"),
          ("scheduled -> first token in the engine", "scheduled_ns", "first_token_ns"),
          ("first token in the engine -> here", "first_token_ns", "received"))


async def _one(open_stream: Callable, prompt: list[int], stages: dict[str, list[float]]) -> tuple[float, float]:
    times = RequestTimes()
    start, start_ns = time.perf_counter(), time.time_ns()
    first, total, _, _ = await timed(open_stream(prompt, times), start)
    stamps = {"start": start_ns, "received": start_ns + round(first * 1e9), **vars(times)}
    import sys
    print("GOT", stamps["first_token_ns"], stamps["received"], file=sys.stderr, flush=True)
    print("START", start_ns, stamps["added_ns"], file=sys.stderr, flush=True)
    for row, begin, end in STAGES:
        stages.setdefault(row, []).append((stamps[end] - stamps[begin]) / 1e9)
    return first, total


async def _group(open_stream: Callable, prompts: list[list[int]], spread_s: float,
                 stages: dict[str, list[float]]) -> tuple[list, float]:
    """The prompts started evenly over spread_s; each (first, total) from its own start."""
    t0 = time.perf_counter()
    step = spread_s / max(len(prompts) - 1, 1)

    async def started(i: int, prompt: list[int]) -> tuple[float, float]:
        await asyncio.sleep(max(0.0, t0 + i * step - time.perf_counter()))
        return await _one(open_stream, prompt, stages)

    results = await asyncio.gather(*(started(i, p) for i, p in enumerate(prompts)))
    return results, time.perf_counter() - t0


async def _measure(open_stream: Callable, steps: Callable, prompts: list[list[int]], concurrency: int,
                   spread_s: float, cached: bool) -> Run:
    """A row; its prompts computed once before (their blocks in the prefix cache) if `cached`."""
    for i in range(0, len(prompts) if cached else concurrency, concurrency):  # warm-up at this spread
        await _group(open_stream, prompts[i:i + concurrency], spread_s, {})
    run = Run([], [], [], 0.0, {})
    before = await steps()
    for i in range(0, len(prompts), concurrency):
        results, whole = await _group(open_stream, prompts[i:i + concurrency], spread_s, run.stages)
        run.first += [r[0] for r in results]
        run.total += [r[1] for r in results]
        run.group.append(whole)
    run.steps = (await steps() - before) / len(run.group)
    return run


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--spreads", type=float, nargs="+", default=[0, 3, 6, 10], help="ms")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--cached", action="store_true",
                        help="each row's prompts run once before it: their prefills hit the prefix cache "
                             "(as in server_overhead.py, whose later concurrency levels repeat the prompts)")
    parser.add_argument("--child-host-threads", type=int, nargs="*", default=[],
                        help="also an engine process with this many torch host threads, for each value")
    parser.add_argument("--one-by-one", action=argparse.BooleanOptionalAction, default=True,
                        help="also the engine process without its coalescing of starts")
    args = parser.parse_args()
    if args.smoke:
        args.model, args.device, args.requests, args.max_tokens, args.spreads = "tiny", "cpu", 16, 8, [0, 5]
        torch.set_num_threads(1)
    from adapterserve import Engine, SamplingParams
    from adapterserve.server.engine_process.proxy import EngineProcess
    from benchmarks.server_overhead import _checkpoint

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    engine_cfg = {"device": args.device, "dtype": dtype, "max_num_seqs": 64, "num_kv_blocks": 2048,
                  "max_model_len": 1024}
    path = _checkpoint(args.model, args.device)
    vocab = 500 if args.model == "tiny" else 32000
    length = 16 if args.model == "tiny" else 256

    def fresh_prompts() -> list[list[int]]:  # a row's own: no row finds another's in the prefix cache
        return [torch.randint(3, vocab, (length,)).tolist() for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    child = EngineProcess(path, engine_cfg)
    one_by_one = EngineProcess(path, engine_cfg, coalesce=False) if args.one_by_one else None
    engine = Engine.from_pretrained(path, **engine_cfg)

    async def engine_steps() -> float:
        return engine.stats.snapshot().step_seconds.count

    def child_path(process: EngineProcess) -> tuple[Callable, Callable]:
        async def steps() -> float:
            return (await process.stats()).stats.step_seconds.count

        return (lambda p, times: process.stream(p, params, times=times)), steps

    paths = {"engine": (lambda p, times: engine.stream(p, params, times=times), engine_steps),
             "engine process": child_path(child)}
    if one_by_one is not None:
        paths["engine process, one by one"] = child_path(one_by_one)
    threaded = [EngineProcess(path, {**engine_cfg, "host_threads": n}) for n in args.child_host_threads]
    for n, process in zip(args.child_host_threads, threaded):
        paths[f"engine process, {n} host threads"] = child_path(process)

    async def run_all() -> dict:
        return {(label, spread): await _measure(opened, steps, fresh_prompts(), args.concurrency, spread / 1e3,
                                                args.cached)
                for spread in args.spreads for label, (opened, steps) in paths.items()}

    try:
        runs = asyncio.run(run_all())
    finally:
        child.close()
        for process in [one_by_one, *threaded]:
            if process is not None:
                process.close()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n{name}; {args.model}; {args.concurrency} requests a group started evenly over the spread; "
          f"prompts {'cached' if args.cached else 'not cached'}; "
          f"{args.requests} requests per row; prompts {length} tokens; {args.max_tokens} output tokens; ms")
    print("| path | spread | first token p50 | p90 | whole request p50 | group p50 | steps per group |")
    print("|---|---|---|---|---|---|---|")
    for (label, spread), run in runs.items():
        print(f"| {label} | {spread:g} | {_p(run.first, 0.5):.2f} | {_p(run.first, 0.9):.2f} | "
              f"{_p(run.total, 0.5):.2f} | {_p(run.group, 0.5):.2f} | {run.steps:.2f} |")
    print("\nwhere the first token's time goes, medians ms:")
    print("| path | spread | " + " | ".join(row for row, _, _ in STAGES) + " |")
    print("|---|---|" + "---|" * len(STAGES))
    for (label, spread), run in runs.items():
        print(f"| {label} | {spread:g} | " + " | ".join(f"{_p(run.stages[row], 0.5):.2f}" for row, _, _ in STAGES)
              + " |")


if __name__ == "__main__":
    main()
