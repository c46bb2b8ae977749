"""Bytes of one adapter each tensor-parallel worker is sent (engine/adapter_shard.py), from
the shapes alone: no GPU, no weights (the backbone and the adapter are built on the meta
device). One rank-16 LoRA on all seven projections of an 8B- and a 70B-shaped Llama, at
TP 2, 4 and 8: the whole adapter (what every worker was sent before each got its cut) in
float32 and bfloat16, and one worker's cut in the pools' dtype (bfloat16); then the total
through the sockets for 64 such adapters. Pickling adds a small overhead per tensor.

    python -m benchmarks.tp_adapter_bytes
    python -m benchmarks.tp_adapter_bytes --shapes tiny --rank 8 --sizes 2   # the CPU tests' shape
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from adapterserve.adapters_store.cache import tensor_nbytes
from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.types import LoraAdapter, LoraModule
from adapterserve.engine.adapter_shard import AdapterCutter
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.decoder_config import read_decoder_config
from benchmarks.tp_decode import ALL_SHAPES

POOL_DTYPE = torch.bfloat16
ADAPTERS = 64


def meta_backbone(shape_name: str) -> DecoderModel:
    """The shape's decoder on the meta device, at one rank (its layers' layouts hold every size)."""
    with tempfile.TemporaryDirectory() as tmp:
        ALL_SHAPES[shape_name].hf_config().save_pretrained(tmp)
        cfg = read_decoder_config(tmp)
    return DecoderModel(cfg, 16, POOL_DTYPE, "meta")


def meta_lora(model: DecoderModel, rank: int) -> Adapter:
    """A float32 LoRA of `rank` on every projection of every layer (meta tensors: shapes only)."""
    modules = {}
    for layer, linear in model.adapter_linears():
        for kind, width in zip(linear.slice_kinds, linear.layout.slice_widths):
            a = torch.empty(rank, linear.layout.in_features, device="meta")
            modules[(layer, kind)] = LoraModule(a, torch.empty(width, rank, device="meta"), 2.0)
    return Adapter("lora", lora=LoraAdapter(modules))


def worker_bytes(model: DecoderModel, adapter: Adapter, world_size: int) -> int:
    """Tensor bytes of the largest cut a worker (rank 1..world_size-1) is sent."""
    cut = AdapterCutter(model.adapter_linears(), model.cfg.num_kv_heads, POOL_DTYPE, world_size)
    return max(tensor_nbytes(cut(adapter, rank)) for rank in range(1, world_size))


def rows(shapes: list[str], sizes: list[int], rank: int) -> list[dict]:
    out = []
    for name in shapes:
        model = meta_backbone(name)
        adapter = meta_lora(model, rank)
        whole32 = tensor_nbytes(adapter)
        for size in sizes:
            part = worker_bytes(model, adapter, size)
            out.append({"shape": name, "tp": size, "whole_f32": whole32, "whole_bf16": whole32 // 2, "part": part,
                        "before_gb": ADAPTERS * (size - 1) * whole32 / 1e9,
                        "after_gb": ADAPTERS * (size - 1) * part / 1e9})
    return out


def table(rows: list[dict], rank: int) -> str:
    head = (f"rank-{rank} LoRA, all 7 projections; MB = 1e6 bytes; {ADAPTERS} adapters through the sockets "
            "(every worker)\n"
            f"{'shape':>6} {'TP':>3} {'whole f32 MB':>13} {'whole bf16 MB':>14} {'cut bf16 MB':>12} "
            f"{'cut/f32':>8} {'cut/bf16':>9} {'before GB':>10} {'after GB':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['shape']:>6} {r['tp']:>3} {r['whole_f32'] / 1e6:>13.1f} {r['whole_bf16'] / 1e6:>14.1f} "
                     f"{r['part'] / 1e6:>12.1f} {r['part'] / r['whole_f32']:>8.3f} "
                     f"{r['part'] / r['whole_bf16']:>9.3f} {r['before_gb']:>10.1f} {r['after_gb']:>9.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="8b,70b", help=f"comma-separated, of {sorted(ALL_SHAPES)}")
    p.add_argument("--sizes", default="2,4,8", help="tensor-parallel sizes, comma-separated")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(table(rows(args.shapes.split(","), sizes, args.rank), args.rank))


if __name__ == "__main__":
    main()
