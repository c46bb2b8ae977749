"""Paged decode attention (Triton) against its float32 twin: random block tables,
GQA groups, padding rows, skipped prefix entries, sliding windows."""
import pytest
import torch

from adapterserve.kernels import attention, reference
from adapterserve.kernels.attention import input_dots, paged_decode_attention
from adapterserve.kernels.kv_fp8 import quantize_kv
from tests.kernels.cases import compiled_counts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(batch, heads, kv_heads, dim, page, max_len, dtype):
    lens = torch.randint(1, max_len + 1, (batch,), dtype=torch.int32)
    lens[0] = 0  # a padding row
    pages_per_seq = -(-max_len // page)
    num_pages = batch * pages_per_seq + 3
    perm = torch.randperm(num_pages)[: batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32)
    k = torch.randn(num_pages * page, kv_heads, dim, dtype=dtype)
    v = torch.randn(num_pages * page, kv_heads, dim, dtype=dtype)
    q = torch.randn(batch, heads, dim, dtype=dtype)
    start = torch.minimum(torch.randint(0, 4, (batch,), dtype=torch.int32), (lens - 1).clamp(min=0))
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return to(q), to(k), to(v), to(perm), to(lens), to(start)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] if DEVICE == "cpu" else [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (6, 6, 24), (8, 1, 32)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("ordered", [False, True])
def test_matches_reference(dtype, heads, kv_heads, dim, window, ordered):
    page, max_len = 4, 37
    q, k, v, table, lens, start = _case(5, heads, kv_heads, dim, page, max_len, dtype)
    out = torch.full_like(q, float("nan"))
    order = torch.argsort(lens.cpu(), descending=True).to(torch.int32).to(DEVICE) if ordered else None
    paged_decode_attention(q, k, v, table, lens, start, page, window, out, order=order)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, page, window, want)
    assert torch.isfinite(out).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rel = (out.float() - want).norm() / want.norm()
    assert rel < tol, rel.item()
    assert torch.equal(out[0].float(), torch.zeros_like(want[0]))  # padding row writes zeros


@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("window", [None, 5])
def test_split_contexts_match_reference(splits, window):
    """Split-KV: parts of every length (empty ones too, 8 parts of <= 37 keys), merged exactly."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(6, 8, 2, 32, 4, 37, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, 4, window, out, block_n=16 if DEVICE == "cpu" else None,
                           splits=splits)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, 4, window, want)
    assert torch.isfinite(out).all()
    rel = (out.float() - want).norm() / want.norm()
    assert rel < (1e-4 if dtype == torch.float32 else 2e-2), rel.item()
    assert torch.equal(out[0].float(), torch.zeros_like(want[0]))  # padding row writes zeros


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (8, 1, 32)])
def test_products_in_the_input_dtype_match_reference(splits, heads, kv_heads, dim):
    """dots="input": both products on 16-bit inputs (the weights rounded to them), float32 sums."""
    dtype = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter's bf16 arithmetic is wrong
    q, k, v, table, lens, start = _case(5, heads, kv_heads, dim, 4, 37, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, 4, None, out, block_n=16 if DEVICE == "cpu" else None,
                           splits=splits, dots="input")
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, 4, None, want)
    assert torch.isfinite(out).all()
    assert (out.float() - want).norm() / want.norm() < 2e-2
    assert torch.equal(out[0].float(), torch.zeros_like(want[0]))  # padding row writes zeros


def _both_loops(monkeypatch, *args, **options) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs (poisoned first) of each tile's pages read in the tile, then a tile ahead."""
    outs = []
    for ahead in (False, True):
        monkeypatch.setattr(attention, "PAGES_AHEAD", ahead)
        out = torch.full_like(args[0], float("nan"))
        paged_decode_attention(*args, out, **options)
        outs.append(out)
    return outs[0], outs[1]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("fp8_cache", [False, True])
