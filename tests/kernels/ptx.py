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


def compile_ptx(kernel, signature: dict[str, str], constexprs: dict, capability: int) -> str:
    source = ASTSource(kernel, signature, constexprs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32)).asm["ptx"]


def mma_count(ptx: str, operand: str) -> int:
    """Tensor-core products (mma.sync or Hopper's wgmma) on two operands of this PTX type (bf16, e4m3)."""
    return len(re.findall(rf"(?:mma|wgmma)[a-z_.0-9]*\.{operand}\.{operand}", ptx))
