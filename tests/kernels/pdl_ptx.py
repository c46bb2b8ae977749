"""Compiles every kernel with a USE_PDL path for sm_90 (no GPU needed: Triton's own ptxas)
with USE_PDL 0, 1 and 2, and prints what test_pdl checks in its PTX, as JSON.

Run in a process of its own without TRITON_INTERPRET (the interpreter compiles nothing):
    python -m tests.kernels.pdl_ptx
"""
from __future__ import annotations

import json
import re

from adapterserve.kernels import (
    attention,
    decode_gemm,
    fp8,
    fp8_fused,
    fp8_parts,
    fused,
    segment_gemv,
    stacked_fused,
    stacked_grouped,
    stacked_tiled,
)
from tests.kernels.ptx import compile_ptx, signature, with_defaults

GEMM = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 2, "NUM_STAGES": 4, "IEEE": False}
SLICES = {"NUM_SLICES": 3, "HAS_BIAS": False}
ATTENTION = {"GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "DIM_PAD": 128, "PAGE": 16, "BLOCK_N": 64,
             "HAS_WINDOW": False, "KV_FP8": False, "INPUT_DOTS": True, "PAGES_AHEAD": 1}
TILED = {"IEEE": False, "BLOCK_M": 16, "BLOCK_N": 128, "CHUNK_ROWS": 16}
KERNELS = {  # name: (kernel, its constexprs but USE_PDL)
    "rms_norm": (fused._rms_norm_kernel, {"BLOCK": 4096}),
    "add_rms_norm": (fused._add_rms_norm_kernel, {"BLOCK": 4096}),
    "silu_mul": (fused._silu_mul_kernel, {"BLOCK": 1024}),
    "rope_and_cache": (fused._rope_cache_kernel, {"HALF": 64, "QH_PAD": 32, "KVH_PAD": 8}),
    "rope_and_cache_fp8": (fused._rope_cache_kernel, {"HALF": 64, "QH_PAD": 32, "KVH_PAD": 8, "KV_FP8": 1}),
    "seg_down_gemv": (segment_gemv.seg_down_gemv,
                      {**SLICES, "HAS_ROW_START": True, "ACT": 0, "A_ALIGN": 16, "ROWS": 4, "BLOCK_K": 1024}),
    "seg_down_gemv_mixed": (segment_gemv.seg_down_gemv,  # a bottleneck's input x + mix * residual
                            {"NUM_SLICES": 1, "HAS_BIAS": True, "HAS_ROW_START": False, "ACT": 1, "A_ALIGN": 16,
                             "ROWS": 4, "BLOCK_K": 1024, "HAS_MIX": 1}),
    "seg_up_gemv": (segment_gemv.seg_up_gemv,
                    {**SLICES, "HAS_ROW_START": True, "N_ALIGN": 16, "BLOCK_R": 16, "BLOCK_N": 1024}),
    "tiled_expand": (stacked_tiled._tiled_expand_kernel, {**SLICES, **TILED, "SKIP_UNUSED": True}),
    "tiled_expand_no_skip": (stacked_tiled._tiled_expand_kernel,
                             {"NUM_SLICES": 1, "HAS_BIAS": True, **TILED, "SKIP_UNUSED": False}),
    "grouped_expand": (stacked_grouped._grouped_expand_kernel,
                       {**SLICES, "DOT_PRECISION": "tf32", "ONE_R": True, "BLOCK_M": 16, "BLOCK_R": 16,
                        "BLOCK_N": 128, "GROUP_N": 512}),
    "quantize_rows": (fp8._quantize_rows_kernel, {"BLOCK": 2048}),
    "rms_norm_quant": (fp8_fused._rms_norm_quant_kernel, {"ADD": False, "BLOCK": 4096}),
    "add_rms_norm_quant": (fp8_fused._rms_norm_quant_kernel, {"ADD": True, "BLOCK": 4096}),
    "silu_mul_quant": (fp8_fused._silu_mul_quant_kernel, {"BLOCK": 2048}),
    "silu_mul_quant_one_pass": (fp8_fused._silu_mul_quant_kernel, {"BLOCK": 16384, "ONE_PASS": 1}),
    "quantize_rows_one_pass": (fp8._quantize_rows_kernel, {"BLOCK": 4096, "ONE_PASS": 1}),
    "silu_mul_part": (fp8_parts._silu_mul_part_kernel, {"PART": 2048}),
    "quantize_part": (fp8_parts._quantize_part_kernel, {"PART": 2048, "PARTS_PAD": 8}),
    "decode_gemm": (decode_gemm._decode_gemm_kernel, GEMM),
    "decode_gemm_fp8_weights": (decode_gemm._decode_gemm_kernel, {**GEMM, "W_SCALED": 1}),
    "decode_gemm_w8a8": (decode_gemm._decode_gemm_kernel, {**GEMM, "X_SCALED": 1, "W_SCALED": 1}),
    "stacked_fused": (stacked_fused._stacked_fused_kernel,
                      {**SLICES, **GEMM, "CHUNK_ROWS": 16, "HAS_LORA": True, "ALIGNED": True}),
    "decode_attention": (attention._decode_kernel, {**ATTENTION, "HAS_ORDER": True}),
    "decode_attention_split": (attention._decode_split_kernel, {**ATTENTION, "SPLITS": 4}),
    "decode_attention_merge": (attention._decode_merge_kernel, {"HEAD_DIM": 128, "DIM_PAD": 128, "SPLITS": 4,
                                                                "SPLITS_PAD": 4}),
    "decode_gemm_prefetch": (decode_gemm._decode_gemm_kernel, {**GEMM, "PREFETCH": 4}),
    "decode_gemm_w8a8_prefetch": (decode_gemm._decode_gemm_kernel, {**GEMM, "X_SCALED": 1, "W_SCALED": 1,
                                                                     "PREFETCH": 4}),
    "stacked_fused_prefetch": (stacked_fused._stacked_fused_kernel,
                               {**SLICES, **GEMM, "CHUNK_ROWS": 16, "HAS_LORA": True, "ALIGNED": True, "PREFETCH": 4}),
}
PREFETCHING = {name for name, (_, consts) in KERNELS.items() if consts.get("PREFETCH")}
E4M3 = "*fp8e4nv"
QUANT = {"q_ptr": E4M3, "s_ptr": "*fp32"}
POINTER_TYPES = {  # name: the pointers that are not bf16 / int32 / float32 by their names
    "quantize_rows": QUANT, "rms_norm_quant": QUANT, "add_rms_norm_quant": QUANT, "silu_mul_quant": QUANT,
    "silu_mul_quant_one_pass": QUANT, "quantize_rows_one_pass": QUANT, "silu_mul_part": {"amax_ptr": "*fp32"},
    "quantize_part": {**QUANT, "amax_ptr": "*fp32"},
    "decode_gemm_fp8_weights": {"w_ptr": E4M3},
    "decode_gemm_w8a8": {"x_ptr": E4M3, "w_ptr": E4M3},
    "decode_gemm_w8a8_prefetch": {"x_ptr": E4M3, "w_ptr": E4M3},
    "rope_and_cache_fp8": {"kc_ptr": E4M3, "vc_ptr": E4M3, "ks_ptr": "*fp32", "vs_ptr": "*fp32"},
    "decode_attention": {"table_ptr": "*i32", "lens_ptr": "*i32", "start_ptr": "*i32", "order_ptr": "*i32",
                         "ks_ptr": "*fp32", "vs_ptr": "*fp32"},
    "decode_attention_split": {"table_ptr": "*i32", "lens_ptr": "*i32", "start_ptr": "*i32", "ks_ptr": "*fp32",
                               "vs_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
                               "part_o_ptr": "*fp32"},
    "decode_attention_merge": {"part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_o_ptr": "*fp32"},
}