def test_pages_read_a_tile_ahead_give_the_bits_of_pages_read_in_the_tile(monkeypatch, splits, window, fp8_cache):
    """The pipelined loop (PAGES_AHEAD) reads the same keys and values and sums them in the same
    order: bit for bit the loop as it was, skipped prefix entries, windows, parts and an FP8 cache too."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(6, 8, 2, 32, 4, 70, dtype)
    scales = {}
    if fp8_cache:
        (k, scales["k_scale"]), (v, scales["v_scale"]) = quantize_kv(k), quantize_kv(v)
    block_n = 16 if DEVICE == "cpu" else 32
    old, ahead = _both_loops(monkeypatch, q, k, v, table, lens, start, 4, window, block_n=block_n, num_stages=3,
                             splits=splits, **scales)
    assert torch.isfinite(ahead).all()
    assert torch.equal(ahead, old)


def test_the_loop_with_pages_read_ahead_is_pipelined():
    """Compiled for sm_90 with 3 stages, the loop keeps a second K and V tile in flight (two buffers
    each; the shared memory nearly doubles); with 2 stages it is the loop as it was."""
    forms = compiled_counts("tests.kernels.pipeline_ptx")
    assert forms["attention_ahead1_stages3"]["kv_buffers"] == [2], forms
    assert forms["attention_ahead1_stages3"]["shared"] > 1.7 * forms["attention_ahead1_stages2"]["shared"], forms
    assert forms["attention_ahead1_stages2"] == forms["attention_ahead0_stages2"], forms


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("block_n, stages", [(128, 2), (128, 3), (64, 3), (64, 4), (32, 5)])
def test_gpu_pipelined_loop_gives_the_bits_of_the_loop_as_it_was(monkeypatch, block_n, stages):
    """The engine's heads (32 / 8, D=128, page 16) on contexts of up to 1,100 keys, bf16 products."""
    q, k, v, table, lens, start = _case(16, 32, 8, 128, 16, 1100, torch.bfloat16)
    old, ahead = _both_loops(monkeypatch, q, k, v, table, lens, start, 16, None, block_n=block_n, num_stages=stages,
                             splits=1, dots="input")
    assert torch.equal(ahead, old)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, 16, None, want)
    assert (ahead.float() - want).norm() / want.norm() < 2e-2


def test_auto_dots_take_the_input_dtype_and_bad_names_are_refused():
    assert input_dots("auto") and input_dots("input") and not input_dots("float32")
    with pytest.raises(ValueError, match="dots must be one of"):
        input_dots("bf16")


def test_an_unknown_dots_choice_is_refused():
    q, k, v, table, lens, start = _case(2, 4, 2, 16, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="dots must be one of"):
        paged_decode_attention(q, k, v, table, lens, start, 4, None, torch.empty_like(q), dots="tf32")


def test_splits_only_when_sequences_leave_the_gpu_idle():
    from adapterserve.kernels.attention import MAX_SPLITS, decode_splits

    assert decode_splits(64, 8, 4096) == 1  # 512 programs already
    assert decode_splits(1, 8, 4096) == 4096 // 256  # no part shorter than 256 keys of the longest context
    assert decode_splits(8, 8, 4096) == 16
    assert decode_splits(1, 1, 1 << 20) == MAX_SPLITS
    assert decode_splits(4, 8, 128) == 1  # short contexts stay whole
    assert decode_splits(3, 8, 3000) == 8  # 12 parts of 250 keys would do: rounded down to a power of two


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 300])
def test_gpu_default_splits_for_few_long_contexts(window):
    """The shapes the engine decodes few long sequences at: the default picks several parts."""
    from adapterserve.kernels.attention import decode_splits

    q, k, v, table, lens, start = _case(3, 32, 8, 128, 16, 3000, torch.bfloat16)
    assert decode_splits(3, 8, table.shape[1] * 16) > 1
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, 16, window, out)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, 16, window, want)
    rel = (out.float() - want).norm() / want.norm()
    assert rel < 2e-2, rel.item()
