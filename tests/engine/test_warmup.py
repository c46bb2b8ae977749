"""Engine warm-up (engine/warmup.py) on the CPU: the variants it runs are every variant
the configuration can reach, as named by the kernels' own choosers; a mixed run
afterwards launches nothing outside them; nothing of the warm-up is left behind."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.engine.graphs import DecodeGraphs, decode_graph_limits
from adapterserve.engine.penalties import PenaltyState
from adapterserve.engine.request import Request
from adapterserve.engine.warmup import SLOWEST_SHOWN, should_warm_up
from adapterserve.engine.warmup_variants import (
    EngineShape,
    context_variants,
    graph_plan,
    reachable,
)
from adapterserve.kernels.stacked import GROUPED_MIN_ADAPTERS
from adapterserve.layers.context import get_context
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora

# small enough for the CPU, wide enough for two segment-kernel classes (gemv, dot16),
# two split-KV choices and every block-table width class
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=300, max_model_len=512, num_kv_blocks=200, max_loras=4,
              max_lora_rank=16, max_bottleneck_rank=16, cuda_graphs=False, seed=1)


@pytest.fixture(scope="module")
def warmed(llama_dir):
    return Engine.from_pretrained(llama_dir, warmup="force", **ENGINE)


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("warmup-adapters")
    out = {f"lora{r}": make_peft_lora(llama_dir, root / f"lora{r}", r=r, lora_alpha=2 * r, seed=r,
                                      target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]) for r in (4, 16)}
    configs = family_configs()
    for name in ("ia3", "prompt", "prefix"):
        out[name] = make_peft_adapter(llama_dir, root / name, configs[name], seed=len(name))
    return out


def _record(engine):
    """Variants of every forward pass from now on (a forward pre-hook), and its handle."""
    shape, seen = EngineShape.of(engine), set()
    handle = engine.model.register_forward_pre_hook(
        lambda _m, args: seen.update(context_variants(shape, get_context(), args[0].shape[0],
                                                      engine.lora_pool.stacked_rows())))
    return seen, handle


def _recorded_mixed_run(engine, adapters, seed: int):
    """_mixed_run's outputs and the kernel variants its forward passes used."""
    seen, handle = _record(engine)
    try:
        return _mixed_run(engine, adapters, seed), seen
    finally:
        handle.remove()


def _mixed_run(engine, adapters, seed: int):
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    try:
        import random

        rng = random.Random(seed)
        names = [None, *adapters]
        prompts = [[rng.randrange(3, 200) for _ in range(rng.choice([1, 3, 15, 16, 17, 40, 120, 280]))]
                   for _ in range(12)]
        sampling = [SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True)
                    for _ in prompts]
        return engine.generate(prompts, sampling, [names[i % len(names)] for i in range(len(prompts))])
    finally:
        for name in adapters:
            engine.unload_adapter(name)


def test_warm_up_reaches_every_variant_the_config_can_reach(warmed):
    report = warmed.warmup
    wanted = reachable(EngineShape.of(warmed))
    assert report.missing == set(), sorted(map(str, report.missing))
    assert wanted <= report.reached
    assert report.variants == len(wanted) > 0
    # the configuration reaches both segment classes, split-KV and every table width class
    assert {("segment", "lora", "gemv"), ("segment", "lora", "dot16"), ("segment", "bottleneck", "dot16"),
            ("ia3",)} <= wanted
    assert {v[1] for v in wanted if v[0] == "decode_attention"} == {1, 2}
    assert {v[2] for v in wanted if v[0] == "prefill_attention"} == {"1", "16k", "n"}
    assert report.seconds > 0 and "kernel variants" in report.summary()


def test_warm_up_times_each_task_and_names_the_slowest(warmed):
    report = warmed.warmup
    seconds = report.task_seconds
    assert len(seconds) > SLOWEST_SHOWN and all(s > 0 for s in seconds.values())
    assert sum(seconds.values()) <= report.seconds
    slowest = report.slowest()
    assert [s for _, s in slowest] == sorted(seconds.values(), reverse=True)[:SLOWEST_SHOWN]
    assert all(f"{label} {s:.1f} s" in report.summary() for label, s in slowest)


def test_warm_up_leaves_nothing_behind(warmed):
    assert warmed.requests == {} and not warmed.has_unfinished()
    assert warmed.list_adapters() == [] and warmed.slots.num_used == 0
    assert warmed.blocks.num_free == warmed.blocks.num_blocks
    assert warmed.config.enable_prefix_caching and warmed.blocks.num_cached == 0  # nothing a prompt could hit
    assert warmed.stats.prefix_queries == warmed.stats.prefix_hits == 0
    assert warmed.stats.snapshot().step_seconds.count == 0
    assert warmed.slots.loads == 0 and warmed.slots.evictions == 0


