"""The fused LoRA linear projection by projection, and its launch choices (kernels/stacked_fused.py).

    PYTHONPATH=. python benchmarks/fused_linear_projections.py           # H100/H200: about a minute
    PYTHONPATH=. python benchmarks/fused_linear_projections.py --smoke   # CPU, interpreter, tiny shapes

fp8_lora_fused.py's stack (16 layers of the 8B, B=64, e4m3 and bf16 weights, rank-16 adapters,
PDL early); each figure is one CUDA graph replay of the 16 projections of one kind, in us per
projection, with its tax over the plain decode GEMM of the same dtype. Variants:
  base            our decode GEMM (W8A8 on the rounded activations, or bf16)
  fused N         the fused linear over N adapters (0: no pool row in use), as on main: shrink
                  tiles, every output tile waiting for them
  fused 1 sF      one adapter with the shrink tiles' K split F times the kernel's own choice: shorter
                  shrink programs, done sooner, so output tiles wait less
  base pfC        the plain decode GEMM, each program asking L2 for its first C K chunks of weight
  fused 1 pfC     rows before its PDL wait (kernels/pdl.py set_prefetch), and the fused linear so
Every variant with launch choices is checked against the same kernel's output without them before it is
timed. --resident R1,R2,...: a second table, one adapter's tokens with the fused linear's shrink covering
a row bucket of R adapters' rows (the span of a step's adapters: the step's windows begin at its lowest
rows, so idle adapters cost it none, but two far apart cost all the rows between them); the separate
kernels (kernels+side: shrink on a second stream, then expand) read only the step's.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels.stacked import row_bucket
from adapterserve.kernels.decode_gemm import _decode_gemm_kernel
from adapterserve.kernels.stacked_fused import _stacked_fused_kernel
from benchmarks.compiled_forms import forms_table
from benchmarks.fp8_lora_fused import RANK, Stack, stack_for
from benchmarks.fused_update import print_table, step_meta, time_ms

KINDS = ("q|k|v", "o", "gate|up", "down")  # Stack's projection order within a layer
DEFAULTS = {"shrink_factor": 1, "prefetch": 0}  # Stack's launch choices, the kernel's own
VARIANTS = {  # name: (adapters, None: the plain decode GEMM; launch choices other than DEFAULTS)
    "fused 0": (0, {}),
    "fused 1": (1, {}),
    "fused 2": (2, {}),
    "base pf2": (None, {"prefetch": 2}),
    "base pf4": (None, {"prefetch": 4}),
    "base pf8": (None, {"prefetch": 8}),
    "fused 1 pf2": (1, {"prefetch": 2}),
    "fused 1 pf4": (1, {"prefetch": 4}),
    "fused 1 pf8": (1, {"prefetch": 8}),
}
CHOICE_TOL = 2e-2  # a launch choice against the kernel's own: bf16 outputs summed in another order


def _set(stack: Stack, choices: dict) -> None:
    for name, value in {**DEFAULTS, **choices}.items():
        setattr(stack, name, value)


def _checked(stack: Stack, variant: str, choices: dict, meta, rows: int, projections: list) -> None:
    """A variant's output against the kernel's own choices', before it is timed."""
    if not choices:
        return
    _set(stack, {})
    want = stack.run(variant, meta, rows, projections).float()
    _set(stack, choices)
    err = float((stack.run(variant, meta, rows, projections).float() - want).norm() / want.norm())
    if err > CHOICE_TOL:
        raise AssertionError(f"{variant} with {choices} differs: {err:.2e}")


def variants(factors: list[int]) -> dict[str, tuple[int | None, dict]]:
    """VARIANTS, then one adapter with the shrink split times each factor."""
    return {**VARIANTS, **{f"fused 1 s{f}": (1, {"shrink_factor": f}) for f in factors}}


