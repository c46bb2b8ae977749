"""Mixed-step graphs (engine/mixed_graphs.py) on the CPU: the padded forward a capture
records, run eagerly over the buckets' fixed buffers (CPU cannot capture; off CUDA
``CapturedSteps.replay`` runs that same forward), against the eager unpadded engine.

Two engines with the same weights and config serve the same requests in the same
order: every family in one run (LoRA, (IA)^3, Houlsby, Pfeiffer, prefix tuning; prompt
tuning too, whose steps stay eager), prompts chunked over several steps, prefix-cache
hits (a second wave sharing the first wave's prompt heads starts mid-sequence), decode
rows beside prefills. The sampled logits of every step match within 1e-4 (absolute,
float32; only the GEMMs' row counts differ) and the greedy tokens are identical.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.engine.graphs import graph_limits
from adapterserve.engine.mixed_graphs import MixedGraphs
from adapterserve.engine.step_device import StepInputs
from adapterserve.engine.warmup import warm_up
from adapterserve.kernels.stacked import FUSED_MAX_TOKENS, STACKED_MAX_TOKENS
from tests.helpers.families import ADAPTERHUB, every_family
from tests.helpers.recording import record_logits

MODEL = ADAPTERHUB / "tiny-llama"
CONFIG = {"max_loras": 8, "block_size": 4, "max_num_seqs": 6, "max_num_batched_tokens": 40, "num_kv_blocks": 400,
          "mixed_graph_tokens": 40, "enable_prefix_caching": True, "seed": 3}
ATOL = 1e-4


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return every_family(MODEL, tmp_path_factory.mktemp("mixed-graph-adapters"))


def _engine(adapters, padded: bool, **settings) -> Engine:
    engine = Engine.from_pretrained(MODEL, **{**CONFIG, **settings})
    if padded:
        cfg = engine.config
        engine.runner.enable_cuda_graphs(*graph_limits(cfg, engine.max_model_len))
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def _serve(engine: Engine, names: list[str | None], seed: int) -> dict[str, list[int]]:
    """Two waves over shared prompt heads (the second hits the prefix cache), requests
    arriving while others decode; request id -> greedy tokens."""
    rng = random.Random(seed)
    heads = {name: [rng.randrange(3, 200) for _ in range(rng.choice([9, 23, 30]))] for name in names}

    def tail() -> list[int]:
        return [rng.randrange(3, 200) for _ in range(rng.choice([1, 5, 14]))]

    waves = [[(f"{wave}-{i}-{name}", heads[name] + tail(), name) for i, name in enumerate(names)] for wave in range(2)]
    requests = []
    for wave in waves:
        for k, (request_id, prompt, name) in enumerate(wave):
            sampling = SamplingParams(max_tokens=rng.choice([3, 7]), temperature=0.0, ignore_eos=True)
            requests.append(engine.add_request(prompt, sampling, name, request_id=request_id))
            if k % 3 == 2:
                engine.step()  # later requests prefill beside earlier ones' decodes
        while engine.has_unfinished():
            engine.step()
    return {r.request_id: r.output_ids for r in requests}


@pytest.mark.parametrize("names", [
    [None, "lora", "ia3", "houlsby", "pfeiffer", "prefix"],
    [None, "lora", "prompt", "houlsby", "ia3"],
], ids=["graphable-families", "with-prompt-tuning"])
def test_padded_mixed_steps_match_the_eager_engine(adapters, names):
    eager, padded = _engine(adapters, False), _engine(adapters, True)
    logits = [record_logits(e) for e in (eager, padded)]
    tokens = [_serve(e, names, seed=7) for e in (eager, padded)]
    assert tokens[0] == tokens[1]
    assert logits[0].keys() == logits[1].keys()
    for request_id, steps in logits[0].items():
        assert len(steps) == len(logits[1][request_id]), request_id
        for step, (want, got) in enumerate(zip(steps, logits[1][request_id])):
            err = (want - got).abs().max().item()
            assert err <= ATOL, f"{request_id} step {step}: max |logits diff| {err:.2e} > {ATOL}"
    mixed = padded.runner.mixed_graphs
    assert mixed.replays >= 3 and padded.stats.prefix_hits > 0
    assert {key[0] for key in mixed._graphs} <= set(mixed.buckets)


@pytest.mark.parametrize("lora_decode", ["kernels", "stacked", "fused"])
def test_each_padded_step_equals_the_eager_step_on_the_same_inputs(adapters, lora_decode):
    """Every step the mixed graphs take, also run eagerly on the same inputs (both write
    the same KV entries): the generating rows' logits match, in buckets mostly padding.
    Stacked LoRA: the bucket's stacked GEMM and the expand chosen from the real rows."""
    engine = _engine({k: adapters[k] for k in ("lora", "houlsby", "ia3")}, True, lora_decode=lora_decode)
    device, compared = engine.runner.device_part, []
    forward = device.forward

    def both(inputs: StepInputs):
        logits, last = forward(inputs)
        if inputs.mixed:
            eager = dataclasses.replace(inputs, mixed=False)
            want, _ = forward(eager)
            compared.append((len(inputs.ids), device.mixed_graphs.bucket_of(len(inputs.ids))))
            torch.testing.assert_close(logits, want, atol=ATOL, rtol=0)
        return logits, last

    device.forward = both
    _serve(engine, [None, "lora", "houlsby", "ia3"], seed=11)
    assert any(tokens < bucket for tokens, bucket in compared)  # padding tokens and requests were there
    assert len({bucket for _, bucket in compared}) >= 2


