"""Paged decode attention (Triton) against its float32 twin: random block tables,
GQA groups, padding rows, skipped prefix entries, sliding windows."""
import pytest
import torch

from adapterserve.kernels import reference
from adapterserve.kernels.attention import paged_decode_attention

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
def test_matches_reference(dtype, heads, kv_heads, dim, window):
    page, max_len = 4, 37
    q, k, v, table, lens, start = _case(5, heads, kv_heads, dim, page, max_len, dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, start, page, window, out)
    want = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    reference.paged_decode_attention(q, k, v, table, lens, start, page, window, want)
    assert torch.isfinite(out).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rel = (out.float() - want).norm() / want.norm()
    assert rel < tol, rel.item()
    assert torch.equal(out[0].float(), torch.zeros_like(want[0]))  # padding row writes zeros
