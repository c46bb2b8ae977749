"""Fused decoder ops (Triton) against plain torch float32, fresh random inputs,
sizes not multiples of the block sizes."""
import pytest
import torch

from adapterserve.kernels.fused import rms_norm_triton, silu_mul_triton
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 3)])
def test_rope_and_cache_rotates_q_and_writes_rotated_k_and_v(dtype, heads):
    from adapterserve.kernels.fused import rope_and_cache

    q_heads, kv_heads, dim, tokens = *heads, 32, 5
    rope = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0}, 64)  # CPU: the float32 oracle
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE)
    q, k, v = (t.reshape(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1))
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    slots = torch.randperm(12, device=DEVICE)[:tokens]
    want_q, want_k = rope(positions.cpu(), q.cpu().float(), k.cpu().float())
    want_v = v.clone()
    k_cache = torch.full((12, kv_heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    half = dim // 2
    rope_and_cache(q, k, v, positions, rope.cos[:, :half].to(DEVICE), rope.sin[:, :half].to(DEVICE), k_cache,
                   v_cache, slots)
    assert _rel(q.cpu(), want_q) < TOL[dtype]  # in place, through the strided view of qkv
    assert _rel(k_cache[slots].cpu(), want_k) < TOL[dtype]
    assert torch.equal(v_cache[slots], want_v)
    untouched = torch.ones(12, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()
