"""Decode attention with the batch's tiles dealt evenly among programs (kernels/attention_balanced.py)
against its float32 twin: units whole in a program and split across up to all of them, idle programs,
padding rows, skipped prefixes, windows, an FP8 cache; the split points blind to padding rows."""
import pytest
import torch

from adapterserve.kernels import attention_balanced, reference
from adapterserve.kernels.attention import paged_decode_attention
from adapterserve.kernels.kv_fp8 import quantize_kv
from tests.kernels.test_attention import DEVICE, _case

BLOCK_N = 16 if DEVICE == "cpu" else None  # the interpreter: small tiles, so contexts span several


def _check(q, k, v, table, lens, start, page, window, programs, **scales):
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, page, window, out, block_n=BLOCK_N, balanced=True,
                           programs=programs, **scales)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, page, window, want, **scales)
    assert torch.isfinite(out).all()
    rel = (out.float() - want).norm() / want.norm()
    assert rel < (1e-4 if q.dtype == torch.float32 else 2e-2), rel.item()
    assert torch.equal(out[0].float(), torch.zeros_like(want[0]))  # the padding row: zeros


@pytest.mark.parametrize("programs", [1, 3, 7, 40])  # 40: more programs than tiles, most idle
@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 16), (8, 1, 32)])
@pytest.mark.parametrize("window", [None, 5])
def test_balanced_matches_reference(programs, heads, kv_heads, dim, window):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(6, heads, kv_heads, dim, 4, 53, dtype)
    _check(q, k, v, table, lens, start, 4, window, programs)


@pytest.mark.parametrize("programs", [2, 5])
def test_balanced_on_an_fp8_cache_matches_reference(programs):
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(5, 4, 2, 16, 4, 41, dtype)
    (kq, ks), (vq, vs) = quantize_kv(k), quantize_kv(v)
    _check(q, kq, vq, table, lens, start, 4, None, programs, k_scale=ks, v_scale=vs)


@pytest.mark.parametrize("dots", ["float32", "input"])
def test_balanced_in_both_products_matches_reference(dots):
    q, k, v, table, lens, start = _case(4, 4, 2, 16, 4, 45, torch.float16)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, 4, None, out, block_n=BLOCK_N, balanced=True, programs=3,
                           dots=dots)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, 4, None, want)
    assert ((out.float() - want).norm() / want.norm()) < 2e-2


def test_padding_rows_move_no_split_point():
    """Rows of no keys after the batch (a graph bucket's padding) hold no tiles: every real row's
    output keeps its bits, where a count of rows in the split would move the parts' ends."""
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(5, 4, 2, 16, 4, 53, dtype)
    pad = lambda t: torch.cat([t, torch.zeros((3, *t.shape[1:]), dtype=t.dtype, device=t.device)])  # noqa: E731
    out, out_padded = torch.full_like(q, float("nan")), torch.full_like(pad(q), float("nan"))
    common = dict(block_n=BLOCK_N, balanced=True, programs=4)
    paged_decode_attention(q, k, v, table, lens, start, 4, None, out, **common)
    paged_decode_attention(pad(q), k, v, pad(table), pad(lens), pad(start), 4, None, out_padded, **common)
    assert torch.equal(out_padded[:5], out)
    assert torch.equal(out_padded[5:], torch.zeros_like(out_padded[5:]))


def test_the_environment_switches_every_launch_to_balanced(monkeypatch):
    """ADAPTERSERVE_ATTENTION_BALANCED=1 takes launches that ask for nothing (the engine's) there."""
    calls = []
    real = attention_balanced.balanced_decode_attention
    monkeypatch.setattr("adapterserve.kernels.attention.balanced_decode_attention",
                        lambda *a: calls.append(1) or real(*a))
    monkeypatch.setenv("ADAPTERSERVE_ATTENTION_BALANCED", "1")
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, table, lens, start = _case(3, 4, 2, 16, 4, 20, dtype)
    paged_decode_attention(q, k, v, table, lens, start, 4, None, torch.empty_like(q), block_n=BLOCK_N)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("batch, max_len", [(64, 1152), (3, 5000), (200, 700)])
def test_gpu_balanced_over_as_many_programs_as_the_gpu_holds(batch, max_len, window):
    q, k, v, table, lens, start = _case(batch, 32, 8, 128, 16, max_len, torch.bfloat16)
    _check(q, k, v, table, lens, start, 16, window, None)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_gpu_resident_programs_are_reckoned_from_the_compiled_kernel():
    """The grid is every multiprocessor times the programs its registers and shared memory hold
    (1 to 16 at 4 warps), reckoned once per compiled variant."""
    attention_balanced._RESIDENT.clear()
    q, k, v, table, lens, start = _case(8, 32, 8, 128, 16, 300, torch.bfloat16)
    paged_decode_attention(q, k, v, table, lens, start, 16, None, torch.empty_like(q), balanced=True)
    assert len(attention_balanced._RESIDENT) == 1
    assert 1 <= next(iter(attention_balanced._RESIDENT.values())) <= 16
