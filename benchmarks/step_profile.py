"""Where a decode step's time goes: host work versus the GPU's graph replay.

    PYTHONPATH=. python benchmarks/step_profile.py --model 8b --batch 64

Runs base-only and 64-distinct-LoRA decode steps and splits each step into the
scheduler, the runner's host preparation, the GPU replay (CUDA events), sampling
and the engine's bookkeeping. Prints one table naming the GPU.

With --kernels, the same steps run under torch.profiler instead and the table
lists each GPU kernel's time per step (graph replays included), so one can see
which launches a LoRA or an adapter family adds.

Timing the replay waits for it (a CUDA event is synchronised each step), which takes
away the overlap of steps the engine otherwise has: "step" here is the step with host
and GPU work in series; benchmarks/engine_throughput.py measures the overlapped engine.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.formats.types import LoraAdapter, LoraModule
from adapterserve.kernels import metadata
from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint
from benchmarks.random_adapters import AdapterFactory
from benchmarks.workloads import families_plan, register

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(engine: Engine, seed: int, rank: int = 16) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    spec, modules = engine.backbone_spec, {}
    for layer in range(spec.num_layers):
        for kind in KINDS:
            i, o = spec.linear_shapes[kind]
            modules[(layer, kind)] = LoraModule(torch.randn(rank, i, generator=gen) / i ** 0.5,
                                                torch.randn(o, rank, generator=gen) * 0.01, 2.0)
    return LoraAdapter(modules)


def _timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out
    return wrapper


def _add_requests(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> None:
    """`batch` 512-token prompts over `adapters` in turn, each long enough for `steps` decode steps."""
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(torch.randint(3, 1000, (512,)).tolist(), params, adapters[i % len(adapters)])


def _abort_all(engine: Engine) -> None:
    while engine.has_unfinished():
        for r in list(engine.requests):
            engine.abort(r)


def profile(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> dict[str, float]:
    _add_requests(engine, batch, adapters, steps)
    for _ in range(8):
        engine.step()  # prefill and graph capture
    sched, host, replay, sample, total = [], [], [], [], []
    engine.scheduler.schedule = _timed(engine.scheduler.schedule, sched)
    runner = engine.runner
    runner._host_batch = _timed(runner._host_batch, host)
    graphs_run = runner.graphs.run

    def gpu_timed(*args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = graphs_run(*args)
        end.record()
        end.synchronize()
        replay.append(start.elapsed_time(end) / 1e3)
        return out

    runner.graphs.run = gpu_timed
    import adapterserve.engine.runner as runner_module
    runner_module.sample = _timed(runner_module.sample, sample)
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        total.append(time.perf_counter() - start)
    _abort_all(engine)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step": med(total), "schedule": med(sched), "host batch": med(host), "gpu replay": med(replay),
            "sample": med(sample)}


def kernel_profile(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> dict[str, tuple]:
    """{kernel name: (us per step, launches per step)} over `steps` decode steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _add_requests(engine, batch, adapters, steps)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()  # prefills done: only decode steps are profiled
    engine.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    _abort_all(engine)
    table: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = table.setdefault(event.name[:60], [0.0, 0])
            entry[0] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            entry[1] += 1
    return {name: (us / steps, n / steps) for name, (us, n) in table.items()}


def _print_kernels(rows: dict[str, dict[str, tuple]], top: int, title: str) -> None:
    names = sorted({n for row in rows.values() for n in row}, key=lambda n: -max(r.get(n, (0, 0))[0] for r in rows.values()))
    print(f"\n{torch.cuda.get_device_name()}; {title}; us per decode step (launches per step) of each kernel")
    print(f"{'kernel':<62}" + "".join(f"{w:>22}" for w in rows))
    for name in names[:top]:
        cells = [row.get(name, (0.0, 0)) for row in rows.values()]
        print(f"{name:<62}" + "".join(f"{us:>14.1f} ({n:>4.0f})" for us, n in cells))
    print(f"{'total':<62}" + "".join(f"{sum(us for us, _ in r.values()):>22.1f}" for r in rows.values()))


