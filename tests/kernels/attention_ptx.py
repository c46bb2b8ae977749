"""Compiles decode attention for sm_90 (no GPU needed) with its pointers and row strides
aligned as a launch finds them, and prints as JSON the shared memory of each form and the K/V
buffers of its loop: what test_attention checks of the pipelined loop (PAGES_AHEAD).

Run in a process of its own without TRITON_INTERPRET (the interpreter compiles nothing):
    python -m tests.kernels.attention_ptx
"""
from __future__ import annotations

import json
import re

from adapterserve.kernels import attention
from tests.kernels.ptx import compile_form, signature, with_defaults

ATTENTION = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
             "HAS_WINDOW": False, "KV_FP8": False, "INPUT_DOTS": True, "HAS_ORDER": True}
ALIGNED = frozenset({"q_ptr", "k_ptr", "v_ptr", "out_ptr", "table_ptr", "lens_ptr", "start_ptr", "order_ptr",
                     "ks_ptr", "vs_ptr", "stride_qb", "stride_qh", "stride_kn", "stride_kh", "stride_tb",
                     "stride_ob", "stride_oh"})
METADATA = {"table_ptr": "*i32", "lens_ptr": "*i32", "start_ptr": "*i32", "order_ptr": "*i32", "ks_ptr": "*fp32",
            "vs_ptr": "*fp32"}


def form(pages_ahead: int, stages: int) -> dict:
    """Shared bytes, and the buffers of each [tiles x BLOCK_N x HEAD_DIM] K/V allocation (how many
    tiles the loop keeps in flight, plus the one in use)."""
    consts = with_defaults(attention._decode_kernel, {**ATTENTION, "PAGES_AHEAD": pages_ahead})
    compiled = compile_form(attention._decode_kernel, signature(attention._decode_kernel, consts, METADATA), consts,
                            90, {"num_warps": 4, "num_stages": stages}, ALIGNED)
    tiles = re.findall(r"memdesc<(\d+)x64x128xbf16", compiled.asm["ttgir"])
    return {"shared": compiled.metadata.shared, "kv_buffers": sorted({int(t) for t in tiles})}


def main() -> None:
    print(json.dumps({f"ahead{ahead}_stages{stages}": form(ahead, stages) for ahead in (0, 1) for stages in (2, 3)}))


if __name__ == "__main__":
    main()
