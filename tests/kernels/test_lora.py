"""LoRA shrink/expand Triton kernels against their float32 reference twins."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels import reference
from adapterserve.kernels.metadata import build_adapter_meta

from .cases import (
    NAN, PATTERNS, check_close, expand_touched, fresh_generator, gpu, interpreted, lora_to, make_lora,
    needs_cuda, shrink_defined, slot_ranks, token_slots,
)

# (pattern, T, S, K, widths, rank spec, share without adapter, block_m)
CPU_CASES = [
    ("identical", 40, 4, 70, (40, 24, 24), 16, 0.0, 16),
    ("distinct", 12, 16, 64, (40, 24, 24), 8, 0.0, 16),
    ("uniform", 24, 6, 33, (48, 20), 1, 0.2, 16),
    ("zipf", 40, 8, 100, (50,), 64, 0.1, 32),
    ("skewed", 40, 6, 70, (40, 24, 24), "mixed", 0.0, 16),
    ("uniform", 30, 5, 45, (24, 17, 17), "mixed", 0.3, 16),
    ("none", 20, 4, 40, (40, 24, 24), 16, 0.0, 16),
    ("uniform", 6, 32, 40, (20, 20), 16, 0.0, 16),
]
QKV = (4096, 1024, 1024)
GPU_CASES = (
    [(p, 64, 64, 4096, QKV, 16, 0.1, None) for p in PATTERNS]  # decode
    + [(p, 2048, 64, 4096, QKV, "mixed", 0.1, None) for p in PATTERNS]  # prefill
    + [
        ("uniform", 256, 64, 4096, QKV, 64, 0.0, None),
        ("zipf", 1024, 64, 4096, QKV, 8, 0.1, None),
        ("distinct", 64, 64, 4096, QKV, 1, 0.0, None),
        ("skewed", 512, 128, 8192, (8192, 1024, 1024), 16, 0.1, None),
        ("zipf", 256, 32, 4096, (11008, 11008), 16, 0.1, None),  # gate/up
        ("distinct", 64, 64, 14336, (4096,), 16, 0.1, None),  # down: the wide-row CUDA-core shrink
        ("skewed", 48, 16, 11008, (4096,), "mixed", 0.1, None),
        ("uniform", 100, 8, 1000, (1000, 250, 248), "mixed", 0.1, None),  # ragged sizes
        ("zipf", 16, 64, 4096, QKV, "mixed", 0.1, None),  # CUDA-core kernels up to rank 64
    ]
)


def _run_shrink(case, dtype, device, impl):
    pattern, t, s, k, widths, rank, no_adapter, block_m = case
    gen, seed = fresh_generator()
    lora = make_lora(k, widths, slot_ranks(rank, len(widths), s, gen), dtype, gen)
    slots = token_slots(pattern, t, s, gen, no_adapter)
    x = torch.randn(t, k, generator=gen).to(dtype)
    meta = build_adapter_meta(slots.to(device), s, block_m)
    out = torch.full((len(widths), t, lora.max_rank), NAN, dtype=dtype, device=device)
    impl(x.to(device), lora_to(lora, device=device), meta, out)
    ref = torch.full(out.shape, NAN, dtype=torch.float32)
    reference.lora_shrink(x.float(), lora_to(lora, torch.float32), build_adapter_meta(slots, s), ref)
    defined = shrink_defined(lora, slots)
    out = out.cpu()
    check_close(out[defined], ref[defined], dtype, seed, f"shrink {case}")
    assert torch.isnan(out[~defined]).all(), f"shrink wrote past a rank or for slot -1; seed={seed}"


def _run_expand(case, dtype, device, impl):
    pattern, t, s, k, widths, rank, no_adapter, block_m = case
    gen, seed = fresh_generator()
    lora = make_lora(k, widths, slot_ranks(rank, len(widths), s, gen), dtype, gen)
    slots = token_slots(pattern, t, s, gen, no_adapter)
    defined = shrink_defined(lora, slots)
    v = torch.where(defined, torch.randn(defined.shape, generator=gen), NAN).to(dtype)
    y0 = torch.randn(t, sum(widths), generator=gen).to(dtype)
    y = y0.clone().to(device)
    impl(v.to(device), lora_to(lora, device=device), build_adapter_meta(slots.to(device), s, block_m), y)
    ref = y0.float().clone()
    reference.lora_expand(v.float(), lora_to(lora, torch.float32), build_adapter_meta(slots, s), ref)
    touched = expand_touched(lora, slots)
    y = y.cpu()
    assert torch.equal(y[~touched], y0[~touched]), f"expand changed rows without adapter; seed={seed}"
    update, ref_update = (y.double() - y0.double())[touched], (ref.double() - y0.double())[touched]
    check_close(update, ref_update, dtype, seed, f"expand {case}")


def _shrink_with(cfg):
    from adapterserve.kernels.segment_ops import seg_down

    def shrink(x, lora, meta, out):
        seg_down(x, lora.a, 0, lora.rank, lora.row_start, meta, out, lora.max_rank, config=cfg)

    return shrink


def _expand_with(cfg):
    from adapterserve.kernels.segment_ops import seg_up

    def expand(v, lora, meta, y):
        seg_up(v, lora.b, 0, lora.rank, lora.row_start, lora.out_offsets, meta, y, lora.max_rank, config=cfg)

    return expand


def _impls(path: str):
    """(shrink, expand): the public ops (kernel family by use_gemv) or forced onto the tensor-core kernels."""
    from adapterserve.kernels import lora
    from adapterserve.kernels.segment_ops import DownConfig, UpConfig

    if path == "public":
        return lora.lora_shrink, lora.lora_expand
    return _shrink_with(DownConfig(64, 64)), _expand_with(UpConfig(64, 32, group_n=64))


@interpreted
@pytest.mark.parametrize("path", ["public", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_shrink_interpreted(case, dtype, path):
    _run_shrink(case, dtype, "cpu", _impls(path)[0])


@interpreted
@pytest.mark.parametrize("path", ["public", "dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CPU_CASES, ids=str)
def test_expand_interpreted(case, dtype, path):
    _run_expand(case, dtype, "cpu", _impls(path)[1])


@interpreted
@pytest.mark.parametrize(
    "cfg",
    [(16, 16, 16, False), (32, 32, 8, False), (16, 64, 4, False),  # tensor-core: block_r, block_k, rows
     (0, 32, 4, True), (0, 64, 16, True), (0, 128, 8, True)],  # CUDA-core
    ids=str,
)
def test_shrink_block_shapes(cfg):
    """Packed ranks spanning several row blocks, partly filled blocks, ragged K loops."""
    from adapterserve.kernels.segment_ops import DownConfig

    block_r, block_k, rows, gemv = cfg
    shrink = _shrink_with(DownConfig(block_r, block_k, rows=rows, gemv=gemv))
    _run_shrink(("uniform", 20, 5, 50, (24, 17, 17), "mixed", 0.2, 16), torch.float32, "cpu", shrink)


@interpreted
@pytest.mark.parametrize(
    "cfg",
    [(16, 32, 32, False), (64, 16, 48, False), (16, 16, 64, False), (64, 16, 0, True), (128, 64, 0, True)],
    ids=str,
)
def test_expand_block_shapes(cfg):
    """Rank loops past the rank block, column groups wider than one block, CUDA-core blocks."""
    from adapterserve.kernels.segment_ops import UpConfig

    block_r, block_n, group_n, gemv = cfg
    expand = _expand_with(UpConfig(block_r, block_n, group_n=group_n, gemv=gemv))
    _run_expand(("skewed", 24, 6, 40, (40, 24, 24), "mixed", 0.1, 16), torch.float32, "cpu", expand)


@interpreted
@pytest.mark.parametrize("block_r", [4, 16])
def test_gemv_expand_steps_through_ranks_past_its_block(block_r):
    """The CUDA-core expand takes rank rows block_r at a time: ranks up to 64 (mixed) still add in full."""
    from adapterserve.kernels.segment_ops import UpConfig

    expand = _expand_with(UpConfig(block_r, 32, gemv=True))
    _run_expand(("uniform", 8, 4, 16, (16, 8), "mixed", 0.0, 16), torch.float32, "cpu", expand)
    _run_expand(("distinct", 8, 8, 16, (16,), 64, 0.0, 16), torch.float32, "cpu", expand)


@interpreted
def test_meta_without_tiles_is_rejected():
    from adapterserve.kernels import lora
    from adapterserve.kernels.metadata import AdapterBatchMeta

    gen, _ = fresh_generator()
    lora_w = make_lora(16, (16,), slot_ranks(4, 1, 2, gen), torch.float32, gen)
    m = build_adapter_meta(torch.tensor([0, 1], dtype=torch.int32), 2)
    bare = AdapterBatchMeta(m.token_slots, m.sorted_tokens, m.slot_counts, m.slot_starts, 2, 2)
    with pytest.raises(ValueError, match="tile list"):
        lora.lora_shrink(torch.randn(2, 16), lora_w, bare, torch.empty(1, 2, lora_w.max_rank))


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_shrink_expand_gpu_bf16(case):
    from adapterserve.kernels import lora

    _run_shrink(case, torch.bfloat16, "cuda", lora.lora_shrink)
    _run_expand(case, torch.bfloat16, "cuda", lora.lora_expand)


@gpu
@needs_cuda
def test_cuda_graph_replay_no_sync():
    """Captured shrink+expand replayed on new slots agrees with the reference; no host sync."""
    from adapterserve.kernels import lora

    gen, seed = fresh_generator()
    t, s, k, widths = 64, 64, 4096, (4096, 1024, 1024)
    w = lora_to(make_lora(k, widths, slot_ranks("mixed", 3, s, gen), torch.bfloat16, gen), device="cuda")
    x = torch.randn(t, k, generator=gen).to("cuda", torch.bfloat16)
    slots = torch.zeros(t, dtype=torch.int32, device="cuda")
    meta = build_adapter_meta(slots, s)
    v = torch.empty(3, t, w.max_rank, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros(t, sum(widths), dtype=torch.bfloat16, device="cuda")
    lora.lora_shrink(x, w, meta, v)  # compile outside the capture
    lora.lora_expand(v, w, meta, y)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora_shrink(x, w, meta, v)
        lora.lora_expand(v, w, meta, y)
    new_slots = token_slots("zipf", t, s, gen, 0.1)
    on_device = new_slots.to("cuda")  # the host-to-device copy syncs; the rest must not
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fresh = build_adapter_meta(on_device, s)
        names = ("token_slots", "sorted_tokens", "slot_counts", "slot_starts", "tile_slots", "tile_starts", "tile_ends")
        for name in names:
            getattr(meta, name).copy_(getattr(fresh, name))
        y.zero_()
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = torch.zeros(t, sum(widths))
    vref = torch.zeros(3, t, w.max_rank)
    cpu_w, cpu_meta = lora_to(w, torch.float32, "cpu"), build_adapter_meta(new_slots, s)
    reference.lora_shrink(x.float().cpu(), cpu_w, cpu_meta, vref)
    reference.lora_expand(vref, cpu_w, cpu_meta, ref)
    check_close(y.float().cpu(), ref, torch.bfloat16, seed, "graph replay")
