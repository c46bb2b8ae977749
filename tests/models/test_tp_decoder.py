"""Tensor parallelism, model side: a tiny Llama loaded through the loader at TP=2 (two
spawned processes, gloo over a file store) gives the logits of TP=1 for one mixed batch of
every family (LoRA on every projection with mixed ranks, (IA)^3 on both kinds of layer,
Houlsby and Pfeiffer bottlenecks, prefix, prompt and P-tuning, base rows), in its prefill
and its decode step; so do the stacked LoRA layout, biases on every projection (untied,
two checkpoint files), FP8 (checkpoints with per-channel and block scales, and float ones
quantized at load), Qwen3 (q/k norm) and one KV head replicated on both ranks; each rank
reads only its shard of the checkpoint.

Tolerance: float32, |TP=2 - TP=1| <= 5e-5 absolute on logits of magnitude up to ~15 (the
ranks sum partial products in another order), FP8 included: quantized at load, the ranks
of a row-parallel layer agree on each row's scale, so they hold exactly TP=1's weights."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from adapterserve.layers.parallel import (
    SINGLE,
    TensorParallel,
    kv_head_span,
    split_span,
)
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.models.fp8_checkpoints import write_fp8_checkpoint
from tests.models.tp_mixed_batch import run_mixed_batch

FIXTURES = Path(__file__).parents[1] / "fixtures" / "adapterhub"
MODEL = FIXTURES / "tiny-llama"
WORLD = 2
ATOL = 5e-5


def _biased_checkpoint(out: Path) -> Path:
    """The tiny Llama's shape, untied, in two safetensors files, with q/k/v/o and MLP biases
    (row-parallel layers' biases are added once, after the all-reduce)."""
    write_tiny_checkpoint(out, "llama", tie_word_embeddings=False, seed=7, shards=2)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(attention_bias=True, mlp_bias=True)
    (out / "config.json").write_text(json.dumps(cfg))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    gen = torch.Generator().manual_seed(8)
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(out / file))
        for name in [n for n in tensors if n.endswith("_proj.weight")]:
            bias = name[: -len("weight")] + "bias"
            tensors[bias] = 0.1 * torch.randn(tensors[name].shape[0], generator=gen)
            index["weight_map"][bias] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def _wide_k_checkpoint(out: Path) -> Path:
    """The tiny Llama with one k_proj a head wider than its config says."""
    write_tiny_checkpoint(out, "llama", seed=9)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors[name] = torch.cat([tensors[name], tensors[name][:16]])
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp")
    adapters = {name: make_peft_adapter(MODEL, root / name, cfg, seed=i)
                for i, (name, cfg) in enumerate(family_configs().items())}
    adapters["lora-all"] = make_peft_lora(MODEL, root / "lora-all", r=8, lora_alpha=16, target_modules="all-linear")
    adapters["lora-mixed"] = make_peft_lora(
        MODEL, root / "lora-mixed", r=4, lora_alpha=8, seed=1,
        target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], rank_pattern={"v_proj": 16, "down_proj": 2})
    adapters["houlsby"] = FIXTURES / "llama-houlsby"
    adapters["pfeiffer"] = FIXTURES / "llama-pfeiffer"
    lora = {"lora-all": adapters["lora-all"], "lora-mixed": adapters["lora-mixed"]}
    biased = _biased_checkpoint(root / "biased")
    scenarios = {
        "mixed": (MODEL, adapters, {}),
        "stacked": (MODEL, lora, {"stacked": True}),
        "biased": (biased, {**lora, "ia3": adapters["ia3"]}, {}),
        "biased-stacked": (biased, lora, {"stacked": True}),
        "fp8-channel": (write_fp8_checkpoint(MODEL, root / "fp8-ch"), adapters, {"fp8_gemm": "reference"}),
        "fp8-block": (write_fp8_checkpoint(MODEL, root / "fp8-blk", "fp8-block"), lora, {}),
        "fp8-at-load": (MODEL, lora, {"fp8_gemm": "reference"}),
    }
    qwen3 = write_tiny_checkpoint(root / "qwen3", "qwen3", seed=5)  # q/k norm, head_dim 2 * hidden / heads
    scenarios["qwen3"] = (qwen3, {"lora": make_peft_lora(qwen3, root / "qwen3-lora", r=8, lora_alpha=16,
                                                         target_modules="all-linear")}, {})
    mqa = write_tiny_checkpoint(root / "mqa", "llama", num_key_value_heads=1, seed=6)  # its KV head on both ranks
    prefix = make_peft_adapter(mqa, root / "mqa-prefix", family_configs()["prefix"], seed=2)
    scenarios["mqa"] = (mqa, {"lora": make_peft_lora(mqa, root / "mqa-lora", r=8, lora_alpha=16,
                                                     target_modules="all-linear"), "prefix": prefix}, {})
    results = root / "results"
    results.mkdir()
    bad = _wide_k_checkpoint(root / "wide-k")
    mp.start_processes(_rank_main, args=(root / "store", scenarios, results, bad), nprocs=WORLD,
                       start_method="spawn")
    return {"scenarios": scenarios, "results": results}


