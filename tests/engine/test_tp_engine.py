"""Tensor parallelism through the engine (CPU, gloo): an engine of tensor_parallel_size 2
(rank 0 here, rank 1 a spawned local process) against the same engine at size 1, on one
mixed batch of every family: greedy tokens identical, seeded sampling identical,
classifier probabilities within float32 tolerance; adapters hot-loaded and evicted while
requests run (more adapters than slots); each worker is sent only its part of an adapter
(bytes counted from the shapes), when it is added or, not shared, with its placement.
Failures and hostile sizes: test_tp_failures.py; the cut's pools: test_tp_shards.py."""
from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapterserve import Engine, SamplingParams
from adapterserve.adapters_store.cache import host_copy_bytes
from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.models.decoder_config import DecoderConfig
from tests.engine.test_all_families import _head_adapter
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
MODEL = FIXTURES / "tiny-llama"  # 4 heads, 2 KV heads, intermediate 160, vocab 512: divides by 2
SETTINGS = {"max_loras": 4, "block_size": 4, "max_num_batched_tokens": 64, "num_kv_blocks": 256,
            "tensor_parallel_launch": "local"}
PROBS_TOLERANCE = 1e-5  # classifier probabilities, float32, TP=2 against TP=1
EMBED_TOLERANCE = 1e-4  # pooled hidden states (RMS-normed, entries of order 1), float32


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp-adapters")
    configs = family_configs()
    dirs = {name: make_peft_adapter(MODEL, root / name, configs[name], seed=i)
            for i, name in enumerate(["ia3", "prompt", "prefix"])}
    dirs["lora-8"] = make_peft_lora(MODEL, root / "lora-8", r=8, lora_alpha=16, target_modules="all-linear", seed=1)
    dirs["lora-2"] = make_peft_lora(MODEL, root / "lora-2", r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"],
                                    rank_pattern={"down_proj": 4}, seed=2)
    dirs["houlsby"] = FIXTURES / "llama-houlsby"
    dirs["pfeiffer"] = FIXTURES / "llama-pfeiffer"
    dirs["head"] = _head_adapter(root / "head")
    return dirs


def engine_pair(adapter_dirs: dict[str, Path], **settings) -> Iterator[list[Engine]]:
    """(TP=1, TP=2) engines of these settings with every adapter registered; closed after."""
    pair = [Engine.from_pretrained(MODEL, tensor_parallel_size=size, **settings) for size in (1, 2)]
    for engine in pair:
        for name, path in adapter_dirs.items():
            engine.load_adapter(name, path)
    yield pair
    for engine in pair:
        engine.close()


@pytest.fixture(scope="module")
def engines(adapter_dirs):
    """(TP=1, TP=2) engines with every adapter registered; 4 slots for 8 adapters."""
    yield from engine_pair(adapter_dirs, **SETTINGS)


def _mixed_run(engine: Engine, names: list[str], sampling: SamplingParams, late: dict[str, Path] | None = None
               ) -> list[list[int]]:
    """Every adapter's request (and a base one) added one step apart, so adapters are placed
    and evicted while others run; their tokens in that order. ``late``: adapters loaded just
    before their request (hot-loaded mid-run), unloaded at the end."""
    late = late or {}
    prompts = [[5 + i, 17, 33 + 3 * i, 250, 7 * i + 2] for i in range(len(names) + 1)]
    requests = []
    for prompt, name in zip(prompts, [None, *names]):
        if name in late:
            engine.load_adapter(name, late[name])
        requests.append(engine.add_request(prompt, sampling, name))
        engine.step()
    engine._run_to_completion(requests)
    assert all(r.error is None for r in requests), [r.error for r in requests]
    for name in late:
        engine.unload_adapter(name)
    return [list(r.output_ids) for r in requests]


