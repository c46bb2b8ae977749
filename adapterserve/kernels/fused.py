"""Fused elementwise ops of the decoder (Triton on CUDA): one launch where plain
torch needs five or ten. Each has a torch twin in ``reference``-style below, used
on CPU tensors and as the oracle."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from adapterserve.kernels.fp8 import FP8, FP8_MAX, MIN_SCALE
from adapterserve.kernels.kv_fp8 import kv_scales
from adapterserve.kernels.pdl import pdl_args, pdl_wait


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n, eps, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if USE_PDL:  # the weight before the wait
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)
    if not USE_PDL:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (x * inv).to(out_ptr.dtype.element_ty) * w
    tl.store(out_ptr + row * stride_o + cols, y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D] -> weight * (x / rms(x)) in x's dtype (Hugging Face Llama semantics)."""
    if not x.is_cuda:
        h = x.float()
        return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return rms_norm_triton(x, weight, eps)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(flat)
    _rms_norm_kernel[(flat.shape[0],)](flat, weight, out, flat.stride(0), out.stride(0), flat.shape[1], eps,
                                       BLOCK=triton.next_power_of_2(flat.shape[1]), **pdl_args(flat))
    return out.view(x.shape)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    if USE_PDL:  # the weight before the wait
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + r).to(res_ptr.dtype.element_ty)
    tl.store(res_ptr + row * stride_r + cols, summed, mask=mask)
    h = summed.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n + eps)
    if not USE_PDL:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (h * inv).to(out_ptr.dtype.element_ty) * w, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """residual += x (rounded to its dtype, as the backbone's own add), then return
    rms_norm(residual): the residual add closing a sublayer fused with the next norm.
    x, residual: [T, D]."""
    if not x.is_cuda:
        residual.add_(x)
        normed = rms_norm(residual, weight, eps)
        return normed if out is None else out.copy_(normed)
    out = torch.empty_like(x) if out is None else out
    _add_rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0),
                                        x.shape[1], eps, BLOCK=triton.next_power_of_2(x.shape[1]), **pdl_args(x))
    return out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_g, stride_o, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = 0):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    pdl_wait(USE_PDL)
    g = tl.load(gu_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_g + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (gate | up) -> silu(gate) * up: [T, I]."""
    if not gate_up.is_cuda:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return silu_mul_triton(gate_up)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                         BLOCK=block, **pdl_args(gate_up))
    return out


@triton.jit
def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                       stride_cn, stride_ch, stride_sn, q_heads, kv_heads, fp8_max, min_scale,
                       HALF: tl.constexpr, QH_PAD: tl.constexpr, KVH_PAD: tl.constexpr, KV_FP8: tl.constexpr = 0,
                       USE_PDL: tl.constexpr = 0):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)  # positions, cache slots and tables: step metadata, read before the wait
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + pos * stride_c + d)
    sin = tl.load(sin_ptr + pos * stride_c + d)
    pdl_wait(USE_PDL)
    hq = tl.arange(0, QH_PAD)[:, None]
    q_mask = hq < q_heads
    q_base = q_ptr + t * stride_qt + hq * stride_qh
    q1 = tl.load(q_base + d, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF + d, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_base + d, (q1 * cos - q2 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_base + HALF + d, (q2 * cos + q1 * sin).to(q_ptr.dtype.element_ty), mask=q_mask)
    hk = tl.arange(0, KVH_PAD)[:, None]
    kv_mask = hk < kv_heads
    k_base = k_ptr + t * stride_kt + hk * stride_kh
    k1 = tl.load(k_base + d, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + HALF + d, mask=kv_mask, other=0.0).to(tl.float32)
    kc = kc_ptr + slot * stride_cn + hk * stride_ch
    v_base = v_ptr + t * stride_vt + hk * stride_vh
    vc = vc_ptr + slot * stride_cn + hk * stride_ch
    if KV_FP8:  # each head's vector rounded to e4m3 on its own scale (kernels/kv_fp8.py)
        _store_e4m3(kc, ks_ptr + slot * stride_sn + hk, k1 * cos - k2 * sin, k2 * cos + k1 * sin, d, kv_mask,
                    fp8_max, min_scale, HALF)
        v1 = tl.load(v_base + d, mask=kv_mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_base + HALF + d, mask=kv_mask, other=0.0).to(tl.float32)
        _store_e4m3(vc, vs_ptr + slot * stride_sn + hk, v1, v2, d, kv_mask, fp8_max, min_scale, HALF)
    else:
        tl.store(kc + d, (k1 * cos - k2 * sin).to(kc_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(kc + HALF + d, (k2 * cos + k1 * sin).to(kc_ptr.dtype.element_ty), mask=kv_mask)
        tl.store(vc + d, tl.load(v_base + d, mask=kv_mask, other=0.0), mask=kv_mask)
        tl.store(vc + HALF + d, tl.load(v_base + HALF + d, mask=kv_mask, other=0.0), mask=kv_mask)


@triton.jit
def _store_e4m3(out, scale_out, lower, upper, d, mask, fp8_max, min_scale, HALF: tl.constexpr):
    """Rows [H, D] given as their halves [H, HALF] (float32) to e4m3 at ``out`` + d and
    + HALF + d, one scale per row (absmax / 448, the IEEE divisions of
    quantize_rows_reference) at ``scale_out``."""
    amax = tl.maximum(tl.max(tl.abs(lower), axis=1), tl.max(tl.abs(upper), axis=1))
    scale = tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)[:, None]
    tl.store(scale_out, scale, mask=mask)
    low = tl.minimum(tl.maximum(tl.math.div_rn(lower, scale), -fp8_max), fp8_max)
    tl.store(out + d, low.to(out.dtype.element_ty), mask=mask)
    high = tl.minimum(tl.maximum(tl.math.div_rn(upper, scale), -fp8_max), fp8_max)
    tl.store(out + HALF + d, high.to(out.dtype.element_ty), mask=mask)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, write_slots: torch.Tensor,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """One launch for RoPE and the KV-cache write: rotate q [T, Hq, D] in place, write
    rotated k and v ([T, Hkv, D], any token/head strides) to the caches [slots, Hkv, D]
    at write_slots [T]. cos, sin: [P, D/2] float32 tables (rotate-half layout). An e4m3
    cache takes each (token, head) vector quantized on its own, its scale into k_scale /
    v_scale [slots, Hkv] (kernels/kv_fp8.py). A float32 cache with scales takes the scaled
    values before their e4m3 rounding (tests under the interpreter, whose float8 rounding
    is not the GPU's)."""
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    unrounded = k_scale is not None and k_cache.dtype == torch.float32
    if unrounded:
        stride_sn = k_scale.stride(0)
    else:
        k_scale, v_scale, stride_sn = kv_scales(k_cache, k_scale, v_scale)
    _rope_cache_kernel[(tokens,)](
        q, k, v, positions, write_slots, cos, sin, k_cache, v_cache, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), stride_sn, q_heads, kv_heads, FP8_MAX, MIN_SCALE,
        HALF=dim // 2, QH_PAD=triton.next_power_of_2(q_heads), KVH_PAD=triton.next_power_of_2(kv_heads),
        KV_FP8=int(unrounded or k_cache.dtype == FP8), **pdl_args(q),
    )
