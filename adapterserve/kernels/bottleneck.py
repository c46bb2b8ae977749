"""Triton bottleneck adapter (Houlsby / Pfeiffer) over tokens grouped by slot.

Two launches: down-projection with bias and activation into the workspace, then
up-projection with bias added into the residual stream. Each slot costs its own
bottleneck width and applies its own activation (a code per slot, read by the kernel:
adapters of every activation share one launch, one compiled form and one graph);
slot -1 tokens and rank-0 slots are untouched.
"""
from __future__ import annotations

import torch

from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.segment_ops import seg_down, seg_up


def bottleneck_adapter(
    h: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    up: torch.Tensor,
    up_bias: torch.Tensor,
    rank: torch.Tensor,
    activation: torch.Tensor,
    meta: AdapterBatchMeta,
    workspace: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    ln_mix: torch.Tensor | None = None,
) -> None:
    """Bottleneck adapter per slot, added into out.

    h:         [T, D] adapter input (with residual: h[t] + ln_mix[slot] * residual[t], formed
               by the down-projection as it reads, which needs its CUDA-core kernel: use_gemv)
    down:      [S, R, D] rows of W_down;  down_bias: [S, R]
    up:        [S, R, D] rows of W_up^T;  up_bias:   [S, D]
    rank:      [S] int32 bottleneck width of each slot
    activation: [S] int32 activation of each slot (segment_common.ACT_CODES)
    workspace: [T, R]
    out:       [T, D] updated in place (holds the residual stream)
    Semantics: out[t] += up_bias + act(h[t] @ down[:r].T + down_bias[:r]) @ up[:r]
    with the slot of t; tokens without adapter are untouched.
    """
    num_slots, width, dim = down.shape
    if up.shape != down.shape or h.shape[1] != dim or out.shape != h.shape:
        raise ValueError(
            f"down/up must be [S, R, D={h.shape[1]}] alike and out like h {tuple(h.shape)}; "
            f"got down {tuple(down.shape)}, up {tuple(up.shape)}, out {tuple(out.shape)}"
        )
    if workspace.shape != (h.shape[0], width) or rank.shape != (num_slots,) or activation.shape != (num_slots,):
        raise ValueError(f"workspace must be [T, R={width}], rank and activation [S={num_slots}]")
    if activation.dtype != torch.int32:
        raise ValueError(f"activation must hold int32 codes of ACT_CODES, got {activation.dtype}")
    ranks = rank.view(1, num_slots)
    ws = workspace.unsqueeze(0)
    mixed = None if residual is None else (residual, ln_mix)
    seg_down(h, down[:1], down.stride(0), ranks, None, meta, ws, width, bias=down_bias, activation=activation,
             mixed=mixed)
    seg_up(ws, up[0], up.stride(0), ranks, None, (0, dim), meta, out, width, bias=up_bias)