def test_a_mixed_run_launches_only_warmed_variants(warmed, adapters):
    outputs, seen = _recorded_mixed_run(warmed, adapters, seed=3)
    assert all(o.error is None for o in outputs)
    assert seen, "the hook saw no forward pass"
    assert seen <= warmed.warmup.reached, sorted(map(str, seen - warmed.warmup.reached))


def test_warm_up_changes_no_output(warmed, adapters, llama_dir):
    cold = Engine.from_pretrained(llama_dir, warmup=False, **ENGINE)
    assert cold.warmup is None
    expected = [o.token_ids for o in _mixed_run(cold, adapters, seed=4)]
    assert [o.token_ids for o in _mixed_run(warmed, adapters, seed=4)] == expected


def test_warm_up_runs_on_cuda_only_unless_forced():
    assert not should_warm_up(EngineConfig(device="cpu"))
    assert should_warm_up(EngineConfig(device="cpu", warmup="force"))
    assert not should_warm_up(EngineConfig(device="cuda", warmup=False))
    assert should_warm_up(EngineConfig(device="cuda"))


@pytest.mark.parametrize("value", ["yes", 2, None])
def test_a_bad_warmup_setting_is_refused(value):
    with pytest.raises(ValueError, match="warmup"):
        EngineConfig(warmup=value)


