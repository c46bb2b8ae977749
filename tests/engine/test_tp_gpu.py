"""Tensor parallelism on 2 GPUs (NCCL): rank 0 on cuda:0, its worker (a local process) on
cuda:1. Decode steps replay CUDA graphs holding the collectives, captured by both ranks in
lockstep (at warm-up and on first use); greedy tokens of a mixed batch of every family equal
those of the engine on one GPU, seeded sampling too. A killed GPU worker: test_tp_failures.py."""
from __future__ import annotations

import pytest
import torch

from adapterserve import SamplingParams
from tests.engine.test_tp_engine import _mixed_run, adapter_dirs, engine_pair  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
GPU = {"device": "cuda:0", "max_loras": 4, "block_size": 16, "max_num_batched_tokens": 256, "num_kv_blocks": 256,
       "max_num_seqs": 16, "tensor_parallel_launch": "local"}


@pytest.fixture(scope="module")
def engines(adapter_dirs):  # noqa: F811
    """(one GPU, two GPUs), float32, CUDA graphs; the pair warms up (every graph captured ahead)."""
    yield from engine_pair(adapter_dirs, warmup=True, **GPU)


def test_greedy_tokens_equal_one_gpu_with_graphs(engines, adapter_dirs):  # noqa: F811
    names = [n for n in adapter_dirs if n != "head"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    one, two = (_mixed_run(engine, names, greedy) for engine in engines)
    assert one == two
    assert engines[1].runner.graphs.num_graphs > 0, "no decode graph was captured"
    assert engines[1].warmup.missing == engines[0].warmup.missing  # warm-up reaches what one GPU's reaches
    assert engines[1].warmup.graphs == engines[0].warmup.graphs


def test_decode_batch_replays_a_graph_on_both_ranks(engines):
    prompts = [[3 + i, 9, 27] for i in range(8)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    graphs_before = engines[1].runner.graphs.num_graphs
    outs = [engine.generate(prompts, greedy, ["lora-8"] * 4 + [None] * 4) for engine in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
    assert engines[1].runner.graphs.num_graphs == graphs_before, "a decode graph was captured after warm-up"


def test_seeded_sampling_equals_one_gpu(engines):
    sampling = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=5 + i, ignore_eos=True)
                for i in range(4)]
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    outs = [engine.generate(prompts, sampling, ["ia3", None, "houlsby", "prefix"]) for engine in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]
