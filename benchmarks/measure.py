"""Timing primitives: copy bandwidth, driving an engine step by step, the floor.

A step's wall time is the time ``engine.step()`` takes: it returns host token
ids, so it ends after the device's work for that step. Steps are classified from
the batch the scheduler handed out (a wrapper around ``scheduler.schedule`` keeps a
reference, no copy): a decode step is one where every request has one new token.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from adapterserve.engine.engine import Engine
from adapterserve.engine.request import Request
from adapterserve.engine.sampling_params import SamplingParams

T = TypeVar("T")


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def capture(run: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured in a CUDA graph, and what the capture returned (run once on a side stream
    first, off the capture, so that cuBLAS and Triton pick and load their kernels)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    return graph, outs


def graph_ms(run: Callable[[], object]) -> float:
    """Median ms of one CUDA graph replay of `run` (captured by `capture`)."""
    import triton.testing

    graph, _ = capture(run)
    return triton.testing.do_bench(graph.replay, return_mode="median")


def copy_bandwidth(device: str, nbytes: int, iters: int = 10, trials: int = 3) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting read + write bytes."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    best = 0.0
    for _ in range(trials):
        sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        sync(device)
        best = max(best, 2 * nbytes * iters / (time.perf_counter() - start))
    return best


@dataclass(frozen=True)
class Step:
    seconds: float
    size: int  # requests in the step
    decode: bool  # every request had exactly one new token
    context: int  # KV entries the step's requests attend (own tokens + prefix)
    adapters: frozenset[str]  # distinct adapter ids in the step


@dataclass
class Run:
    steps: list[Step] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # seconds, add_request -> first token
    tokens: int = 0  # generated tokens
    wall: float = 0.0  # seconds from the first add_request to the last token
    requests: list[Request] = field(default_factory=list)


class StepTrace:
    """Keeps the batch of the latest ``engine.step()``."""

    def __init__(self, engine: Engine) -> None:
        self.last = None
        inner = engine.scheduler.schedule

        def schedule():
            self.last = inner()
            return self.last

        engine.scheduler.schedule = schedule

    def step_of(self, seconds: float) -> Step:
        batch = self.last
        requests = batch.requests
        return Step(
            seconds=seconds,
            size=len(requests),
            decode=bool(requests) and all(n == 1 for n in batch.num_new_tokens),
            context=sum(r.num_tokens + r.prefix_len for r in requests),
            adapters=frozenset(r.adapter_id for r in requests if r.adapter_id is not None),
        )


def run_requests(engine: Engine, trace: StepTrace, prompts: list[list[int]], adapter_ids: list[str | None],
                 max_tokens: list[int], max_stall_s: float = 10.0) -> Run:
    """Submit every request at once, step until all finish, time each step. Steps that
    schedule nothing are normal while adapter copies land; max_stall_s of them is a stall."""
    run = Run()
    start = time.perf_counter()
    added: dict[str, float] = {}
    for prompt, adapter_id, n in zip(prompts, adapter_ids, max_tokens):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        request = engine.add_request(prompt, params, adapter_id)
        added[request.request_id] = time.perf_counter()
        run.requests.append(request)
    last_progress = time.perf_counter()
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        step = trace.step_of(t1 - t0)
        if step.size:
            run.steps.append(step)
            last_progress = t1
        elif t1 - last_progress > max_stall_s:
            raise RuntimeError(f"engine stalled: {len(engine.scheduler.waiting)} requests wait and none can be "
                               "scheduled (adapter slots, LoRA pool rows, KV blocks or token budget)")
        for out in outputs:
            if out.request_id in added and out.token_ids:
                run.ttft.append(t1 - added.pop(out.request_id))
    run.wall = time.perf_counter() - start
    run.tokens = sum(len(r.output_ids) for r in run.requests)
    return run


@dataclass(frozen=True)
class Floor:
    """Bytes a decode step must read, over the measured copy bandwidth."""

    weight_bytes: int  # every weight once, lm_head included (an untied embedding: not counted)
    kv_bytes_per_token: int  # all layers, keys and values
    adapter_bytes: dict[str, int]  # adapter id -> bytes of its weights
    bandwidth: float  # bytes/s

    def seconds(self, context: int, adapters: frozenset[str]) -> float:
        total = self.weight_bytes + context * self.kv_bytes_per_token + sum(self.adapter_bytes[a] for a in adapters)
        return total / self.bandwidth


def floor_for(model, adapter_bytes: dict[str, int], bandwidth: float) -> Floor:
    cfg = model.cfg
    params = {id(p): p for p in model.parameters()}.values()
    weights = sum(p.numel() * p.element_size() for p in params)
    embed = model.embed_tokens.weight
    if not cfg.tie_word_embeddings:  # the step reads B rows of the input embedding, not all
        weights -= embed.numel() * embed.element_size()
    caches = [t for attn in model.attention_layers() for t in attn.cache_tensors()]
    if caches:  # as the engine stores them: an FP8 cache's entries and scales
        kv = sum(t[0].numel() * t.element_size() for t in caches)
    else:
        kv = cfg.num_layers * 2 * cfg.kv_size * embed.element_size()
    return Floor(weights, kv, adapter_bytes, bandwidth)


def decode_summary(run: Run, batch: int, floor: Floor) -> dict:
    """Median decode step (full-batch decode steps; all decode steps if fewer than 3
    ran at full batch) and its floor; tokens/s and TTFT over the whole run."""
    decode = [s for s in run.steps if s.decode]
    full = [s for s in decode if s.size == batch]
    chosen = full if len(full) >= 3 else decode
    out = {
        "tokens": run.tokens, "wall_s": run.wall, "run_tok_s": run.tokens / run.wall if run.wall else None,
        "ttft_ms": 1e3 * statistics.median(run.ttft) if run.ttft else None,
        "steps": len(run.steps), "decode_steps": len(decode), "full_decode_steps": len(full),
        "prefill_steps": len(run.steps) - len(decode),
    }
    if not chosen:
        return out
    step_s = statistics.median(s.seconds for s in chosen)
    floor_s = statistics.median(floor.seconds(s.context, s.adapters) for s in chosen)
    size = statistics.median(s.size for s in chosen)
    out.update({
        "decode_ms": 1e3 * step_s, "floor_ms": 1e3 * floor_s, "x_floor": step_s / floor_s,
        "decode_tok_s": size / step_s, "decode_batch": size,
        "distinct_adapters": statistics.median(len(s.adapters) for s in chosen),
        "avg_context": statistics.mean(s.context / s.size for s in chosen),
    })
    return out


def kernel_variants() -> set[str]:
    """Every Triton kernel variant adapterserve's kernels hold (name and specialisation key)."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return set()
    kernels = {id(v): v for name, module in list(sys.modules.items()) if name.startswith("adapterserve.kernels")
               for v in vars(module).values() if isinstance(v, JITFunction)}
    return {f"{fn.fn.__name__} {key}" for fn in kernels.values() for cache in fn.device_caches.values()
            for key in cache[0]}


def device_allocs(device: str) -> int:
    """cudaMalloc calls the caching allocator has made (0 off CUDA)."""
    return torch.cuda.memory_stats().get("num_device_alloc", 0) if device.startswith("cuda") else 0


def captured_graphs(engine: Engine) -> int:
    """Decode and mixed-step CUDA graphs the engine holds (0 without graphs)."""
    return sum(g.num_graphs for g in (engine.runner.graphs, engine.runner.mixed_graphs) if g is not None)


@dataclass
class ColdCheck:
    """What a run met for the first time, against a snapshot taken before it: Triton kernel
    variants (compiled, or loaded from the disk cache) and CUDA graphs captured."""

    engine: Engine
    kernels: set[str] = field(default_factory=kernel_variants)
    graphs: int = field(init=False)

    def __post_init__(self) -> None:
        self.graphs = captured_graphs(self.engine)

    def since(self) -> dict[str, int]:
        return {"kernels": len(kernel_variants() - self.kernels), "graphs": captured_graphs(self.engine) - self.graphs}
