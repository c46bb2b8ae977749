"""The fused LoRA linear projection by projection, and what Triton's integer specialisation of
its arguments is worth (kernels/stacked_fused.py).

    PYTHONPATH=. python benchmarks/fused_linear_projections.py           # H100/H200: about a minute
    PYTHONPATH=. python benchmarks/fused_linear_projections.py --smoke   # CPU, interpreter, tiny shapes

fp8_lora_fused.py's stack (16 layers of the 8B, B=64, e4m3 and bf16 weights, rank-16 adapters,
PDL early); each figure is one CUDA graph replay of the 16 projections of one kind, in us per
projection, with its tax over the plain decode GEMM of the same dtype. Variants:
  base            our decode GEMM (W8A8 on the rounded activations, or bf16)
  fused N         the fused linear over N adapters (0: no pool row in use), as on main
  fused N, rows unspecialised    the same kernel compiled with ``rows`` left unspecialised, as
                  before the nineteenth session (``do_not_specialize``: M, rows, a_tiles)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

import triton

from adapterserve.kernels import stacked_fused as fused_module
from adapterserve.kernels.pdl import set_pdl
from adapterserve.kernels.stacked import row_bucket
from benchmarks.checkpoints import SHAPES
from benchmarks.fp8_lora_fused import RANK, Stack
from benchmarks.fused_update import print_table, step_meta, time_ms

KINDS = ("q|k|v", "o", "gate|up", "down")  # Stack's projection order within a layer
MAIN_KERNEL = fused_module._stacked_fused_kernel
UNSPECIALISED = triton.jit(MAIN_KERNEL.fn, do_not_specialize=["M", "rows", "a_tiles"])
VARIANTS = {  # name: (adapters, kernel, Stack's variant without its dtype)
    "fused 0": (0, MAIN_KERNEL, "fused"),
    "fused 0, rows unspecialised": (0, UNSPECIALISED, "fused"),
    "fused 1": (1, MAIN_KERNEL, "fused"),
    "fused 1, rows unspecialised": (1, UNSPECIALISED, "fused"),
}


def timed_with(kernel, run, device: str) -> float:
    """run's time with the fused linear's launches going to this compiled form of its kernel."""
    fused_module._stacked_fused_kernel = kernel
    try:
        return time_ms(run, device)
    finally:
        fused_module._stacked_fused_kernel = MAIN_KERNEL


def table(stack: Stack, tokens: int, slots: int, device: str, layers: int) -> list[list[str]]:
    metas = {0: step_meta(tokens, 1, slots, device), 1: step_meta(tokens, 1, slots, device)}
    metas[0].token_slots.fill_(-1)
    rows_of = {0: 0, 1: row_bucket(RANK, slots * RANK)}
    out = []
    for dtype in ("fp8", "bf16"):
        for i, kind in enumerate(KINDS):
            projections = stack.projections[i::len(KINDS)]
            base = time_ms(lambda: stack.run(f"{dtype} base", metas[0], 0, projections), device)
            cells = [f"{base * 1e3 / layers:.1f}"]
            for adapters, kernel, form in VARIANTS.values():
                meta, rows = metas[adapters], rows_of[adapters]
                ms = timed_with(kernel, lambda: stack.run(f"{dtype} {form}", meta, rows, projections), device)
                cells.append(f"{ms * 1e3 / layers:.1f} ({(ms / base - 1) * 100:+.0f}%)")
            out.append([dtype, kind, *cells])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code runs, figures mean nothing")
    args = p.parse_args()
    if args.smoke:
        device, dtype, shape, layers, tokens, slots = "cpu", torch.float32, SHAPES["tiny"], 1, 8, 8
        name = "CPU (smoke)"
    else:
        device, dtype, shape, layers, tokens, slots = "cuda", torch.bfloat16, SHAPES["8b"], args.layers, 64, 8
        name = torch.cuda.get_device_name()
        set_pdl("early")
    torch.manual_seed(0)
    stack = Stack(shape, layers, tokens, slots, device, dtype)
    rows = table(stack, tokens, slots, device, layers)
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, rank-{RANK} adapters; "
          "us per projection (one CUDA graph replay of the layers' projections of a kind; tax over base):")
    print_table(["dtype", "projection", "base us", *VARIANTS], rows)


if __name__ == "__main__":
    main()
