"""Where the fused LoRA linear's adapter tax goes: the kernel with one part of its LoRA path
taken out at a time, projection by projection (kernels/stacked_fused.py; a diagnostic, the parts
taken out give wrong outputs).

    PYTHONPATH=. python benchmarks/fused_ablation.py           # H100/H200: about a minute
    PYTHONPATH=. python benchmarks/fused_ablation.py --dtype fp8
    PYTHONPATH=. python benchmarks/fused_ablation.py --adapters 8   # the tokens over 8 adapters
    PYTHONPATH=. python benchmarks/fused_ablation.py --smoke   # CPU, interpreter, tiny shapes

fused_linear_projections.py's stack and timing (bf16 or fp8, B=64, 16 layers of the 8B, PDL early), us
per projection and the tax over the plain decode GEMM. Each variant is a copy of the kernel's
module with its source edited (ABLATIONS), loaded from a file of its own:
  fused 0 / fused N   the kernel as on main, no adapter / the tokens round-robin over N adapters
                      (--adapters, default 1); the ablations below run with N too
  no wait             one adapter; output tiles do not wait for the shrink tiles
  no count            one adapter; output tiles do not count themselves past their wait, so the step
                      counters are never reset (after the first call no tile waits: a graph replay
                      times one atomic read in place of the wait)
  no expand           one adapter; output tiles neither wait nor add the update (shrink tiles run)
  no shrink tiles     one adapter; no shrink tiles launched; output tiles add the update
  rows known          one adapter; the tokens' pool rows (0-15) and the windows taken as known, not read
                      (slot, then rank and row start): what a per-step table of them could save at most (not
                      run with more adapters: the rows it assumes would be wrong)
  prologue only       one adapter; no shrink tiles, no wait, no update: the tokens' rows and the
                      first B chunk loaded, the counters kept
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import sys
import tempfile
from types import ModuleType

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels import stacked_fused as fused_module
from adapterserve.kernels.split_counters import split_counters
from adapterserve.kernels.stacked import row_bucket
from benchmarks.fp8_lora_fused import RANK, Stack, stack_for
from benchmarks.fused_linear_projections import KINDS
from benchmarks.fused_update import print_table, step_meta, time_ms

NO_WAIT = ("_wait_for(step, a_tiles)", "pass")
NO_EXPAND = ("if HAS_LORA:\n                _wait_for(step, a_tiles)", "if HAS_LORA * 0:\n                _wait_for(step, a_tiles)")
NO_COUNT = ('if tl.atomic_add(step + 1, 1, sem="relaxed") == b_tiles - 1:', "if tile < 0:")
ROWS_KNOWN = (("""base, column_base = _window_bases(rank_ptr, row_start_ptr, slots_ptr, rm, rm < M, sl, cols, rows, pool_rows,
                                          stride_rs, stride_rslot, NUM_SLICES)""", "base, column_base = 0, cols * 0"),
              ("""row0, end, lo, hi = token_rows(rank_ptr, row_start_ptr, slots_ptr, rm, rm < M, sl, base + rows, max_rank,
                                        stride_rs, stride_rslot)""",
               "row0 = rm * 0\n        end = row0 + 16\n        lo = tl.min(row0, axis=0)\n        hi = tl.max(end, axis=0)"))
NO_SHRINK_TILES = ("a_tiles = triton.cdiv(a_width, config.block_n)", "a_tiles = 0")
ABLATIONS = {  # name: the source edits of the copy
    "no wait": (NO_WAIT,),
    "no count": (NO_COUNT,),
    "no expand": (NO_EXPAND,),
    "no shrink tiles": (NO_SHRINK_TILES,),
    "rows known": ROWS_KNOWN,
    "prologue only": (NO_SHRINK_TILES, NO_EXPAND),
}


def ablated(name: str, edits: tuple[tuple[str, str], ...], folder: str) -> ModuleType:
    """A copy of kernels/stacked_fused.py with ``edits`` made (each must match once), imported from
    a file in ``folder`` (Triton reads a kernel's source from its file)."""
    source = inspect.getsource(fused_module)
    for old, new in edits:
        if source.count(old) != 1:
            raise ValueError(f"{name}: {old!r} matches {source.count(old)} times in stacked_fused.py")
        source = source.replace(old, new)
    path = os.path.join(folder, f"stacked_fused_{name.replace(' ', '_')}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"_ablated_{name.replace(' ', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def ablations(adapters: int) -> dict[str, tuple[tuple[str, str], ...]]:
    """The ablations that hold for tokens over ``adapters`` adapters."""
    return {name: edits for name, edits in ABLATIONS.items() if adapters == 1 or ROWS_KNOWN not in edits}


def table(stack: Stack, tokens: int, slots: int, device: str, layers: int, folder: str,
          dtype: str, adapters: int) -> list[list[str]]:
    modules = {"fused 0": fused_module, f"fused {adapters}": fused_module,
               **{name: ablated(name, edits, folder) for name, edits in ablations(adapters).items()}}
    metas = {n: step_meta(tokens, max(n, 1), slots, device) for n in (0, adapters)}
    metas[0].token_slots.fill_(-1)
    out = []
    for i, kind in enumerate(KINDS):
        projections = stack.projections[i::len(KINDS)]
        base = time_ms(lambda: stack.run(f"{dtype} base", metas[0], 0, projections), device)
        cells = [f"{base * 1e3 / layers:.1f}"]
        for name, module in modules.items():
            used = 0 if name == "fused 0" else adapters
            meta, rows = metas[used], row_bucket(used * RANK, slots * RANK)
            stack.fused = module.stacked_fused
            ms = time_ms(lambda: stack.run(f"{dtype} fused", meta, rows, projections), device)
            if device == "cuda":
                torch.cuda.synchronize()
            split_counters(torch.device(device)).zero_()  # "no count" leaves its step counters set
            cells.append(f"{ms * 1e3 / layers:.1f} ({(ms / base - 1) * 100:+.0f}%)")
        out.append([kind, *cells])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                   help="the weights: bf16, or e4m3 (W8A8 base tiles, the shrink tiles' loop of their own)")
    p.add_argument("--adapters", type=int, default=1, help="the tokens round-robin over this many adapters")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code runs, figures mean nothing")
    args = p.parse_args()
    stack, (device, _, shape, layers, tokens, slots, name) = stack_for(args.smoke, args.layers)
    if not 1 <= args.adapters <= min(slots, tokens):
        p.error(f"--adapters must be 1 to {min(slots, tokens)} (the stack's slots and tokens)")
    with tempfile.TemporaryDirectory() as folder:
        rows = table(stack, tokens, slots, device, layers, folder, args.dtype, args.adapters)
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, {layers} layers, B={tokens}, {args.dtype}, "
          f"{args.adapters} rank-{RANK} adapter(s); us per projection (tax over base):")
    print_table(["projection", "base us", "fused 0", f"fused {args.adapters}", *ablations(args.adapters)], rows)


if __name__ == "__main__":
    main()
