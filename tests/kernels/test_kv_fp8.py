"""The FP8 KV cache (kernels/kv_fp8.py): the fused RoPE + cache write quantizing each
(token, head) vector, and both paged attention kernels reading e4m3 entries with their
scales, against their float32 twins on the dequantized cache (Triton under the
interpreter on CPU). Fresh random inputs each run; outputs and untouched cache entries
poisoned with NaN."""

import pytest
import torch

from adapterserve.kernels import reference
from adapterserve.kernels.attention import paged_decode_attention
from adapterserve.kernels.fp8 import FP8
from adapterserve.kernels.fused import rope_and_cache
from adapterserve.kernels.kv_fp8 import dequantize_kv, kv_scales, quantize_kv, write_kv
from adapterserve.kernels.prefill_attention import paged_prefill_attention
from adapterserve.models.rope import RotaryEmbedding
from tests.kernels.cases import NAN, compiled_counts, fresh_generator, gpu, rel_err
from tests.kernels.test_prefill_attention import CASES, WINDOW, Paged

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ACT = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the queries' dtype
# the kernels against their twin on the same e4m3 entries: float32 summation order on CPU;
# on a GPU bf16 queries and the prefill products' bf16 weights
SAME_ENTRIES_TOL = 1e-4 if DEVICE == "cpu" else 2e-2
# against the unquantized cache: e4m3 keeps 3 mantissa bits (relative rounding up to 1/16,
# about 2% RMS per entry); attention outputs of random inputs move by a few percent
QUANTIZATION_TOL = 0.08


def _fp8_cache(k: torch.Tensor, v: torch.Tensor):
    """The e4m3 cache of float k, v [slots, H, D] and its scales."""
    (kq, ks), (vq, vs) = quantize_kv(k.float()), quantize_kv(v.float())
    return kq, vq, ks, vs


def test_quantize_kv_is_per_token_and_head_within_e4m3_rounding():
    gen, seed = fresh_generator()
    x = torch.randn(7, 3, 64, generator=gen) * torch.logspace(-3, 3, 7)[:, None, None]
    x[2, 1] = 0.0  # an all-zero vector stays zero
    q, scale = quantize_kv(x)
    assert q.dtype == FP8 and scale.shape == (7, 3)
    back = dequantize_kv(q, scale)
    assert (back - x).abs().le(x.abs() / 16 + scale[..., None] * 2.0**-9).all(), f"seed {seed}"
    assert torch.equal(back[2, 1], torch.zeros(64))
    assert torch.allclose(scale, x.abs().amax(-1).clamp(min=1e-12 * 448) / 448)


def test_write_kv_writes_only_its_slots():
    gen, seed = fresh_generator()
    cache = torch.full((10, 2, 16), NAN).to(FP8)
    scale = torch.full((10, 2), NAN)
    x = torch.randn(3, 2, 16, generator=gen)
    index = torch.tensor([7, 1, 4])
    write_kv(cache, scale, index, x)
    q, s = quantize_kv(x)
    assert torch.equal(cache[index].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale[index], s)
    rest = torch.ones(10, dtype=torch.bool)
    rest[index] = False
    assert cache[rest].float().isnan().all() and scale[rest].isnan().all()


def test_a_cache_and_its_scales_must_agree():
    fp8_cache, plain = torch.zeros(8, 2, 16, dtype=FP8), torch.zeros(8, 2, 16)
    scales = torch.zeros(8, 2)
    with pytest.raises(ValueError, match="needs both its key and value scales"):
        kv_scales(fp8_cache, None, None)
    with pytest.raises(ValueError, match="needs both its key and value scales"):
        kv_scales(fp8_cache, scales, None)
    with pytest.raises(ValueError, match="needs both its key and value scales"):
        kv_scales(plain, scales, scales)
    with pytest.raises(ValueError, match=r"KV scales must be \[slots, kv heads\]"):
        kv_scales(fp8_cache, torch.zeros(8, 3), torch.zeros(8, 3))
    assert kv_scales(fp8_cache, scales, scales)[2] == 2