def test_greedy_tokens_equal_one_rank_for_every_family(engines, adapter_dirs):
    names = [n for n in adapter_dirs if n != "head"] + ["late-lora"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    late = {"late-lora": adapter_dirs["lora-8"]}
    one, two = (_mixed_run(engine, names, greedy, late) for engine in engines)
    assert one == two
    assert len({tuple(tokens) for tokens in one}) > len(names) // 2, "adapters changed nothing: a vacuous check"
    assert engines[1].slots.evictions > 0, "no adapter was evicted mid-run: raise the adapter count"


def test_seeded_sampling_equals_one_rank(engines):
    sampling = [SamplingParams(max_tokens=5, temperature=0.9, top_k=40, seed=11 + i, ignore_eos=True)
                for i in range(3)]
    prompts = [[3, 4, 5], [9, 8, 7, 6], [100, 200]]
    outs = [engine.generate(prompts, sampling, ["lora-8", None, "prompt"]) for engine in engines]
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_classify_equals_one_rank(engines):
    texts = [[5, 6, 7, 8], [40, 41]]
    one, two = (engine.classify(texts, "head") for engine in engines)
    for a, b in zip(one, two):
        assert a.label == b.label
        assert max(abs(x - y) for x, y in zip(a.probabilities, b.probabilities)) < PROBS_TOLERANCE


def test_embeddings_equal_one_rank(engines):
    texts = [[5, 6, 7, 8], [40, 41]]
    one, two = (engine.embed(texts, [None, "lora-8"]) for engine in engines)
    for a, b in zip(one, two):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < EMBED_TOLERANCE


def test_choices_forked_from_one_prompt_equal_one_rank(engines):
    """n > 1: the choices' KV blocks are copied from the first on every rank."""
    sampling = SamplingParams(max_tokens=5, temperature=0.9, seed=3, n=3, ignore_eos=True)
    one, two = (engine.generate([[11, 12, 13, 14, 15, 16, 17]], sampling, ["lora-8"]) for engine in engines)
    assert [o.token_ids for o in one] == [o.token_ids for o in two]
    assert len({tuple(o.token_ids) for o in one}) > 1, "the choices are all alike: a vacuous check"


ROW_PARALLEL = ("o_proj", "down_proj")  # the others are column-parallel


def _part_bytes(adapter: Adapter, cfg: DecoderConfig, world: int) -> int:
    """Bytes of one worker's part of a LoRA from the shapes alone: A whole and B's rows split
    on column-parallel projections, A's columns split and B whole on row-parallel ones."""
    total = 0
    for (_, kind), module in adapter.lora.modules.items():
        (rank, cols), (rows, _) = module.a.shape, module.b.shape
        split_a, split_b = (world, 1) if kind in ROW_PARALLEL else (1, world)
        total += (rank * cols // split_a + rows * rank // split_b) * module.a.element_size()
    return total


def test_workers_are_sent_only_their_part(engines, adapter_dirs):
    """A rank-8 LoRA on every projection: shared when added, then (the workers told to forget
    it) sent again with its placement; each message carries the worker's part and the
    overhead of the whole adapter's message at most, and the tokens equal TP=1's."""
    two = engines[1]
    sent = two.lockstep.adapter_bytes
    before = sent[1]
    for engine in engines:
        engine.load_adapter("cut-lora", adapter_dirs["lora-8"])
    adapter = two.adapters["cut-lora"]
    shared = sent[1] - before
    two.lockstep.forget(adapter)  # its placement now carries its part
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = [engine.generate([[9, 8, 7, 6, 5]], greedy, ["cut-lora"])[0].token_ids for engine in engines]
    placed = sent[1] - before - shared
    for engine in engines:
        engine.unload_adapter("cut-lora")
    assert outs[0] == outs[1]
    whole = len(pickle.dumps((0, dataclasses.replace(adapter, staged={})), protocol=pickle.HIGHEST_PROTOCOL))
    part = _part_bytes(adapter, two.model_config, 2)
    overhead = whole - host_copy_bytes(adapter)  # pickling's, for the same count of tensors
    assert part < 0.75 * host_copy_bytes(adapter)
    for message in (shared, placed):
        assert part <= message <= part + overhead + 1024, (message, part, whole)
