"""Compiles the fused stacked LoRA linear (kernels/stacked_fused.py) for sm_89 and sm_90 (no
GPU needed: Triton's own ptxas), with its A rows kept apart from an e4m3 weight (W8A8 and
weight-only: the shrink loop each target's shared memory allows) or beside a bf16 one, and prints,
as JSON, per variant and target, how many e4m3 and bf16 tensor-core products its PTX holds: what
test_stacked_fused_apart checks.
The interpreter compiles nothing, so this is where a branch Triton cannot type shows.

Run in a process of its own without TRITON_INTERPRET:
    python -m tests.kernels.fused_apart_ptx
    python -m tests.kernels.fused_apart_ptx --engine-8b   # every form the 8B engine launches, sm_90
                                                          # (before a GPU session: minutes, not in CI)
"""
from __future__ import annotations

import json
import sys
from itertools import product

from adapterserve.kernels.decode_gemm import DecodeGemmConfig, decode_config, fp8_fused_config
from adapterserve.kernels.stacked_fused import CHUNK, _stacked_fused_kernel, shrink_tiles
from tests.kernels.ptx import TARGETS, compile_ptx, mma_count, signature, with_defaults

TILES = {"NUM_SLICES": 3, "HAS_BIAS": False, "IEEE": False, "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 256,
         "SPLIT_K": 2, "NUM_STAGES": 4, "CHUNK_ROWS": CHUNK, "HAS_LORA": True, "ALIGNED": True,
         "BASE_IEEE": False, "USE_PDL": 0}
VARIANTS = {  # name: (constexprs, pointer types that differ from bf16)
    "apart_w8a8": ({**TILES, "X_SCALED": 1, "W_SCALED": 1},
                   {"w_ptr": "*fp8e4nv", "xb_ptr": "*fp8e4nv"}),
    "apart_w8a8_prefetch": ({**TILES, "X_SCALED": 1, "W_SCALED": 1, "PREFETCH": 4},  # its weight rows asked of L2
                            {"w_ptr": "*fp8e4nv", "xb_ptr": "*fp8e4nv"}),
    "apart_weight_only": ({**TILES, "X_SCALED": 0, "W_SCALED": 1}, {"w_ptr": "*fp8e4nv"}),
    "plain": ({**TILES, "X_SCALED": 0, "W_SCALED": 0}, {}),  # a bf16 weight, apart or joint: one kernel
}
SHARED_MEMORY = {89: 101376, 90: 232448}  # bytes a program may use: Ada, Hopper
K_8B = 4096  # the variants' K (the 8B's hidden size)


def with_shrink_loop(constexprs: dict, pointers: dict[str, str], capability: int, k: int) -> dict:
    """The constexprs with the shrink tiles' K loop the launch would choose on this target."""
    config = DecodeGemmConfig(block_n=constexprs["BLOCK_N"], block_k=constexprs["BLOCK_K"],
                              num_stages=constexprs["NUM_STAGES"])
    sizes = [1 if pointers.get(name) == "*fp8e4nv" else 2 for name in ("x_ptr", "xb_ptr", "w_ptr")]
    shrink = shrink_tiles(config, constexprs["BLOCK_M"], constexprs["SPLIT_K"], k, *sizes,
                          SHARED_MEMORY[capability])
    return {**constexprs, "SPLIT_A": shrink.split, "A_BLOCK_K": shrink.block_k, "A_STAGES": shrink.stages}


def counts(constexprs: dict, pointers: dict[str, str], capability: int, k: int = K_8B) -> dict[str, int]:
    constexprs = with_defaults(_stacked_fused_kernel, with_shrink_loop(constexprs, pointers, capability, k))
    ptx = compile_ptx(_stacked_fused_kernel, signature(_stacked_fused_kernel, constexprs, pointers), constexprs,
                      capability)
    return {"e4m3_mma": mma_count(ptx, "e4m3"), "bf16_mma": mma_count(ptx, "bf16")}


# the 8B's projections: (slices, N, K)
PROJECTIONS_8B = {"q|k|v": (3, 6144, 4096), "o": (1, 4096, 4096), "gate|up": (2, 28672, 4096), "down": (1, 4096, 14336)}


def engine_8b_forms() -> dict[str, tuple[dict, dict[str, str], int]]:
    """Every apart form an 8B engine's decode steps launch: per projection, row tile, with and
    without rows in use, plain / W8A8 / weight-only, the tiles decode_config and fp8_fused_config pick."""
    forms = {}
    for (name, (slices, n, k)), block_m, has_lora, form in product(
            PROJECTIONS_8B.items(), (16, 32, 64), (True, False), ("plain", "w8a8", "weight_only")):
        config = decode_config(n, k) if form == "plain" else fp8_fused_config(n, k)
        consts = {**TILES, "NUM_SLICES": slices, "BLOCK_M": block_m, "BLOCK_N": config.block_n,
                  "BLOCK_K": config.block_k, "NUM_STAGES": config.num_stages, "SPLIT_K": 4, "HAS_LORA": has_lora,
                  "X_SCALED": int(form == "w8a8"), "W_SCALED": int(form != "plain")}
        pointers = {"w_ptr": "*fp8e4nv"} if form != "plain" else {}
        if form == "w8a8":
            pointers["xb_ptr"] = "*fp8e4nv"
        forms[f"{name} m{block_m} {'lora' if has_lora else 'none'} {form}"] = (consts, pointers, k)
    return forms


def main() -> None:
    if "--engine-8b" in sys.argv:
        for name, (consts, pointers, k) in engine_8b_forms().items():
            print(name, counts(consts, pointers, 90, k), flush=True)
        return
    print(json.dumps({name: {str(cc): counts(consts, pointers, cc) for cc in TARGETS}
                      for name, (consts, pointers) in VARIANTS.items()}))


if __name__ == "__main__":
    main()
