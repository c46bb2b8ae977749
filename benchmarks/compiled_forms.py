"""What each compiled form of a Triton kernel asks of a multiprocessor: registers, spills and
shared memory per program, and so how many of its programs fit on one at a time.

    forms_table(kernel)  # after the kernel has run on a GPU: one row per compiled form
"""
from __future__ import annotations

import torch

REGISTERS_PER_SM = 65536
MAX_PROGRAMS_PER_SM = 32
CONSTEXPRS = ("BLOCK_N", "BLOCK_K", "SPLIT_K", "NUM_STAGES", "HAS_LORA", "NUM_SLICES", "SPLIT_A", "A_STAGES")


def _constexprs(compiled) -> str:
    """The form's constexprs of CONSTEXPRS that it has, as name=value."""
    src = getattr(compiled, "src", None)
    names = getattr(getattr(src, "fn", None), "arg_names", [])
    constants = getattr(src, "constants", {}) or {}
    values = {names[key[0]]: value for key, value in constants.items()
              if isinstance(key, tuple) and len(key) == 1 and key[0] < len(names)}
    return " ".join(f"{n}={values[n]}" for n in CONSTEXPRS if n in values)


def programs_per_sm(n_regs: int, warps: int, shared: int, shared_per_sm: int) -> int:
    """Programs of a form that one multiprocessor holds at once (registers, shared memory, the cap)."""
    by_regs = REGISTERS_PER_SM // max(1, n_regs * warps * 32)
    by_shared = shared_per_sm // shared if shared else MAX_PROGRAMS_PER_SM
    return min(by_regs, by_shared, MAX_PROGRAMS_PER_SM)


def forms_table(kernel) -> list[list[str]]:
    """[form, registers, spills, shared KiB, programs a multiprocessor] per compiled form of a
    @triton.jit kernel on this GPU (none under the interpreter, which compiles nothing)."""
    if not torch.cuda.is_available():
        return []
    shared_per_sm = torch.cuda.get_device_properties(0).shared_memory_per_multiprocessor
    rows = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for compiled in cache[0].values():
            regs, spills = getattr(compiled, "n_regs", 0), getattr(compiled, "n_spills", 0)
            meta = compiled.metadata
            rows.append([_constexprs(compiled), str(regs), str(spills), f"{meta.shared / 1024:.1f}",
                         str(programs_per_sm(regs, meta.num_warps, meta.shared, shared_per_sm))])
    return rows