def table(stack: Stack, tokens: int, slots: int, device: str, layers: int,
          named: dict[str, tuple[int | None, dict]]) -> list[list[str]]:
    metas = {n: step_meta(tokens, max(n, 1), slots, device) for n in (0, 1, 2)}
    metas[0].token_slots.fill_(-1)
    rows_of = {n: row_bucket(n * RANK, slots * RANK) for n in (0, 1, 2)}
    out = []
    for dtype in ("fp8", "bf16"):
        for i, kind in enumerate(KINDS):
            projections = stack.projections[i::len(KINDS)]
            base = time_ms(lambda: stack.run(f"{dtype} base", metas[0], 0, projections), device)
            cells = [f"{base * 1e3 / layers:.1f}"]
            for adapters, choices in named.values():
                variant = f"{dtype} {'base' if adapters is None else 'fused'}"
                meta, rows = metas[adapters or 0], rows_of[adapters or 0]
                _checked(stack, variant, choices, meta, rows, projections)
                _set(stack, choices)
                ms = time_ms(lambda: stack.run(variant, meta, rows, projections), device)
                cells.append(f"{ms * 1e3 / layers:.1f} ({(ms / base - 1) * 100:+.0f}%)")
            out.append([dtype, kind, *cells])
    return out


def resident_table(stack: Stack, tokens: int, slots: int, device: str, layers: int,
                   residents: list[int]) -> list[list[str]]:
    """One adapter's tokens: the separate kernels, and the fused linear covering the rows of R resident
    adapters for each R."""
    meta, base_meta = step_meta(tokens, 1, slots, device), step_meta(tokens, 1, slots, device)
    base_meta.token_slots.fill_(-1)
    _set(stack, {})
    out = []
    for dtype in ("fp8", "bf16"):
        for i, kind in enumerate(KINDS):
            projections = stack.projections[i::len(KINDS)]
            base = time_ms(lambda: stack.run(f"{dtype} base", base_meta, 0, projections), device)
            runs = [(f"{dtype} kernels+side", row_bucket(RANK, slots * RANK))]
            runs += [(f"{dtype} fused", row_bucket(r * RANK, slots * RANK)) for r in residents]
            cells = [f"{base * 1e3 / layers:.1f}"]
            for variant, rows in runs:
                ms = time_ms(lambda: stack.run(variant, meta, rows, projections), device)
                cells.append(f"{ms * 1e3 / layers:.1f} ({(ms / base - 1) * 100:+.0f}%)")
            out.append([dtype, kind, *cells])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--splits", default="", help="comma-separated shrink split factors to add (e.g. 2,4,8)")
    p.add_argument("--resident", default="", help="comma-separated counts of resident adapters for the "
                   "one-adapter table (e.g. 1,8,64): the pool holds the largest")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code runs, figures mean nothing")
    args = p.parse_args()
    residents = [int(r) for r in args.resident.split(",") if r]
    stack, (device, _, shape, layers, tokens, slots, name) = stack_for(args.smoke, args.layers,
                                                                      max([8, *residents]))
    named = variants([int(f) for f in args.splits.split(",") if f])
    rows = table(stack, tokens, slots, device, layers, named)
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, rank-{RANK} adapters; "
          "us per projection (one CUDA graph replay of the layers' projections of a kind; tax over base):")
    print_table(["dtype", "projection", "base us", *named], rows)
    if residents:
        print(f"\none adapter's {tokens} tokens while R adapters are resident (the fused linear covers their rows):")
        print_table(["dtype", "projection", "base us", "kernels+side 1",
                     *[f"fused 1 of {r}" for r in residents]],
                    resident_table(stack, tokens, slots, device, layers, residents))
    for name, kernel in (("decode GEMM", _decode_gemm_kernel), ("fused linear", _stacked_fused_kernel)):
        if forms := forms_table(kernel):
            print(f"\n{name}: its compiled forms")
            print_table(["form", "registers", "spills", "shared KiB", "programs / SM"], forms)


if __name__ == "__main__":
    main()
