"""Adapter hot-swap: moving one rank-16, all-projection adapter from host memory
into a GPU slot, and what that costs the requests already decoding.

1. Isolated: ``engine.slots.acquire`` of an adapter not resident (a free slot
   waits), synchronised before and after; median over several adapters.
2. Under load: ``batch - 1`` requests decode; one request arrives at a time, on a
   resident adapter or on one not yet in a slot, alternately. Each arrival's window
   runs from its add_request to its first token. The load's cost to the others is
   the window's time above plain decode steps, cold arrivals minus resident ones,
   in units of one decode step (a side-stream load that admits the request later
   shows as ~0).
"""
from __future__ import annotations

import statistics
import time

from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.sampling_params import SamplingParams
from benchmarks.backbone import Backbone
from benchmarks.measure import Step, StepTrace, sync
from benchmarks.random_adapters import BOTTLENECK_RANK, AdapterFactory
from benchmarks.workloads import Settings, make_prompts

RESIDENT = 8  # adapters of the running requests
GAP = 4  # plain decode steps between arrivals
WARM = 8  # decode steps before the first arrival


def measure_hotswap(backbone: Backbone, factory: AdapterFactory, s: Settings, batch: int, loads: int = 5,
                    arrivals: int = 3) -> dict:
    """Hot-swap timings on a batch of ``batch`` requests (``batch - 1`` running)."""
    events = ["resident"] + ["resident", "cold"] * arrivals  # the first one warms the mixed step
    max_tokens = WARM + len(events) * (GAP + 3) + 8
    cold_ids = [f"cold{j}" for j in range(loads + arrivals)]
    engine = None
    try:
        engine = backbone.engine(_config(batch, len(cold_ids), max_tokens, s))
        for i in range(RESIDENT):
            engine.add_adapter(f"hot{i}", factory.lora(i))
        for j, adapter_id in enumerate(cold_ids):
            engine.add_adapter(adapter_id, factory.lora(100 + j))
        load_ms = [_isolated_load(engine, a, s.device) for a in cold_ids[:loads]]
        trace = StepTrace(engine)
        windows, plain = _decode_with_arrivals(engine, trace, batch, events, cold_ids[loads:], max_tokens, s)
        return _summary(load_ms, windows[1:], plain, batch - 1)
    finally:
        engine = None
        backbone.reset()


def _config(batch: int, cold: int, max_tokens: int, s: Settings) -> EngineConfig:
    bs, prompt = s.block_size, s.prompt_range[0]
    per_request = -(-(prompt + max_tokens + 1) // bs) + 1
    slots = RESIDENT + cold
    return EngineConfig(
        device=s.device, dtype=s.dtype, max_loras=slots, max_lora_rank=16, lora_pool_rows=16 * slots,
        max_bottleneck_rank=BOTTLENECK_RANK, block_size=bs, num_kv_blocks=(batch + 1) * per_request + 8,
        max_num_seqs=batch, max_num_batched_tokens=s.max_batched_tokens, max_model_len=(per_request + 2) * bs,
        cuda_graphs=True, seed=s.seed,
    )


def _isolated_load(engine: Engine, adapter_id: str, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    slot = engine.slots.acquire(adapter_id, engine.adapters[adapter_id])  # held only if already landed
    sync(device)
    ms = 1e3 * (time.perf_counter() - start)
    if slot is not None:
        engine.slots.release(slot)
    engine.slots.evict(adapter_id)
    return ms


def _step(engine: Engine, trace: StepTrace) -> tuple[Step, int]:
    loads = engine.slots.loads
    start = time.perf_counter()
    engine.step()
    step = trace.step_of(time.perf_counter() - start)
    return step, engine.slots.loads - loads


def _decode_with_arrivals(engine: Engine, trace: StepTrace, batch: int, events: list[str], cold_ids: list[str],
                          max_tokens: int, s: Settings) -> tuple[list[dict], list[float]]:
    vocab = engine.model_config.vocab_size
    prompts = make_prompts(batch - 1 + len(events), vocab, (s.prompt_range[0],) * 2, s.seed + 3)
    running = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                  f"hot{i % RESIDENT}") for i, p in enumerate(prompts[: batch - 1])]
    plain: list[float] = []
    budget = iter(range(20 * max_tokens))  # guards every loop below against a stalled engine
    while engine.scheduler.waiting or len(plain) < WARM:
        _next(budget)
        step, _ = _step(engine, trace)
        if step.decode and step.size == batch - 1:
            plain.append(step.seconds)
    windows = []
    cold = iter(cold_ids)
    for kind, prompt in zip(events, prompts[batch - 1:]):
        adapter_id = f"hot{len(windows) % RESIDENT}" if kind == "resident" else next(cold)
        arrival = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                     adapter_id)
        window, loaded = [], 0
        while not arrival.output_ids:
            _next(budget)
            step, n = _step(engine, trace)
            window.append(step.seconds)
            loaded += n
        windows.append({"kind": kind, "steps": window, "loads": loaded})
        for _ in range(GAP):
            step, _ = _step(engine, trace)
            if step.decode and step.size == batch - 1:
                plain.append(step.seconds)
    for request in running:
        engine.abort(request.request_id)
    return windows, plain


def _next(budget) -> None:
    if next(budget, None) is None:
        raise RuntimeError("hot-swap run stalled: too many steps without progress")


def _summary(load_ms: list[float], windows: list[dict], plain: list[float], others: int) -> dict:
    decode_s = statistics.median(plain)

    def extra(kind: str) -> float:  # seconds a window took beyond plain decode steps
        return statistics.median(sum(t - decode_s for t in w["steps"]) for w in windows if w["kind"] == kind)

    delay_s = extra("cold") - extra("resident")
    return {
        "load_ms": statistics.median(load_ms), "load_ms_all": load_ms, "decode_ms": 1e3 * decode_s,
        "others": others, "resident_extra_ms": 1e3 * extra("resident"), "cold_extra_ms": 1e3 * extra("cold"),
        "delay_ms": 1e3 * delay_s, "delay_steps": delay_s / decode_s,
        "cold_loaded_in_window": all(w["loads"] > 0 for w in windows if w["kind"] == "cold"),
        "windows": [{"kind": w["kind"], "steps_ms": [1e3 * t for t in w["steps"]], "loads": w["loads"]}
                    for w in windows],
    }
