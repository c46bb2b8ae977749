"""An adapter cut for one tensor-parallel rank (engine/adapter_shard.py) fills that rank's
pools exactly as the whole adapter does: at TP=2 (two spawned processes, gloo over a file
store, the tiny Llama in bfloat16 so every cast to the pools' dtype is exercised), each rank
places every family whole in one slot and its AdapterShard in another, and every pool
tensor of the two slots is bit-identical: LoRA (all projections, mixed ranks; the three pool
layouts; read in float32 and in bfloat16), (IA)^3 on column- and row-parallel layers,
prefix, prompt and P-tuning, Houlsby and Pfeiffer; and one KV head replicated on both
ranks (LoRA on k/v and a prefix). What the workers are sent: test_tp_engine.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapterserve.adapters_store.formats.read import AdapterLimits, read_adapter
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_shard import AdapterCutter
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.pool_set import PoolSet, build_pools
from adapterserve.layers.parallel import TensorParallel
from adapterserve.models.loader import load_decoder
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import every_family, family_configs, make_peft_adapter
from tests.helpers.lora import backbone_spec, make_peft_lora
from tests.helpers.spawned import join_within

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
WORLD, DTYPE, BLOCK = 2, torch.bfloat16, 4
WHOLE, CUT, EMPTY = 0, 1, 2  # the slots the whole adapter and its cut take; one left empty
RANKS_WITHIN_S = 300.0


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    configs = family_configs()
    adapters = every_family(MODEL, root)
    adapters["lora-mixed"] = make_peft_lora(MODEL, root / "lora-mixed", r=4, lora_alpha=6, seed=1,
                                            target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                                            rank_pattern={"v_proj": 16, "down_proj": 2})
    adapters["ia3-attn"] = make_peft_adapter(MODEL, root / "ia3-attn", configs["ia3-attn"], seed=4)
    adapters["p-tuning"] = make_peft_adapter(MODEL, root / "p-tuning", configs["p-tuning"], seed=5)
    mqa = write_tiny_checkpoint(root / "mqa", "llama", num_key_value_heads=1, seed=6)  # its KV head on both ranks
    mqa_adapters = {"lora": make_peft_lora(mqa, root / "mqa-lora", r=8, lora_alpha=16, target_modules="all-linear"),
                    "prefix": make_peft_adapter(mqa, root / "mqa-prefix", configs["prefix"], seed=2)}
    scenarios = {"kernels": (MODEL, adapters, "kernels"),
                 "stacked": (MODEL, {n: p for n, p in adapters.items() if n.startswith("lora")}, "stacked"),
                 "fused": (MODEL, {n: p for n, p in adapters.items() if n.startswith("lora")}, "fused"),
                 "mqa": (mqa, mqa_adapters, "kernels")}
    out = root / "results"
    out.mkdir()
    ranks = mp.start_processes(_rank_main, args=(root / "store", scenarios, out), nprocs=WORLD, join=False,
                               start_method="spawn")
    assert join_within(ranks, RANKS_WITHIN_S), "the ranks did not finish"
    return out


def _rank_main(rank: int, store: Path, scenarios: dict, out: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    try:
        tp = TensorParallel(rank, WORLD, dist.group.WORLD)
        found = {f"{scenario}/{name}/{read}": differences
                 for scenario, (model_dir, adapters, layout) in scenarios.items()
                 for name, read, differences in _compare_scenario(model_dir, adapters, layout, tp)}
        torch.save(found, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@torch.inference_mode()
def _compare_scenario(model_dir: Path, adapters: dict[str, Path], layout: str, tp: TensorParallel):
    """(adapter, dtype read in, pool tensors that differ between its two placements) for each
    adapter, read in float32 (cast by the cut) and in the pools' dtype."""
    model, cfg = load_decoder(model_dir, DTYPE, "cpu", tp=tp)
    config = EngineConfig(dtype="bfloat16", max_loras=3, max_lora_rank=16, block_size=BLOCK, num_kv_blocks=32,
                          lora_decode=layout)
    for attn in model.attention_layers():  # as StepDevice binds them
        attn.k_cache = torch.zeros(32 * BLOCK + 1, attn.num_kv_heads, cfg.head_dim, dtype=DTYPE)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    pools = build_pools(config, model, BlockManager(32, BLOCK), with_head=False)
    cut = AdapterCutter(model.adapter_linears(), cfg.num_kv_heads, DTYPE, WORLD)
    spec = backbone_spec(model_dir)
    spec = type(spec)(spec.model_type, spec.num_layers, spec.hidden_size, spec.linear_shapes, cfg.num_kv_heads,
                      cfg.head_dim)
    for name, path in adapters.items():
        for read in (None, DTYPE):
            adapter = read_adapter(path, spec, AdapterLimits(max_lora_rank=16), name=name, dtype=read)
            for slot, placed in ((WHOLE, adapter), (CUT, cut(adapter, tp.rank))):
                assert all(pool.place(slot, placed) for pool in pools.all()), name
            whole, part = _slot_tensors(pools, model, WHOLE), _slot_tensors(pools, model, CUT)
            empty = _slot_tensors(pools, model, EMPTY)
            differences = [key for key in whole if not torch.equal(whole[key], part[key])]
            if all(torch.equal(whole[key], empty[key]) for key in whole):
                differences.append("nothing placed: a vacuous comparison")
            for pool in pools.all():
                for slot in (WHOLE, CUT):
                    pool.clear(slot)
            yield name, str(read), differences


def _slot_tensors(pools: PoolSet, model, slot: int) -> dict[str, torch.Tensor]:
    """Every pool tensor a slot's placement writes, by name."""
    out = {}
    for i, stack in enumerate(pools.lora.stacks):
        for s, kind in enumerate(stack.kinds):
            start, rank = int(stack.row_start[0, s, slot]), int(stack.rank[:, s, slot].max())
            out[f"lora.rank.{kind}"] = stack.rank[:, s, slot]
            out[f"lora.a.{kind}"] = torch.stack([a[s, start : start + rank] for a in stack.a_layers])
            out[f"lora.b.{kind}"] = stack.b[:, start : start + rank, stack.offsets[s] : stack.offsets[s + 1]]
    for layer, linear in pools.ia3.linears:
        if linear.ia3_in is not None:
            out[f"ia3.in.{layer}.{linear.slice_kinds}"] = linear.ia3_in[slot]
        out[f"ia3.out.{layer}.{linear.slice_kinds}"] = linear.ia3_out[slot]
    for layer_index, layer in enumerate(model.layers):
        for place in ("mh", "output"):
            pool = getattr(layer, f"bottleneck_{place}")
            for field in ("down", "down_bias", "up", "up_bias", "ln_mix"):
                out[f"bottleneck.{layer_index}.{place}.{field}"] = getattr(pool, field)[slot]
    out["prompt"] = pools.prompt.embeddings[slot]
    blocks = torch.tensor(pools.prefix.pages.get(slot, []), dtype=torch.long)
    rows = (blocks[:, None] * BLOCK + torch.arange(BLOCK)).flatten()
    for layer_index, attn in enumerate(model.attention_layers()):
        out[f"prefix.k.{layer_index}"] = attn.k_cache[rows]
        out[f"prefix.v.{layer_index}"] = attn.v_cache[rows]
    return out


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_cut_fills_the_pools_as_the_whole_adapter_does(results, rank):
    found = torch.load(results / f"rank{rank}.pt")
    assert len(found) == 2 * (9 + 2 + 2 + 2), sorted(found)  # every adapter of every scenario, read both ways
    assert {key: diff for key, diff in found.items() if diff} == {}
