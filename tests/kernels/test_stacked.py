"""The stacked LoRA path ([W; A] GEMM, then the stacked expand) against the float32
base GEMM plus the reference shrink/expand: the Triton expands (the tiled and the grouped
one the engine chooses between per step, the per-token one), on the interpreter and a
GPU, and the twin."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapterserve.kernels import reference, stacked_expand
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.stacked import (
    ExpandTiles,
    GroupedTiles,
    RowsInUse,
    expand_tiles,
    row_bucket,
    stack_weight,
    stacked_gemm,
)

from .cases import (
    NAN,
    PATTERNS,
    check_close,
    expand_touched,
    fresh_generator,
    gpu,
    interpreted,
    lora_to,
    make_lora,
    needs_cuda,
    slot_ranks,
    token_slots,
)

# (pattern, T, S, K, widths, rank spec, share without adapter, bias, rows: "all" pool rows or the "bucket")
CPU_CASES = [
    ("identical", 24, 4, 70, (40, 24, 24), 16, 0.0, False, "bucket"),
    ("distinct", 12, 16, 64, (40, 24, 24), 8, 0.0, True, "all"),
    ("uniform", 20, 6, 33, (48, 20), 1, 0.2, False, "bucket"),
    ("zipf", 24, 8, 100, (50,), 64, 0.1, True, "bucket"),
    ("skewed", 24, 6, 70, (40, 24, 24), "mixed", 0.0, False, "all"),
    ("uniform", 18, 5, 45, (24, 17, 17, 9), "mixed", 0.3, True, "bucket"),
    ("none", 10, 4, 40, (40, 24, 24), 16, 0.0, False, "bucket"),
    ("zipf", 70, 6, 36, (72, 20), 24, 0.1, True, "bucket"),  # two 64-token tiles, rank 24 (not 16k)
    ("distinct", 3, 24, 32, (40,), 16, 0.0, False, "all"),  # most row chunks used by no token
]
QKV = (4096, 1024, 1024)
GPU_CASES = (
    [(p, 64, 64, 4096, QKV, 16, 0.1, False, "bucket") for p in PATTERNS]
    + [
        ("zipf", 64, 64, 4096, QKV, "mixed", 0.1, True, "all"),
        ("distinct", 1, 8, 4096, QKV, 64, 0.0, False, "bucket"),
        ("uniform", 256, 64, 4096, (14336, 14336), 16, 0.1, False, "bucket"),  # gate/up
        ("skewed", 128, 32, 14336, (4096,), "mixed", 0.1, False, "all"),  # down
        ("uniform", 100, 8, 1000, (1000, 250, 248), "mixed", 0.1, True, "bucket"),  # ragged sizes
    ]
)


def _high_water(lora: LoraSlices) -> int:
    return int((lora.row_start + lora.rank).max())


def _stacked_case(case, dtype, gen):
    """(x, stacked weight, lora whose A is the stacked view, bias, slots, rows)."""
    pattern, t, s, k, widths, rank, no_adapter, with_bias, rows_spec = case
    pool = make_lora(k, widths, slot_ranks(rank, len(widths), s, gen), torch.float32, gen)  # unused rows NaN
    weight = torch.randn(sum(widths), k, generator=gen) / k**0.5
    stacked = stack_weight(weight.to(dtype), len(widths), pool.a.shape[1], RowsInUse())
    stacked.lora_a().copy_(pool.a)
    lora = LoraSlices(stacked.lora_a(), pool.b.to(dtype), pool.row_start, pool.rank, pool.out_offsets, pool.max_rank)
    bias = torch.randn(sum(widths), generator=gen).to(dtype) if with_bias else None
    slots = token_slots(pattern, t, s, gen, no_adapter)
    rows = stacked.pool_rows if rows_spec == "all" else row_bucket(_high_water(pool), stacked.pool_rows)
    x = torch.randn(t, k, generator=gen).to(dtype)
    return x, stacked, lora, bias, slots, rows


def _oracle(x, stacked, lora, bias, slots) -> torch.Tensor:
    """float32: base GEMM + bias, plus the reference LoRA shrink and expand."""
    y = F.linear(x.float(), stacked.weight().float(), None if bias is None else bias.float())
    return add_update_oracle(x, lora, slots, y)


def add_update_oracle(x, lora, slots, y) -> torch.Tensor:
    """y (float32) plus each token's LoRA update from x, by the reference shrink and expand."""
    lora32 = lora_to(lora, torch.float32)
    lora32 = LoraSlices(lora32.a.contiguous(), lora32.b, lora32.row_start, lora32.rank, lora32.out_offsets,
                        lora32.max_rank)
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    v = torch.zeros(lora.num_slices, x.shape[0], lora.max_rank)
    reference.lora_shrink(x.float(), lora32, meta, v)
    reference.lora_expand(v, lora32, meta, y)
    return y


