"""Warm-up at engine start: compile every kernel variant and capture every decode
graph the configuration can reach (engine/warmup_variants.py names them), before the
engine exists for anyone else, so the first request after ready runs compiled code.

Throwaway requests run through the real step path: adapters of every family with
zero weights (scratch ids, unloaded afterwards), prompts whose token counts land in
each kernel class, a decode row beside a prompt, every penalty combination, seeded
sampling, and with stacked LoRA a step of as many distinct adapters as make it run the
grouped expand (with the fused linear, steps of few rows over more adapters than it takes:
the separate kernels at those sizes). A step's adapters are placed (their copies
landed) before its requests are added, so the scheduler admits them together and the step
has the planned size.
Decode graphs are captured directly for every key the engine's DecodeGraphs can replay
(its buckets x family mixes x, with stacked LoRA, the GEMM's row buckets and expands),
and so are the mixed-step graphs (MixedGraphs: its token buckets x the same keys). The
throwaway steps then run with mixed-step graphs off, so they compile the eager kernels
that steps the graphs exclude (prompt tuning, pooling, steps above the largest bucket) run.
Afterwards no request, adapter, KV block, prefix-cache entry or slot of the warm-up
remains, and the engine's counters (stats, prefix-cache hits, slot loads) start from zero.

    engine = Engine(model, tokenizer, EngineConfig(device="cuda"))   # warms up (config.warmup)
    engine.warmup.summary()   # "warm-up: 37 kernel variants and 84 graphs (48 for steps with prefills) in 41.2 s;
                              #  slowest: graphs lora, decode buckets 1..64 12.0 s, ..."
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import torch

from adapterserve.adapters_store.formats.families import (
    Adapter,
    Ia3Adapter,
    PrefixAdapter,
    PromptAdapter,
)
from adapterserve.adapters_store.formats.types import (
    BOTTLENECK_POSITIONS,
    BottleneckAdapter,
    BottleneckModule,
    LoraAdapter,
    LoraModule,
)
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_host import TOKEN_FAMILIES
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.engine.stats import EngineStats
from adapterserve.engine.warmup_variants import (
    PENALTY_USES,
    SEGMENT_FAMILIES,
    EngineShape,
    Variant,
    context_variants,
    decode_attention,
    graph_plan,
    reachable,
    runs_stacked,
    segment_variants,
)
from adapterserve.kernels.stacked import (
    FUSED_MAX_ADAPTERS,
    FUSED_MAX_TOKENS,
    GROUPED_MIN_ADAPTERS,
    STACKED_MAX_TOKENS,
    choose_expand,
)
from adapterserve.layers.context import get_context
from adapterserve.layers.ia3_places import WIDEST

log = logging.getLogger("adapterserve.engine")

SCRATCH = "\0warmup:"  # id prefix of the warm-up's adapters and requests
SCRATCH_RANK = 8
SLOWEST_SHOWN = 5  # warm-up tasks the summary names, slowest first


def should_warm_up(config: EngineConfig) -> bool:
    """config.warmup: True warms up on CUDA devices only; "force" everywhere (tests)."""
    return config.warmup == "force" or (config.warmup is True and torch.device(config.device).type == "cuda")


@dataclass
class WarmupReport:
    variants: int  # kernel variants the configuration can reach (graphs not counted)
    graphs: int  # graphs captured (decode and mixed-step)
    seconds: float
    reached: set[Variant] = field(default_factory=set)  # what the warm-up's steps launched
    missing: set[Variant] = field(default_factory=set)  # reachable, not reached (logged as a warning)
    mixed_graphs: int = 0  # of `graphs`, those for steps with prefills
    task_seconds: dict[str, float] = field(default_factory=dict)  # each task's wall time (compiling included)

    def slowest(self) -> list[tuple[str, float]]:
        """The SLOWEST_SHOWN tasks that took longest, slowest first."""
        return sorted(self.task_seconds.items(), key=lambda item: -item[1])[:SLOWEST_SHOWN]

    def summary(self) -> str:
        slowest = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in self.slowest())
        return (f"warm-up: {self.variants} kernel variants and {self.graphs} graphs ({self.mixed_graphs} for steps "
                f"with prefills) in {self.seconds:.1f} s" + (f"; slowest: {slowest}" if slowest else ""))


def warm_up(engine) -> WarmupReport:
    """Run every reachable variant once; the engine's state and counters are as before."""
    started = time.perf_counter()
    shape = EngineShape.of(engine)
    wanted = reachable(shape)
    reached: set[Variant] = set()
    tasks = _tasks(engine, shape, reached)
    task_seconds: dict[str, float] = {}
    hook = engine.model.register_forward_pre_hook(lambda _module, args: reached.update(context_variants(
        shape, get_context(), args[0].shape[0], engine.lora_pool.stacked_rows(), engine.pools.ia3.graph_part())))
    try:
        for i, (label, task) in enumerate(tasks, 1):
            log.info("warm-up %d/%d: %s", i, len(tasks), label)
            task_seconds[label] = task_seconds.get(label, 0.0) + _timed(task, engine.config.device)
    finally:
        hook.remove()
        _reset_counters(engine)
    graphs = engine.runner.graphs.num_graphs if engine.runner.graphs is not None else 0
    mixed = engine.runner.mixed_graphs.num_graphs if engine.runner.mixed_graphs is not None else 0
    kernels = {v for v in wanted if v[0] != "graph"}
    report = WarmupReport(len(kernels), graphs + mixed, time.perf_counter() - started, reached, wanted - reached,
                          mixed, task_seconds)
    if report.missing:
        log.warning("warm-up did not reach %d variants (they compile on first use): %s", len(report.missing),
                    sorted(map(str, report.missing))[:8])
    log.info(report.summary())
    return report


