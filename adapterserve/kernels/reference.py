"""Float32 torch twin of every adapter op: the CPU path and the test oracle.

Each function has the signature of its Triton counterpart. Inputs and outputs
keep their dtype; arithmetic runs in float32. Outputs come from the caller and
are written in place; nothing here allocates a result the caller keeps.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from adapterserve.kernels.kv_fp8 import dequantize_kv
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.segment_common import ACT_CODES
from adapterserve.kernels.stacked import check_stacked

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
    "tanh": torch.tanh,
}
ACT_NAMES = {code: name for name, code in reversed(ACT_CODES.items())}  # a code's first name


def _segments(meta: AdapterBatchMeta) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every slot with tokens this step (host sync)."""
    counts = meta.slot_counts.tolist()
    starts = meta.slot_starts.tolist()
    return [
        (slot, meta.sorted_tokens[starts[slot] : starts[slot] + n].long())
        for slot, n in enumerate(counts)
        if n > 0
    ]


def lora_shrink(x: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, out: torch.Tensor) -> None:
    """LoRA down-projection for every slice.

    x:   [T, K]
    out: [n_slices, T, lora.max_rank] workspace
    Semantics: out[s, t, :r] = x[t] @ A_s[row0 : row0 + r].T with slot = slot[t],
    row0 = row_start[s, slot], r = rank[s, slot]. Entries past r, and rows of
    tokens without adapter, are left unspecified (expand never reads them).
    """
    for slot, tokens in _segments(meta):
        xs = x[tokens].float()
        for s in range(lora.num_slices):
            row0, r = int(lora.row_start[s, slot]), int(lora.rank[s, slot])
            if r == 0:
                continue
            a = lora.a[s, row0 : row0 + r].float()
            out[s, tokens, :r] = (xs @ a.T).to(out.dtype)


def lora_expand(v: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor) -> None:
    """LoRA up-projection added into the layer output.

    v: [n_slices, T, lora.max_rank] from lora_shrink
    y: [T, N] base output, updated in place
    Semantics: y[t, off_s : off_s1] += v[s, t, :r] @ B_s[row0 : row0 + r] (scaling
    folded into B at load). Tokens without adapter are untouched.
    """
    offsets = lora.out_offsets
    for slot, tokens in _segments(meta):
        for s in range(lora.num_slices):
            row0, r = int(lora.row_start[s, slot]), int(lora.rank[s, slot])
            if r == 0:
                continue
            cols = slice(offsets[s], offsets[s + 1])
            b = lora.b[row0 : row0 + r, cols].float()
            update = v[s, tokens, :r].float() @ b
            y[tokens, cols] = (y[tokens, cols].float() + update).to(y.dtype)


def stacked_expand(out: torch.Tensor, lora: LoraSlices, meta: AdapterBatchMeta, y: torch.Tensor,
                   bias: torch.Tensor | None = None, bases: list[int] | None = None) -> None:
    """The layer output from a stacked GEMM's output (see kernels/stacked.py): the twin of
    both Triton expands, the tiled and the grouped one (same semantics), and of the fused
    linear's (whose shrink covers a window of pool rows from each slice's ``bases``).

    out: [T, N + rows * n_slices]; y: [T, N] written whole; bias: [N] or None.
    Semantics: y[t, off_s : off_s1] = out[t, off_s : off_s1] + bias + sum over j < r of
    out[t, N + (row0 - base_s + j) * n_slices + s] * B[row0 + j, off_s : off_s1], r cut
    where the window's rows end (base_s 0 without bases).
    """
    rows = check_stacked(out, lora, meta, y, bias)
    n, n_slices, offsets = lora.out_offsets[-1], lora.num_slices, lora.out_offsets
    result = out[:, :n].float() + (bias.float() if bias is not None else 0.0)
    for slot, tokens in _segments(meta):
        for s in range(n_slices):
            row0, r, base = int(lora.row_start[s, slot]), int(lora.rank[s, slot]), bases[s] if bases else 0
            r = min(r, lora.max_rank, base + rows - row0)
            if r <= 0:
                continue
            if row0 < base:
                raise ValueError(f"slot {slot}'s rows begin at {row0}, below its window's first row {base}")
            cols = n + (row0 - base + torch.arange(r, device=out.device)) * n_slices + s
            v = out[tokens][:, cols].float()
            b = lora.b[row0 : row0 + r, offsets[s] : offsets[s + 1]].float()
            result[tokens, offsets[s] : offsets[s + 1]] += v @ b
    y.copy_(result.to(y.dtype))


def window_bases(lora: LoraSlices, meta: AdapterBatchMeta, rows: int, pool_rows: int) -> list[int]:
    """The first pool row of each slice's window of ``rows`` rows in a fused linear
    (kernels/stacked_fused.py): the lowest row of that slice a token of the step uses, lowered so
    the window ends within the pool's ``pool_rows`` rows (host sync)."""
    slots = meta.token_slots[meta.token_slots >= 0].long()
    bases = []
    for starts, ranks in zip(lora.row_start[:, slots], lora.rank[:, slots]):
        used = starts[ranks > 0]
        lo = int(used.min()) if used.numel() else pool_rows
        bases.append(max(min(lo, pool_rows - rows), 0))
    return bases


