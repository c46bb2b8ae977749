"""Rank 0's host work per decode step, without the model's compute (CPU).

    python -m benchmarks.host_step                          # TP=1, B=64 and 256, base
    python -m benchmarks.host_step --tp 1,2 --adapters 64   # and TP=2 (gloo), a LoRA per request

A tiny random Llama (models/tiny.py) serves B requests of short prompts; after their
prefill, decode steps run through the decode-graph path (on the CPU a graph's replay
runs its forward eagerly) or, with --eager, the eager path. The model's forward (the
graph replay, or the backbone and logits) is timed apart and left out of the profile:
what remains is the host work that a GPU step must hide, the scheduler, the step's
inputs, the graph buffers' fill, the step message to the other ranks, sampling and the
engine's bookkeeping. One table: ms per step (wall, forward, host), Python calls per
step, then each configuration's functions by own time per step (cProfile, forward left out).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import AutoTokenizer

from adapterserve import Engine, SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.engine.graphs import decode_graph_limits
from adapterserve.engine.tp.worker import checkpoint_shard
from adapterserve.models.decoder_config import read_decoder_config
from adapterserve.models.tiny import write_tiny_checkpoint
from benchmarks.checkpoints import SHAPES
from benchmarks.random_adapters import AdapterFactory

PROMPT_TOKENS = 16
WARM_STEPS = 4


@dataclass(frozen=True)
class Setting:
    tp: int
    batch: int
    adapters: int  # distinct rank-16 LoRAs, one per request in turn; 0: base only
    eager: bool
    text: bool  # with the tokenizer: each new token detokenized (else ids only, as benchmarks/tp_decode.py)
    steps: int


@dataclass
class Measured:
    step_ms: float  # median wall time of engine.step()
    forward_ms: float  # median wall time in the model's forward (compute; under TP, the other ranks too)
    host_ms: float  # median wall time of a step less its forward
    host_cpu_ms: float  # median of the same in this thread's CPU time (what other processes take is left out)
    calls: float  # Python function calls per step outside the forward (cProfile)
    top: list[tuple[str, float, float]]  # (function, own ms per step under cProfile, calls per step)


class ForwardClock:
    """Times the model's forward on rank 0 (wall and this thread's CPU) and keeps it out of a
    profile: the graph replay (what a GPU runs from one launch) or, eagerly, the backbone and
    its logits."""

    def __init__(self, engine: Engine, eager: bool) -> None:
        self.profile: cProfile.Profile | None = None
        self.wall = self.cpu = 0.0
        if eager:
            self._wrap(engine.model, "forward")
            self._wrap(engine.model, "compute_logits")
        else:
            self._wrap(engine.runner.graphs, "_forward")

    def _wrap(self, owner: object, name: str) -> None:
        inner: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.profile is not None:
                self.profile.disable()
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu
                if self.profile is not None:
                    self.profile.enable()

        setattr(owner, name, timed)


def build_engine(model_dir: Path, s: Setting) -> Engine:
    length = PROMPT_TOKENS + WARM_STEPS + 2 * s.steps + 8  # decode graphs' tables as narrow as the run needs
    blocks = s.batch * (-(-length // 16) + 1)
    config = EngineConfig(
        device="cpu", dtype="float32", max_model_len=length, max_loras=max(s.adapters, 1), max_lora_rank=16,
        max_num_seqs=s.batch,
        max_num_batched_tokens=s.batch * PROMPT_TOKENS, num_kv_blocks=blocks, warmup=False,
        tensor_parallel_size=s.tp, tensor_parallel_launch="local", host_threads=1, lora_pool_rows=max(s.adapters, 1) * 16,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir)) if s.text else None
    build = partial(checkpoint_shard, str(model_dir), config.torch_dtype, None)
    engine = Engine.from_model(build, read_decoder_config(model_dir), tokenizer, config)
    if not s.eager:
        engine.runner.enable_cuda_graphs(*decode_graph_limits(engine.config, engine.max_model_len))
    factory = AdapterFactory(SHAPES["tiny"], "cpu")
    for i in range(s.adapters):
        engine.add_adapter(f"lora{i}", factory.lora(i))
    return engine


def measure(engine: Engine, s: Setting, top: int) -> Measured:
    """B requests decoding; s.steps timed steps, then s.steps profiled ones."""
    requests = start_decoding(engine, s)
    clock = ForwardClock(engine, s.eager)
    walls, forwards, hosts, host_cpus = timed_steps(engine, clock, s.steps)
    if not s.eager and not engine.runner.graphs.replays:
        raise RuntimeError("no decode step took the graph path")
    profile = cProfile.Profile()
    clock.profile = profile
    profile.enable()
    for _ in range(s.steps):
        engine.step()
    profile.disable()
    if any(r.finished for r in requests):
        raise RuntimeError("requests ended before the measured steps did")
    for r in list(engine.requests):
        engine.abort(r)
    stats = pstats.Stats(profile).stats  # {(file, line, function): (calls, primitive, own s, cum s, callers)}
    rows = sorted(stats.items(), key=lambda item: -item[1][2])
    named = [(f"{function} ({Path(file).name}:{line})", 1e3 * own / s.steps, calls / s.steps)
             for (file, line, function), (calls, _, own, _, _) in rows[:top]]
    calls = sum(v[0] for v in stats.values()) / s.steps
    med = statistics.median
    return Measured(1e3 * med(walls), 1e3 * med(forwards), 1e3 * med(hosts), 1e3 * med(host_cpus), calls, named)


def start_decoding(engine: Engine, s: Setting) -> list:
    """B requests added, prefilled and a few steps into their decode, long enough for 2 * s.steps more."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=WARM_STEPS + 2 * s.steps + 4, temperature=0.0, ignore_eos=True)
    names = [f"lora{i % s.adapters}" if s.adapters else None for i in range(s.batch)]
    requests = [engine.add_request(torch.randint(3, 500, (PROMPT_TOKENS,), generator=gen).tolist(), params, name)
                for name in names]
    while any(r.num_computed < r.num_virtual + len(r.prompt_ids) for r in requests):
        engine.step()  # prefill
    for _ in range(WARM_STEPS):
        engine.step()
    gc.collect()
    gc.freeze()  # setup's objects: a long-running server's old generation, not rescanned per step
    return requests


