"""Fused decoder ops (Triton) against plain torch float32, fresh random inputs,
sizes not multiples of the block sizes."""
import pytest
import torch

from adapterserve.kernels.fused import rms_norm_triton, rope_, silu_mul_triton
from adapterserve.models.rope import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100])
def test_rms_norm(dtype, dim):
    x = torch.randn(7, dim, dtype=dtype, device=DEVICE) * 3
    w = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    h = x.float()
    want = w.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert _rel(rms_norm_triton(x, w, 1e-6), want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = torch.randn(5, 2 * 1100, dtype=dtype, device=DEVICE)
    gate, up = gate_up.float().chunk(2, dim=-1)
    out = silu_mul_triton(gate_up)
    assert out.shape == (5, 1100)
    assert _rel(out, torch.nn.functional.silu(gate) * up) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 6])
def test_rope_matches_the_torch_rotation(dtype, heads):
    rope = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0}, 64, device=DEVICE)
    x = torch.randn(9, heads, 32, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 64, (9,), device=DEVICE)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    want = x.float() * cos + torch.cat((-x2, x1), dim=-1) * sin
    got = x.clone()
    rope_(got, positions, rope.cos[:, :16], rope.sin[:, :16])
    assert _rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 100])
def test_add_rms_norm_updates_the_residual_and_normalises_the_sum(dtype, dim):
    from adapterserve.kernels.fused import _add_rms_norm_kernel  # the Triton kernel, on CPU too
    import triton

    x = torch.randn(7, dim, dtype=dtype, device=DEVICE) * 3
    residual = torch.randn(7, dim, dtype=dtype, device=DEVICE)
    w = (1 + 0.1 * torch.randn(dim, device=DEVICE)).to(dtype)
    summed = (x + residual).float()  # the add rounds to dtype, as the backbone's own add
    want_sum = (x + residual)
    want = w.float() * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6))
    out = torch.full_like(x, float("nan"))
    got_residual = residual.clone()
    _add_rms_norm_kernel[(7,)](x, got_residual, w, out, x.stride(0), got_residual.stride(0), out.stride(0), dim,
                               1e-6, BLOCK=triton.next_power_of_2(dim))
    assert torch.equal(got_residual, want_sum)
    assert _rel(out, want) < TOL[dtype]