def test_a_step_past_the_largest_bucket_runs_eagerly(adapters):
    engine = _engine({}, True)
    runner = engine.runner
    assert runner.mixed_graphs.buckets == [16, 32, 40]
    assert not runner.mixed_graphs.fits(41, 2, 1) and runner.mixed_graphs.fits(40, 6, 1)
    engine.generate([list(range(3, 120))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert runner.mixed_graphs.replays >= 3  # the prompt in chunks of at most 40 tokens


def test_mixed_graphs_refuse_a_bucket_above_the_step_capacity():
    engine = Engine.from_pretrained(MODEL, **CONFIG)
    with pytest.raises(ValueError, match="mixed_graph_tokens"):
        MixedGraphs(engine.runner.device_part, 41, 6, 8, 0)


def test_tensor_parallel_workers_replay_the_same_padded_step(adapters):
    """TP=2 (rank 1 a spawned local process, gloo) with mixed graphs against the eager
    TP=1 engine: the ranks all-reduce activations of the bucket's token count, so a rank
    that ran the unpadded step instead would fail the step; greedy tokens identical."""
    names = [None, "lora", "ia3", "houlsby", "prefix"]
    used = {k: adapters[k] for k in names if k}
    eager = _engine(used, False)
    settings = {**CONFIG, "max_loras": 4, "tensor_parallel_launch": "local"}
    tp = Engine.from_pretrained(MODEL, tensor_parallel_size=2, **settings)
    try:
        cfg = tp.config
        tp.runner.enable_cuda_graphs(*graph_limits(cfg, tp.max_model_len))  # rank 0 and, through the lockstep, rank 1
        for name, path in used.items():
            tp.load_adapter(name, path)
        assert _serve(tp, names, seed=5) == _serve(eager, names, seed=5)
        assert tp.runner.mixed_graphs.replays >= 3
    finally:
        tp.close()


@pytest.mark.parametrize("lora_decode", ["kernels", "stacked", "fused"])
def test_warm_up_plans_every_mixed_graph_key_a_run_reaches(adapters, lora_decode):
    """Warm-up over mixed graphs (off CUDA it records each key it would capture and runs its
    forward once): every variant reached; a run of
    every graphable family after it (bottlenecks of two activations, silu and gelu, which warm-up
    captured no graph for apart) adds no key, decode or mixed; the summary counts the mixed
    graphs. Stacked LoRA: keys per GEMM row bucket and expand. Graphs with (IA)^3 rows: decode
    graphs per (IA)^3 tier, mixed-step graphs in the widest tier only (the run's PEFT-default
    (IA)^3 adapter then adds none either)."""
    engine = _engine({}, True, lora_decode=lora_decode)
    report = warm_up(engine)
    assert report.missing == set(), sorted(map(str, report.missing))
    mixed, decode = engine.runner.mixed_graphs, engine.runner.graphs
    assert report.mixed_graphs == mixed.num_graphs and report.graphs == mixed.num_graphs + decode.num_graphs
    assert {key[2][1] for key in decode._graphs if key[1][1]} == {"peft", "all"}
    assert {key[2][1] for key in mixed._graphs if key[1][1]} == {"all"}
    assert {key[0] for key in mixed._graphs} == set(mixed.buckets)
    assert f"({mixed.num_graphs} for steps with prefills)" in report.summary()
    before = (set(mixed._graphs), set(decode._graphs))
    replays = mixed.replays
    names = [None, "lora", "ia3", "houlsby", "pfeiffer", "prefix"]
    for name in names[1:]:
        engine.load_adapter(name, adapters[name])
    _serve(engine, names, seed=13)
    assert mixed.replays > replays
    assert (set(mixed._graphs), set(decode._graphs)) == before


def test_buckets_past_the_stacked_limit_share_one_graph_over_row_buckets():
    """Stacked LoRA: a bucket above STACKED_MAX_TOKENS runs the segmented kernels, so its
    graph does not depend on the stacked GEMM's row bucket or expand; smaller ones do."""
    engine = _engine({}, True, lora_decode="stacked", max_num_batched_tokens=512, mixed_graph_tokens=512)
    mixed = engine.runner.mixed_graphs
    assert mixed.buckets[-3:] == [256, 384, 512] and STACKED_MAX_TOKENS == 256
    lora = (True, False, False)
    rows = [(("stacked_rows", r), (), ()) for r in (16, 32)]
    assert mixed.capture(384, lora, rows[0]) and not mixed.capture(384, lora, rows[1])
    assert mixed.capture(256, lora, rows[0]) and mixed.capture(256, lora, rows[1])
    assert {key[3] for key in mixed._graphs if key[0] == 384} == {None}


def test_the_fused_pool_keys_its_separate_kernel_graphs_without_the_row_bucket():
    """lora_decode="fused": a step the fused linear does not take (more tokens or adapters than
    it takes) runs the separate LoRA kernels, which read no row bucket, so one graph serves every
    bucket; the fused linear's own graphs stay one per row bucket."""
    engine = _engine({}, True, lora_decode="fused", max_num_batched_tokens=128, mixed_graph_tokens=128)
    mixed = engine.runner.mixed_graphs
    lora = (True, False, False)
    rows = [(("stacked_rows", r), (), ()) for r in (16, 32)]
    big = mixed.buckets[-1]
    assert big > FUSED_MAX_TOKENS  # the separate kernels only
    assert mixed.capture(big, lora, rows[0]) and not mixed.capture(big, lora, rows[1])
    small = mixed.buckets[0]
    assert mixed.capture(small, lora, rows[0], "fused") and mixed.capture(small, lora, rows[1], "fused")
    assert mixed.capture(small, lora, rows[0], "tiled") and not mixed.capture(small, lora, rows[1], "tiled")
    assert {key[3] for key in mixed._graphs if key[0] == big} == {None}