def _timed(task: Callable[[], None], device: str) -> float:
    """Seconds the task took, its GPU work finished."""
    started = time.perf_counter()
    task()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _reset_counters(engine) -> None:
    engine.blocks.forget_idle()  # no real prompt may hit a warm-up block in the prefix cache
    engine.stats = EngineStats()
    engine.slots.loads = engine.slots.evictions = 0
    engine._last_progress = time.monotonic()


# the plan


def _tasks(engine, shape: EngineShape, reached: set[Variant]) -> list[tuple[str, Callable[[], None]]]:
    run = _Runner(engine)
    scratch = scratch_adapters(engine)
    tasks: list[tuple[str, Callable[[], None]]] = []
    if shape.buckets is not None:
        tasks += _graph_tasks(engine, shape)
    else:
        tasks += _eager_decode_tasks(run, shape)
    first_eager = len(tasks)
    tasks += _prefill_tasks(run, shape, scratch)
    tasks += _grouped_tasks(run, shape, scratch)
    tasks += _tiled_beside_fused_tasks(run, shape, scratch)
    tasks += _mixed_tasks(run, shape)
    for use in PENALTY_USES:
        tasks.append((f"penalties {use}", lambda use=use: (run.penalties(use), reached.add(("penalties", use)))))
    sampled = SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, top_k=8, seed=0, ignore_eos=True)
    tasks.append(("sampling", lambda: run.wave([([1, 2], sampled, None)])))
    return tasks[:first_eager] + [(label, lambda t=task: _without_mixed_graphs(engine, t))
                                  for label, task in tasks[first_eager:]]


def _without_mixed_graphs(engine, task: Callable[[], None]) -> None:
    """Run a task's steps eagerly (rank 0 decides, the other ranks follow its StepInputs)."""
    device, mixed = engine.runner.device_part, engine.runner.device_part.mixed_graphs
    device.mixed_graphs = None
    try:
        task()
    finally:
        device.mixed_graphs = mixed


def _graph_tasks(engine, shape: EngineShape) -> list:
    """One task per (family mix, stacked rows, (IA)^3 tier) of graph_plan, all the graphs' buckets each. No
    adapter need be resident: the ops read every slot's state on the device, so a graph with
    bottleneck rows serves bottlenecks of every activation."""
    groups: dict[tuple[frozenset[str], int, str | None], list[int]] = {}
    for bucket, families, rows, tier in graph_plan(shape):
        groups.setdefault((families, rows, tier), []).append(bucket)
    return [(f"graphs {_names(f)}{_rows(r)}{_tier(t)}, decode buckets {b[0]}..{b[-1]}",
             lambda f=f, r=r, t=t, b=b: _capture(engine, b, f, r, t)) for (f, r, t), b in groups.items()]


