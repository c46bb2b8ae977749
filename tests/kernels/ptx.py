"""Compiling a Triton kernel for a CUDA target with no GPU (Triton's own ptxas) and counting
what its PTX holds: the PTX-checking modules' shared part (kv_fp8_ptx, fused_apart_ptx)."""
from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGETS = (89, 90)  # the float8 capabilities: Ada and Hopper


def with_defaults(kernel, constexprs: dict) -> dict:
    """The constexprs, with the kernel's defaults for those not given (as a launch compiles them:
    left out of a signature, they would be typed as runtime scalars)."""
    return {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}


INT_POINTERS = {"slots_ptr", "rank_ptr", "row_start_ptr", "sorted_ptr", "tile_slots_ptr", "tile_starts_ptr",
                "tile_ends_ptr", "slot_starts_ptr", "pos_ptr", "slot_ptr", "count_ptr", "codes_ptr"}
FLOAT_POINTERS = {"cos_ptr", "sin_ptr", "part_ptr", "part_a_ptr", "xs_ptr", "ws_ptr"}
FLOAT_SCALARS = {"eps", "fp8_max", "min_scale"}


def signature(kernel, constexprs: dict, pointers: dict[str, str] | None = None) -> dict[str, str]:
    """bf16 tensors, int32 metadata, float32 tables, int32 scalars (FLOAT_SCALARS float32); ``pointers``
    names others."""
    types = {}
    for name in kernel.arg_names:
        if pointers and name in pointers:
            types[name] = pointers[name]
        elif name in constexprs:
            types[name] = "constexpr"
        elif name in INT_POINTERS:
            types[name] = "*i32"
        elif name in FLOAT_POINTERS:
            types[name] = "*fp32"
        else:
            types[name] = "*bf16" if name.endswith("_ptr") else "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def compile_ptx(kernel, signature: dict[str, str], constexprs: dict, capability: int,
                options: dict | None = None) -> str:
    return compile_form(kernel, signature, constexprs, capability, options).asm["ptx"]


def compile_form(kernel, signature: dict[str, str], constexprs: dict, capability: int,
                 options: dict | None = None, aligned: frozenset[str] = frozenset()):
    """The compiled kernel (its .asm and .metadata); ``aligned``: arguments a launch would find
    divisible by 16 (pointers from torch, strides of 16-element rows), as Triton specialises them:
    without that, loads are not vectorised and no loop is pipelined."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def mma_count(ptx: str, operand: str) -> int:
    """Tensor-core products (mma.sync or Hopper's wgmma) on two operands of this PTX type (bf16, e4m3)."""
    return len(re.findall(rf"(?:mma|wgmma)[a-z_.0-9]*\.{operand}\.{operand}", ptx))
