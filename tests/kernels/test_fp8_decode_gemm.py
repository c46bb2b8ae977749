"""The decode GEMM on FP8 weights (kernels/decode_gemm.fp8_decode_gemm) against float32 torch:
weight-only (activations in their dtype, e4m3 weights widened chunk by chunk) and W8A8 (e4m3
activations with row scales). Fresh random inputs, output poisoned with NaN before the call,
split and unsplit K, ragged N and K; on a GPU the 8B's shapes, W8A8 against torch._scaled_mm,
and PDL on in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels.decode_gemm import DecodeGemmConfig, fp8_decode_gemm
from adapterserve.kernels.fp8 import quantize_rows, quantize_rows_reference
from adapterserve.kernels.fp8_fused import rms_norm_quant, silu_mul_quant
from adapterserve.models.fp8 import dequantize, quantize_per_channel

from .cases import NAN, SHAPES_8B, TOL, fresh_generator, gpu, gpu_pdl_modes, interpreted, needs_cuda, pdl_replays

E4M3 = torch.float8_e4m3fn
CONFIGS = [DecodeGemmConfig(block_n=32, block_k=32, split_k=1), DecodeGemmConfig(block_n=16, block_k=32, split_k=3)]


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str):
    gen, seed = fresh_generator()
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    q, scale = quantize_per_channel((torch.randn(n, k, generator=gen) * 0.05).to(device))
    return x, q, scale, seed


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def _weight_only_twin(x, q, scale) -> torch.Tensor:
    return x.float() @ dequantize(q, scale).float().T


def _w8a8_twin(xq, x_scale, q, scale) -> torch.Tensor:
    return (xq.float() * x_scale.float().view(-1, 1)) @ dequantize(q, scale).float().T


@interpreted
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("config", CONFIGS, ids=["one-split", "three-splits"])
def test_weight_only_matches_float32(m, config):
    x, q, scale, seed = _inputs(m, 72, 200, torch.float32, "cpu")  # N and K not multiples of the tiles
    out = torch.full((m, 72), NAN)
    fp8_decode_gemm(x, q, scale, config=config, out=out)
    assert not out.isnan().any(), f"seed {seed}"
    assert _rel(out, _weight_only_twin(x, q, scale)) < TOL[torch.float32], f"seed {seed}"


@interpreted
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("config", CONFIGS, ids=["one-split", "three-splits"])
def test_w8a8_matches_float32(m, config):
    x, q, scale, seed = _inputs(m, 72, 200, torch.float32, "cpu")
    x[0] *= 100.0  # rows of different magnitude: each row's own scale matters
    xq, x_scale = quantize_rows_reference(x)
    out = torch.full((m, 72), NAN)
    fp8_decode_gemm(xq, q, scale, x_scale, torch.float32, config, out=out)
    assert not out.isnan().any(), f"seed {seed}"
    assert _rel(out, _w8a8_twin(xq, x_scale, q, scale)) < TOL[torch.float32], f"seed {seed}"


def test_refuses_what_it_cannot_take():
    q, scale = quantize_per_channel(torch.randn(8, 16))
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="one scale per row"):
        fp8_decode_gemm(x, q.float(), scale)
    with pytest.raises(ValueError, match="one scale per row"):
        fp8_decode_gemm(x, q, scale[:4])
    xq, x_scale = quantize_rows_reference(x)
    with pytest.raises(ValueError, match="row scales and an out_dtype"):
        fp8_decode_gemm(xq, q, scale)  # e4m3 activations without their scales
    with pytest.raises(ValueError, match="row scales and an out_dtype"):
        fp8_decode_gemm(xq, q, scale, x_scale)  # nor an out_dtype
    with pytest.raises(ValueError, match="row scales and an out_dtype"):
        fp8_decode_gemm(x, q, scale, x_scale, torch.float32)  # scales for unquantized rows
    with pytest.raises(ValueError, match="3 row scales for 4 rows"):
        fp8_decode_gemm(xq, q, scale, x_scale[:3], torch.float32)
    with pytest.raises(ValueError, match="M <= 64"):
        fp8_decode_gemm(torch.randn(65, 16), q, scale)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("form", ["weight_only", "w8a8"])
def test_gpu_on_8b_shapes(m, n, k, form):
    """weight_only: against the float32 product; w8a8 (sm_90: e4m3 dots) also against torch._scaled_mm,
    the same arithmetic (e4m3 products, float32 sums in another order)."""
    if form == "w8a8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("e4m3 tl.dot and row-wise scaled_mm need sm_90")
    x, q, scale, seed = _inputs(m, n, k, torch.bfloat16, "cuda")
    out = torch.full((m, n), NAN, dtype=torch.bfloat16 if form == "weight_only" else torch.float32, device="cuda")
    if form == "weight_only":
        fp8_decode_gemm(x, q, scale, out=out)
        want, tol = _weight_only_twin(x, q, scale), TOL[torch.bfloat16] / 4
    else:
        xq, x_scale = quantize_rows(x)
        fp8_decode_gemm(xq, q, scale, x_scale, torch.float32, out=out)
        want, tol = _w8a8_twin(xq, x_scale, q, scale), 2e-3
        scaled_mm = torch._scaled_mm(xq, q.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=torch.float32)
        assert _rel(out, scaled_mm) < tol, f"seed {seed}"
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"seed {seed}"
    assert _rel(out, want) < tol, f"seed {seed}"


@gpu_pdl_modes
def test_gpu_pdl_chain_in_a_graph_gives_the_bits_of_pdl_off(mode):
    """An FP8 decode layer's kernels in launch order, each reading what the one before wrote
    (norm + quantization, W8A8 GEMM, row quantization, W8A8 GEMM, SiLU-mul + quantization,
    W8A8 and weight-only GEMMs): PDL on gives PDL off's bits, every replay."""
    x, q1, s1, seed = _inputs(64, 4096, 1024, torch.bfloat16, "cuda")
    q2, s2 = quantize_per_channel(torch.randn(2048, 4096, device="cuda") * 0.02)
    q3, s3 = quantize_per_channel(torch.randn(1024, 1024, device="cuda") * 0.02)
    norm_w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)

    def chain():
        _, xq, xs = rms_norm_quant(x, norm_w, 1e-5)
        hidden = fp8_decode_gemm(xq, q1, s1, xs, torch.bfloat16)
        hq, hs = quantize_rows(hidden)
        gate_up = fp8_decode_gemm(hq, q2, s2, hs, torch.bfloat16)
        act, aq, a_scale = silu_mul_quant(gate_up)
        return torch.stack([fp8_decode_gemm(aq, q3, s3, a_scale, torch.bfloat16), fp8_decode_gemm(act, q3, s3)])

    outs = pdl_replays(chain, ("off", mode))
    outs["prefetch"] = pdl_replays(chain, (mode,), prefetch=4)[mode]  # weight rows asked for first
    assert torch.equal(outs["off"], outs[mode]) and torch.equal(outs["off"], outs["prefetch"]), f"seed {seed}"
    assert not outs["off"].isnan().any(), f"seed {seed}"