def _capture(engine, buckets: list[int], families: frozenset[str], rows: int, tier: str | None) -> None:
    """Capture these decode buckets' graphs, and every mixed-step bucket's (in the widest (IA)^3
    tier only: Ia3Pool.for_step), with the stacked GEMMs covering `rows` pool rows (as when
    adapters fill them), the (IA)^3 scales of ``tier`` (None: no (IA)^3 rows), and the signature
    the engine would then replay with."""
    flags = tuple(f in families for f in TOKEN_FAMILIES)
    mixed = engine.runner.mixed_graphs if tier in (None, WIDEST) else None  # mixed steps: the widest tier only
    with engine.pools.covering(rows, tier or WIDEST):
        for bucket in buckets:
            engine.runner.capture_graph(bucket, flags, rows)  # on every tensor-parallel rank
        for bucket in mixed.buckets if mixed is not None else ():
            engine.runner.capture_graph(bucket, flags, rows, mixed=True)


def _rows(rows: int) -> str:
    return f" (stacked rows {rows})" if rows else ""


def _tier(tier: str | None) -> str:
    return f" ((IA)^3 {tier} scales)" if tier else ""


def acquire_landed(engine, adapter_id: str, adapter: Adapter) -> int | None:
    """The adapter's slot, referenced once, its placement copies landed; None: no room."""
    for _ in range(100):
        slot = engine.slots.acquire(adapter_id, adapter)
        if slot is not None or torch.device(engine.config.device).type != "cuda":
            return slot
        torch.cuda.synchronize()
    return None


def _place(engine, adapter_id: str, adapter: Adapter) -> None:
    """Leave the adapter resident (idle) with its copies landed, where there is room:
    requests added for it next are admitted at once, in the step the plan counts them in
    (else they wait for room, and the report names what that leaves unreached)."""
    slot = acquire_landed(engine, adapter_id, adapter)
    if slot is not None:
        engine.slots.release(slot)


def _eager_decode_tasks(run: "_Runner", shape: EngineShape) -> list:
    """Without graphs: one decode step per (split-KV, tile, table width) choice."""
    tasks = []
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    for variant, (batch, prompt) in sorted(_decode_representatives(run.engine, shape).items()):
        tasks.append((f"decode {batch} x {prompt + 1} keys: {variant[1:]}",
                      lambda b=batch, p=prompt: run.wave([(run.prompt(p), sampling, None) for _ in range(b)])))
    return tasks


def _decode_representatives(engine, shape: EngineShape) -> dict[Variant, tuple[int, int]]:
    """The cheapest (batch, prompt length) whose decode step launches each decode variant;
    a batch of several must prefill in one step (so it decodes in one) and fit the KV cache."""
    best: dict[Variant, tuple[int, int]] = {}
    for width in range(1, shape.max_pages + 1):
        prompt = max(1, (width - 1) * shape.page)
        if prompt + 2 > engine.max_model_len:
            break
        for batch in range(1, shape.max_num_seqs + 1):
            if (batch > 1 and batch * prompt > shape.max_tokens) or batch * width > engine.blocks.num_blocks:
                break
            variant = decode_attention(shape, batch, width)
            if variant not in best or batch * prompt < best[variant][0] * best[variant][1]:
                best[variant] = (batch, prompt)
    return best


def _prefill_tasks(run: "_Runner", shape: EngineShape, scratch: dict[str, Adapter]) -> list:
    """Each group of scratch adapters (as many as slots allow) in one prompt step per
    kernel class of the token count."""
    per_group = max(1, min(run.engine.config.max_loras, shape.max_num_seqs - 1))
    ids = list(scratch)
    tasks = []
    for start in range(0, len(ids), per_group):
        group = {i: scratch[i] for i in ids[start : start + per_group]}
        minimum = sum(1 + a.num_virtual for a in group.values()) + 1
        for tokens in class_sizes(shape, minimum):
            label = f"prompts of {tokens} tokens: base, {', '.join(i.removeprefix(SCRATCH) for i in group)}"
            tasks.append((label, lambda g=group, t=tokens: run.with_adapters(g, lambda: run.family_step(g, t))))
    return tasks


def class_sizes(shape: EngineShape, minimum: int) -> list[int]:
    """The smallest step size >= minimum of each combination of adapter-kernel classes (a step
    of one LoRA adapter: the stacked expand it chooses)."""
    sizes: dict[frozenset, int] = {}
    for tokens in range(max(2, minimum), shape.max_tokens + 1):
        one = (choose_expand(1, tokens, shape.fused_rows),)
        sizes.setdefault(frozenset(segment_variants(shape, tokens, SEGMENT_FAMILIES, one)), tokens)
    return sorted(sizes.values())


