"""The device functions of our decode GEMMs (kernels/decode_gemm.py, kernels/stacked_fused.py):
the software-pipelined K loop of one output tile, the sum of a tile's K splits by the last of
its programs to finish, and the finished tile's scales and store."""
from __future__ import annotations

import triton
import triton.language as tl


# elements between a row's prefetches: a 128-byte line of bf16 (of e4m3: each line asked for twice)
PREFETCH_STRIDE = tl.constexpr(64)


@triton.jit
def prefetch_rows(w_rows, w_ptr, n_mask, k_start, k_end, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """Ask L2 for w[rows, k_start:k_start + PREFETCH * BLOCK_K] (within k_end), one prefetch a
    line, nothing read: before a PDL wait, the K loop's first chunks stream while the kernel
    before finishes. Masked rows and columns prefetch w_ptr (a valid address) instead. Nothing
    when PREFETCH is 0 (the interpreter, which has no inline PTX, never gets more)."""
    if PREFETCH > 0:
        k = k_start + tl.arange(0, PREFETCH * BLOCK_K // PREFETCH_STRIDE) * PREFETCH_STRIDE
        inside = n_mask[:, None] & (k[None, :] < k_end)
        lines = tl.where(inside, w_rows + k[None, :], w_ptr)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def k_loop(acc, x_rows, w_rows, rm, M, n_mask, k_start, k_end, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
           IEEE: tl.constexpr):
    """acc + x[rm, k_start:k_end] @ w[rows, k_start:k_end].T, BLOCK_K columns at a time (IEEE:
    float32 products, not TF32). A weight stored narrower than x (e4m3 under bf16) is widened
    to x's dtype chunk by chunk."""
    rk = tl.arange(0, BLOCK_K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + rk
        x = tl.load(x_rows + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < k_end), other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k[None, :] < k_end), other=0.0)
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def split_total(acc, part_ptr, counter, pid_k, rm, cols, out_mask, M, width, SPLIT_K: tl.constexpr):
    """The tile's sum over its K splits, and whether this program holds it: with one split
    always; else each split stores its float32 partial and the last to finish (the tile's
    counter) sums them in split order and resets the counter."""
    if SPLIT_K == 1:
        total = acc
        last = pid_k == 0
    else:
        tile = rm[:, None] * width + cols[None, :]
        tl.store(part_ptr + pid_k * M * width + tile, acc, mask=out_mask)
        tl.debug_barrier()
        last = tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1
        total = tl.zeros_like(acc)
        if last:
            for split in range(SPLIT_K):
                total += tl.load(part_ptr + split * M * width + tile, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)  # ready for the next call (and graph replay)
    return total, last


@triton.jit
def store_scaled(total, y_ptr, xs_ptr, ws_ptr, rm, rn, n_mask, out_mask, M, stride_ym, X_SCALED: tl.constexpr,
                 W_SCALED: tl.constexpr):
    """y[rm, rn] = total, times the rows' scales (X_SCALED) and the columns' (W_SCALED)."""
    total = scaled(total, xs_ptr, ws_ptr, rm, rn, n_mask, M, X_SCALED, W_SCALED)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def scaled(total, xs_ptr, ws_ptr, rm, rn, n_mask, M, X_SCALED: tl.constexpr, W_SCALED: tl.constexpr):
    """total times the rows' scales (X_SCALED) and the columns' (W_SCALED)."""
    if X_SCALED:
        total *= tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if W_SCALED:
        total *= tl.load(ws_ptr + rn, mask=n_mask, other=0.0)[None, :]
    return total