def window_rows(bases: list[int], rows: int) -> torch.Tensor:
    """The A rows (pool row r of slice s at r * n_slices + s) of windows of ``rows`` rows from
    ``bases``, in the order of the shrink values they give."""
    n_slices = len(bases)
    columns = torch.arange(rows * n_slices)
    return columns + torch.tensor(bases)[columns % n_slices] * n_slices


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

    h:         [T, D] adapter input; with residual [T, D] and ln_mix [S], the input is
               h[t] + ln_mix[slot] * residual[t] (formed in float32; h may then be out itself)
    down:      [S, R, D] rows of W_down;  down_bias: [S, R]
    up:        [S, R, D] rows of W_up^T;  up_bias:   [S, D]
    rank:      [S] int32 bottleneck width of each slot
    activation: [S] int32 activation of each slot (segment_common.ACT_CODES)
    workspace: [T, R]
    out:       [T, D] updated in place (holds the residual stream)
    Semantics: out[t] += up_bias + act(h[t] @ down[:r].T + down_bias[:r]) @ up[:r]
    with the slot of t; tokens without adapter are untouched.
    """
    for slot, tokens in _segments(meta):
        r = int(rank[slot])
        if r == 0:
            continue
        x = h[tokens].float()
        if residual is not None:
            x = x + ln_mix[slot].float() * residual[tokens].float()
        z = x @ down[slot, :r].float().T + down_bias[slot, :r].float()
        z = ACTIVATIONS[ACT_NAMES[int(activation[slot])]](z)
        workspace[tokens, :r] = z.to(workspace.dtype)
        update = z @ up[slot, :r].float() + up_bias[slot].float()
        out[tokens] = (out[tokens].float() + update).to(out.dtype)


def ia3_scale(x: torch.Tensor, scales: torch.Tensor, meta: AdapterBatchMeta) -> None:
    """(IA)^3: scale each token's features by its slot's vector, in place.

    x: [T, N]; scales: [S, N]. Semantics: x[t] *= scales[slot[t]]; slot -1 untouched.
    """
    slots = meta.token_slots.long()
    rows = slots >= 0
    if not bool(rows.any()):
        return
    x[rows] = (x[rows].float() * scales[slots[rows]].float()).to(x.dtype)


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, kv_start, page_size, window, out,
                           k_scale=None, v_scale=None) -> None:
    """Float32 twin of kernels.attention.paged_decode_attention (same semantics; an FP8
    cache's entries dequantized with their scales)."""
    batch, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    for b in range(batch):
        length = int(context_lens[b])
        lo = int(kv_start[b]) if window is None else max(int(kv_start[b]), length - window)
        if length <= lo:
            out[b] = 0
            continue
        j = torch.arange(lo, length, device=q.device)
        slots = block_tables[b, j // page_size].long() * page_size + j % page_size
        keys, values = (_cached(c, s, slots, group) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))  # [n, Hq, D]
        scores = torch.einsum("hd,nhd->hn", q[b].float(), keys) * head_dim ** -0.5
        out[b] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values).to(out.dtype)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables, context_lens, kv_start, cu_q, tiles, page_size, window, out, k_scale=None,
    v_scale=None,
) -> None:
    """Float32 twin of kernels.prefill_attention.paged_prefill_attention (same
    semantics; the tile list is not needed here)."""
    group = q.shape[1] // k_cache.shape[1]
    cu, lens, starts = cu_q.tolist(), context_lens.tolist(), kv_start.tolist()
    for b in range(len(lens)):
        rows, length = slice(cu[b], cu[b + 1]), lens[b]
        n = cu[b + 1] - cu[b]
        if n == 0:
            continue
        j = torch.arange(starts[b], length, device=q.device)
        slots = block_tables[b, j // page_size].long() * page_size + j % page_size
        keys, values = (_cached(c, s, slots, group) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))  # [K, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * q.shape[2] ** -0.5
        query_kv = torch.arange(length - n, length, device=q.device)[:, None]
        visible = j[None, :] <= query_kv
        if window is not None:
            visible &= j[None, :] > query_kv - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[rows] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)


def _cached(cache: torch.Tensor, scale: torch.Tensor | None, slots: torch.Tensor, group: int) -> torch.Tensor:
    """Float32 cache entries at ``slots``, dequantized if FP8, each KV head repeated for its group."""
    return dequantize_kv(cache[slots], None if scale is None else scale[slots]).repeat_interleave(group, dim=1)


def penalise_rows(logits: torch.Tensor, rows: torch.Tensor, table_rows: torch.Tensor, counts: torch.Tensor,
                  in_prompt: torch.Tensor, params: torch.Tensor, use: tuple[bool, bool, bool],
                  out: torch.Tensor) -> None:
    """Float32 twin of kernels.penalties.penalise_rows (same semantics)."""
    x = logits.index_select(0, rows).float()
    count = counts.index_select(0, table_rows)
    generated = count > 0
    p = params.index_select(0, table_rows).float()
    if use[0]:
        seen = in_prompt.index_select(0, table_rows) | generated
        x = torch.where(seen, torch.where(x > 0, x / p[:, 0:1], x * p[:, 0:1]), x)
    if use[1]:
        x = x - p[:, 1:2] * count.float()
    if use[2]:
        x = x - p[:, 2:3] * generated.float()
    out.copy_(x)