def test_decode_graphs_cover_exactly_the_decode_batches_a_step_can_hold(llama_dir):
    """A budget below max_num_seqs (neither a bucket) bounds decode batches: warm-up's
    graph keys are the buckets graphs.run can pick, each within the LoRA workspace."""
    engine = Engine.from_pretrained(llama_dir, max_num_seqs=20, max_num_batched_tokens=12, cuda_graphs=False,
                                    warmup=False, seed=1)
    sizes, handle = set(), engine.model.register_forward_pre_hook(
        lambda _m, args: sizes.add(args[0].shape[0]) if get_context().attention.decode else None)
    try:
        engine.generate([[5 + i, 6] for i in range(20)], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        handle.remove()
    engine.runner.enable_cuda_graphs(*decode_graph_limits(engine.config, engine.max_model_len))
    graphs = engine.runner.graphs
    planned = {bucket for bucket, *_ in graph_plan(EngineShape.of(engine))}
    assert max(sizes) == 12 and graphs.buckets[-1] == 12
    assert planned == {graphs.bucket_of(n) for n in range(1, 13)}
    assert max(planned) <= engine.runner.lora_workspace.shape[1]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        DecodeGraphs(engine.runner, 13, 4, 0)


def test_stacked_lora_warm_up_covers_its_row_buckets_and_expand_tiles(llama_dir, adapters):
    config = dict(ENGINE, lora_decode="stacked")
    engine = Engine.from_pretrained(llama_dir, warmup="force", **config)
    assert engine.warmup.missing == set(), sorted(map(str, engine.warmup.missing))
    grouped = {"grouped"} if GROUPED_MIN_ADAPTERS <= ENGINE["max_loras"] else set()
    assert {v[1] for v in engine.warmup.reached if v[0] == "stacked"} == {"tiled"} | grouped
    outputs, seen = _recorded_mixed_run(engine, adapters, seed=5)
    assert all(o.error is None for o in outputs)
    assert seen <= engine.warmup.reached, sorted(map(str, seen - engine.warmup.reached))
    # with graphs, every row bucket an adapter placement can make gets its own graphs
    engine.runner.enable_cuda_graphs(*decode_graph_limits(engine.config, engine.max_model_len))
    shape = EngineShape.of(engine)
    assert shape.row_buckets == (16, 32, 64)  # pool rows: max_loras 4 x rank 16
    plan = graph_plan(shape)
    assert {rows for _, families, rows, _ in plan if "lora" in families} == {16, 32, 64}
    assert {rows for _, families, rows, _ in plan if "lora" not in families} == {0}
    # a graph per stacked expand a bucket's rows can choose (the grouped one from 4 distinct adapters)
    graphs = {(v[1], v[4]) for v in reachable(shape) if v[0] == "graph" and "lora" in v[2]}
    assert graphs == {(b, e) for b in (1, 2, 4) for e in ("tiled", "grouped")
                      if e == "tiled" or b >= GROUPED_MIN_ADAPTERS}
    assert {v[4] for v in reachable(shape) if v[0] == "graph" and "lora" not in v[2]} == {None}


@pytest.mark.parametrize("fused_limit", [None, 16])
def test_fused_lora_warm_up_covers_the_fused_linear(llama_dir, adapters, fused_limit, monkeypatch):
    """lora_decode="fused": warm-up reaches the fused linear beside the stacked expands, a
    mixed run uses nothing it did not reach, and each bucket's graphs cover every choice. With
    the fused linear's row limit at 16 rows (below the pool's 64), one-adapter decode buckets
    also have the separate kernels' graphs, for adapters placed above it."""
    import adapterserve.kernels.stacked as stacked
    from adapterserve.kernels.stacked import reachable_expands

    if fused_limit:
        monkeypatch.setattr(stacked, "FUSED_MAX_ROWS", {size: fused_limit for size in stacked.FUSED_MAX_ROWS})
    engine = Engine.from_pretrained(llama_dir, warmup="force", **dict(ENGINE, lora_decode="fused"))
    assert engine.warmup.missing == set(), sorted(map(str, engine.warmup.missing))
    assert "fused" in {v[1] for v in engine.warmup.reached if v[0] == "stacked"}
    outputs, seen = _recorded_mixed_run(engine, adapters, seed=7)
    assert all(o.error is None for o in outputs)
    assert seen <= engine.warmup.reached, sorted(map(str, seen - engine.warmup.reached))
    engine.runner.enable_cuda_graphs(*decode_graph_limits(engine.config, engine.max_model_len))
    shape = EngineShape.of(engine)
    assert shape.fused_rows
    graphs = {(v[1], v[4]) for v in reachable(shape) if v[0] == "graph" and "lora" in v[2]}
    assert graphs == {(b, e) for b in (1, 2, 4) for r in shape.row_buckets
                      for e in reachable_expands(b, ENGINE["max_loras"], shape.fused_rows, rows=r)}
    assert ("fused" in {e for _, e in graphs}) and ("tiled" in {e for _, e in graphs})
    assert ((1, "tiled") in graphs) == (fused_limit is not None and max(shape.row_buckets) > fused_limit)


def test_fused_fp8_lora_warm_up_covers_the_fused_linear_and_the_segment_kernels(llama_dir, adapters):
    """lora_decode="fused" on FP8 weights: steps of few adapters run the fused linear, the
    others the segment kernels (no stacked expand); warm-up reaches both, a mixed run uses
    nothing it did not reach."""
    engine = Engine.from_pretrained(llama_dir, warmup="force", **dict(ENGINE, lora_decode="fused", dtype="fp8"))
    assert engine.warmup.missing == set(), sorted(map(str, engine.warmup.missing))
    shape = EngineShape.of(engine)
    assert shape.fused_rows and all(not linear.stacked.joint for _, linear in engine.model.adapter_linears())
    reached = engine.warmup.reached
    assert {v[1] for v in reached if v[0] == "stacked"} == {"fused"}
    assert {v[2] for v in reached if v[0] == "segment" and v[1] == "lora"} >= {"gemv", "dot16"}
    outputs, seen = _recorded_mixed_run(engine, adapters, seed=9)
    assert all(o.error is None for o in outputs)
    assert seen <= reached, sorted(map(str, seen - reached))


def test_warm_up_steps_find_their_adapters_resident(llama_dir):
    """A slot's copies land asynchronously on a GPU and the scheduler admits an adapter's
    requests only once they have: the warm-up places (and waits for) a step's adapters
    before adding its requests, so the prompts of a kernel class run in one step of the
    planned size with every family in it."""
    from adapterserve.engine.warmup import _Runner, class_sizes, scratch_adapters

    engine = Engine.from_pretrained(llama_dir, warmup=False, **ENGINE)
    run, scratch = _Runner(engine), scratch_adapters(engine)
    group = {i: scratch[i] for i in list(scratch)[:3]}  # lora, ia3, prompt: with the base row, max_num_seqs
    resident, steps = {}, []
    handle = engine.model.register_forward_pre_hook(lambda _m, args: steps.append(
        (args[0].shape[0], frozenset(f for f in ("lora", "ia3") if getattr(get_context(), f) is not None))))
    tokens = class_sizes(EngineShape.of(engine), 8)[-1]
    try:
        run.with_adapters(group, lambda: (resident.update({i: engine.slots.is_resident(i) for i in group}),
                                          run.family_step(group, tokens)))
    finally:
        handle.remove()
    assert resident and all(resident.values()), resident
    assert steps == [(tokens, frozenset({"lora", "ia3"}))]
    assert engine.slots.num_used == 0


@pytest.mark.parametrize("penalised, biased", [(1, 0), (2, 0), (3, 1), (2, 1), (1, 2)])
def test_penalty_rows_start_aligned_whatever_the_counts(penalised, biased):
    """One pointer alignment for the penalty kernel's row tensors (Triton compiles a
    variant per alignment; warm-up runs one)."""
    requests = ([Request([1, 2], SamplingParams(presence_penalty=0.5)) for _ in range(penalised)]
                + [Request([3], SamplingParams(logit_bias={7: 1.0})) for _ in range(biased)])
    step = PenaltyState(16, torch.device("cpu")).prepare(requests)
    for rows in (step.rows, step.table_rows):
        assert rows.shape == (penalised,) and rows.storage_offset() % 2 == 0  # int64: 16 bytes
    assert step.rows.tolist() == list(range(penalised))
    if biased:  # the bias rows follow (torch ops only read them)
        assert step.bias_rows.tolist() == list(range(penalised, penalised + biased))
