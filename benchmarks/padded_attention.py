"""The engine's former attention for steps with prefills, kept as a baseline:
gather every sequence's context into padded [B, Hkv, Kmax, D] tensors, pad the
queries to [B, Hq, Qmax, D] and run torch SDPA under a padded causal mask.

``padded_views`` is built once per step (as the runner did); ``padded_attention``
is what every layer paid.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class PaddedViews:
    query_pad: torch.Tensor  # [B, Qmax] token row of each padded query
    token_pad: torch.Tensor  # [T] place of each token in the flattened [B * Qmax]
    kv_slots: torch.Tensor  # [B, Kmax] cache slot of every kv index (padding: 0)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool, True where a query may attend


def padded_views(counts: np.ndarray, lens: np.ndarray, starts: torch.Tensor, tables: torch.Tensor, page: int,
                 window: int | None) -> PaddedViews:
    device = tables.device
    batch, qmax, kmax = len(counts), int(counts.max()), int(lens.max())
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    j = np.arange(qmax)
    valid = j[None, :] < counts[:, None]
    query_pad = np.where(valid, first[:, None] + j[None, :], first[:, None])
    query_kv = np.where(valid, (lens - counts)[:, None] + j[None, :], -1)
    token_pad = (np.arange(batch)[:, None] * qmax + j[None, :])[valid]
    keys = torch.arange(kmax, device=device)
    pages = (keys // page).expand(batch, -1).clamp(max=tables.shape[1] - 1)
    kv_slots = tables.long().gather(1, pages) * page + keys % page
    qkv = torch.from_numpy(query_kv).to(device).unsqueeze(-1)  # [B, Qmax, 1]
    visible = (keys >= starts.long().view(-1, 1, 1)) & (keys <= qkv)
    if window is not None:
        visible &= keys > qkv - window
    mask = (visible | ((qkv < 0) & (keys == 0))).unsqueeze(1)
    to = lambda a: torch.from_numpy(a).to(device)
    return PaddedViews(to(query_pad), to(token_pad), kv_slots, mask)


def padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, views: PaddedViews) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]."""
    keys = k_cache[views.kv_slots].transpose(1, 2)  # [B, Hkv, Kmax, D]
    values = v_cache[views.kv_slots].transpose(1, 2)
    queries = q[views.query_pad].transpose(1, 2)  # [B, Hq, Qmax, D]
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=views.mask, enable_gqa=True)
    batch, heads, qmax, dim = out.shape
    return out.transpose(1, 2).reshape(batch * qmax, heads, dim)[views.token_pad]
