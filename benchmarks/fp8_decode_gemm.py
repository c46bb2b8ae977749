"""FP8 decode products on our decode GEMM (kernels/decode_gemm.fp8_decode_gemm) against the
engine's current FP8 kernels and bf16, per Llama-8B projection.

    PYTHONPATH=. python benchmarks/fp8_decode_gemm.py            # H100/H200: about two minutes
    PYTHONPATH=. python benchmarks/fp8_decode_gemm.py --smoke    # CPU, tiny shapes, seconds

For each projection (q|k|v, o, gate|up, down): a stack of `--layers` copies with distinct
weights (every read from HBM), one CUDA graph replay per figure, B tokens. Variants:
  bf16 cuBLAS, bf16 ours        F.linear; our decode GEMM (decode_config's tiles)
  scaled_mm, w8a8 triton        the activations already quantized per token (as the fused
                                RMSNorm / SiLU-mul hand them over): the GEMM alone
  ours w8a8 <tiles>             e4m3 activations and weights in our decode GEMM
  ours wo <tiles>               bf16 activations, e4m3 weights widened in the loop (no
                                activation quantization at all)
Ours run with PDL "early" (the other kernels have no PDL path); the engine's tiles
(fp8_decode_config) also with PDL off. The floor: the weights'
bytes at the copy bandwidth measured in the same run. "err": max |y - twin| / max |twin|
against the float32 product of what the variant reads.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' @triton.jit runs

from adapterserve.kernels.decode_gemm import (
    DecodeGemmConfig,
    decode_config,
    decode_gemm,
    fp8_decode_config,
    fp8_decode_gemm,
)
from adapterserve.kernels.fp8 import quantize_rows
from adapterserve.kernels.fp8_w8a8 import fp8_w8a8_linear
from adapterserve.kernels.pdl import set_pdl
from adapterserve.models.fp8 import dequantize, quantize_per_channel
from benchmarks.checkpoints import SHAPES
from benchmarks.decode_gemm import projection_shapes
from benchmarks.fused_update import bandwidth, print_table, time_ms

TILES = (  # (block_n, block_k, stages, waves: split-K aims at this many programs per SM) swept for the FP8 variants
    (32, 128, 4, 2), (32, 256, 4, 2), (64, 256, 3, 2), (128, 128, 3, 2), (128, 256, 3, 2),
    (32, 256, 4, 4), (16, 256, 4, 2), (16, 256, 4, 4),  # narrow outputs (o, q|k|v): more, shorter programs
)


def fp8_configs(quick: bool) -> list[DecodeGemmConfig]:
    tiles = TILES[:3] if quick else TILES
    return [DecodeGemmConfig(block_n=n, block_k=k, num_stages=s, waves=w, num_warps=8 if n * k >= 128 * 256 else 4)
            for n, k, s, w in tiles]


def label(c: DecodeGemmConfig) -> str:
    """e.g. "n32 k256 s4", "n64 k256 s3 w1"."""
    return f"n{c.block_n} k{c.block_k} s{c.num_stages}" + (f" w{c.waves}" if c.waves != 2 else "")


class Projection:
    """`layers` distinct copies of one projection: bf16 weights, their e4m3 rows and scales,
    and a batch of activations with their per-token quantization."""

    def __init__(self, n: int, k: int, layers: int, tokens: int, device: str, dtype: torch.dtype) -> None:
        self.bf16 = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
        self.fp8 = [quantize_per_channel(w) for w in self.bf16]
        self.x = torch.randn(tokens, k, device=device, dtype=dtype)
        self.xq, self.x_scale = quantize_rows(self.x)

    def runs(self, configs: list[DecodeGemmConfig]) -> dict[str, tuple]:
        """name -> (one call over every copy, the last copy's product, its float32 twin, PDL mode)."""
        x, xq, xs, (q, s) = self.x, self.xq, self.x_scale, self.fp8[-1]
        wo_twin = x.float() @ dequantize(q, s).T
        a8_twin = (xq.float() * xs) @ dequantize(q, s).T
        runs = {
            "bf16 cuBLAS": (lambda: [F.linear(x, w) for w in self.bf16][-1], x.float() @ self.bf16[-1].float().T,
                            "off"),
            "bf16 ours": (lambda: [decode_gemm(x, w, decode_config(*w.shape)) for w in self.bf16][-1],
                          x.float() @ self.bf16[-1].float().T, "early"),
            "scaled_mm": (lambda: [torch._scaled_mm(xq, q.t(), scale_a=xs, scale_b=s.view(1, -1), out_dtype=x.dtype)
                                   for q, s in self.fp8][-1], a8_twin, "off"),
            "w8a8 triton": (lambda: [fp8_w8a8_linear(xq, xs, q, s, x.dtype) for q, s in self.fp8][-1], a8_twin,
                            "off"),
        }
        engine_tiles = fp8_decode_config(*q.shape)
        for mode in ("off", "early"):  # the engine's tiles (fp8_decode_config), PDL off and on
            runs[f"ours w8a8 engine tiles, PDL {mode}"] = (
                lambda: [fp8_decode_gemm(xq, q, s, xs, x.dtype, engine_tiles) for q, s in self.fp8][-1], a8_twin, mode)
        for c in configs:
            runs[f"ours w8a8 {label(c)}"] = (
                lambda c=c: [fp8_decode_gemm(xq, q, s, xs, x.dtype, c) for q, s in self.fp8][-1], a8_twin, "early")
            runs[f"ours wo {label(c)}"] = (
                lambda c=c: [fp8_decode_gemm(x, q, s, config=c) for q, s in self.fp8][-1], wo_twin, "early")
        return runs


def measure(proj: Projection, configs: list[DecodeGemmConfig], device: str) -> dict[str, tuple[float, float]]:
    """name -> (ms per graph replay, err); a variant that fails is reported and left out."""
    timed = {}
    for name, (run, twin, mode) in proj.runs(configs).items():
        try:
            set_pdl(mode)
            ms = time_ms(run, device)
            got = run().float()
        except Exception as exc:  # a tile configuration that does not compile is reported, not fatal
            print(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        finally:
            set_pdl("off")
        timed[name] = (ms, float((got - twin).abs().max() / twin.abs().max()))
    return timed


def rows_for(name: str, timed: dict[str, tuple[float, float]], fp8_floor: float) -> list[list[str]]:
    """The fixed variants, then the fastest two tile choices of each of ours."""
    picked = ["bf16 cuBLAS", "bf16 ours", "scaled_mm", "w8a8 triton", "ours w8a8 engine tiles, PDL off",
              "ours w8a8 engine tiles, PDL early"]
    for kind in ("ours w8a8", "ours wo"):
        ours = sorted((v for v in timed if v.startswith(kind + " ") and "engine" not in v), key=lambda v: timed[v][0])
        picked += ours[:2]
    base = timed.get("w8a8 triton", (float("nan"), 0.0))[0]
    return [[name, v, f"{timed[v][0]:.3f}", f"{timed[v][0] / fp8_floor:.2f}", f"{timed[v][0] / base:.3f}",
             f"{timed[v][1]:.0e}"] for v in picked if v in timed]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="the first three tile choices only")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the figures mean nothing")
    args = p.parse_args()
    if args.smoke:
        device, dtype, shape, layers, name = "cpu", torch.float32, SHAPES["tiny"], 2, "CPU (smoke)"
        configs = [DecodeGemmConfig(block_n=32, block_k=32, split_k=2)]
    else:
        device, dtype, shape, layers = "cuda", torch.bfloat16, SHAPES["8b"], args.layers
        name, configs = torch.cuda.get_device_name(), fp8_configs(args.quick)
    torch.manual_seed(0)
    bw, tokens = bandwidth(device), 8 if args.smoke else args.tokens
    rows = []
    for proj_name, (n, k) in projection_shapes(shape).items():
        proj = Projection(n, k, layers, tokens, device, dtype)
        rows += rows_for(proj_name, measure(proj, configs, device), layers * n * k / bw * 1e3)
        del proj
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"\n{name}; torch {torch.__version__}; {shape.name}, B={tokens}, {layers} projections a graph; "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; ms per graph replay (ours: PDL early):")
    print_table(["proj", "variant", "ms", "x fp8 floor", "/ w8a8 triton", "err"], rows)


if __name__ == "__main__":
    main()
