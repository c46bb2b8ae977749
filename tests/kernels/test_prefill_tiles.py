"""Prefill tile lists: every new token in exactly one tile, no tile straddles
sequences, single-token sequences apart, heaviest tiles first."""
import numpy as np
import pytest
import torch

from adapterserve.kernels import build_prefill_tiles
from tests.kernels.cases import fresh_generator


@pytest.mark.parametrize("tile_tokens", [1, 16, 64])
def test_tiles_cover_every_token_once(tile_tokens):
    gen, seed = fresh_generator()
    counts = torch.randint(0, 150, (40,), generator=gen).numpy()
    counts[torch.randint(40, (15,), generator=gen).numpy()] = 1
    lens = counts + torch.randint(0, 500, (40,), generator=gen).numpy()
    tiles = build_prefill_tiles(counts, lens, torch.device("cpu"), tile_tokens)
    covered = np.zeros((40, 150), dtype=int)
    for seq, first in tiles.single.tolist():
        assert counts[seq] == 1 and first == 0, f"seed={seed}"
        covered[seq, 0] += 1
    for seq, first in tiles.multi.tolist():
        assert counts[seq] > 1 and first % tile_tokens == 0 and first < counts[seq], f"seed={seed}"
        covered[seq, first : min(first + tile_tokens, counts[seq])] += 1
    want = np.arange(150)[None, :] < counts[:, None]
    assert np.array_equal(covered, want.astype(int)), f"seed={seed}"


def test_heaviest_first():
    counts, lens = np.array([1, 130, 1, 5]), np.array([10, 200, 30, 5])
    tiles = build_prefill_tiles(counts, lens, torch.device("cpu"), 64)
    assert tiles.single.tolist() == [[2, 0], [0, 0]]
    assert tiles.multi.tolist() == [[1, 128], [1, 64], [1, 0], [3, 0]]
    assert tiles.multi.dtype == torch.int32


def test_tile_tokens_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        build_prefill_tiles(np.array([3]), np.array([3]), torch.device("cpu"), 48)