def _rank_main(rank: int, store: Path, scenarios: dict, results: Path, bad: Path) -> None:
    """One rank: every scenario at TP=2, results saved for the test process."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(rank, WORLD, dist.group.WORLD)
        for name, (model_dir, adapters, options) in scenarios.items():
            result = run_mixed_batch(model_dir, adapters, tp, **options)
            torch.save(result.__dict__, results / f"{name}.{rank}.pt")
        _rank_facts(rank, tp, results, bad)
    finally:
        dist.destroy_process_group()


def _rank_facts(rank: int, tp: TensorParallel, results: Path, bad: Path) -> None:
    """The collectives' and shard's results, the error of a TensorParallel claiming another
    world size (or rank) than its group, and of loading a checkpoint with a misshapen shard."""
    from adapterserve.models.loader import load_decoder

    x = torch.arange(6.0).view(2, 3) + 10 * rank
    facts = {
        "shard": tp.shard(torch.arange(6), 0).tolist(),
        "all_reduce": tp.all_reduce_(x.clone()).tolist(),
        "all_gather": tp.all_gather(x, dim=-1).tolist(),
        "all_gather_0": tp.all_gather(x, dim=0).tolist(),
        "errors": [],
    }
    for claim in ((rank, 4), (1 - rank, WORLD)):
        try:
            TensorParallel(claim[0], claim[1], dist.group.WORLD)
            facts["errors"].append("")
        except ValueError as err:
            facts["errors"].append(str(err))
    try:
        load_decoder(bad, torch.float32, "cpu", tp=tp)
        facts["errors"].append("")
    except ValueError as err:
        facts["errors"].append(str(err))
    (results / f"facts.{rank}.json").write_text(json.dumps(facts))


def _tp2(setup: dict, name: str, rank: int) -> dict:
    return torch.load(setup["results"] / f"{name}.{rank}.pt")


def _tp1(setup: dict, name: str):
    model_dir, adapters, options = setup["scenarios"][name]
    return run_mixed_batch(model_dir, adapters, SINGLE, **options)


@pytest.mark.parametrize("name", ["mixed", "stacked", "biased", "biased-stacked", "fp8-channel", "fp8-block",
                                  "fp8-at-load", "qwen3", "mqa"])
def test_tp2_logits_equal_tp1(setup, name):
    want = _tp1(setup, name).logits
    for rank in range(WORLD):
        got = _tp2(setup, name, rank)["logits"]
        for step, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape, (rank, step)
            torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
    assert want[0].abs().max() > 1  # logits of some spread: the tolerance is tight
    base, adapted = want[0][0], want[0][1:]
    assert ((adapted - base).abs().amax(dim=-1) > 0.05).all(), "every adapter moves its row's logits"


@pytest.mark.parametrize("name", ["mixed", "biased"])
def test_each_rank_reads_its_shard(setup, name):
    """Float checkpoints: the bytes each rank's loader read are exactly the bytes its
    parameters hold, about half of TP=1's (norms are whole on every rank)."""
    whole = _tp1(setup, name)
    assert whole.bytes_read == whole.param_bytes
    for rank in range(WORLD):
        part = _tp2(setup, name, rank)
        assert part["bytes_read"] == part["param_bytes"]
        assert 0.5 * whole.bytes_read <= part["bytes_read"] < 0.52 * whole.bytes_read


def test_collectives_and_shards(setup):
    x = [torch.arange(6.0).view(2, 3) + 10 * r for r in range(WORLD)]
    for rank in range(WORLD):
        facts = json.loads((setup["results"] / f"facts.{rank}.json").read_text())
        assert facts["shard"] == [3 * rank, 3 * rank + 1, 3 * rank + 2]
        assert facts["all_reduce"] == (x[0] + x[1]).tolist()
        assert facts["all_gather"] == torch.cat(x, dim=-1).tolist()
        assert facts["all_gather_0"] == torch.cat(x, dim=0).tolist()
        assert "world_size 4 does not match its process group, which has 2 ranks" in facts["errors"][0]
        assert f"calls this one {rank}" in facts["errors"][1]
        assert ("'model.layers.1.self_attn.k_proj.weight' has shape (48, 64), expected 32 along dim 0"
                in facts["errors"][2])


def test_single_rank_needs_no_group_and_more_ranks_do():
    assert SINGLE.all_reduce_(torch.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="world_size 2 needs a process group"):
        TensorParallel(0, 2, None)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        TensorParallel(2, 2, None)


@pytest.mark.parametrize("edit, world, message", [
    ({"num_key_value_heads": 3, "num_attention_heads": 6, "hidden_size": 96}, 2,
     "num_key_value_heads=3 must divide by 2 or divide it (replicated KV heads)"),
    ({"num_attention_heads": 2}, 4, "num_attention_heads=2 must divide by 4"),
    ({"intermediate_size": 161}, 2, "intermediate_size=161 must divide by 2"),
    ({"vocab_size": 511}, 2, "vocab_size=511 must divide by 2"),
])
def test_indivisible_shapes_are_refused(tmp_path, edit, world, message):
    """A shape the world size does not split: a ValueError naming it, before any weight is read."""
    from adapterserve.models.decoder import check_shardable
    from adapterserve.models.decoder_config import read_decoder_config

    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"cannot be split over {world} tensor parallel ranks") as err:
        check_shardable(read_decoder_config(tmp_path), world)
    assert message in str(err.value)


def test_split_span_names_the_sizes():
    assert split_span(6, 1, 3, "x") == (2, 2)
    with pytest.raises(ValueError, match="the input of down_proj has size 5, which does not divide by "
                                         "the tensor parallel world size 3"):
        split_span(5, 0, 3, "the input of down_proj")


def test_kv_heads_split_or_replicated():
    """8 query heads, 2 KV heads: over 2 ranks one KV head each; over 4, ranks 0-1 hold head 0
    and ranks 2-3 head 1, the head their query heads (2r, 2r + 1) read in groups of 4."""
    assert [kv_head_span(2, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [kv_head_span(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_span(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    for rank in range(4):
        first, count = split_span(8, rank, 4, "heads")
        query_heads = range(first, first + count)
        assert {h // 4 for h in query_heads} == {kv_head_span(2, rank, 4)[0]}
    with pytest.raises(ValueError, match="num_key_value_heads=3 must divide by the tensor parallel world size 2"):
        kv_head_span(3, 0, 2)
