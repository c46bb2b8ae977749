"""Mixed-step CUDA graphs on a GPU: greedy tokens identical with them on and off (every
graphable family, prefix-cache hits, chunked prompts, decodes beside prefills), steps
with prefills replaying captured graphs, and none captured after warm-up."""
from __future__ import annotations

import random

import pytest
import torch

from adapterserve import Engine, SamplingParams
from tests.helpers.families import ADAPTERHUB, every_family

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

MODEL = ADAPTERHUB / "tiny-llama"
CONFIG = {"device": "cuda", "dtype": "float32", "max_loras": 8, "block_size": 16, "max_num_seqs": 8,
          "max_num_batched_tokens": 256, "num_kv_blocks": 512, "enable_prefix_caching": True, "seed": 3}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return every_family(MODEL, tmp_path_factory.mktemp("mixed-graphs-gpu"))


def _serve(engine: Engine, adapters: dict, seed: int) -> dict[str, list[int]]:
    """Two waves over shared prompt heads (the second hits the prefix cache), requests
    arriving while others decode, prompts longer than a step; request id -> greedy tokens."""
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    rng = random.Random(seed)
    names = [None, *adapters]
    heads = {name: [rng.randrange(3, 200) for _ in range(rng.choice([20, 70, 300]))] for name in names}
    requests = []
    for wave in range(2):
        for i, name in enumerate(names):
            prompt = heads[name] + [rng.randrange(3, 200) for _ in range(rng.choice([1, 9, 40]))]
            sampling = SamplingParams(max_tokens=rng.choice([4, 12]), temperature=0.0, ignore_eos=True)
            requests.append(engine.add_request(prompt, sampling, name, request_id=f"{wave}-{i}-{name}"))
            if i % 2:
                engine.step()
        while engine.has_unfinished():
            engine.step()
    return {r.request_id: r.output_ids for r in requests}


def test_greedy_tokens_identical_with_mixed_graphs_on_and_off(adapters):
    off = Engine.from_pretrained(MODEL, warmup=False, mixed_graph_tokens=0, **CONFIG)
    on = Engine.from_pretrained(MODEL, warmup=False, mixed_graph_tokens=128, **CONFIG)
    assert off.runner.mixed_graphs is None and on.runner.mixed_graphs.buckets == [16, 32, 64, 128]
    want, got = _serve(off, adapters, seed=1), _serve(on, adapters, seed=1)
    assert got == want
    mixed = on.runner.mixed_graphs
    assert mixed.replays > 0 and mixed.num_graphs > 0  # steps with prefills replayed captured graphs
    assert all(isinstance(graph, torch.cuda.CUDAGraph) for graph, _ in mixed._graphs.values())
    assert on.stats.prefix_hits > 0


def test_no_mixed_graph_is_captured_after_warm_up(adapters):
    engine = Engine.from_pretrained(MODEL, mixed_graph_tokens=128, **CONFIG)
    report = engine.warmup
    mixed = engine.runner.mixed_graphs
    assert report is not None and report.mixed_graphs == mixed.num_graphs > 0
    assert {key[0] for key in mixed._graphs} == set(mixed.buckets)
    before = (set(mixed._graphs), set(engine.runner.graphs._graphs))
    replays = mixed.replays
    # bottlenecks of two activations (swish, gelu) replay the graphs warm-up captured with none resident
    _serve(engine, {k: adapters[k] for k in ("lora", "ia3", "houlsby", "pfeiffer", "prefix")}, seed=2)
    assert mixed.replays > replays
    after = (set(mixed._graphs), set(engine.runner.graphs._graphs))
    assert after == before, f"captured after warm-up: {after[0] - before[0]} {after[1] - before[1]}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_replay_mixed_graphs_in_lockstep(adapters):
    """TP=2 (worker on cuda:1, NCCL collectives inside the captured graphs) with mixed
    graphs, warmed up, against one GPU with them off: greedy tokens identical, steps with
    prefills replayed, nothing captured after warm-up."""
    graphable = {k: adapters[k] for k in ("lora", "ia3", "prefix")}
    one = Engine.from_pretrained(MODEL, warmup=False, mixed_graph_tokens=0, **CONFIG)
    settings = {**CONFIG, "device": "cuda:0", "tensor_parallel_launch": "local"}
    two = Engine.from_pretrained(MODEL, tensor_parallel_size=2, mixed_graph_tokens=128, **settings)
    try:
        mixed = two.runner.mixed_graphs
        keys, replays = set(mixed._graphs), mixed.replays
        assert _serve(two, graphable, seed=3) == _serve(one, graphable, seed=3)
        assert mixed.replays > replays and set(mixed._graphs) == keys
    finally:
        two.close()
