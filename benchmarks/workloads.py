"""The benchmark's workloads: which adapter each request uses, and the engine built
for it around an already loaded backbone (one backbone, a fresh Engine per run).

Per workload the engine gets just the adapter slots and LoRA pool rows it needs
(every adapter of the batch resident at once; Zipf: a fixed number of slots), KV
blocks for every request's prompt, virtual tokens and output, and max_model_len
set to the longest request, so block tables stay narrow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.config import EngineConfig
from adapterserve.engine.engine import Engine
from adapterserve.engine.graphs import BUCKETS
from adapterserve.engine.warmup import acquire_landed
from benchmarks.backbone import Backbone
from benchmarks.measure import ColdCheck, StepTrace, decode_summary, floor_for, run_requests, sync
from benchmarks.random_adapters import BOTTLENECK_RANK, AdapterFactory, decode_read_bytes

WORKLOADS = ("base", "one", "uniform8", "distinct", "zipf", "ranks", "families")
# named only: every request on one adapter while RESIDENT_IDLE others stay resident, idle (their slots
# placed before the run); the floor counts the one adapter only, so x floor shows what idle ones cost.
# one-of-64: the used adapter placed first (the pool's lowest rows); one-over-64: placed last, above the
# idle ones (the fused linear's window then begins at its rows: kernels/stacked_fused.py)
IDLE_WORKLOADS = ("one-of-64", "one-over-64")
RESIDENT_IDLE = 63
# named only: families' requests of one family (fam-lora, fam-ia3, ...) on their adapters, the rest on
# the base model: what each family adds to a families step
FAMILY_PARTS = ("lora", "ia3", "prompt", "prefix", "bottleneck")
EXTRA_WORKLOADS = IDLE_WORKLOADS + tuple(f"fam-{f}" for f in FAMILY_PARTS)
# a workload name may end in a variant suffix: the same requests, an engine option changed
# (+r64: the pool sized for rank 64, the engine's default, whatever the adapters' ranks;
# +1s: LoRA shrinks on the compute stream, as before lora_side_stream became the default;
# +st: decode LoRA through the stacked [W; A] GEMM, lora_decode="stacked"; +fu / +ke: lora_decode "fused" /
# "kernels" (the default, "auto", is "fused" on sm_90 and later);
# +dg / +dgt: decode_gemm "auto" / "triton"; with --dtype fp8, +d8 / +dw: fp8_gemm "decode_w8a8" /
# "decode_weight_only"; +pe / +po: pdl "early" / "off" (the engine's default, "auto", is early for an
# FP8 backbone on our decode GEMM); +kv8: kv_cache_dtype "fp8"; +ad / +fd: decode_attention_dots "input" / "float32" (the default, "auto": input);
# +pf4 / +pf8: weight_prefetch 4 / 8 (K chunks of weight rows asked of L2 before the PDL wait; with PDL on));
VARIANTS = {"+1s": {"lora_side_stream": False}, "+r64": {"max_lora_rank": 64}, "+st": {"lora_decode": "stacked"},
            "+fu": {"lora_decode": "fused"}, "+ke": {"lora_decode": "kernels"}, "+dg": {"decode_gemm": "auto"}, "+dgt": {"decode_gemm": "triton"},
            "+d8": {"fp8_gemm": "decode_w8a8"}, "+dw": {"fp8_gemm": "decode_weight_only"},
            "+pe": {"pdl": "early"}, "+po": {"pdl": "off"}, "+kv8": {"kv_cache_dtype": "fp8"},
            "+ad": {"decode_attention_dots": "input"}, "+fd": {"decode_attention_dots": "float32"},
            "+pf4": {"weight_prefetch": 4}, "+pf8": {"weight_prefetch": 8}}
PEFT_ID = "peft-file"


@dataclass
class Plan:
    name: str
    adapter_ids: list[str | None]  # one per request
    adapters: dict[str, Adapter] = field(default_factory=dict)  # registered with add_adapter
    files: dict[str, Path] = field(default_factory=dict)  # registered with load_adapter (PEFT directories)
    max_loras: int = 1
    max_rank: int = 16
    pool_rows: int = 16
    cold: bool = False  # evict every adapter after warm-up: the run includes its slot loads
    resident: bool = False  # place every adapter in a slot before the warm-up (idle ones stay resident)
    engine_options: dict = field(default_factory=dict)  # EngineConfig fields of a variant
    note: str = ""


@dataclass(frozen=True)
class Settings:
    device: str
    dtype: str
    max_tokens: int
    prompt_range: tuple[int, int]
    block_size: int
    max_batched_tokens: int
    zipf_adapters: int
    zipf_slots: int
    zipf_alpha: float
    seed: int
    fp8_gemm: str = "auto"  # EngineConfig.fp8_gemm with dtype fp8 (a variant may change it)
    engine_warmup: bool = True  # EngineConfig.warmup (off: only this benchmark's warm-up runs first)


def make_prompts(batch: int, vocab: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, size=batch)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in sizes]


def plan(name: str, batch: int, factory: AdapterFactory, peft_dir: Path | dict, s: Settings,
         bottleneck: bool) -> Plan:
    """``peft_dir``: the PEFT LoRA directory, or the error entry of writing it."""
    for suffix, options in VARIANTS.items():
        if name.endswith(suffix):
            variant = plan(name.removesuffix(suffix), batch, factory, peft_dir, s, bottleneck)
            variant.name, variant.engine_options = name, {**variant.engine_options, **options}
            return variant
    if name == "base":
        return Plan(name, [None] * batch)
    if name == "one":
        if not isinstance(peft_dir, Path):
            raise RuntimeError(f"no PEFT LoRA directory: {peft_dir.get('error')}")
        return Plan(name, [PEFT_ID] * batch, files={PEFT_ID: peft_dir}, note="PEFT files")
    if name in IDLE_WORKLOADS:
        ids = [f"i{i}" for i in range(RESIDENT_IDLE + 1)]
        adapters = {a: factory.lora(i) for i, a in enumerate(ids)}
        used, idle = (ids[0], "above") if name == "one-of-64" else (ids[-1], "below")
        return Plan(name, [used] * batch, adapters, max_loras=len(ids), pool_rows=16 * len(ids), resident=True,
                    note=f"1 adapter used, {RESIDENT_IDLE} idle resident {idle} it")
    if name == "uniform8":
        ids = [f"u{i % 8}" for i in range(batch)]
        return _lora_plan(name, ids, factory, {a: 16 for a in ids})
    if name == "distinct":
        ids = [f"d{i}" for i in range(batch)]
        return _lora_plan(name, ids, factory, {a: 16 for a in ids})
    if name == "ranks":
        ids = [f"r{i}" for i in range(batch)]
        return _lora_plan(name, ids, factory, {a: (8, 16, 64)[i % 3] for i, a in enumerate(ids)})
    if name == "zipf":
        return _zipf_plan(batch, factory, s)
    if name == "families":
        return families_plan(batch, factory, bottleneck)
    if name in EXTRA_WORKLOADS:  # fam-<family>
        return families_plan(batch, factory, bottleneck, only=name.removeprefix("fam-"))
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS + EXTRA_WORKLOADS)}")


def _lora_plan(name: str, ids: list[str], factory: AdapterFactory, ranks: dict[str, int]) -> Plan:
    adapters = {a: factory.lora(i, r) for i, (a, r) in enumerate(ranks.items())}
    return Plan(name, ids, adapters, max_loras=len(adapters), max_rank=max(ranks.values()),
                pool_rows=sum(ranks.values()))


def _zipf_plan(batch: int, factory: AdapterFactory, s: Settings) -> Plan:
    weights = 1.0 / np.arange(1, s.zipf_adapters + 1) ** s.zipf_alpha
    picks = np.random.default_rng(s.seed + 7).choice(s.zipf_adapters, size=batch, p=weights / weights.sum())
    ids = [f"z{k}" for k in picks]
    adapters = {f"z{k}": factory.lora(k) for k in range(s.zipf_adapters)}
    slots = min(s.zipf_slots, s.zipf_adapters)
    return Plan("zipf", ids, adapters, max_loras=slots, pool_rows=slots * 16, cold=True,
                note=f"{len(set(ids))} distinct/{s.zipf_adapters}, {slots} slots")


def families_plan(batch: int, factory: AdapterFactory, bottleneck: bool, only: str | None = None) -> Plan:
    """A distinct adapter of each family in turn, and base rows; only: that family's rows keep their
    adapters, the others run on the base model."""
    families = ["lora", "ia3", "prompt", "prefix"] + (["bottleneck"] if bottleneck else []) + ["base"]
    if only is not None and only not in families:
        raise ValueError(f"this engine has no {only} adapters")
    ids: list[str | None] = []
    adapters: dict[str, Adapter] = {}
    for i in range(batch):
        family = families[i % len(families)]
        if family == "base" or only not in (None, family):
            ids.append(None)
            continue
        ids.append(f"f{i}-{family}")
        adapters[ids[-1]] = factory.family(family, i)
    loras = sum(a.lora is not None for a in adapters.values())
    note = "+".join(families) + ("" if bottleneck else "; no bottleneck in engine")
    note = note if only is None else f"the {only} rows of families"
    return Plan("families" if only is None else f"fam-{only}", ids, adapters, max_loras=max(1, len(adapters)), pool_rows=16 * max(1, loras), note=note)


def engine_config(p: Plan, prompts: list[list[int]], virtual: list[int], s: Settings) -> EngineConfig:
    """Capacity for this plan: every request resident at once, nothing to spare."""
    bs = s.block_size
    longest = max(len(x) + v for x, v in zip(prompts, virtual)) + s.max_tokens
    blocks = sum(-(-(len(x) + v + s.max_tokens + 1) // bs) + 1 for x, v in zip(prompts, virtual))
    prefix_blocks = sum(-(-a.prefix_len // bs) for a in p.adapters.values())
    fields = dict(
        device=s.device, dtype=s.dtype, max_loras=p.max_loras, max_lora_rank=p.max_rank,
        lora_pool_rows=max(p.pool_rows, p.max_rank), max_bottleneck_rank=BOTTLENECK_RANK, block_size=bs,
        num_kv_blocks=blocks + prefix_blocks + 8, max_num_seqs=len(prompts),
        max_num_batched_tokens=s.max_batched_tokens, max_model_len=-(-(longest + 2 * bs) // bs) * bs,
        cuda_graphs=True, seed=s.seed, fp8_gemm=s.fp8_gemm, warmup=s.engine_warmup,
    )
    fields.update(p.engine_options)
    fields["lora_pool_rows"] = max(fields["lora_pool_rows"], fields["max_lora_rank"])
    return EngineConfig(**fields)


def supports_bottleneck(backbone: Backbone, s: Settings) -> bool:
    """Whether the engine has a bottleneck-adapter pool (asked of a minimal engine, which runs no
    request: no warm-up)."""
    config = EngineConfig(device=s.device, dtype=s.dtype, max_loras=1, max_lora_rank=16, num_kv_blocks=4,
                          max_num_seqs=1, max_num_batched_tokens=64, max_model_len=32, cuda_graphs=False,
                          warmup=False)
    try:
        engine = backbone.engine(config)
        return any(getattr(pool, "family", None) == "bottleneck" for pool in engine.slots.pools)
    finally:
        engine = None
        backbone.reset()


def register(engine: Engine, p: Plan) -> None:
    for adapter_id, adapter in p.adapters.items():
        engine.add_adapter(adapter_id, adapter)
    for adapter_id, path in p.files.items():
        engine.load_adapter(adapter_id, path)
    if p.resident:
        for adapter_id in p.adapters:
            _place(engine, adapter_id)


def _place(engine: Engine, adapter_id: str) -> None:
    """Leave the adapter resident and idle in a slot, its copies landed."""
    slot = acquire_landed(engine, adapter_id, engine.adapters[adapter_id])
    if slot is None:
        raise RuntimeError(f"no slot for {adapter_id!r}")
    engine.slots.release(slot)


def warm_up(engine: Engine, trace: StepTrace, p: Plan, timed: list[list[int]], vocab: int, s: Settings) -> None:
    """Same adapters, short prompts; request i stops after 1 + (buckets >= batch - i)
    tokens, so the decode batch shrinks through every graph bucket, keeping the
    requests added last (as the timed run's tail does). Then the timed prompts for two
    tokens each: the same prefill steps (whole prompts and chunks, beside the decodes of
    requests whose prompts are done) compile their kernel variants now, not in the timed run."""
    batch = len(timed)
    buckets = [b for b in BUCKETS if b < batch] + [batch]
    max_tokens = [1 + sum(b >= batch - i for b in buckets) for i in range(batch)]
    prompts = make_prompts(batch, vocab, (4, min(24, s.prompt_range[0])), s.seed + 1)
    run_requests(engine, trace, prompts, p.adapter_ids, max_tokens)
    run_requests(engine, trace, timed, p.adapter_ids, [2] * batch)


def run_workload(backbone: Backbone, p: Plan, prompts: list[list[int]], s: Settings, bandwidth: float) -> dict:
    """Warm up, then time the workload; the summary row (without the adapter tax)."""
    batch, model = len(prompts), backbone.model
    engine = None
    try:
        virtual = [_virtual(p.adapters.get(a)) for a in p.adapter_ids]
        started = time.perf_counter()
        engine = backbone.engine(engine_config(p, prompts, virtual, s))
        start_s = time.perf_counter() - started  # construction, the engine's own warm-up included
        register(engine, p)
        trace = StepTrace(engine)
        warm_up(engine, trace, p, prompts, model.cfg.vocab_size, s)
        if p.cold:
            for adapter_id in list(engine.slots.slot_of):
                engine.slots.evict(adapter_id)
        loads = engine.slots.loads
        reset_peak(s.device)
        sync(s.device)
        cold = ColdCheck(engine)
        run = run_requests(engine, trace, prompts, p.adapter_ids, [s.max_tokens] * batch)
        first_met = cold.since()
        floor = floor_for(model, _adapter_bytes(engine, p, model), bandwidth)
        row = decode_summary(run, batch, floor)
        row.update({"loads": engine.slots.loads - loads, "peak_gib": peak_gib(s.device),
                    "note": "; ".join(x for x in (p.note, _cold_note(first_met)) if x), "cold": first_met,
                    "start_s": start_s, "warmup_s": engine.warmup.seconds if engine.warmup is not None else None})
        return row
    finally:
        engine = None
        backbone.reset()


def _cold_note(first_met: dict[str, int]) -> str:
    """The row's note when its timed run compiled or captured anything (its TTFT and run tok/s carry it)."""
    if not any(first_met.values()):
        return ""
    return f"timed run met {first_met['kernels']} kernel variants, {first_met['graphs']} graphs first"


def _virtual(adapter: Adapter | None) -> int:
    return 0 if adapter is None else adapter.num_virtual + adapter.prefix_len


def _adapter_bytes(engine: Engine, p: Plan, model) -> dict[str, int]:
    size = model.embed_tokens.weight.element_size()
    return {a: decode_read_bytes(engine.adapters[a], size) for a in set(p.adapter_ids) if a is not None}


def reset_peak(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / 2**30