def ptx(kernel, constexprs: dict, use_pdl: int, pointers: dict[str, str] | None = None) -> str:
    constexprs = with_defaults(kernel, {**constexprs, "USE_PDL": use_pdl})
    options = {"launch_pdl": True} if use_pdl else {}
    return compile_ptx(kernel, signature(kernel, constexprs, pointers), constexprs, 90, options)


def summary(text: str) -> dict:
    """Counts of the grid dependency ops, and the global memory ops (prefetches apart) before the first wait."""
    ops = [m.group(0) for m in re.finditer(
        r"griddepcontrol\.wait|prefetch\.global\.L2|ld\.global|st\.global|atom\.global", text)]
    first_wait = ops.index("griddepcontrol.wait") if "griddepcontrol.wait" in ops else len(ops)
    before = ops[:first_wait]
    return {"waits": text.count("griddepcontrol.wait"), "launches": text.count("griddepcontrol.launch_dependents"),
            "stores_before_wait": sum(op.startswith(("st.", "atom.")) for op in before),
            "loads_before_wait": before.count("ld.global"), "prefetches": text.count("prefetch.global.L2"),
            "prefetches_before_wait": before.count("prefetch.global.L2")}


def main() -> None:
    print(json.dumps({name: {mode: summary(ptx(kernel, consts, mode, POINTER_TYPES.get(name))) for mode in (0, 1, 2)}
                      for name, (kernel, consts) in KERNELS.items()}))


if __name__ == "__main__":
    main()
