"""The fused LoRA linear's tiles swept per projection, one adapter (kernels/stacked_fused.py).

    PYTHONPATH=. python benchmarks/fused_tiles.py            # H100/H200: a few minutes
    PYTHONPATH=. python benchmarks/fused_tiles.py --smoke    # CPU, interpreter, tiny shapes

The engine's fused linear takes the base decode GEMM's tiles (decode_config; fp8_fused_config:
fp8_decode_config's but for gate|up). Its LoRA path adds latency per output tile (the prologue, the wait,
the expand), and a grid of more than one wave pays it once a wave, so the tiles that are fastest
with one adapter need not be the base GEMM's. fp8_lora_fused.py's stack (16 layers of the 8B,
B=64, PDL early); each figure is one CUDA graph replay of the 16 projections of one kind, in us
per projection, with its tax over the plain decode GEMM on the engine's tiles. Every choice's
output is checked against the engine's tiles' before it is timed.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels.decode_gemm import DecodeGemmConfig, split_for
from adapterserve.kernels.split_counters import sms_of
from adapterserve.kernels.stacked import row_bucket
from benchmarks.fp8_lora_fused import RANK, Projection, Stack, stack_for
from benchmarks.fused_linear_projections import CHOICE_TOL, KINDS
from benchmarks.fused_update import print_table, step_meta, time_ms

# (block_n, block_k, num_stages, num_warps, split_k; 0: the kernel's split for two programs an SM)
BF16_TILES = [(16, 128, 4, 4, 0), (16, 256, 3, 4, 0), (32, 128, 4, 4, 0), (32, 256, 3, 4, 0), (32, 128, 4, 4, 1),
              (32, 128, 4, 4, 4), (64, 128, 3, 4, 0), (64, 128, 4, 4, 0), (64, 64, 4, 4, 0), (128, 128, 3, 4, 0),
              (128, 128, 3, 8, 0), (128, 64, 4, 8, 0), (256, 64, 3, 8, 0), (256, 32, 4, 8, 0)]
FP8_TILES = [(16, 256, 4, 4, 0), (32, 256, 4, 4, 0), (32, 256, 4, 8, 0), (32, 128, 4, 8, 0), (32, 512, 3, 4, 0),
             (64, 256, 3, 4, 0), (64, 128, 4, 4, 0), (64, 128, 3, 8, 0), (64, 256, 3, 8, 0), (128, 256, 3, 8, 0),
             (128, 128, 3, 8, 0), (128, 128, 4, 8, 0), (128, 64, 4, 8, 0), (128, 128, 2, 8, 0), (256, 64, 3, 8, 0)]
SMOKE_TILES = [(16, 32, 2, 4, 0), (16, 32, 2, 4, 1)]


def _tiles(choice: tuple[int, int, int, int, int]) -> DecodeGemmConfig:
    block_n, block_k, stages, warps, split = choice
    return DecodeGemmConfig(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps, split_k=split)


def _label(config: DecodeGemmConfig, engine: DecodeGemmConfig) -> str:
    split = f"s{config.split_k}" if config.split_k else "s auto"
    mark = " (engine)" if config == engine else ""
    return f"n{config.block_n} k{config.block_k} st{config.num_stages} w{config.num_warps} {split}{mark}"


def _with_tiles(projections: list[Projection], dtype: str, config: DecodeGemmConfig | None) -> None:
    """Every projection's fused tiles of `dtype` set to config (None: back to the engine's)."""
    for p in projections:
        p.fused_tiles[dtype] = config or p.engine_tiles[dtype]


def kind_rows(stack: Stack, dtype: str, kind: str, projections: list[Projection], choices: list, device: str,
              layers: int, tokens: int, slots: int) -> list[list[str]]:
    """One row per tile choice of one projection kind: us per projection and its tax."""
    meta, rows = step_meta(tokens, 1, slots, device), row_bucket(RANK, slots * RANK)
    base = time_ms(lambda: stack.run(f"{dtype} base", meta, rows, projections), device)
    want = stack.run(f"{dtype} fused", meta, rows, projections).float()
    engine = projections[0].engine_tiles[dtype]
    out = []
    for config in [engine, *(c for c in map(_tiles, choices) if c != engine)]:
        _with_tiles(projections, dtype, config)
        try:
            got = stack.run(f"{dtype} fused", meta, rows, projections).float()
            err = float((got - want).norm() / want.norm())
            if err > CHOICE_TOL:
                raise AssertionError(f"differs from the engine's tiles' output: {err:.2e}")
            ms = time_ms(lambda: stack.run(f"{dtype} fused", meta, rows, projections), device)
            cell = f"{ms * 1e3 / layers:.1f} ({(ms / base - 1) * 100:+.0f}%)"
        except Exception as exc:  # a choice past the device's shared memory or registers
            cell = f"{type(exc).__name__}: {str(exc)[:60]}"
        grid = _grid(projections[0], config, tokens, device)
        out.append([dtype, kind, f"{base * 1e3 / layers:.1f}", _label(config, engine), grid, cell])
    _with_tiles(projections, dtype, None)
    return out


def _grid(p: Projection, config: DecodeGemmConfig, tokens: int, device: str) -> str:
    """Output tiles x K splits over the device's multiprocessors (the waves a grid needs at its
    occupancy are in compiled_forms.py)."""
    split = split_for(p.n + RANK * p.n_slices, p.k, config, sms_of(torch.device(device)))
    tiles = -(-p.n // config.block_n)
    return f"{tiles} x {split} / {sms_of(torch.device(device))}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"of {','.join(KINDS)}")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code runs, figures mean nothing")
    args = p.parse_args()
    stack, (device, _, shape, layers, tokens, slots, name) = stack_for(args.smoke, args.layers)
    rows = []
    for dtype in args.dtypes.split(","):
        choices = SMOKE_TILES if args.smoke else BF16_TILES if dtype == "bf16" else FP8_TILES
        for i, kind in enumerate(KINDS):
            if kind in args.kinds.split(","):
                rows += kind_rows(stack, dtype, kind, stack.projections[i::len(KINDS)], choices, device, layers,
                                  tokens, slots)
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, one rank-{RANK} adapter; "
          "us per projection, the fused linear on each choice of tiles (tax over the base decode GEMM):")
    print_table(["dtype", "projection", "base us", "tiles", "tiles x splits / SMs", "fused 1"], rows)


if __name__ == "__main__":
    main()