def _run(case, dtype, device, impl):
    gen, seed = fresh_generator()
    x, stacked, lora, bias, slots, rows = _stacked_case(case, dtype, gen)
    ref = _oracle(x, stacked, lora, bias, slots)
    stacked.buffer = stacked.buffer.to(device)
    lora_dev = LoraSlices(stacked.lora_a(), lora.b.to(device), lora.row_start.to(device), lora.rank.to(device),
                          lora.out_offsets, lora.max_rank)
    x_dev, bias_dev = x.to(device), None if bias is None else bias.to(device)
    out = stacked_gemm(x_dev, stacked, rows)
    y = torch.full((x.shape[0], lora.out_offsets[-1]), NAN, dtype=dtype, device=device)
    impl(out, lora_dev, build_adapter_meta(slots.to(device), lora.rank.shape[1]), y, bias_dev)
    y, base = y.cpu(), out[:, : y.shape[1]].cpu()
    check_close(y, ref, dtype, seed, f"stacked {case}")
    touched = expand_touched(lora, slots)
    if bias is None:
        assert torch.equal(y[~touched], base[~touched]), f"stacked changed entries without adapter; seed={seed}"
    if touched.any():
        base32 = F.linear(x.float(), stacked.weight().float().cpu(), None if bias is None else bias.float())
        check_close((y.float() - base32)[touched], (ref - base32)[touched], dtype, seed, f"update {case}")


def _per_token(out, lora, meta, y, bias):
    from adapterserve.kernels.stacked_triton import stacked_expand

    stacked_expand(out, lora, meta, y, bias)


def _tiled_as(tiles: ExpandTiles | None):
    def run(out, lora, meta, y, bias):
        from adapterserve.kernels.stacked_tiled import stacked_expand_tiled

        stacked_expand_tiled(out, lora, meta, y, bias, tiles)

    return run


def _tiled_no_skip(out, lora, meta, y, bias):
    from adapterserve.kernels.stacked_tiled import stacked_expand_tiled

    chosen = expand_tiles(y.shape[0], y.shape[1])
    stacked_expand_tiled(out, lora, meta, y, bias, ExpandTiles(chosen.block_m, chosen.block_n, chosen.warps,
                                                               skip_unused=False, stages=3))


def _grouped_as(tiles: GroupedTiles | None):
    def run(out, lora, meta, y, bias):
        from adapterserve.kernels.stacked_grouped import stacked_expand_grouped

        stacked_expand_grouped(out, lora, meta, y, bias, tiles)

    return run


IMPLS = {"tiled": _tiled_as(None), "tiled_no_skip": _tiled_no_skip, "per_token": _per_token,
         "grouped": _grouped_as(None)}


@interpreted
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_stacked_interpreted(case, dtype, impl):
    _run(case, dtype, "cpu", IMPLS[impl])


@interpreted
@pytest.mark.parametrize("tiles", [ExpandTiles(16, 128, 4), ExpandTiles(32, 64, 4), ExpandTiles(64, 64, 4),
                                   ExpandTiles(16, 64, 4, skip_unused=False, stages=3)], ids=str)
def test_tiled_other_tiles_interpreted(tiles):
    """Tiles the chooser does not pick for these shapes (benchmarks compare them): many
    token tiles of 16, column tiles wider than a slice, every chunk loaded (masked)."""
    _run(("uniform", 40, 5, 24, (40, 24), "mixed", 0.2, True, "bucket"), torch.float32, "cpu", _tiled_as(tiles))


@interpreted
@pytest.mark.parametrize("tiles", [GroupedTiles(16, 16, 48), GroupedTiles(32, 32, 32, warps=2)], ids=str)
@pytest.mark.parametrize("case", [("skewed", 40, 6, 24, (40, 24), "mixed", 0.2, True, "bucket"),
                                  ("zipf", 33, 5, 20, (50, 9), 16, 0.5, False, "all")], ids=str)
