"""Triton LoRA shrink and expand over tokens grouped by adapter slot.

All slices of a fused linear (q, k, v or gate, up) run in one launch each; every
slot costs its own rank on each slice; slot -1 tokens are skipped. Nothing is
allocated and nothing waits for the host, so both ops can be captured in a CUDA
graph. The kernels live in ``segment_gemm`` / ``segment_gemv`` (launched by
``segment_ops``); this module checks shapes and maps ``LoraSlices`` onto them.
"""
from __future__ import annotations

import torch

from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.segment_ops import seg_down, seg_up


def _check_pool(lora: LoraSlices) -> None:
    if lora.rank.shape != lora.row_start.shape or lora.rank.stride() != lora.row_start.stride():
        raise ValueError(
            f"lora.rank {tuple(lora.rank.shape)} and lora.row_start {tuple(lora.row_start.shape)} "
            "must have the same shape and strides"
        )
    if len(lora.out_offsets) != lora.num_slices + 1:
        raise ValueError(f"{lora.num_slices} slices need {lora.num_slices + 1} out_offsets, got {lora.out_offsets}")


def _check_workspace(v: torch.Tensor, lora: LoraSlices, num_tokens: int, name: str) -> None:
    if v.dim() != 3 or v.shape[0] != lora.num_slices or v.shape[1] != num_tokens or v.shape[2] < lora.max_rank:
        raise ValueError(
            f"{name} must be [n_slices={lora.num_slices}, T={num_tokens}, >= max_rank={lora.max_rank}], "
            f"got {tuple(v.shape)}"
        )


def lora_shrink(x: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, out: torch.Tensor) -> None:
    """LoRA down-projection for every slice, one launch.

    x:   [T, K]
    out: [n_slices, T, lora.max_rank] workspace
    Semantics: out[s, t, :r] = x[t] @ A_s[row0 : row0 + r].T with slot = slot[t],
    row0 = row_start[s, slot], r = rank[s, slot]; other entries are not written.
    """
    _check_pool(lora)
    if x.dim() != 2 or x.shape[1] != lora.a.shape[2] or x.shape[0] != meta.num_tokens:
        raise ValueError(f"x must be [T={meta.num_tokens}, K={lora.a.shape[2]}], got {tuple(x.shape)}")
    _check_workspace(out, lora, x.shape[0], "out")
    seg_down(x, lora.a, 0, lora.rank, lora.row_start, meta, out, lora.max_rank)


def lora_expand(v: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor) -> None:
    """LoRA up-projection added into the layer output, one launch.

    v: [n_slices, T, lora.max_rank] from lora_shrink
    y: [T, N] base output, updated in place
    Semantics: y[t, off_s : off_s1] += v[s, t, :r] @ B_s[row0 : row0 + r] (scaling
    folded into B at load). Tokens without adapter are untouched.
    """
    _check_pool(lora)
    n = lora.out_offsets[-1]
    if y.dim() != 2 or y.shape[1] != n or lora.b.shape[1] != n or y.shape[0] != meta.num_tokens:
        raise ValueError(
            f"y must be [T={meta.num_tokens}, N={n}] and lora.b [R, {n}], "
            f"got {tuple(y.shape)} and {tuple(lora.b.shape)}"
        )
    _check_workspace(v, lora, y.shape[0], "v")
    seg_up(v, lora.b, 0, lora.rank, lora.row_start, lora.out_offsets, meta, y, lora.max_rank)
