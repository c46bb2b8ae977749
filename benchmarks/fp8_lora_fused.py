"""The LoRA update on an FP8 backbone: the separate kernels against the fused linear, per 8B stack.

    PYTHONPATH=. python benchmarks/fp8_lora_fused.py            # H100/H200: about a minute
    PYTHONPATH=. python benchmarks/fp8_lora_fused.py --smoke    # CPU, interpreter, tiny shapes

`--layers` layers (16) of q|k|v, o, gate|up and down with distinct e4m3 weights (per-channel
scales) and distinct LoRA pools, B=64 tokens spread round-robin over 0, 1, 2 or 8 rank-16
adapters; one CUDA graph replay of the whole stack per figure, PDL early (the engine's FP8
default). Variants:
  fp8 base          our decode GEMM, W8A8, the activations already rounded per token
  fp8 kernels       the same, then the segmented shrink and expand (lora_decode="kernels")
  fp8 kernels+side  the shrink on a side stream beside the GEMM (the engine's default path)
  fp8 fused         base product, shrink and expand in one launch, A rows kept apart
                    (kernels/stacked_fused.py with BaseApart; lora_decode="fused")
  bf16 base, bf16 kernels+side, bf16 fused   the same stack in bf16 on our decode GEMM: the bf16
                    taxes the issue compares with (fused: A rows apart, as the engine)
Tax: over the base of its dtype. Floor: the e4m3 weights and the distinct adapters' A and B
rows at the copy bandwidth of the same run. Check: the largest relative difference of the last
projection's fused output against fp8 kernels' (both on the same rounded activations).
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels import lora_expand, lora_shrink
from adapterserve.kernels.decode_gemm import (
    DecodeGemmConfig,
    decode_config,
    decode_gemm,
    fp8_decode_config,
    fp8_fused_config,
    fp8_decode_gemm,
    row_tile,
    split_for,
)
from adapterserve.kernels.fp8 import quantize_rows
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.pdl import set_pdl, set_prefetch
from adapterserve.kernels.stacked import RowsInUse, row_bucket, stack_apart
from adapterserve.kernels.split_counters import sms_of
from adapterserve.kernels.stacked_fused import BaseApart, ShrinkTiles, shared_memory_of, shrink_tiles, stacked_fused
from adapterserve.models.fp8 import quantize_per_channel
from benchmarks.checkpoints import SHAPES
from benchmarks.fused_update import bandwidth, print_table, step_meta, time_ms

RANK = 16
ADAPTERS = (0, 1, 2, 8)  # distinct adapters of a step's tokens (0: none)
VARIANTS = ("fp8 base", "fp8 kernels", "fp8 kernels+side", "fp8 fused", "bf16 base", "bf16 kernels+side",
            "bf16 fused")


class Projection:
    """One layer's fused projection with its weight in bf16 and in e4m3, A rows apart (one
    buffer for both), one B pool and one pool layout."""

    def __init__(self, k: int, widths: tuple[int, ...], slots: int, device: str, dtype: torch.dtype) -> None:
        n = sum(widths)
        offsets = tuple(sum(widths[:i]) for i in range(len(widths) + 1))
        pool_rows = slots * RANK
        self.weight = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        self.q, self.scale = quantize_per_channel(self.weight)
        self.apart = stack_apart(self.q, len(widths), pool_rows, RowsInUse(), dtype)
        a = torch.randn(self.apart.lora_a().shape, device=device, dtype=dtype) * 0.02
        self.apart.lora_a().copy_(a)
        b = torch.randn(pool_rows, n, device=device, dtype=dtype) * 0.02
        row_start = (torch.arange(slots, device=device, dtype=torch.int32) * RANK).repeat(len(widths), 1).contiguous()
        rank = torch.full((len(widths), slots), RANK, device=device, dtype=torch.int32)
        self.lora_apart = LoraSlices(self.apart.lora_a(), b, row_start, rank, offsets, RANK)
        self.lora_kernels = LoraSlices(a.contiguous(), b, row_start, rank, offsets, RANK)
        self.fp8_config, self.bf16_config = fp8_decode_config(n, k), decode_config(n, k)  # the base GEMM's tiles
        self.engine_tiles = {"bf16": self.bf16_config, "fp8": fp8_fused_config(n, k)}  # the engine's fused linear's
        self.fused_tiles = dict(self.engine_tiles)  # what the fused variants run (fused_tiles.py sweeps them)
        self.k, self.n, self.n_slices = k, n, len(widths)

    def floor_bytes(self, adapters: int) -> int:
        rows = adapters * RANK
        return self.n * self.k + 2 * rows * (self.n_slices * self.k + self.n)


class Stack:
    def __init__(self, shape, layers: int, tokens: int, slots: int, device: str, dtype: torch.dtype) -> None:
        lin, h, inter = shape.linear_shapes(), shape.hidden, shape.inter
        kinds = [(h, (lin["q_proj"][1], lin["k_proj"][1], lin["v_proj"][1])), (lin["o_proj"][0], (h,)),
                 (h, (inter, inter)), (inter, (h,))]
        self.projections = [Projection(k, widths, slots, device, dtype) for _ in range(layers) for k, widths in kinds]
        self.x = {k: torch.randn(tokens, k, device=device, dtype=dtype) for k, _ in kinds}
        self.rounded = {k: quantize_rows(x) for k, x in self.x.items()}
        self.workspace = torch.empty(3, tokens, RANK, device=device, dtype=dtype)
        self.side = torch.cuda.Stream() if device == "cuda" else None
        # fp8 fused's swept loops: (shrink K chunk, shrink stages, shrink split factor, most base stages)
        self.shrink: tuple[int, int, int, int] | None = None
        self.shrink_factor = 1  # both dtypes' fused: the kernel's own shrink split times this
        self.prefetch = 0  # K chunks each GEMM program asks L2 for before its PDL wait (kernels/pdl.py)
        self.fused = stacked_fused  # the fused linear both dtypes' fused run (fused_ablation.py: an edited copy)

    def run(self, variant: str, meta, rows: int, projections: list[Projection] | None = None) -> torch.Tensor:
        """The variant over every projection of the stack (or over `projections`); the last output."""
        set_prefetch(self.prefetch)
        y = None
        for p in self.projections if projections is None else projections:
            y = self._projection(p, variant, meta, rows)
        return y

    def _projection(self, p: Projection, variant: str, meta, rows: int) -> torch.Tensor:
        x, (xq, xs) = self.x[p.k], self.rounded[p.k]
        if variant == "fp8 fused":
            return self.fused(x, p.apart, p.lora_apart, meta, rows, config=self._fp8_config(p),
                              apart=BaseApart(p.q, p.scale, (xq, xs)), shrink=self._shrink(p, x, rows, True))
        if variant == "bf16 fused":
            return self.fused(x, p.apart, p.lora_apart, meta, rows, config=p.fused_tiles["bf16"],
                              apart=BaseApart(p.weight), shrink=self._shrink(p, x, rows, False))
        bf16 = variant.startswith("bf16")
        if variant.endswith("base") or not rows:
            return self._base(p, bf16)
        workspace = self.workspace[: p.n_slices]
        if variant.endswith("kernels+side") and self.side is not None:
            main = torch.cuda.current_stream()
            self.side.wait_stream(main)
            with torch.cuda.stream(self.side):
                lora_shrink(x, p.lora_kernels, meta, workspace)
            y = self._base(p, bf16)
            main.wait_stream(self.side)
        else:
            y = self._base(p, bf16)
            lora_shrink(x, p.lora_kernels, meta, workspace)
        lora_expand(workspace, p.lora_kernels, meta, y)
        return y

    def _shrink(self, p: Projection, x: torch.Tensor, rows: int, fp8: bool) -> ShrinkTiles | None:
        """The shrink loop of this projection: fp8's swept one, or the kernel's own with its split
        times shrink_factor (None: the kernel's own choice)."""
        config = p.fused_tiles["fp8" if fp8 else "bf16"]
        split = split_for(p.n + rows * p.n_slices, p.k, config, sms_of(x.device))
        if fp8 and self.shrink is not None:
            block_k, stages, factor, _ = self.shrink
            return ShrinkTiles(block_k, stages, factor * split)
        if self.shrink_factor == 1:
            return None
        own = shrink_tiles(config, row_tile(x.shape[0]), split, p.k, x.element_size(), 1 if fp8 else x.element_size(),
                           1 if fp8 else x.element_size(), shared_memory_of(x.device))
        return replace(own, split=own.split * self.shrink_factor)

    def _fp8_config(self, p: Projection) -> DecodeGemmConfig:
        """fp8 fused's base tiles: the projection's, their stages capped by the sweep's if any (fewer
        stages: room in shared memory for two programs a multiprocessor beside the shrink loop)."""
        tiles = p.fused_tiles["fp8"]
        if self.shrink is None:
            return tiles
        return replace(tiles, num_stages=min(tiles.num_stages, self.shrink[3]))

    def _base(self, p: Projection, bf16: bool) -> torch.Tensor:
        """The base product on our decode GEMM: bf16, or W8A8 on the rounded activations."""
        if bf16:
            return decode_gemm(self.x[p.k], p.weight, p.bf16_config)
        xq, xs = self.rounded[p.k]
        return fp8_decode_gemm(xq, p.q, p.scale, xs, self.x[p.k].dtype, p.fp8_config)


def measure(stack: Stack, adapters: int, tokens: int, slots: int, device: str, bw: float) -> list[str]:
    meta = step_meta(tokens, max(adapters, 1), slots, device)
    if adapters == 0:
        meta.token_slots.fill_(-1)
    rows = row_bucket(adapters * RANK, slots * RANK)
    ms = {v: time_ms(lambda v=v: stack.run(v, meta, rows), device) for v in VARIANTS}
    want = stack.run("fp8 kernels", meta, rows).float()
    check = float((stack.run("fp8 fused", meta, rows).float() - want).norm() / want.norm())
    floor = sum(p.floor_bytes(adapters) for p in stack.projections) / bw * 1e3
    cells = []
    for v in VARIANTS:
        base = ms["bf16 base" if v.startswith("bf16") else "fp8 base"]
        cells.append(f"{ms[v]:.3f}" + ("" if v.endswith("base") else f" ({(ms[v] / base - 1) * 100:+.1f}%)"))
    return [str(adapters), str(rows), *cells, f"{floor:.3f}", f"{ms['fp8 fused'] / floor:.2f}", f"{check:.1e}"]


SWEEP = [(block_k, stages, factor, base_stages) for block_k in (64, 128) for stages in (1, 2, 3) for factor in (2, 4)
         for base_stages in (3, 4)]


def sweep(stack: Stack, tokens: int, slots: int, device: str) -> list[list[str]]:
    """fp8 fused with one adapter per loop choice of SWEEP (the default first), against fp8 base."""
    meta, rows = step_meta(tokens, 1, slots, device), row_bucket(RANK, slots * RANK)
    base = time_ms(lambda: stack.run("fp8 base", meta, rows), device)
    table = []
    for choice in [None, *SWEEP]:
        stack.shrink = choice
        try:
            ms = time_ms(lambda: stack.run("fp8 fused", meta, rows), device)
            table.append([str(choice or "default"), f"{ms:.3f}", f"{(ms / base - 1) * 100:+.1f}%"])
        except Exception as exc:  # a choice past the device's shared memory
            table.append([str(choice), type(exc).__name__, "-"])
    stack.shrink = None
    return table


def stack_for(smoke: bool, layers: int, slots: int = 8) -> tuple[Stack, tuple]:
    """The stack to time and (device, dtype, shape, layers, tokens, slots, card name): the 8B's on
    a GPU with PDL early, or a tiny one layer deep for --smoke (float32: the interpreter's bf16
    arithmetic is wrong); ``slots``: adapters its LoRA pools hold."""
    if smoke:
        device, dtype, shape, layers, tokens, name = "cpu", torch.float32, SHAPES["tiny"], 1, 8, "CPU (smoke)"
    else:
        device, dtype, shape, tokens = "cuda", torch.bfloat16, SHAPES["8b"], 64
        name = torch.cuda.get_device_name()
        set_pdl("early")
    torch.manual_seed(0)
    return Stack(shape, layers, tokens, slots, device, dtype), (device, dtype, shape, layers, tokens, slots, name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code runs, figures mean nothing")
    p.add_argument("--sweep", action="store_true", help="also: fp8 fused's shrink loops, one adapter")
    args = p.parse_args()
    stack, (device, dtype, shape, layers, tokens, slots, name) = stack_for(args.smoke, args.layers)
    bw = bandwidth(device)
    rows = [measure(stack, n, tokens, slots, device, bw) for n in ADAPTERS]
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, {dtype}, rank-{RANK} "
          "adapters; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; ms per replay of q|k|v, o, gate|up, down (tax over its base):")
    print_table(["adapters", "rows", *[f"{v} ms" for v in VARIANTS], "fp8 floor ms", "fused / floor", "check"], rows)
    if args.sweep:
        print("\nfp8 fused, one adapter, per loop choice (shrink K chunk, shrink stages, shrink split factor, base "
              "stages at most); tax over fp8 base:")
        print_table(["shrink loop", "ms", "tax"], sweep(stack, tokens, slots, device))


if __name__ == "__main__":
    main()
