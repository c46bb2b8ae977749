"""Our decode GEMM (kernels/decode_gemm.py) against cuBLAS on the 8B's projections, then
in the stack with its ops (benchmarks/ops_stack.py), PDL off and on.

    PYTHONPATH=. python benchmarks/decode_gemm.py            # H100/H200: a few minutes
    PYTHONPATH=. python benchmarks/decode_gemm.py --smoke    # CPU, tiny shapes, seconds

Sweep: for each projection (q|k|v, o, gate|up, down) a stack of `--layers` copies with
distinct weights (every read from HBM), B=64, one CUDA graph replay per figure, cuBLAS
(F.linear) against each tile configuration with PDL off and "early". The floor: the
weights at the copy bandwidth measured in the same run. Each configuration's output is
checked against cuBLAS's (max relative difference).

Then the ops table (fused_update.py --quick's, with the own+ops and fused+ops columns):
the stack with its norms and SiLU-mul, every projection on its fastest configuration
with PDL early, for our GEMM alone and for the GEMM with the LoRA shrink and expand
inside (kernels/stacked_fused.py).
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from adapterserve.kernels.decode_gemm import DecodeGemmConfig, decode_gemm
from adapterserve.kernels.pdl import set_pdl
from benchmarks.checkpoints import SHAPES
from benchmarks.fused_update import bandwidth, print_table, time_ms

MODES = ("off", "early")


def projection_shapes(shape) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of the 8B's fused projections."""
    lin, h, inter = shape.linear_shapes(), shape.hidden, shape.inter
    q = lin["o_proj"][0]
    return {"qkv": (q + lin["k_proj"][1] + lin["v_proj"][1], h), "o": (h, q), "gate_up": (2 * inter, h),
            "down": (h, inter)}


def configs(quick: bool) -> list[DecodeGemmConfig]:
    """The sweep's tile configurations."""
    widths = (32, 64, 128)
    depths = (128,) if quick else (64, 128, 256)
    waves = (2, 4)
    stages = (3,) if quick else (3, 4)
    return [DecodeGemmConfig(block_n=n, block_k=k, waves=w, num_stages=st, num_warps=8 if n * k >= 128 * 256 else 4)
            for n, k, w, st in itertools.product(widths, depths, waves, stages)]


def label(c: DecodeGemmConfig) -> str:
    return f"n{c.block_n} k{c.block_k} w{c.waves} s{c.num_stages}"


def sweep_one(name: str, n: int, k: int, layers: int, tokens: int, device: str, dtype, bw: float,
              candidates: list[DecodeGemmConfig]) -> tuple[list[list[str]], DecodeGemmConfig]:
    """Rows for one projection (cuBLAS, then the 3 fastest configurations with PDL early) and
    the fastest configuration."""
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for _ in range(layers)]
    x = torch.randn(tokens, k, device=device, dtype=dtype)
    want = F.linear(x, weights[-1]).float()
    floor = layers * n * k * weights[0].element_size() / bw * 1e3
    cublas = time_ms(lambda: [F.linear(x, w) for w in weights][-1], device)
    timed = []
    for c in candidates:
        ms = {}
        try:
            for mode in MODES:
                set_pdl(mode)
                ms[mode] = time_ms(lambda c=c: [decode_gemm(x, w, c) for w in weights][-1], device)
            err = float((decode_gemm(x, weights[-1], c).float() - want).abs().max() / want.abs().max())
        except Exception as exc:  # a configuration that does not compile or run is reported, not fatal
            print(f"{name} {label(c)}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        finally:
            set_pdl("off")
        timed.append((ms["early"], ms["off"], err, c))
    timed.sort(key=lambda t: t[0])
    rows = [[name, "cuBLAS", f"{cublas:.3f}", "", f"{cublas / floor:.2f}", "", f"{floor:.3f}"]]
    for early, off, err, c in timed[:3]:
        rows.append([name, label(c), f"{off:.3f}", f"{early:.3f}", f"{early / floor:.2f}", f"{early / cublas:.3f}",
                     f"{err:.0e}"])

    return rows, timed[0][3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--quick", action="store_true", help="one K chunk depth (128) in the sweep")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, tiny shapes: the figures mean nothing")
    args = p.parse_args()
    if args.smoke:
        device, dtype, shape, layers, tokens, name = "cpu", torch.float32, SHAPES["tiny"], 2, 8, "CPU (smoke)"
        candidates = configs(True)[:2]
    else:
        device, dtype, shape, layers, tokens = "cuda", torch.bfloat16, SHAPES["8b"], args.layers, 64
        name, candidates = torch.cuda.get_device_name(), configs(args.quick)
    torch.manual_seed(0)
    bw = bandwidth(device)
    rows, best = [], {}
    for proj, (n, k) in projection_shapes(shape).items():
        proj_rows, best[proj] = sweep_one(proj, n, k, layers, tokens, device, dtype, bw, candidates)
        rows += proj_rows
        if device == "cuda":
            torch.cuda.empty_cache()
    setting = f"{name}; torch {torch.__version__}; {shape.name}, B={tokens}, {dtype}, {layers} projections a graph"
    print(f"\n{setting}; copy bandwidth {bw / 1e9:.0f} GB/s; ms per graph replay (fastest 3 with PDL early):")
    print_table(["proj", "config", "pdl off ms", "pdl early ms", "x floor", "/ cuBLAS", "floor ms / rel err"], rows)
    ops_table(setting, shape, layers, tokens, device, dtype, bw, best)


def ops_table(setting: str, shape, layers: int, tokens: int, device: str, dtype, bw: float,
              best: dict[str, DecodeGemmConfig]) -> None:
    from benchmarks import ops_stack
    from benchmarks.fused_update import OPS_ADAPTERS, OPS_SLOTS

    stack = ops_stack.OpsStack(shape, layers, tokens, OPS_SLOTS, device, dtype)
    for layer in stack.layers:
        for proj, projection in layer.items():
            projection.own_config = best[proj]
    picked = ", ".join(f"{proj} {label(c)}" for proj, c in best.items())
    rows = [ops_stack.measure(stack, n, tokens, device, bw, time_ms) for n in OPS_ADAPTERS]
    print(f"\n{setting}, {OPS_SLOTS} slots; own+ops: {picked}; ms per step of the stack with its ops "
          "(tax over base+ops, PDL off):")
    print_table(ops_stack.header(), rows)


if __name__ == "__main__":
    main()