def test_grouped_other_tiles_interpreted(case, tiles):
    """Tiles the chooser does not pick: ranks above one dot's rows (the rank loop), a
    program's columns not a multiple of a dot's, several tiles of one slot and of the
    tokens without adapter."""
    _run(case, torch.float32, "cpu", _grouped_as(tiles))


@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_stacked_twin(case):
    """The CPU path the engine takes: the float32 twin on the same layout."""
    _run(case, torch.float32, "cpu", reference.stacked_expand)


@gpu
@needs_cuda
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_stacked_gpu(case, dtype, impl):
    _run(case, dtype, "cuda", IMPLS[impl])


def test_expand_tiles_by_token_count():
    """One token tile holds a decode step of up to 64 rows; wide linears take wider column tiles."""
    assert [expand_tiles(t, 6144).block_m for t in (1, 16, 17, 32, 33, 64, 256)] == [16, 16, 32, 32, 64, 64, 64]
    assert expand_tiles(64, 6144).block_n == 64 and expand_tiles(64, 28672).block_n == 128
    assert all(t.block_m >= 16 and t.block_n >= 16 for t in (expand_tiles(n, 10) for n in range(1, 300)))


def test_expand_choice_by_distinct_adapters():
    """Few distinct adapters: the tiled expand; from GROUPED_MIN_ADAPTERS on, the grouped
    one. A step can choose only what its rows and the slots allow."""
    from adapterserve.kernels.stacked import (
        GROUPED_MIN_ADAPTERS,
        choose_expand,
        expand_for_slots,
        reachable_expands,
    )

    n = GROUPED_MIN_ADAPTERS
    assert choose_expand(n - 1) == "tiled" and choose_expand(n) == "grouped" and choose_expand(10 * n) == "grouped"
    assert expand_for_slots([-1] * 5 + [0] * 9) == "tiled"  # tokens without adapter count for nothing
    assert expand_for_slots(list(range(n)) * 2 + [-1]) == "grouped"
    assert expand_for_slots(list(range(n - 1)) * 3) == "tiled"
    assert reachable_expands(64, 64) == ("tiled", "grouped")
    assert reachable_expands(n - 1, 64) == ("tiled",) == reachable_expands(64, n - 1)
    assert reachable_expands(n, n) == ("tiled", "grouped")


def test_fused_choice_by_adapters_tokens_and_row_bucket():
    """lora_decode="fused": steps of at most FUSED_MAX_TOKENS rows over at most
    FUSED_MAX_ADAPTERS distinct adapters, in a row bucket of at most the pool's fused_rows, run
    the fused linear; the rest the separate kernels, named "tiled" (never "grouped": the A rows
    are apart, there is no stacked GEMM to expand)."""
    from adapterserve.kernels.stacked import (
        FUSED_MAX_ADAPTERS,
        FUSED_MAX_TOKENS,
        GROUPED_MIN_ADAPTERS,
        choose_expand,
        expand_for_slots,
        fused_max_rows,
        reachable_expands,
    )

    f, tokens, most = FUSED_MAX_ADAPTERS, FUSED_MAX_TOKENS, 64
    assert choose_expand(1, tokens, most) == "fused" == choose_expand(f, 1, most)
    assert choose_expand(f + 1, tokens, most) == "tiled"
    assert choose_expand(1, tokens + 1, most) == "tiled"
    assert choose_expand(GROUPED_MIN_ADAPTERS, tokens, most) == "tiled"
    assert choose_expand(1, tokens) == "tiled"  # not asked for: never fused
    assert choose_expand(1, tokens, most, rows=most) == "fused"
    assert choose_expand(1, tokens, most, rows=2 * most) == "tiled"  # the shrink would read every row below
    assert expand_for_slots([0] * 5 + [-1] * 3, most) == "fused"
    assert expand_for_slots([0] * 5, most, rows=2 * most) == "tiled"
    assert expand_for_slots([0] * (tokens + 1), most) == "tiled"  # every row counts, adapter or not
    assert reachable_expands(64, 64, most) == ("tiled", "fused")
    assert reachable_expands(128, 64, most) == ("tiled",)
    assert reachable_expands(f, 64, most) == ("fused",)
    assert reachable_expands(f, 64, most, rows=2 * most) == ("tiled",)
    # a graph's rows are its bucket; its requests (distinct adapters) may be fewer
    assert reachable_expands(128, 64, most, max_requests=f) == ("tiled",)
    assert reachable_expands(64, 64, most, max_requests=f) == ("fused",)
    assert expand_for_slots([0] * 3, most, num_tokens=tokens + 1) == "tiled"
    # FP8 weights halve the base bytes, so the A rows' share of the read doubles: half the rows
    assert fused_max_rows(torch.float8_e4m3fn) == fused_max_rows(torch.bfloat16) // 2 > 0


