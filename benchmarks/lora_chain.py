"""The decode LoRA chain of a whole Llama-8B stack, kernel by kernel, on its own.

    PYTHONPATH=. python benchmarks/lora_chain.py            # per-launch table and chain totals
    PYTHONPATH=. python benchmarks/lora_chain.py --sweep    # CUDA-core shrink block shapes per projection

32 layers of q|k|v, o, gate|up and down projections (bf16, distinct weights and adapter
pools per layer, so every read comes from HBM as in a decode step), B=64 tokens, rank 16
on every projection, tokens spread over 1, 8 or 64 adapters. Each figure is one CUDA
graph replay of the 32 launches (or of the whole chain), divided per launch where the
table says so. Per launch: the shrink and the expand each kernel picks, against the
bytes of the distinct adapters it must read at the copy bandwidth measured in the same
run. Chain: the base GEMMs alone, the LoRA kernels alone, both on one stream, and the
engine's path (each shrink on a side stream beside its GEMM, the expand after it), and the
tensor-core kernels in place of the CUDA-core ones. Prints one table naming the GPU.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.segment_ops import (
    DownConfig,
    UpConfig,
    dot_down_config,
    dot_up_config,
    seg_down,
    seg_up,
)
from benchmarks.checkpoints import SHAPES
from benchmarks.measure import copy_bandwidth, graph_ms

TOKENS, RANK, SLOTS = 64, 16, 64
SPREADS = (1, 8, 64)
SWEEP = [(1024, 4, 4), (1024, 4, 8), (2048, 4, 4), (2048, 4, 8), (2048, 2, 8), (2048, 8, 8), (4096, 2, 8),
         (512, 8, 4)]  # block_k, rank rows per program, warps


class Projection:
    """One layer's fused projection: base weight [N, K] and its LoRA pool of SLOTS adapters."""

    def __init__(self, kind: str, k: int, widths: tuple[int, ...]) -> None:
        self.kind, self.k, self.widths = kind, k, widths
        offsets = [0]
        for w in widths:
            offsets.append(offsets[-1] + w)
        bf16 = {"device": "cuda", "dtype": torch.bfloat16}
        self.weight = torch.randn(offsets[-1], k, **bf16) * 0.02
        a = torch.randn(len(widths), SLOTS * RANK, k, **bf16) * 0.01
        b = torch.randn(SLOTS * RANK, offsets[-1], **bf16) * 0.01
        rows = (torch.arange(SLOTS, device="cuda", dtype=torch.int32) * RANK).repeat(len(widths), 1).contiguous()
        ranks = torch.full((len(widths), SLOTS), RANK, device="cuda", dtype=torch.int32)
        self.lora = LoraSlices(a, b, rows, ranks, tuple(offsets), RANK)

    def adapter_bytes(self, adapters: int) -> tuple[int, int]:
        """Bytes of A and of B that `adapters` distinct adapters hold on this projection."""
        return adapters * len(self.widths) * RANK * self.k * 2, adapters * RANK * sum(self.widths) * 2


class Stack:
    def __init__(self, layers: int) -> None:
        shape = SHAPES["8b"]
        lin, h, inter = shape.linear_shapes(), shape.hidden, shape.inter
        kinds = {"q|k|v": (h, (lin["q_proj"][1], lin["k_proj"][1], lin["v_proj"][1])), "o": (lin["o_proj"][0], (h,)),
                 "gate|up": (h, (inter, inter)), "down": (inter, (h,))}
        self.layers = [[Projection(kind, k, widths) for kind, (k, widths) in kinds.items()] for _ in range(layers)]
        self.kinds = list(kinds)
        bf16 = {"device": "cuda", "dtype": torch.bfloat16}
        self.x = {k: torch.randn(TOKENS, k, **bf16) for k, _ in kinds.values()}
        self.v = {n: torch.empty(n, TOKENS, RANK, **bf16) for n in (1, 2, 3)}
        self.y = {sum(w): torch.empty(TOKENS, sum(w), **bf16) for _, w in kinds.values()}
        self.side = torch.cuda.Stream()

    def of_kind(self, kind: str) -> list[Projection]:
        return [layer[self.kinds.index(kind)] for layer in self.layers]

    def shrink(self, p: Projection, meta, config: DownConfig | None = None) -> None:
        seg_down(self.x[p.k], p.lora.a, 0, p.lora.rank, p.lora.row_start, meta, self.v[len(p.widths)], RANK,
                 config=config)

    def expand(self, p: Projection, meta, config=None) -> None:
        seg_up(self.v[len(p.widths)], p.lora.b, 0, p.lora.rank, p.lora.row_start, p.lora.out_offsets, meta,
               self.y[sum(p.widths)], RANK, config=config)

    def gemm(self, p: Projection) -> torch.Tensor:
        return F.linear(self.x[p.k], p.weight)

    def chain(self, mode: str, meta) -> None:
        """Every projection of the stack: base GEMMs and LoRA kernels as `mode` says."""
        main = torch.cuda.current_stream()
        for p in (p for layer in self.layers for p in layer):
            if mode == "base":
                self.gemm(p)
                continue
            down, up = _tensor_core_configs(p) if mode == "tensor-core" else (None, None)
            if mode == "side stream":  # the engine's path: the shrink beside the GEMM
                self.side.wait_stream(main)
                with torch.cuda.stream(self.side):
                    self.shrink(p, meta)
                self.gemm(p)
                main.wait_stream(self.side)
            else:  # one stream, or the LoRA kernels alone ("lora only", "tensor-core")
                if mode == "one stream":
                    self.gemm(p)
                self.shrink(p, meta, down)
            self.expand(p, meta, up)


