"""Builds a step's AttentionMeta: block tables on the host (numpy), padded views
for batched attention on the device."""
from __future__ import annotations

import numpy as np
import torch

from adapterserve.engine.context import AttentionMeta


class SequenceLayout:
    """One sequence's place in the step, as the host computes it."""

    __slots__ = ("pages", "kv_start", "context_len", "new_tokens", "first_kv")

    def __init__(self, pages: list[int], kv_start: int, context_len: int, new_tokens: int) -> None:
        self.pages = pages  # prefix pages then own pages
        self.kv_start = kv_start
        self.context_len = context_len
        self.new_tokens = new_tokens
        self.first_kv = context_len - new_tokens  # kv index of the first new token


def build_attention_meta(
    layouts: list[SequenceLayout], page: int, windows: list[int | None], device: torch.device
) -> AttentionMeta:
    batch = len(layouts)
    max_pages = max(len(s.pages) for s in layouts)
    tables = np.zeros((batch, max_pages), dtype=np.int32)
    for b, s in enumerate(layouts):
        tables[b, : len(s.pages)] = s.pages
    lens = np.array([s.context_len for s in layouts], dtype=np.int32)
    starts = np.array([s.kv_start for s in layouts], dtype=np.int32)
    kv_index = np.concatenate([np.arange(s.first_kv, s.context_len) for s in layouts])
    seq = np.repeat(np.arange(batch), [s.new_tokens for s in layouts])
    write = tables[seq, kv_index // page].astype(np.int64) * page + kv_index % page
    decode = all(s.new_tokens == 1 for s in layouts)
    meta = AttentionMeta(
        write_slots=torch.from_numpy(write).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        context_lens=torch.from_numpy(lens).to(device),
        kv_start=torch.from_numpy(starts).to(device),
        page_size=page,
        decode=decode,
    )
    if not (decode and device.type == "cuda"):
        _add_padded_views(meta, layouts, kv_index, windows)
    return meta


def _add_padded_views(meta: AttentionMeta, layouts: list[SequenceLayout], kv_index: np.ndarray, windows) -> None:
    """Padded [B, Qmax] queries and [B, Kmax] contexts with their causal masks."""
    device = meta.block_tables.device
    counts = np.array([s.new_tokens for s in layouts])
    batch, qmax, kmax = len(layouts), int(counts.max()), int(max(s.context_len for s in layouts))
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    j = np.arange(qmax)
    valid = j[None, :] < counts[:, None]
    query_pad = np.where(valid, first[:, None] + j[None, :], first[:, None])
    query_kv = np.full((batch, qmax), -1, dtype=np.int64)
    query_kv[valid] = kv_index
    token_pad = (np.arange(batch)[:, None] * qmax + j[None, :])[valid]
    keys = torch.arange(kmax, device=device)
    meta.kv_slots = meta.block_tables.long().gather(1, (keys // meta.page_size).expand(batch, -1).clamp(
        max=meta.block_tables.shape[1] - 1)) * meta.page_size + keys % meta.page_size
    qkv = torch.from_numpy(query_kv).to(device).unsqueeze(-1)  # [B, Qmax, 1]
    visible = (keys >= meta.kv_start.long().view(-1, 1, 1)) & (keys <= qkv)
    padding = (qkv < 0) & (keys == 0)
    meta.masks = {None: (visible | padding).unsqueeze(1)}
    for w in {w for w in windows if w is not None}:
        meta.masks[w] = ((visible & (keys > qkv - w)) | padding).unsqueeze(1)
    meta.query_pad = torch.from_numpy(query_pad).to(device)
    meta.token_pad = torch.from_numpy(token_pad).to(device)