def test_grouped_tiles_by_rank():
    """One dot covers ranks up to 64 (rounded up to a power of two, at least 16)."""
    from adapterserve.kernels.stacked import grouped_tiles

    assert [grouped_tiles(r).block_r for r in (1, 8, 16, 17, 64, 128)] == [16, 16, 16, 32, 64, 64]
    assert all(t.block_n >= 16 and t.group_n % t.block_n == 0 for t in map(grouped_tiles, range(1, 200)))


def test_layout_views_share_the_buffer():
    """The base weight and the A pool are views of one buffer; pool row r of slice s sits
    at buffer row N + r * n_slices + s."""
    weight = torch.randn(10, 6)
    stacked = stack_weight(weight, 3, 4, RowsInUse())
    assert torch.equal(stacked.weight(), weight)
    a = stacked.lora_a()
    assert a.shape == (3, 4, 6)
    a[2, 1] = 7.0
    assert torch.equal(stacked.buffer[10 + 1 * 3 + 2], torch.full((6,), 7.0))
    assert stacked.weight().data_ptr() == stacked.buffer.data_ptr()


def test_row_bucket():
    assert row_bucket(0, 512) == 0
    assert row_bucket(1, 512) == 16
    assert row_bucket(16, 512) == 16
    assert row_bucket(17, 512) == 32
    assert row_bucket(300, 512) == 512
    assert row_bucket(300, 320) == 320
    with pytest.raises(ValueError, match="exceed"):
        row_bucket(513, 512)


def test_bad_shapes():
    gen, _ = fresh_generator()
    x, stacked, lora, _, slots, rows = _stacked_case(CPU_CASES[0], torch.float32, gen)
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    out = stacked_gemm(x, stacked, rows)
    y = torch.empty(x.shape[0], lora.out_offsets[-1])
    with pytest.raises(ValueError, match="out must be"):
        reference.stacked_expand(out[:, :-1], lora, meta, y)
    with pytest.raises(ValueError, match="y must be"):
        reference.stacked_expand(out, lora, meta, y[:, :-1])
    with pytest.raises(ValueError, match="bias must be"):
        reference.stacked_expand(out, lora, meta, y, torch.zeros(3))
    with pytest.raises(ValueError, match="rows must be"):
        stacked_gemm(x, stacked, stacked.pool_rows + 1)
    with pytest.raises(ValueError, match="expand must be one of"):
        stacked_expand(out, lora, meta, y, expand="fused")


@interpreted
@pytest.mark.parametrize("impl", ["tiled", "grouped"])
def test_triton_expands_refuse_b_of_another_dtype(impl):
    gen, _ = fresh_generator()
    x, stacked, lora, _, slots, rows = _stacked_case(CPU_CASES[0], torch.float32, gen)
    lora16 = LoraSlices(lora.a, lora.b.half(), lora.row_start, lora.rank, lora.out_offsets, lora.max_rank)
    y = torch.empty(x.shape[0], lora.out_offsets[-1])
    with pytest.raises(ValueError, match="share a dtype"):
        IMPLS[impl](stacked_gemm(x, stacked, rows), lora16, build_adapter_meta(slots, 4), y, None)


@interpreted
def test_grouped_needs_the_tile_list():
    from adapterserve.kernels.stacked_grouped import stacked_expand_grouped

    gen, _ = fresh_generator()
    x, stacked, lora, _, slots, rows = _stacked_case(CPU_CASES[0], torch.float32, gen)
    meta = build_adapter_meta(slots, 4, block_m=8)
    y = torch.empty(x.shape[0], lora.out_offsets[-1])
    with pytest.raises(ValueError, match="tile list"):
        stacked_expand_grouped(stacked_gemm(x, stacked, rows), lora, meta, y)
