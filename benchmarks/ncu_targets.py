"""Launches for Nsight Compute (ncu): the 8B's decode step kernels whose time sits furthest above
their bytes' floor, each launched LAUNCHES times at B=64 with the engine's own choices, nothing
else on the GPU. Run under ncu, the last launch of each profiled:

    ncu --clock-control none --launch-skip 2 \\
        -k regex:"_decode_kernel|_decode_split_kernel|_decode_gemm_kernel|_quant_kernel" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/ncu_targets.py

Targets (--targets picks, comma-separated):
  attention      decode attention, 64 sequences of 128-1152 keys, bf16 cache, the engine's tiles and order
  attention_kv8  the same on an FP8 (e4m3) cache: half the bytes
  attention_s3   the same with 3 stages: the pipelined loop (kernels/attention.py, PAGES_AHEAD) keeps a
                 second tile of keys and values in flight (136 KiB of shared memory: one program a multiprocessor)
  attention_n64  64-key tiles and 3 stages, pipelined (70 KiB: up to three programs a multiprocessor)
  attention_split2  the engine's case split into 2 parts a context (twice the programs; a merge after)
  fp8_gate_up    the FP8 W8A8 decode GEMM of the 8B's gate|up (28,672 x 4,096), 64 tokens, engine tiles
  fp8_down       the same for down (4,096 x 14,336)
  fp8_silu_quant the FP8 backbone's SiLU-mul with its per-token quantization (64 tokens, 2 x 14,336 inputs)
  fp8_norm_quant its residual add + RMSNorm with the quantization (64 tokens, 4,096)
With --time (not under ncu) it times each target as the engine runs it, in a CUDA graph (the launcher's
Python off the clock: timed eagerly, a launch of a few tens of us measures the host), and prints a table.
"""
from __future__ import annotations

import argparse

import torch

from adapterserve.kernels.attention import paged_decode_attention
from adapterserve.kernels.decode_gemm import fp8_decode_config, fp8_decode_gemm
from adapterserve.kernels.fp8 import quantize_rows
from adapterserve.kernels.fp8_fused import rms_norm_quant, silu_mul_quant
from adapterserve.models.fp8 import quantize_per_channel
from benchmarks.attention_decode import decode_case, fp8_cache_case
from benchmarks.measure import graph_ms

BATCH = 64
CONTEXTS = (128, 1152)  # each sequence's keys, drawn from this range
LAUNCHES = 3  # each target's; ncu's --launch-skip picks among them
DEVICE, DTYPE = "cuda", torch.bfloat16  # a CPU check of the launches sets "cpu", float32 (the interpreter)


def _attention(block_n: int | None = None, stages: int = 2, fp8_cache: bool = False, splits: int = 1):
    torch.manual_seed(0)  # every target's process the same contexts and block tables
    args, moved = decode_case(BATCH, f"{CONTEXTS[0]}-{CONTEXTS[1]}", DEVICE, DTYPE)
    scales = {}
    if fp8_cache:
        args, scales, _ = fp8_cache_case(args, moved)
    q, lens = args[0], args[4]
    order = torch.argsort(lens, descending=True, stable=True).to(torch.int32)
    out = torch.empty_like(q)
    return lambda: paged_decode_attention(*args, None, out, block_n=block_n, num_stages=stages,
                                          splits=splits, order=order, **scales)


GEMMS = {"fp8_gate_up": (28672, 4096), "fp8_down": (4096, 14336)}  # the 8B's (n, k)


def _fp8_gemm(n: int, k: int):
    weight, scale = quantize_per_channel(torch.randn(n, k, device=DEVICE, dtype=DTYPE) * 0.02)
    xq, x_scale = quantize_rows(torch.randn(BATCH, k, device=DEVICE, dtype=DTYPE))
    config = fp8_decode_config(n, k)
    return lambda: fp8_decode_gemm(xq, weight, scale, x_scale, DTYPE, config)


def _silu_quant(inter: int):
    gate_up = torch.randn(BATCH, 2 * inter, device=DEVICE, dtype=DTYPE)
    return lambda: silu_mul_quant(gate_up)


def _norm_quant(hidden: int):
    x, residual = (torch.randn(BATCH, hidden, device=DEVICE, dtype=DTYPE) for _ in range(2))
    weight = torch.ones(hidden, device=DEVICE, dtype=DTYPE)
    return lambda: rms_norm_quant(x, weight, 1e-5, residual)


ROWS = {"fp8_silu_quant": 14336, "fp8_norm_quant": 4096}  # the 8B's intermediate and hidden sizes
TARGETS = {
    "attention": lambda: _attention(),
    "attention_kv8": lambda: _attention(fp8_cache=True),
    "attention_s3": lambda: _attention(stages=3),
    "attention_n64": lambda: _attention(block_n=64, stages=3),
    "attention_split2": lambda: _attention(splits=2),
    "fp8_gate_up": lambda: _fp8_gemm(*GEMMS["fp8_gate_up"]),
    "fp8_down": lambda: _fp8_gemm(*GEMMS["fp8_down"]),
    "fp8_silu_quant": lambda: _silu_quant(ROWS["fp8_silu_quant"]),
    "fp8_norm_quant": lambda: _norm_quant(ROWS["fp8_norm_quant"]),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of: {', '.join(TARGETS)}")
    p.add_argument("--time", action="store_true", help="also time each target (not under ncu)")
    args = p.parse_args()
    names = args.targets.split(",")
    unknown = set(names) - set(TARGETS)
    if unknown:
        p.error(f"unknown targets {sorted(unknown)}")
    rows = []
    for name in names:
        fn = TARGETS[name]()
        for _ in range(LAUNCHES):
            fn()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        if args.time:
            rows.append((name, graph_ms(fn) * 1e3))
    if rows:
        print(f"\n{torch.cuda.get_device_name()}; B={BATCH}; us per launch (median of a CUDA graph replay)")
        print("| target | us |\n|---|---|")
        for name, us in rows:
            print(f"| {name} | {us:.1f} |")


if __name__ == "__main__":
    main()