def _grouped_tasks(run: _Runner, shape: EngineShape, scratch: dict[str, Adapter]) -> list:
    """Stacked LoRA: one prompt step of GROUPED_MIN_ADAPTERS distinct scratch LoRA adapters
    (the grouped expand), where a step can hold that many."""
    tokens = min(shape.max_tokens, STACKED_MAX_TOKENS)
    if not runs_stacked(shape, tokens) or "grouped" not in shape.expands(tokens) \
            or GROUPED_MIN_ADAPTERS > shape.max_num_seqs:
        return []
    return [(f"prompts of {GROUPED_MIN_ADAPTERS} LoRA adapters (the grouped stacked expand)",
             _lora_step(run, scratch, [1] * GROUPED_MIN_ADAPTERS))]


def _tiled_beside_fused_tasks(run: _Runner, shape: EngineShape, scratch: dict[str, Adapter]) -> list:
    """lora_decode="fused": a step of at most FUSED_MAX_TOKENS rows and one adapter runs the
    fused linear, so the segment kernels' classes at those sizes need steps of
    FUSED_MAX_ADAPTERS + 1 distinct adapters: one per class."""
    count = FUSED_MAX_ADAPTERS + 1
    if not shape.fused_rows or count > shape.max_num_seqs:
        return []
    sizes = {}  # the segment kernels' classes -> the largest step of them
    for tokens in range(count, min(FUSED_MAX_TOKENS, shape.max_tokens) + 1):
        if runs_stacked(shape, tokens) and "tiled" in shape.expands(tokens):
            sizes[frozenset(segment_variants(shape, tokens, ("lora",), ("tiled",)))] = tokens
    return [(f"prompts of {tokens} tokens over {count} LoRA adapters (the segment kernels)",
             _lora_step(run, scratch, [tokens - count + 1] + [1] * (count - 1))) for tokens in sorted(sizes.values())]


def _lora_step(run: _Runner, scratch: dict[str, Adapter], lengths: list[int]) -> Callable[[], None]:
    """One prompt step: a prompt of each length, each on a distinct scratch LoRA adapter."""
    lora = scratch[f"{SCRATCH}lora"]
    group = {f"{SCRATCH}lora-{i}": Adapter("lora", lora=lora.lora) for i in range(len(lengths))}
    once = SamplingParams(max_tokens=1, ignore_eos=True)
    return lambda: run.with_adapters(group, lambda: run.wave([(run.prompt(n), once, a)
                                                               for n, a in zip(lengths, group)]))


def _mixed_tasks(run: "_Runner", shape: EngineShape) -> list:
    """A decode row beside a prompt (the prefill kernel's two launches), for each class
    of block-table width."""
    engine, page, tasks = run.engine, shape.page, []
    for width in (1, 3, 16):
        prompt = min(width * page - 2, shape.max_tokens - 1) if width == 1 else (width - 1) * page + 1
        fits = prompt >= 2 and prompt + 1 <= engine.max_model_len  # longer than a step: prefilled in chunks
        if fits and width <= shape.max_pages:
            tasks.append((f"a decode beside a {prompt}-token prompt", lambda p=prompt: run.mixed(p)))
    return tasks


def _names(families: frozenset[str]) -> str:
    return "+".join(sorted(families)) or "base"


# scratch adapters


