"""Builds a step's AttentionMeta on the host (numpy): block tables, cache slots to
write, and for steps with prefills the query offsets and tiles of the prefill kernel."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from adapterserve.engine.host_copy import to_device
from adapterserve.kernels.prefill_tiles import (
    DEFAULT_TILE_TOKENS,
    PrefillTiles,
    prefill_tile_lists,
)
from adapterserve.layers.context import AttentionMeta


class SequenceLayout:
    """One sequence's place in the step, as the host computes it."""

    __slots__ = ("pages", "kv_start", "context_len", "new_tokens", "first_kv")

    def __init__(self, pages: list[int], kv_start: int, context_len: int, new_tokens: int) -> None:
        self.pages = pages  # prefix pages then own pages
        self.kv_start = kv_start
        self.context_len = context_len
        self.new_tokens = new_tokens
        self.first_kv = context_len - new_tokens  # kv index of the first new token


LayoutColumns = tuple[list[list[int]], list[int], list[int], list[int]]


def layout_columns(layouts: list[SequenceLayout]) -> LayoutColumns:
    """The layouts as columns (pages, kv_start, context_len, new_tokens): plain lists, which
    pickle many times faster than the objects."""
    return ([s.pages for s in layouts], [s.kv_start for s in layouts], [s.context_len for s in layouts],
            [s.new_tokens for s in layouts])


def layouts_from_columns(columns: LayoutColumns) -> list[SequenceLayout]:
    return [SequenceLayout(*fields) for fields in zip(*columns)]


def longest_first(context_lens: np.ndarray) -> np.ndarray:
    """int32 batch rows ordered by context length, longest first (ties in row order)."""
    return np.argsort(-context_lens.astype(np.int64), kind="stable").astype(np.int32)


def block_tables(layouts: list[SequenceLayout], rows: int, width: int) -> np.ndarray:
    """[rows, width] int32: row b holds layouts[b]'s pages, then zeros (rows past the layouts: zeros)."""
    counts = np.array([len(s.pages) for s in layouts], dtype=np.int64)
    pages = np.fromiter(itertools.chain.from_iterable(s.pages for s in layouts), dtype=np.int32,
                        count=int(counts.sum()))
    row = np.repeat(np.arange(len(layouts)), counts)
    column = np.arange(pages.size) - np.repeat(np.cumsum(counts) - counts, counts)
    tables = np.zeros((rows, width), dtype=np.int32)
    tables[row, column] = pages
    return tables


@dataclass
class StepArrays:
    """A step's per-sequence attention arrays on the host."""

    tables: np.ndarray  # [B, width] int32 block tables
    lens: np.ndarray  # [B] int32 context lengths after the step
    starts: np.ndarray  # [B] int32 kv_start
    counts: np.ndarray  # [B] int32 new tokens
    write: np.ndarray  # [T] int64 cache slot of each new token


def step_arrays(layouts: list[SequenceLayout], page: int, width: int | None = None) -> StepArrays:
    """width: block-table columns (default the widest table of the step)."""
    batch = len(layouts)
    tables = block_tables(layouts, batch, width or max(len(s.pages) for s in layouts))
    lens = np.array([s.context_len for s in layouts], dtype=np.int32)
    starts = np.array([s.kv_start for s in layouts], dtype=np.int32)
    counts = np.array([s.new_tokens for s in layouts], dtype=np.int32)
    kv_index = np.concatenate([np.arange(s.first_kv, s.context_len) for s in layouts])
    seq = np.repeat(np.arange(batch), counts)
    write = tables[seq, kv_index // page].astype(np.int64) * page + kv_index % page
    return StepArrays(tables, lens, starts, counts, write)


def build_attention_meta(
    layouts: list[SequenceLayout], page: int, device: torch.device
) -> AttentionMeta:
    step = step_arrays(layouts, page)
    lens, counts = step.lens, step.counts
    decode = bool((counts == 1).all())
    meta = AttentionMeta(
        write_slots=to_device(step.write, device),
        block_tables=to_device(step.tables, device),
        context_lens=to_device(lens, device),
        kv_start=to_device(step.starts, device),
        page_size=page,
        decode=decode,
    )
    if decode:
        meta.decode_order = to_device(longest_first(lens), device)
    else:
        meta.cu_q = to_device(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32), device)
        single, multi = prefill_tile_lists(counts, lens)
        meta.tiles = PrefillTiles(to_device(single, device), to_device(multi, device), DEFAULT_TILE_TOKENS)
    return meta