@gpu  # also on CPU, under the interpreter
@pytest.mark.parametrize("heads", [(4, 2), (6, 3)])
def test_rope_and_cache_quantizes_each_rotated_head(heads):
    """Each written (token, head) vector: its scale is the rotated vector's absmax / 448 and
    its entries the rotated values rounded to e4m3. On CPU the cache is float32: the kernel
    stores the scaled values unrounded (the interpreter's float8 rounding is not the GPU's)
    and torch rounds them here."""
    gen, seed = fresh_generator()
    q_heads, kv_heads, dim, tokens, slots = *heads, 32, 5, 12
    rope = RotaryEmbedding(dim, {"rope_type": "default", "rope_theta": 10000.0}, 64)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, ACT)
    qkv[:, q_heads * dim:] *= torch.logspace(-2, 2, tokens, device=DEVICE)[:, None].to(ACT)  # tokens' own scales
    q, k, v = (t.reshape(tokens, -1, dim) for t in qkv.split([q_heads * dim, kv_heads * dim, kv_heads * dim], -1))
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    write = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)
    want_q, want_k = rope(positions.cpu(), q.cpu().float(), k.cpu().float())
    want_v = v.cpu().float()
    k_cache = torch.full((slots, kv_heads, dim), NAN, device=DEVICE).to(FP8 if DEVICE == "cuda" else torch.float32)
    v_cache = k_cache.clone()
    k_scale = torch.full((slots, kv_heads), NAN, device=DEVICE)
    v_scale = k_scale.clone()
    half = dim // 2
    rope_and_cache(q, k, v, positions, rope.cos[:, :half].to(DEVICE), rope.sin[:, :half].to(DEVICE), k_cache,
                   v_cache, write, k_scale, v_scale)
    assert rel_err(q.cpu().float(), want_q) < (1e-5 if ACT == torch.float32 else 2e-2), f"seed {seed}"
    rtol = 1e-5 if ACT == torch.float32 else 1e-2  # bf16 on a GPU: the rotation's inputs and q rounded
    for cache, scale, want in ((k_cache, k_scale, want_k), (v_cache, v_scale, want_v)):
        got_scale = scale[write].cpu()
        assert torch.allclose(got_scale, want.abs().amax(-1) / 448, rtol=rtol), f"seed {seed}"
        entries = cache[write].cpu().to(FP8)
        want_entries = (want / got_scale[..., None]).to(FP8)
        if ACT == torch.float32:  # the same float32 values, one rounding: the same bits but for ties moved by
            # the rotation's float32 order
            assert (entries.view(torch.uint8) != want_entries.view(torch.uint8)).float().mean() < 0.02, f"seed {seed}"
        back = dequantize_kv(entries, got_scale)
        assert (back - want).abs().le(want.abs() * rtol + want.abs() / 16 + got_scale[..., None] * 2.0**-9).all(), \
            f"seed {seed}"
        untouched = torch.ones(slots, dtype=torch.bool)
        untouched[write.cpu()] = False
        assert cache[untouched.to(DEVICE)].float().isnan().all() and scale[untouched.to(DEVICE)].isnan().all()