def scratch_adapters(engine) -> dict[str, Adapter]:
    """Zero-weight adapters of every family the engine serves, under scratch ids."""
    spec, cfg, mcfg = engine.backbone_spec, engine.config, engine.model_config
    rank = min(SCRATCH_RANK, cfg.max_lora_rank)
    modules = {(layer, kind): LoraModule(torch.zeros(rank, k), torch.zeros(n, rank), 1.0)
               for layer in range(spec.num_layers) for kind, (k, n) in spec.linear_shapes.items()}
    virtual = min(4, cfg.max_virtual_tokens)
    prefix = min(cfg.block_size + 1, cfg.max_virtual_tokens)
    kv = torch.zeros(mcfg.num_layers, prefix, mcfg.num_kv_heads, mcfg.head_dim)
    out = {
        "lora": Adapter("lora", lora=LoraAdapter(modules)),
        "ia3": Adapter("ia3", ia3=Ia3Adapter({}, frozenset())),
        "prompt": Adapter("prompt_tuning", prompt=PromptAdapter(torch.zeros(virtual, mcfg.hidden_size))),
        "prefix": Adapter("prefix_tuning", prefix=PrefixAdapter(kv, kv.clone())),
    }
    if any(p.family == "bottleneck" for p in engine.slots.pools):
        width, dim = min(SCRATCH_RANK, cfg.max_bottleneck_rank), mcfg.hidden_size
        zero = BottleneckModule(torch.zeros(width, dim), torch.zeros(width), torch.zeros(width, dim),
                                torch.zeros(dim), "relu")  # one for all: the kernels read each slot's activation
        mods = {(layer, place): zero for layer in range(mcfg.num_layers) for place in BOTTLENECK_POSITIONS}
        out["bottleneck"] = Adapter("bottleneck", bottleneck=BottleneckAdapter(mods, False))
    return {f"{SCRATCH}{name}": adapter for name, adapter in out.items()}


# throwaway requests


class _Runner:
    """Throwaway requests through the engine's own add_request / step loop."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.vocab = engine.model_config.vocab_size
        self.ids = count()
        self.random = random.Random(0)

    def prompt(self, n: int) -> list[int]:
        """n random token ids (nothing a prefix cache could match)."""
        return [self.random.randrange(self.vocab) for _ in range(n)]

    def _add(self, prompt: list[int], sampling: SamplingParams, adapter_id: str | None):
        return self.engine.add_request(prompt, sampling, adapter_id, request_id=f"{SCRATCH}{next(self.ids)}")

    def wave(self, specs: list[tuple[list[int], SamplingParams, str | None]]) -> None:
        """Add every (prompt, sampling, adapter id) at once; step until all finished."""
        self._finish([self._add(*spec) for spec in specs])

    def _finish(self, requests: list) -> None:
        self.engine._run_to_completion(requests)
        failed = [r.error for r in requests if r.error is not None]
        if failed:
            raise RuntimeError(f"a warm-up request failed: {failed[0]}") from failed[0]

    def with_adapters(self, adapters: dict[str, Adapter], work: Callable[[], None]) -> None:
        """`work` with the adapters added and resident (see _place), then unloaded."""
        for adapter_id, adapter in adapters.items():
            self.engine.add_adapter(adapter_id, adapter)
        try:
            for adapter_id, adapter in adapters.items():
                _place(self.engine, adapter_id, adapter)
            work()
        finally:
            for adapter_id in adapters:
                self.engine.unload_adapter(adapter_id)

    def family_step(self, adapters: dict[str, Adapter], tokens: int) -> None:
        """One prompt per adapter plus a base one, `tokens` new tokens in all, one step."""
        limit = self.engine.max_model_len - 1
        rows = [(a, adapters[a].num_virtual, adapters[a].num_virtual + adapters[a].prefix_len) for a in adapters]
        rows.append((None, 0, 0))
        lengths = [1] * len(rows)
        left = tokens - sum(1 + virtual for _, virtual, _ in rows)
        for i, (_, virtual, extra) in enumerate(rows):
            more = max(0, min(left, limit - extra - lengths[i]))
            lengths[i] += more
            left -= more
        once = SamplingParams(max_tokens=1, ignore_eos=True)  # no decode: no graph for this adapter mix
        self.wave([(self.prompt(n), once, a) for (a, _, _), n in zip(rows, lengths)])

    def mixed(self, prompt: int) -> None:
        """A two-token request decoding in the steps that prefill a `prompt`-token one (in
        chunks when it is longer than a step: the decode lasts until its last chunk)."""
        chunks = -(-prompt // max(1, self.engine.config.max_num_batched_tokens - 1))
        first = self._add(self.prompt(2), SamplingParams(max_tokens=chunks + 3, ignore_eos=True), None)
        self.engine.step()
        second = self._add(self.prompt(prompt), SamplingParams(max_tokens=1, ignore_eos=True), None)
        self._finish([first, second])

    def penalties(self, use: tuple[bool, bool, bool]) -> None:
        sampling = SamplingParams(max_tokens=1, ignore_eos=True, repetition_penalty=1.1 if use[0] else 1.0,
                                  frequency_penalty=0.5 if use[1] else 0.0, presence_penalty=0.5 if use[2] else 0.0)
        self.wave([(self.prompt(2), sampling, None)])
