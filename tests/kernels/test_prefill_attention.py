"""Paged prefill attention: Triton (interpreter on the CPU, bfloat16 on a GPU)
against its float32 twin, and the twin against a naive per-query softmax.

Each sequence is (new tokens, tokens cached before this step, prefix length): a
prefix is right-aligned in its own pages (kv_start > 0), cached tokens make a
chunked prefill, one new token a decode row of a mixed step.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from adapterserve.kernels import build_prefill_tiles, reference
from adapterserve.kernels.prefill_attention import paged_prefill_attention
from adapterserve.kernels.prefill_tiles import PrefillTiles, padded_tile_lists
from tests.kernels.cases import NAN, TOL, check_close, fresh_generator, gpu, needs_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16
CASES = {
    "mixed": [(1, 20, 0), (17, 0, 0), (1, 37, 0), (1, 1, 0), (33, 0, 0), (5, 0, 0)],
    "chunked": [(24, 40, 0), (1, 12, 0), (9, 70, 0)],
    "prefix": [(20, 0, 11), (1, 30, 5), (12, 18, 16)],
    "windowed": [(30, 9, 3), (1, 44, 0), (18, 0, 0)],
}
WINDOW = {"windowed": 7}


class Paged:
    """One random step: packed queries, a paged cache in random pages, tiles."""

    def __init__(self, seqs, heads, kv_heads, dim, dtype, gen, device=DEVICE, tile_tokens=16):
        aligned = [-(-p // PAGE) * PAGE for _, _, p in seqs]
        counts = np.array([n for n, _, _ in seqs], dtype=np.int32)
        lens = np.array([a + c + n for a, (n, c, _) in zip(aligned, seqs)], dtype=np.int32)
        starts = np.array([a - p for a, (_, _, p) in zip(aligned, seqs)], dtype=np.int32)
        pages = -(-lens // PAGE)
        pool = torch.randperm(int(pages.sum()) + 3, generator=gen)
        table = torch.zeros(len(seqs), int(pages.max()), dtype=torch.int32)
        for b, first in enumerate(np.cumsum(pages) - pages):
            table[b, : pages[b]] = pool[first : first + pages[b]]
        slots = len(pool) * PAGE
        to = lambda t: t.to(device)
        self.k = to(torch.randn(slots, kv_heads, dim, generator=gen).to(dtype))
        self.v = to(torch.randn(slots, kv_heads, dim, generator=gen).to(dtype))
        self.q = to(torch.randn(int(counts.sum()), heads, dim, generator=gen).to(dtype))
        self.table, self.lens, self.starts = to(table), to(torch.from_numpy(lens)), to(torch.from_numpy(starts))
        self.cu = to(torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)))
        self.tiles = build_prefill_tiles(counts, lens, torch.device(device), tile_tokens)

    def args(self, window):
        return (self.q, self.k, self.v, self.table, self.lens, self.starts, self.cu, self.tiles, PAGE, window)

    def twin(self, window) -> torch.Tensor:
        out = torch.full(self.q.shape, NAN, dtype=torch.float32, device=self.q.device)
        reference.paged_prefill_attention(*self.args(window), out)
        return out

    def triton(self, window, **tuning) -> torch.Tensor:
        out = torch.full_like(self.q, NAN)
        paged_prefill_attention(*self.args(window), out, **tuning)
        return out


def naive(case: Paged, window) -> torch.Tensor:
    """Per query: slice the visible kv range, softmax, weighted sum (float64)."""
    q, group = case.q.double().cpu(), case.q.shape[1] // case.k.shape[1]
    out = torch.empty_like(q)
    cu, lens, starts = case.cu.tolist(), case.lens.tolist(), case.starts.tolist()
    for b, length in enumerate(lens):
        n = cu[b + 1] - cu[b]
        slots = [int(case.table[b, j // PAGE]) * PAGE + j % PAGE for j in range(length)]
        keys = case.k.cpu()[slots].double().repeat_interleave(group, 1)  # [L, Hq, D]
        values = case.v.cpu()[slots].double().repeat_interleave(group, 1)
        for i in range(n):
            t = length - n + i
            lo = starts[b] if window is None else max(starts[b], t - window + 1)
            scores = torch.einsum("hd,khd->hk", q[cu[b] + i], keys[lo : t + 1]) / q.shape[2] ** 0.5
            out[cu[b] + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[lo : t + 1])
    return out.to(case.q.device)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 64), (8, 2, 128)])
def test_twin_matches_naive(name, heads, kv_heads, dim):
    gen, seed = fresh_generator()
    case = Paged(CASES[name], heads, kv_heads, dim, torch.float32, gen)
    window = WINDOW.get(name)
    check_close(case.twin(window), naive(case, window).float(), torch.float32, seed, f"twin {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 4, 64), (8, 2, 128)])
def test_triton_matches_twin(dtype, name, heads, kv_heads, dim):
    gen, seed = fresh_generator()
    case = Paged(CASES[name], heads, kv_heads, dim, dtype, gen)
    window = WINDOW.get(name)
    check_close(case.triton(window), case.twin(window), dtype, seed, f"triton {name}")


@pytest.mark.parametrize("heads, kv_heads, tile_tokens, block_m, block_n", [
    (6, 2, 16, 16, 16),  # group of 3, padded to 4
    (8, 1, 64, 32, 32),  # group of 8, default tile height, a tile split over 2 programs
    (2, 2, 8, 16, 32),   # tile shorter than a program's rows
])
def test_triton_tile_shapes(heads, kv_heads, tile_tokens, block_m, block_n):
    gen, seed = fresh_generator()
    seqs = [(1, 25, 0), (40, 3, 5), (1, 0, 0), (2, 17, 0)]
    case = Paged(seqs, heads, kv_heads, 32, torch.float32, gen, tile_tokens=tile_tokens)
    for window in (None, 5):
        got = case.triton(window, block_m=block_m, block_n=block_n)
        check_close(got, case.twin(window), torch.float32, seed, f"tiles {tile_tokens}/{block_m}/{block_n} w={window}")


@pytest.mark.parametrize("window", [None, 5, 11, 40])
def test_triton_key_tile_boundaries(window):
    """Decode rows whose context ends and kv_start fall on every offset within a
    16-key tile, beside chunked prefills: the split into masked and unmasked key
    tiles must never leave a hidden key unmasked."""
    gen, seed = fresh_generator()
    seqs = [(1, 32 + i, i + 1) for i in range(16)] + [(11, 13, 3), (19, 0, 7), (40, 33, 0)]
    case = Paged(seqs, 4, 2, 32, torch.float32, gen)
    got = case.triton(window, block_m=16, block_n=16)
    check_close(got, case.twin(window), torch.float32, seed, f"key tile boundaries w={window}")


@pytest.mark.parametrize("tile_tokens", [8, 16])
@pytest.mark.parametrize("name", ["mixed", "chunked", "prefix"])
def test_triton_padded_tile_lists(name, tile_tokens):
    """A captured step's fixed-length lists: padding requests (no new tokens, context 0,
    cu_q flat), padding token rows after the last sequence's, tiles of sequence -1. Real
    rows match the twin; the padding rows are never written (still NaN)."""
    gen, seed = fresh_generator()
    case = Paged(CASES[name], 4, 2, 32, torch.float32, gen, tile_tokens=tile_tokens)
    real_tokens, real_seqs = case.q.shape[0], case.lens.shape[0]
    max_tokens, max_requests = real_tokens + 21, real_seqs + 3
    expected = case.twin(None)
    counts = (case.cu[1:] - case.cu[:-1]).cpu().numpy()
    single, multi = padded_tile_lists(counts, case.lens.cpu().numpy(), max_tokens, max_requests, tile_tokens)
    assert (single[:, 0] == -1).any() and (multi[:, 0] == -1).any()
    pad = max_requests - real_seqs
    q = torch.cat([case.q, torch.randn(max_tokens - real_tokens, *case.q.shape[1:], generator=gen).to(case.q)])
    table = torch.cat([case.table, torch.zeros(pad, case.table.shape[1], dtype=torch.int32, device=DEVICE)])
    zeros = torch.zeros(pad, dtype=torch.int32, device=DEVICE)
    lens, starts = torch.cat([case.lens, zeros]), torch.cat([case.starts, zeros])
    cu = torch.cat([case.cu, case.cu[-1:].repeat(pad)])
    tiles = PrefillTiles(torch.from_numpy(single).to(DEVICE), torch.from_numpy(multi).to(DEVICE), tile_tokens)
    out = torch.full_like(q, NAN)
    paged_prefill_attention(q, case.k, case.v, table, lens, starts, cu, tiles, PAGE, None, out, block_m=16)
    check_close(out[:real_tokens], expected, torch.float32, seed, f"padded {name}")
    assert out[real_tokens:].isnan().all()


def test_padded_tile_lists_refuse_a_step_too_large():
    with pytest.raises(ValueError, match="does not fit"):
        padded_tile_lists(np.array([5, 4]), np.array([5, 4]), max_tokens=8, max_requests=2)
    with pytest.raises(ValueError, match="does not fit"):
        padded_tile_lists(np.array([1, 1, 1]), np.array([5, 4, 3]), max_tokens=8, max_requests=2)


GPU_SEQS = [(1, 600, 0)] * 20 + [(300, 0, 0), (1000, 24, 0), (129, 700, 20), (2, 90, 0), (64, 0, 0)]


@gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("block_m, block_n, num_warps, num_stages", [
    (None, None, None, 2), (64, 32, 4, 2), (128, 64, 8, 3), (128, 128, 4, 2), (256, 64, 4, 2),
])
def test_gpu_bfloat16_matches_twin(window, block_m, block_n, num_warps, num_stages):
    """Llama-8B heads in bfloat16; tolerance TOL[bfloat16] = 2e-2 relative (Frobenius)."""
    gen, seed = fresh_generator()
    case = Paged(GPU_SEQS, 32, 8, 128, torch.bfloat16, gen, tile_tokens=64)
    got = case.triton(window, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    torch.cuda.synchronize()
    check_close(got, case.twin(window), torch.bfloat16, seed, f"gpu {block_m}/{block_n} w={window}")
    assert TOL[torch.bfloat16] == 2e-2
