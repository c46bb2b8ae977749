"""The decode GEMM (kernels/decode_gemm.py) against float32 torch: fresh random inputs,
output poisoned with NaN before the call, split and unsplit K, ragged N and K, on a GPU
also the 8B's shapes and PDL on in a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels.decode_gemm import DecodeGemmConfig, decode_gemm
from adapterserve.kernels.split_counters import split_counters

from .cases import NAN, SHAPES_8B, TOL, fresh_generator, gpu, gpu_pdl_modes, interpreted, needs_cuda, pdl_replays


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device: str):
    gen, seed = fresh_generator()
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
    return x, w, seed


def _rel(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    want = x.float() @ w.float().T
    return float((got.float() - want).norm() / want.norm())


@interpreted
@pytest.mark.parametrize("m", [1, 5, 16, 64])
@pytest.mark.parametrize("config", [
    DecodeGemmConfig(block_n=32, block_k=32, split_k=1),
    DecodeGemmConfig(block_n=32, block_k=32, split_k=3),
    DecodeGemmConfig(block_n=16, block_k=32, split_k=2, num_stages=1),
], ids=["one-split", "three-splits", "unpipelined"])
def test_interpreted_matches_float32(m, config):
    x, w, seed = _inputs(m, 72, 200, torch.float32, "cpu")  # N and K not multiples of the tiles
    out = torch.full((m, 72), NAN)
    decode_gemm(x, w, config, out=out)
    assert not out.isnan().any(), f"seed {seed}"
    assert _rel(out, x, w) < TOL[torch.float32], f"seed {seed}"


@interpreted
def test_counters_are_reset_for_the_next_call():
    config = DecodeGemmConfig(block_n=16, block_k=32, split_k=3)
    x, w, seed = _inputs(8, 40, 96, torch.float32, "cpu")
    first = decode_gemm(x, w, config)
    assert not split_counters(x.device).any()
    x2 = torch.randn_like(x)
    second = decode_gemm(x2, w, config)
    assert _rel(first, x, w) < TOL[torch.float32] and _rel(second, x2, w) < TOL[torch.float32], f"seed {seed}"


def test_refuses_what_it_cannot_take():
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="M <= 64"):
        decode_gemm(torch.zeros(65, 16), w)
    with pytest.raises(ValueError, match="one K"):
        decode_gemm(torch.zeros(4, 8), w)


def test_base_products_take_it_only_on_a_gpu_and_by_name():
    from adapterserve.layers.base_gemm import base_linear, uses_decode_gemm

    x, w = torch.randn(4, 32), torch.randn(48, 32)
    for kernel in ("cublas", "triton", "auto"):
        assert not uses_decode_gemm(kernel, x, w)  # CPU tensors: F.linear
        assert torch.allclose(base_linear(x, w, None, None, decode_gemm=kernel), x @ w.T, atol=1e-5)
    with pytest.raises(ValueError, match="decode_gemm must be one of"):
        uses_decode_gemm("cutlass", x, w)


@gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("config", [DecodeGemmConfig(), DecodeGemmConfig(block_n=128, block_k=64, waves=4)],
                         ids=["default", "n128-k64"])
def test_gpu_matches_float32_on_8b_shapes(m, n, k, config):
    x, w, seed = _inputs(m, n, k, torch.bfloat16, "cuda")
    out = torch.full((m, n), NAN, dtype=torch.bfloat16, device="cuda")
    decode_gemm(x, w, config, out=out)
    torch.cuda.synchronize()
    assert not out.isnan().any(), f"seed {seed}"
    assert _rel(out, x, w) < TOL[torch.bfloat16] / 4, f"seed {seed}"


@gpu_pdl_modes
def test_gpu_pdl_chain_in_a_graph_gives_the_bits_of_pdl_off(mode):
    x, w1, seed = _inputs(64, 4096, 4096, torch.bfloat16, "cuda")
    w2 = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    config = DecodeGemmConfig()

    def chain():
        return decode_gemm(torch.relu(decode_gemm(x, w1, config)), w2, config)

    outs = pdl_replays(chain, ("off", mode))
    outs["prefetch"] = pdl_replays(chain, (mode,), prefetch=4)[mode]  # weight rows asked for first
    assert torch.equal(outs["off"], outs[mode]) and torch.equal(outs["off"], outs["prefetch"]), f"seed {seed}"
    assert _rel(outs["off"], torch.relu(x.float() @ w1.float().T).to(torch.bfloat16), w2) < TOL[torch.bfloat16] / 4