def _decode_case(gen, batch=5, heads=8, kv_heads=2, dim=32, page=4, max_len=37):
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen, dtype=torch.int32)
    lens[0] = 0  # a padding row
    pages = -(-max_len // page)
    table = torch.randperm(batch * pages + 3, generator=gen)[: batch * pages].view(batch, pages).to(torch.int32)
    slots = (batch * pages + 3) * page
    k = torch.randn(slots, kv_heads, dim, generator=gen) * torch.rand(slots, kv_heads, 1, generator=gen) * 4
    v = torch.randn(slots, kv_heads, dim, generator=gen)
    q = torch.randn(batch, heads, dim, generator=gen)
    start = torch.minimum(torch.randint(0, 4, (batch,), generator=gen, dtype=torch.int32), (lens - 1).clamp(min=0))
    return q, k, v, table, lens, start, page


@gpu  # also on CPU, under the interpreter
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dots", ["float32", "input"])
def test_decode_attention_reads_the_fp8_cache(splits, window, dots):
    gen, seed = fresh_generator()
    q, k, v, table, lens, start, page = _decode_case(gen)
    kq, vq, ks, vs = _fp8_cache(k, v)
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    args = on(table, lens, start)
    act = torch.float16 if dots == "input" and DEVICE == "cpu" else ACT  # the interpreter's bf16 is wrong
    out = torch.full(q.shape, NAN, device=DEVICE, dtype=act)
    paged_decode_attention(q.to(DEVICE, act), *on(kq, vq), *args, page, window, out,
                           block_n=16 if DEVICE == "cpu" else None, splits=splits, k_scale=ks.to(DEVICE),
                           v_scale=vs.to(DEVICE), dots=dots)
    same = torch.empty(q.shape)
    reference.paged_decode_attention(q.to(act).float(), kq, vq, table, lens, start, page, window, same, k_scale=ks,
                                     v_scale=vs)
    unquantized = torch.empty(q.shape)
    reference.paged_decode_attention(q.to(act).float(), k, v, table, lens, start, page, window, unquantized)
    got = out.cpu().float()
    assert not got.isnan().any(), f"seed {seed}"
    assert rel_err(got, same) < (SAME_ENTRIES_TOL if act == torch.float32 else 2e-2), f"seed {seed}"
    assert rel_err(got, unquantized) < QUANTIZATION_TOL, f"seed {seed}"
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # padding row


@gpu  # also on CPU, under the interpreter
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_attention_reads_the_fp8_cache(name):
    gen, seed = fresh_generator()
    case = Paged(CASES[name], 8, 2, 32, torch.float32, gen, device="cpu")
    window = WINDOW.get(name)
    unquantized = case.twin(window)
    kq, vq, ks, vs = _fp8_cache(case.k, case.v)
    case.k, case.v = kq, vq
    same = torch.full(case.q.shape, NAN)
    reference.paged_prefill_attention(*case.args(window), same, k_scale=ks, v_scale=vs)
    tiles = case.tiles
    on = lambda t: t.to(DEVICE)  # noqa: E731
    args = (on(case.q).to(ACT), on(kq), on(vq), on(case.table), on(case.lens), on(case.starts), on(case.cu))
    if DEVICE == "cuda":
        from adapterserve.kernels import build_prefill_tiles

        counts = (case.cu[1:] - case.cu[:-1]).numpy()
        tiles = build_prefill_tiles(counts, case.lens.numpy(), torch.device(DEVICE), tiles.tile_tokens)
    out = torch.full(case.q.shape, NAN, device=DEVICE, dtype=ACT)
    paged_prefill_attention(*args, tiles, 16, window, out, k_scale=on(ks), v_scale=on(vs))
    got = out.cpu().float()
    assert not got.isnan().any(), f"seed {seed}"
    assert rel_err(got, same) < SAME_ENTRIES_TOL, f"seed {seed}"
    assert rel_err(got, unquantized) < QUANTIZATION_TOL, f"seed {seed}"


def test_the_fp8_paths_compile_for_sm_89_and_sm_90():
    """The three attention kernels and the cache write compile with e4m3 entries for both
    float8 targets and convert e4m3 there (the interpreter compiles nothing); a bf16 cache's
    kernel has no conversion. Decode attention with dots="input" runs bf16 tensor-core
    products, with "float32" none."""
    counts = compiled_counts("tests.kernels.kv_fp8_ptx")
    for name, per_target in counts.items():
        for target, found in per_target.items():
            assert (found["e4m3"] == 0) == ("bf16_cache" in name), (name, target, found)
            if name.startswith("decode"):
                assert (found["bf16_mma"] > 0) == name.endswith("input_dots"), (name, target, found)
