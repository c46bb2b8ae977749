"""Per-step metadata: segments and the fixed-length tile list."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels.metadata import build_adapter_meta, build_tiles, group_by_slot, max_tiles
from adapterserve.kernels import metadata_triton
from adapterserve.kernels.metadata_triton import MAX_TOKENS, adapter_meta_one_launch

from .cases import PATTERNS, fresh_generator, gpu, interpreted, needs_cuda, token_slots


def _check(slots: torch.Tensor, num_slots: int, block_m: int, seed: int) -> None:
    meta = build_adapter_meta(slots, num_slots, block_m)
    slots = slots.cpu()
    t = slots.shape[0]
    counts = torch.bincount(slots[slots >= 0].long(), minlength=num_slots)
    assert torch.equal(meta.slot_counts.cpu().long(), counts), f"seed={seed}"
    order = meta.sorted_tokens.cpu().long()
    assert torch.equal(order.sort().values, torch.arange(t)), f"not a permutation; seed={seed}"
    assert (slots[order].diff() >= 0).all(), f"tokens not grouped by slot; seed={seed}"
    assert meta.max_tiles == max_tiles(t, num_slots, block_m)
    covered = torch.zeros(t, dtype=torch.int64)
    starts, counts_l = meta.slot_starts.cpu(), meta.slot_counts.cpu()
    tiles = zip(meta.tile_slots.tolist(), meta.tile_starts.tolist(), meta.tile_ends.tolist())
    for slot, start, end in tiles:
        if slot < 0:
            continue
        assert 0 < end - start <= block_m, f"tile of {end - start} tokens; seed={seed}"
        assert starts[slot] <= start and end <= starts[slot] + counts_l[slot], f"tile leaves its segment; seed={seed}"
        covered[order[start:end]] += 1
    expected = (slots >= 0).long()
    assert torch.equal(covered, expected), f"each adapter token must be in exactly one tile; seed={seed}"


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,s,block_m", [(1, 4, 16), (37, 5, 16), (100, 64, 32), (300, 7, 16)])
def test_tiles_cover_every_token_once(pattern, t, s, block_m):
    gen, seed = fresh_generator()
    _check(token_slots(pattern, t, s, gen, no_adapter=0.2), s, block_m, seed)


def test_empty_batch():
    meta = build_adapter_meta(torch.empty(0, dtype=torch.int32), 8)
    assert meta.max_tiles == 0 and meta.num_tokens == 0


def test_bad_block_m_is_rejected():
    with pytest.raises(ValueError, match="block_m"):
        build_adapter_meta(torch.zeros(3, dtype=torch.int32), 2, block_m=0)


@gpu
@needs_cuda
@pytest.mark.parametrize("pattern", PATTERNS)
def test_tiles_on_gpu_without_sync(pattern):
    gen, seed = fresh_generator()
    slots = token_slots(pattern, 512, 128, gen, no_adapter=0.1).cuda()
    build_adapter_meta(slots, 128)  # warm up lazy CUDA init outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        build_adapter_meta(slots, 128)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _check(slots, 128, 16, seed)


def _torch_ops(slots: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, ...]:
    sorted_tokens, counts, starts = group_by_slot(slots, num_slots)
    return (sorted_tokens, counts, starts, *build_tiles(counts, starts, slots.shape[0], block_m))


def _poisoned_buffers(monkeypatch) -> None:
    """The launch's outputs and scratch start as -7s: every value compared below was written."""
    monkeypatch.setattr(metadata_triton, "_int32",
                        lambda n, device: torch.full((n,), -7, dtype=torch.int32, device=device))


def _one_launch_matches_the_torch_ops(slots: torch.Tensor, num_slots: int, block_m: int, seed: int) -> None:
    n_tiles = max_tiles(slots.shape[0], num_slots, block_m)
    got = adapter_meta_one_launch(slots, num_slots, block_m, n_tiles)
    names = ("sorted_tokens", "slot_counts", "slot_starts", "tile_slots", "tile_starts", "tile_ends")
    for name, a, b in zip(names, got, _torch_ops(slots, num_slots, block_m)):
        assert torch.equal(a.cpu(), b.cpu()), f"{name}: {a.tolist()} != {b.tolist()}; seed={seed}"


@interpreted
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,s,block_m", [(1, 1, 16), (5, 3, 16), (64, 70, 16), (130, 9, 32), (100, 200, 16)])
def test_one_launch_gives_the_torch_ops_metadata(pattern, t, s, block_m, monkeypatch):
    """Every output equal to the torch ops' (the stable order included), slots and tiles over more
    than one chunk (70 and 200 slots, 130 tokens), tokens without adapters among them."""
    _poisoned_buffers(monkeypatch)
    gen, seed = fresh_generator()
    _one_launch_matches_the_torch_ops(token_slots(pattern, t, s, gen, no_adapter=0.2), s, block_m, seed)


def test_one_launch_refuses_what_it_cannot_take():
    int32 = dict(dtype=torch.int32)
    for slots, num_slots in [(torch.zeros(0, **int32), 2), (torch.zeros(MAX_TOKENS + 1, **int32), 2),
                             (torch.zeros(4, dtype=torch.int64), 2), (torch.zeros(4, **int32), 0),
                             (torch.zeros(8, **int32)[::2], 2)]:
        with pytest.raises(ValueError, match="adapter_meta_one_launch"):
            adapter_meta_one_launch(slots, num_slots, 16, 4)


@gpu
@needs_cuda
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("t,s", [(1, 8), (64, 128), (512, 1000)])
def test_one_launch_on_gpu_gives_the_torch_ops_metadata(pattern, t, s, monkeypatch):
    _poisoned_buffers(monkeypatch)
    gen, seed = fresh_generator()
    _one_launch_matches_the_torch_ops(token_slots(pattern, t, s, gen, no_adapter=0.1).cuda(), s, 16, seed)
