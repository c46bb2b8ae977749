"""Compiles decode attention and the fused LoRA linear for sm_90 (no GPU needed) with their
pointers and row strides aligned as a launch finds them, and prints as JSON the shared memory
and the software pipeline's buffers of their loops: what test_attention and test_stacked_fused
check (a loop whose loads Triton cannot pipeline gets one buffer, or none, and waits on every
load).

Run in a process of its own without TRITON_INTERPRET (the interpreter compiles nothing):
    python -m tests.kernels.pipeline_ptx
"""
from __future__ import annotations

import json
import re

from adapterserve.kernels import attention
from adapterserve.kernels.stacked_fused import _stacked_fused_kernel
from tests.kernels.fused_apart_ptx import TILES, with_shrink_loop
from tests.kernels.ptx import compile_form, signature, with_defaults

ATTENTION = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
             "HAS_WINDOW": False, "KV_FP8": False, "INPUT_DOTS": True, "HAS_ORDER": True}
INT_POINTERS = {"table_ptr", "lens_ptr", "start_ptr", "order_ptr", "count_ptr", "rank_ptr", "row_start_ptr",
                "slots_ptr"}
FLOAT_POINTERS = {"ks_ptr", "vs_ptr", "part_ptr", "part_a_ptr", "xs_ptr", "ws_ptr"}
WEIGHT_TILE = "32x128xbf16"  # the fused linear's weight rows a K chunk (BLOCK_N x BLOCK_K below)


def _compile(kernel, constexprs: dict, warps: int, stages: int):
    consts = with_defaults(kernel, constexprs)
    pointers = {**{n: "*i32" for n in INT_POINTERS}, **{n: "*fp32" for n in FLOAT_POINTERS}}
    aligned = frozenset(n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride_")
                        or n in ("K", "k_per_split", "a_k_per_split"))
    return compile_form(kernel, signature(kernel, consts, pointers), consts, 90,
                        {"num_warps": warps, "num_stages": stages}, aligned)


def _buffers(compiled, tile: str) -> list[int]:
    """The depths of the loop buffers holding this tile shape (none: its loads are not pipelined)."""
    return sorted({int(d) for d in re.findall(rf"memdesc<(\d+)x{tile}", compiled.asm["ttgir"])})


def _loop_body(compiled) -> list[str]:
    """The TTGIR lines of the kernel's first loop."""
    lines = compiled.asm["ttgir"].splitlines()
    start = next(i for i, line in enumerate(lines) if "scf.for" in line)
    depth, body = 0, []
    for line in lines[start:]:
        depth += line.count("{") - line.count("}")
        body.append(line)
        if depth <= 0 and len(body) > 1:
            return body
    return body


def attention_form(pages_ahead: int, stages: int) -> dict:
    """Shared bytes and the K/V buffers' depths."""
    consts = {**ATTENTION, "PAGES_AHEAD": pages_ahead}
    compiled = _compile(attention._decode_kernel, consts, 4, stages)
    return {"shared": compiled.metadata.shared, "kv_buffers": _buffers(compiled, "64x128xbf16")}


def fused_linear_form() -> dict:
    """The bf16 fused linear (one K loop over a shrink tile's A rows or an output tile's weight rows)."""
    consts = with_shrink_loop({**TILES, "BLOCK_K": 128, "SPLIT_K": 4, "X_SCALED": 0, "W_SCALED": 0}, {}, 90, 4096)
    compiled = _compile(_stacked_fused_kernel, consts, 4, consts["NUM_STAGES"])
    return {"stages": consts["NUM_STAGES"], "weight_buffers": _buffers(compiled, WEIGHT_TILE)}


def main() -> None:
    forms = {f"attention_ahead{ahead}_stages{stages}": attention_form(ahead, stages)
             for ahead in (0, 1) for stages in (2, 3)}
    print(json.dumps({**forms, "fused_linear": fused_linear_form()}))


if __name__ == "__main__":
    main()