def timed_steps(engine: Engine, clock: ForwardClock, steps: int) -> tuple[list[float], ...]:
    """Per step: (wall s, forward wall s, host wall s, host CPU s of this thread)."""
    walls, forwards, hosts, host_cpus = [], [], [], []
    for _ in range(steps):
        clock.wall = clock.cpu = 0.0
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        walls.append(time.perf_counter() - wall)
        forwards.append(clock.wall)
        hosts.append(walls[-1] - clock.wall)
        host_cpus.append(time.thread_time() - cpu - clock.cpu)
    return walls, forwards, hosts, host_cpus


def run(settings: list[Setting], top: int) -> list[tuple[Setting, Measured]]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_checkpoint(Path(tmp) / "tiny", "llama", seed=1)
        for s in settings:
            engine = build_engine(model_dir, s)
            try:
                results.append((s, measure(engine, s, top)))
            finally:
                engine.close()
                del engine
                gc.unfreeze()
                gc.collect()
    return results


def report(results: list[tuple[Setting, Measured]]) -> str:
    lines = [(f"host work per decode step, rank 0, {platform.processor() or platform.machine()} CPU, "
              f"torch threads {torch.get_num_threads()}; tiny Llama, forward timed apart"),
             (f"{'tp':>3} {'batch':>5} {'adapters':>8} {'path':<6} {'text':<4} {'step ms':>8} {'forward':>8} "
              f"{'host ms':>8} {'host CPU':>8} {'calls/step':>10}")]
    for s, m in results:
        lines.append(f"{s.tp:>3} {s.batch:>5} {s.adapters:>8} {'eager' if s.eager else 'graph':<6} "
                     f"{'yes' if s.text else 'no':<4} {m.step_ms:>8.3f} {m.forward_ms:>8.3f} {m.host_ms:>8.3f} "
                     f"{m.host_cpu_ms:>8.3f} {m.calls:>10.0f}")
    for s, m in results:
        lines.append(f"\ntp={s.tp} batch={s.batch} adapters={s.adapters}: own time per step under cProfile (forward left out)")
        lines += [f"  {ms:7.3f} ms {calls:8.1f} calls  {name}" for name, ms, calls in m.top]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", default="1", help="tensor-parallel sizes, comma-separated (> 1: gloo, local workers)")
    p.add_argument("--batch", default="64,256", help="decode batch sizes, comma-separated")
    p.add_argument("--adapters", type=int, default=0, help="distinct LoRAs, one per request in turn; 0: base")
    p.add_argument("--eager", action="store_true", help="the eager path instead of the decode-graph path")
    p.add_argument("--text", action="store_true", help="with the tokenizer: every new token detokenized")
    p.add_argument("--steps", type=int, default=40, help="timed steps, then as many profiled")
    p.add_argument("--top", type=int, default=15, help="functions listed per configuration")
    args = p.parse_args(argv)
    settings = [Setting(int(tp), int(b), args.adapters, args.eager, args.text, args.steps)
                for tp in args.tp.split(",") for b in args.batch.split(",")]
    print(report(run(settings, args.top)))


if __name__ == "__main__":
    main()