def _tensor_core_configs(p: Projection) -> tuple[DownConfig, UpConfig]:
    """The blocks the ops give this projection on the tensor-core kernels (prefill-sized batches)."""
    return dot_down_config(len(p.widths) * RANK, True), dot_up_config(RANK, True)


def meta_for(spread: int):
    slots = (torch.arange(TOKENS, device="cuda") % spread).to(torch.int32)
    return build_adapter_meta(slots, SLOTS)


def per_launch(stack: Stack, bandwidth: float) -> None:
    layers = len(stack.layers)
    print("| adapters | projection | shrink µs | shrink floor µs | expand µs | expand floor µs |")
    print("|---|---|---|---|---|---|")
    for spread in SPREADS:
        meta = meta_for(spread)
        for kind in stack.kinds:
            projs = stack.of_kind(kind)
            shrink = graph_ms(lambda ps=projs, m=meta: [stack.shrink(p, m) for p in ps]) * 1e3 / layers
            expand = graph_ms(lambda ps=projs, m=meta: [stack.expand(p, m) for p in ps]) * 1e3 / layers
            a_bytes, b_bytes = projs[0].adapter_bytes(spread)
            print(f"| {spread} | {kind} | {shrink:.1f} | {a_bytes / bandwidth * 1e6:.1f} | {expand:.1f} | "
                  f"{b_bytes / bandwidth * 1e6:.1f} |")


def chains(stack: Stack) -> None:
    modes = ("base", "lora only", "one stream", "side stream", "tensor-core")
    print("\n| adapters | " + " | ".join(f"{m} ms" for m in modes) + " | LoRA added, side stream ms |")
    print("|---|" + "---|" * (len(modes) + 1))
    for spread in SPREADS:
        meta = meta_for(spread)
        ms = {m: graph_ms(lambda m=m, meta=meta: stack.chain(m, meta)) for m in modes}
        print(f"| {spread} | " + " | ".join(f"{ms[m]:.3f}" for m in modes) +
              f" | {ms['side stream'] - ms['base']:.3f} |")


def sweep(stack: Stack) -> None:
    layers = len(stack.layers)
    print("| adapters | projection | " + " | ".join(f"k{k} r{r} w{w}" for k, r, w in SWEEP) + " |")
    print("|---|---|" + "---|" * len(SWEEP))
    for spread in SPREADS:
        meta = meta_for(spread)
        for kind in stack.kinds:
            projs = stack.of_kind(kind)
            cells = []
            for k, rows, warps in SWEEP:
                cfg = DownConfig(block_r=0, block_k=k, num_warps=warps, num_stages=1, rows=rows, gemv=True)
                run = lambda ps=projs, m=meta, c=cfg: [stack.shrink(p, m, c) for p in ps]
                cells.append(graph_ms(run) * 1e3 / layers)
            print(f"| {spread} | {kind} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--sweep", action="store_true", help="CUDA-core shrink block shapes per projection (µs per launch)")
    args = p.parse_args()
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    stack = Stack(args.layers)
    print(f"\n{torch.cuda.get_device_name()}; torch {torch.__version__}; 8B, {args.layers} layers, B={TOKENS}, "
          f"rank {RANK} on q|k|v, o, gate|up, down; copy bandwidth {bandwidth / 1e9:.0f} GB/s (read+write); "
          "one CUDA graph replay per figure")
    if args.sweep:
        sweep(stack)
        return
    per_launch(stack, bandwidth)
    chains(stack)


if __name__ == "__main__":
    main()
