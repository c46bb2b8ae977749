"""The fused LoRA linear projection by projection, its shrink tiles against each output tile's own
shrink (kernels/stacked_fused.py).

    PYTHONPATH=. python benchmarks/fused_linear_projections.py           # H100/H200: about a minute
    PYTHONPATH=. python benchmarks/fused_linear_projections.py --smoke   # CPU, interpreter, tiny shapes

fp8_lora_fused.py's stack (16 layers of the 8B, B=64, e4m3 and bf16 weights, rank-16 adapters,
PDL early); each figure is one CUDA graph replay of the 16 projections of one kind, in us per
projection, with its tax over the plain decode GEMM of the same dtype. Variants:
  base            our decode GEMM (W8A8 on the rounded activations, or bf16)
  fused N         the fused linear over N adapters (0: no pool row in use), as on main: shrink
                  tiles, every output tile waiting for them
  own shrink N    the same with ``own_shrink``: no shrink tiles, each output tile's shrink in
                  its own K loop, no wait (bf16 only; its output checked against fused N's)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels.pdl import set_pdl
from adapterserve.kernels.stacked import row_bucket
from benchmarks.checkpoints import SHAPES
from benchmarks.fp8_lora_fused import RANK, Stack
from benchmarks.fused_update import print_table, step_meta, time_ms

KINDS = ("q|k|v", "o", "gate|up", "down")  # Stack's projection order within a layer
VARIANTS = {  # name: (adapters, Stack's variant without its dtype)
    "fused 0": (0, "fused"),
    "fused 1": (1, "fused"),
    "own shrink 1": (1, "own shrink"),
    "fused 2": (2, "fused"),
    "own shrink 2": (2, "own shrink"),
}
OWN_SHRINK_TOL = 2e-2  # own shrink against fused: bf16 outputs, the shrink summed in another order


def _checked(stack: Stack, form: str, meta, rows: int, projections: list) -> None:
    """An own-shrink variant's output against the fused linear's, before it is timed."""
    if form != "own shrink":
        return
    want = stack.run("bf16 fused", meta, rows, projections).float()
    err = float((stack.run("bf16 own shrink", meta, rows, projections).float() - want).norm() / want.norm())
    if err > OWN_SHRINK_TOL:
        raise AssertionError(f"own shrink differs from fused: {err:.2e}")


def table(stack: Stack, tokens: int, slots: int, device: str, layers: int) -> list[list[str]]:
    metas = {n: step_meta(tokens, max(n, 1), slots, device) for n in (0, 1, 2)}
    metas[0].token_slots.fill_(-1)
    rows_of = {n: row_bucket(n * RANK, slots * RANK) for n in (0, 1, 2)}
    out = []
    for dtype in ("fp8", "bf16"):
        for i, kind in enumerate(KINDS):
            projections = stack.projections[i::len(KINDS)]
            base = time_ms(lambda: stack.run(f"{dtype} base", metas[0], 0, projections), device)
            cells = [f"{base * 1e3 / layers:.1f}"]
            for adapters, form in VARIANTS.values():
                if dtype == "fp8" and form == "own shrink":  # one dtype only
                    cells.append("-")
                    continue
                meta, rows = metas[adapters], rows_of[adapters]
                _checked(stack, form, meta, rows, projections)
                ms = time_ms(lambda: stack.run(f"{dtype} {form}", meta, rows, projections), device)
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
