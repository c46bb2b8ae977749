"""Compiles the attention kernels' FP8 KV cache paths (and the RoPE + cache write's, and decode
attention's products in the queries' dtype) for
sm_89 and sm_90 (no GPU needed: Triton's own ptxas) and prints, as JSON, per kernel and
target, how many e4m3 conversions and bf16 tensor-core products its PTX holds: what
test_kv_fp8 checks.

Run in a process of its own without TRITON_INTERPRET (the interpreter compiles nothing):
    python -m tests.kernels.kv_fp8_ptx
"""
from __future__ import annotations

import json
import re

from adapterserve.kernels import attention, fused, prefill_attention
from tests.kernels.ptx import TARGETS, compile_ptx, mma_count

ATTENTION = {"GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
             "HAS_WINDOW": False, "KV_FP8": 1, "INPUT_DOTS": 0, "PAGES_AHEAD": 1, "USE_PDL": 0}
PREFILL = {k: v for k, v in ATTENTION.items()
           if k not in ("INPUT_DOTS", "PAGES_AHEAD", "USE_PDL")}  # products in q's dtype; no PDL
KERNELS = {  # name: (kernel, its constexprs)
    "decode": (attention._decode_kernel, {**ATTENTION, "HAS_ORDER": True}),
    "decode_bf16_cache": (attention._decode_kernel, {**ATTENTION, "HAS_ORDER": True, "KV_FP8": 0}),
    "decode_input_dots": (attention._decode_kernel, {**ATTENTION, "HAS_ORDER": True, "INPUT_DOTS": 1}),
    "decode_bf16_cache_input_dots": (attention._decode_kernel,
                                     {**ATTENTION, "HAS_ORDER": True, "KV_FP8": 0, "INPUT_DOTS": 1}),
    "decode_split_input_dots": (attention._decode_split_kernel, {**ATTENTION, "SPLITS": 4, "INPUT_DOTS": 1}),
    "decode_split": (attention._decode_split_kernel, {**ATTENTION, "SPLITS": 4}),
    "prefill": (prefill_attention._prefill_kernel, {**PREFILL, "BLOCK_M": 64, "TILE_TOKENS": 16, "SUBS": 1,
                                                    "PRECISION": "tf32"}),
    "rope_and_cache": (fused._rope_cache_kernel, {"HALF": 64, "QH_PAD": 32, "KVH_PAD": 8, "KV_FP8": 1,
                                                  "USE_PDL": 0}),
}
POINTERS = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv",
            "q_ptr": "*bf16", "out_ptr": "*bf16"}
FLOAT_POINTERS = {"ks_ptr", "vs_ptr", "part_m_ptr", "part_l_ptr", "part_o_ptr", "cos_ptr", "sin_ptr"}
FLOAT_SCALARS = {"scale", "qk_scale", "fp8_max", "min_scale"}


def signature(kernel, constexprs: dict) -> dict[str, str]:
    rope = kernel is fused._rope_cache_kernel
    plain = not constexprs.get("KV_FP8")
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif rope and name in ("k_ptr", "v_ptr"):
            types[name] = "*bf16"  # the projection's k and v, rounded as they are written
        elif name in POINTERS:
            types[name] = "*bf16" if plain and name in ("k_ptr", "v_ptr") else POINTERS[name]
        elif name in FLOAT_POINTERS:
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i32"
        else:
            types[name] = "fp32" if name in FLOAT_SCALARS else "i32"
    return types


def counts(kernel, constexprs: dict, capability: int) -> dict[str, int]:
    ptx = compile_ptx(kernel, signature(kernel, constexprs), constexprs, capability)
    return {"e4m3": len(re.findall(r"cvt\.[a-z.0-9]*e4m3x2", ptx)), "bf16_mma": mma_count(ptx, "bf16")}


def main() -> None:
    print(json.dumps({name: {str(cc): counts(kernel, consts, cc) for cc in TARGETS}
                      for name, (kernel, consts) in KERNELS.items()}))


if __name__ == "__main__":
    main()
