"""Query tiles for paged prefill attention, built on the host (numpy) once per step.

A tile is a run of one sequence's new tokens; no tile straddles two sequences.
Sequences with one new token (decode rows of a mixed step) get a tile each and
run in a launch with short tiles; the others are cut into tiles of
``tile_tokens`` tokens. Each list is ordered heaviest first (most keys to read),
so the longest programs start early and the short ones fill the tail.

A captured step (engine/mixed_graphs.py) needs lists of a fixed length, known from
host ints: ``padded_tile_lists`` pads them with entries of sequence -1, which the
kernel skips.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_TILE_TOKENS = 64  # queries per multi-token tile (the kernel splits it by GQA group)
NO_SEQUENCE = -1  # the sequence of a padding tile


@dataclass(frozen=True)
class PrefillTiles:
    """single: [N, 2] int32 (sequence, 0) for sequences with one new token
    multi:  [M, 2] int32 (sequence, first query within it), tile_tokens queries each
    tile_tokens: host int
    """

    single: torch.Tensor
    multi: torch.Tensor
    tile_tokens: int


def build_prefill_tiles(
    counts: np.ndarray, context_lens: np.ndarray, device: torch.device, tile_tokens: int = DEFAULT_TILE_TOKENS
) -> PrefillTiles:
    """counts: [B] new tokens per sequence; context_lens: [B] kv entries after this step."""
    single, multi = prefill_tile_lists(counts, context_lens, tile_tokens)
    return PrefillTiles(torch.from_numpy(single).to(device), torch.from_numpy(multi).to(device), tile_tokens)


def prefill_tile_lists(
    counts: np.ndarray, context_lens: np.ndarray, tile_tokens: int = DEFAULT_TILE_TOKENS
) -> tuple[np.ndarray, np.ndarray]:
    """The (single, multi) lists of PrefillTiles as host arrays."""
    if tile_tokens < 1 or tile_tokens & (tile_tokens - 1):
        raise ValueError(f"tile_tokens must be a power of two, got {tile_tokens}")
    counts = np.asarray(counts, dtype=np.int64)
    lens = np.asarray(context_lens, dtype=np.int64)
    ones = np.flatnonzero(counts == 1)
    single = _heaviest_first(ones, np.zeros(len(ones), np.int64), lens[ones])
    many = np.flatnonzero(counts > 1)
    per_seq = -(-counts[many] // tile_tokens)
    seqs = np.repeat(many, per_seq)
    firsts = (np.arange(per_seq.sum()) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * tile_tokens
    last_kv = lens[seqs] - counts[seqs] + np.minimum(firsts + tile_tokens, counts[seqs])
    return single, _heaviest_first(seqs, firsts, last_kv)


def padded_lengths(max_tokens: int, max_requests: int, tile_tokens: int = DEFAULT_TILE_TOKENS) -> tuple[int, int]:
    """Fixed (single, multi) list lengths that hold the tiles of any step of at most
    max_tokens tokens over at most max_requests sequences: a sequence of n tokens takes
    ceil(n / tile_tokens) <= n / tile_tokens + 1 multi tiles, so the step at most
    ceil(max_tokens / tile_tokens) + max_requests; single tiles at most one per sequence."""
    return max_requests, -(-max_tokens // tile_tokens) + max_requests


def padded_tile_lists(
    counts: np.ndarray, context_lens: np.ndarray, max_tokens: int, max_requests: int,
    tile_tokens: int = DEFAULT_TILE_TOKENS,
) -> tuple[np.ndarray, np.ndarray]:
    """prefill_tile_lists padded to padded_lengths with (NO_SEQUENCE, 0) entries."""
    counts = np.asarray(counts)
    if counts.sum() > max_tokens or len(counts) > max_requests:
        raise ValueError(f"a step of {int(counts.sum())} tokens over {len(counts)} sequences does not fit "
                         f"padded tile lists for {max_tokens} tokens over {max_requests} sequences")
    lists = prefill_tile_lists(counts, context_lens, tile_tokens)
    out = []
    for tiles, length in zip(lists, padded_lengths(max_tokens, max_requests, tile_tokens)):
        padded = np.zeros((length, 2), dtype=np.int32)
        padded[:, 0] = NO_SEQUENCE
        padded[: len(tiles)] = tiles
        out.append(padded)
    return out[0], out[1]


def _heaviest_first(seqs: np.ndarray, firsts: np.ndarray, last_kv: np.ndarray) -> np.ndarray:
    """[N, 2] int32 (seq, first query), sorted by the tile's highest kv index, descending."""
    order = np.argsort(-last_kv, kind="stable")
    return np.stack([seqs[order], firsts[order]], axis=1).astype(np.int32).reshape(-1, 2)
