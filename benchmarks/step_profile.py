"""Where a decode step's time goes: host work versus the GPU's graph replay.

    PYTHONPATH=. python benchmarks/step_profile.py --model 8b --batch 64

Runs base-only and 64-distinct-LoRA decode steps and splits each step into the
scheduler, the runner's host preparation, the GPU replay (CUDA events), sampling
and the engine's bookkeeping. Prints one table naming the GPU.

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
from benchmarks.checkpoints import SHAPES, scratch_dir, write_random_checkpoint

KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapter(engine: Engine, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    spec, modules = engine.backbone_spec, {}
    for layer in range(spec.num_layers):
        for kind in KINDS:
            i, o = spec.linear_shapes[kind]
            modules[(layer, kind)] = LoraModule(torch.randn(16, i, generator=gen) / i ** 0.5,
                                                torch.randn(o, 16, generator=gen) * 0.01, 2.0)
    return LoraAdapter(modules)


def _timed(fn, sink: list[float]):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return out
    return wrapper


def profile(engine: Engine, batch: int, adapters: list[str | None], steps: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=steps + 40, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(torch.randint(3, 1000, (512,)).tolist(), params, adapters[i % len(adapters)])
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
    while engine.has_unfinished():
        for r in list(engine.requests):
            engine.abort(r)
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return {"step": med(total), "schedule": med(sched), "host batch": med(host), "gpu replay": med(replay),
            "sample": med(sample)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    shape = SHAPES[args.model]
    path = write_random_checkpoint(shape, scratch_dir(shape.checkpoint_bytes()), "cuda")
    engine = Engine.from_pretrained(path, device="cuda", dtype="bfloat16", max_loras=args.batch,
                                    max_num_seqs=args.batch, num_kv_blocks=args.batch * 40, max_model_len=640)
    ids = [f"a{i}" for i in range(args.batch)]
    for i, name in enumerate(ids):
        engine.add_adapter(name, _adapter(engine, i))
    rows = {"base": profile(engine, args.batch, [None], args.steps),
            f"{args.batch} distinct LoRA r16": profile(engine, args.batch, ids, args.steps)}
    cols = list(next(iter(rows.values())))
    print(f"\n{torch.cuda.get_device_name()}; {args.model}; batch {args.batch}; median ms per decode step")
    print(f"{'workload':<24}" + "".join(f"{c:>12}" for c in cols))
    for name, row in rows.items():
        print(f"{name:<24}" + "".join(f"{row[c]:>12.2f}" for c in cols))


if __name__ == "__main__":
    main()
