"""The FP8 decoder's per-token quantizing ops: one pass (the row held in registers) against the
row loops they ran before (kernels/fp8.py, kernels/fp8_fused.py), and SiLU-mul's quantization in
two launches over parts of each row (kernels/fp8_parts.py: PARTS values a program).

    PYTHONPATH=. python benchmarks/fp8_row_ops.py      # H100/H200: under a minute

Each figure is one CUDA graph replay of 32 launches (a decode step's worth: one a layer) over
different inputs, in us per launch, beside the bf16 op the step runs without FP8 (silu_mul) and
the bytes' floor at the copy bandwidth measured in the same run. Every variant's outputs are
checked bit for bit against the loops' before timing.
"""
from __future__ import annotations

import argparse
from functools import partial

import torch

from adapterserve.kernels.fp8 import LOOP_BLOCK, quantize_rows_triton
from adapterserve.kernels.fp8_fused import silu_mul_quant
from adapterserve.kernels.fused import silu_mul
from benchmarks.fused_update import print_table
from benchmarks.measure import copy_bandwidth, graph_ms

LAUNCHES = 32  # LOOP_BLOCK: the block the row loops run with
PARTS = (1024, 2048, 4096)  # values of a row per program of the two-launch SiLU-mul quantization


def _per_launch_us(op, inputs: list[torch.Tensor]) -> float:
    def run():
        for x in inputs:
            op(x)
    run()  # compile before graph_ms's warm-up and capture
    torch.cuda.synchronize()
    return graph_ms(run) * 1e3 / len(inputs)


def _check_same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...], what: str) -> None:
    for x, y in zip(a, b):
        if not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            raise AssertionError(f"{what}: the outputs differ")


def _ops(kind: str):
    """(loops, one pass, the bf16 op or None, bytes moved a launch as a function of the input)."""
    if kind == "silu_mul_quant":
        return (lambda x: silu_mul_quant(x, block=LOOP_BLOCK), silu_mul_quant, silu_mul,
                lambda x: x.numel() * 2 + x.numel() // 2 * 3)  # read gate|up, write out (bf16) and q
    return (lambda x: quantize_rows_triton(x, block=LOOP_BLOCK), quantize_rows_triton, None,
            lambda x: x.numel() * 3)  # read x (bf16), write q


def measure(kind: str, tokens: int, width: int, bandwidth: float) -> list[str]:
    loops, one_pass, plain, nbytes = _ops(kind)
    inputs = [torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(LAUNCHES)]
    _check_same(loops(inputs[0]), one_pass(inputs[0]), kind)
    loop_us, one_us = _per_launch_us(loops, inputs), _per_launch_us(one_pass, inputs)
    plain_us = f"{_per_launch_us(plain, inputs):.1f}" if plain is not None else "-"
    floor_us = nbytes(inputs[0]) / bandwidth * 1e6
    return [kind, str(tokens), str(width), f"{loop_us:.1f}", f"{one_us:.1f}", f"{loop_us / one_us:.2f}x",
            *_in_parts(kind, one_pass, inputs), plain_us, f"{floor_us:.1f}"]


def _in_parts(kind: str, one_pass, inputs: list[torch.Tensor]) -> list[str]:
    """us per launch of SiLU-mul's quantization in parts of each size in PARTS (each checked bit for
    bit against the one-pass kernel's first), "-" for the other ops."""
    if kind != "silu_mul_quant":
        return ["-"] * len(PARTS)
    cells = []
    for part in PARTS:
        in_parts = partial(silu_mul_quant, part=part)
        _check_same(one_pass(inputs[0]), in_parts(inputs[0]), f"{kind} in parts of {part}")
        cells.append(f"{_per_launch_us(in_parts, inputs):.1f}")
    return cells


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1,64,256,2048", help="rows a launch (decode and prefill sizes)")
    args = parser.parse_args()
    bandwidth = copy_bandwidth("cuda", 1 << 30)
    cases = [("silu_mul_quant", 2 * 14336), ("quantize_rows", 4096)]  # the 8B's down and o inputs
    rows = [measure(kind, int(t), width, bandwidth) for kind, width in cases for t in args.tokens.split(",")]
    print(f"\n{torch.cuda.get_device_name()}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s; us per launch "
          f"(graph replay of {LAUNCHES})")
    print_table(["op", "tokens", "input width", "loops", "one pass", "speed-up",
                 *(f"parts of {part}" for part in PARTS), "bf16 silu_mul", "bytes' floor"], rows)


if __name__ == "__main__":
    main()