def _metadata_build() -> str:
    return "one launch" if metadata.ONE_LAUNCH else "torch ops"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kernels", action="store_true", help="per-kernel GPU time per step (torch.profiler)")
    parser.add_argument("--top", type=int, default=30, help="kernels listed with --kernels")
    parser.add_argument("--in-graphs", action="store_true",
                        help="with --kernels: trace the graph replays' kernels (where CUPTI records them), "
                             "not eager steps")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "fp8"], help="the engine's dtype")
    parser.add_argument("--workloads", default="base,one,distinct,ranks",
                        help="of base, one (one shared LoRA), distinct (a LoRA a row), ranks (--kernels only), "
                             "families (engine_throughput's: lora, ia3, prompt, prefix, bottleneck and base rows)")
    parser.add_argument("--pdl", default="auto", choices=["auto", "off", "early", "exit"],
                        help="programmatic dependent launch: with it, a kernel's traced time includes its wait")
    parser.add_argument("--metadata", choices=["torch", "one-launch"],
                        help="the adapter metadata's build (default: kernels/metadata.py's ONE_LAUNCH)")
    args = parser.parse_args()
    if args.metadata:
        metadata.ONE_LAUNCH = args.metadata == "one-launch"
    chosen = args.workloads.split(",")
    shape = SHAPES[args.model]
    path = write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()), "cuda")
    # --kernels runs the same kernels eagerly unless --in-graphs (older CUPTI does not trace a replay's kernels)
    ranks = (8, 16, 64)
    ranked = args.batch if args.kernels and "ranks" in chosen else 0  # adapters of mixed rank ("ranks")
    engine = Engine.from_pretrained(path, device="cuda", dtype=args.dtype, max_loras=args.batch + ranked,
                                    lora_pool_rows=args.batch * 16 + ranked * 32, max_num_seqs=args.batch,
                                    num_kv_blocks=args.batch * 40, max_model_len=640,
                                    cuda_graphs=not args.kernels or args.in_graphs, warmup=False, pdl=args.pdl)
    ids = [f"a{i}" for i in range(args.batch if "distinct" in chosen else 1)]
    for i, name in enumerate(ids):
        engine.add_adapter(name, _adapter(engine, i))
    named = {"base": ("base", [None]), "one": ("one LoRA r16", ids[:1]),
             "distinct": (f"{args.batch} distinct LoRA r16", ids)}
    workloads = dict(named[key] for key in named if key in chosen)
    if ranked:
        mixed = [f"m{i}" for i in range(ranked)]
        for i, name in enumerate(mixed):
            engine.add_adapter(name, _adapter(engine, 1000 + i, ranks[i % len(ranks)]))
        workloads[f"{ranked} ranks 8/16/64"] = mixed
    if "families" in chosen:  # engine_throughput's plan: a distinct adapter of each family in turn, and base rows
        families = families_plan(args.batch, AdapterFactory(shape, "cuda"), bottleneck=True)
        register(engine, families)
        workloads["families"] = families.adapter_ids
    if args.kernels:
        _print_kernels({w: kernel_profile(engine, args.batch, a, args.steps) for w, a in workloads.items()},
                       args.top, f"{args.dtype}, PDL {args.pdl}, metadata {_metadata_build()}")
        return
    rows = {w: profile(engine, args.batch, a, args.steps) for w, a in workloads.items()}
    cols = list(next(iter(rows.values())))
    print(f"\n{torch.cuda.get_device_name()}; {args.model}; {args.dtype}; batch {args.batch}; median ms per decode step")
    print(f"{'workload':<24}" + "".join(f"{c:>12}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<24}" + "".join(f"{row[c]:>12.2f}" for c in cols))


if __name__ == "__main__":
    main()
