"""First request after ready against steady state: time to first token of the first
request an engine serves (right after its construction, warm-up included) and the
median of the requests after it, one at a time, each a long prompt on an adapter of
its own; and the engine's start-up time (construction, of which warm-up). For the first and
the second request it also says what each paid that a warm one would not: Triton kernel
variants first used (compiled or loaded from disk), the CUDA caching allocator's new device
allocations, and the wall time of each engine step."""
from __future__ import annotations

import statistics
import time


from adapterserve.config import EngineConfig
from adapterserve.engine.sampling_params import SamplingParams
from benchmarks.backbone import Backbone
from benchmarks.random_adapters import AdapterFactory
from benchmarks.measure import device_allocs, kernel_variants, sync
from benchmarks.workloads import Settings, make_prompts

LATER = 8  # requests after the first whose median is the steady state


def measure_first_request(backbone: Backbone, factory: AdapterFactory, s: Settings) -> dict:
    n = 1 + LATER
    prompts = make_prompts(n, backbone.model.cfg.vocab_size, (s.prompt_range[1], s.prompt_range[1]), s.seed + 11)
    longest = len(prompts[0]) + 2 * s.block_size
    config = EngineConfig(device=s.device, dtype=s.dtype, max_loras=n, max_lora_rank=16, block_size=s.block_size,
                          num_kv_blocks=2 * n * (-(-longest // s.block_size)) + 8, max_num_seqs=64,
                          max_num_batched_tokens=s.max_batched_tokens, max_model_len=longest, seed=s.seed)
    try:
        started = time.perf_counter()
        engine = backbone.engine(config)
        start_s = time.perf_counter() - started
        warmup_s = engine.warmup.seconds if engine.warmup is not None else None
        warmup = engine.warmup.summary() if engine.warmup is not None else None
        for i in range(n):
            engine.add_adapter(f"a{i}", factory.lora(i))
        costs: list[dict] = []
        ttfts = [_ttft(engine, prompt, f"a{i}", s.device, costs) for i, prompt in enumerate(prompts)]
    finally:
        engine = None
        backbone.reset()
    steady = statistics.median(ttfts[1:])
    return {"start_s": start_s, "warmup_s": warmup_s, "warmup": warmup, "first_ms": 1e3 * ttfts[0],
            "steady_ms": 1e3 * steady,
            "first_x": ttfts[0] / steady, "prompt": len(prompts[0]), "first_costs": costs[0], "second_costs": costs[1]}


def _ttft(engine, prompt: list[int], adapter_id: str, device: str, costs: list[dict]) -> float:
    """Seconds from add_request to the request's first token (it alone in the engine); what it
    paid (``_cold_costs``) appended to costs."""
    kernels, allocs = kernel_variants(), device_allocs(device)
    sync(device)
    started = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), adapter_id)
    steps_ms = []
    while not request.finished:
        step_started = time.perf_counter()
        engine.step()
        steps_ms.append(1e3 * (time.perf_counter() - step_started))
    took = time.perf_counter() - started
    costs.append({"kernels": sorted(kernel_variants() - kernels), "device_allocs": device_allocs(device) - allocs,
                  "steps_ms": steps_ms})
    return took


def cold_cost_lines(row: dict) -> list[str]:
    """Where the warm-up went, and what the first and second requests paid, for the log."""
    lines = [f"  {row['warmup']}"] if row.get("warmup") else []
    for which in ("first", "second"):
        cost = row.get(f"{which}_costs")
        if cost:
            steps = ", ".join(f"{ms:.1f}" for ms in cost["steps_ms"])
            lines.append(f"  {which} request: steps {steps} ms; {cost['device_allocs']} new device allocations; "
                         f"{len(cost['kernels'])} kernel variants first used")
            lines += [f"    {kernel[:200]}" for kernel in cost["kernels"]]
    return lines


def first_request_line(name: str, row: dict) -> str:
    if "error" in row:
        return f"{name} first request: {row['error']}"
    warmup = "no warm-up" if row["warmup_s"] is None else f"warm-up {row['warmup_s']:.1f} s"
    return (f"{name} start-up {row['start_s']:.1f} s ({warmup}); first request after ready: TTFT "
            f"{row['first_ms']:.0f} ms vs steady {row['steady_ms']:.0f} ms (median of {LATER}), "
            f"{row['first_x']:.2f}x, {row['prompt']}-token prompt on a LoRA of its own (target <= 1.10x)")
