"""Shared inputs for the kernel tests: seeds, popularity patterns, pools, checks.

Every test draws fresh random inputs; the seed is in every failure message
(set KERNEL_TEST_SEED to replay one).
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adapterserve.kernels.lora_slices import LoraSlices

PATTERNS = ("identical", "distinct", "uniform", "zipf", "skewed", "none")
NAN = float("nan")
# ||out - ref|| / ||ref|| bounds (ref in float32)
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K) of q|k|v, o, gate|up, down

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU kernel tests run under TRITON_INTERPRET=1"
)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                                  reason="PDL needs sm_90 or later")


def gpu_pdl_modes(test):
    """A GPU test of PDL (sm_90+) run once per mode that lets the next kernel start early."""
    return gpu(needs_cuda(needs_hopper(pytest.mark.parametrize("mode", ["early", "exit"])(test))))


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int(os.environ.get("KERNEL_TEST_SEED", secrets.randbits(31)))
    gen = torch.Generator().manual_seed(seed)
    return gen, seed


def token_slots(
    pattern: str, num_tokens: int, num_slots: int, gen: torch.Generator, no_adapter: float = 0.0
) -> torch.Tensor:
    """[T] int32 slots drawn by popularity pattern; a share of tokens gets -1."""
    t, s = num_tokens, num_slots
    if pattern == "identical":
        slots = torch.full((t,), int(torch.randint(s, (1,), generator=gen)), dtype=torch.int64)
    elif pattern == "distinct":
        slots = torch.randperm(s, generator=gen)[:t] if t <= s else torch.randperm(t, generator=gen) % s
    elif pattern == "uniform":
        slots = torch.randint(s, (t,), generator=gen)
    elif pattern == "zipf":
        weights = 1.0 / torch.arange(1, s + 1, dtype=torch.float64) ** 1.2
        slots = torch.randperm(s, generator=gen)[torch.multinomial(weights, t, replacement=True, generator=gen)]
    elif pattern == "skewed":
        hot = int(torch.randint(s, (1,), generator=gen))
        slots = torch.where(torch.rand(t, generator=gen) < 0.8, hot, torch.randint(s, (t,), generator=gen))
    elif pattern == "none":
        slots = torch.full((t,), -1, dtype=torch.int64)
    else:
        raise ValueError(pattern)
    drop = torch.rand(t, generator=gen) < no_adapter
    return torch.where(drop, -1, slots).to(torch.int32)


def slot_ranks(spec, n_slices: int, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """[n_slices, S] ranks: an int for all, or 'mixed' (1/8/16/64 and some 0)."""
    if spec != "mixed":
        return torch.full((n_slices, num_slots), int(spec), dtype=torch.int32)
    choices = torch.tensor([0, 1, 8, 16, 64, 8, 16, 64], dtype=torch.int32)
    return choices[torch.randint(len(choices), (n_slices, num_slots), generator=gen)]


def make_lora(
    k: int, widths: tuple[int, ...], ranks: torch.Tensor, dtype: torch.dtype, gen: torch.Generator
) -> LoraSlices:
    """A pool with each slot's rows scattered (random order and gaps); unused rows are NaN."""
    n_slices, num_slots = ranks.shape
    max_rank = max(int(ranks.max()), 1)
    pool_rows = int(ranks.sum(1).max()) + 4 * num_slots + 1
    lora = LoraSlices.allocate(k, widths, pool_rows, num_slots, max_rank, torch.float32, "cpu")
    lora.a.fill_(NAN)
    lora.b.fill_(NAN)
    lora.rank.copy_(ranks)
    offs = lora.out_offsets
    for s in range(n_slices):
        row = int(torch.randint(3, (1,), generator=gen))
        for slot in torch.randperm(num_slots, generator=gen).tolist():
            r = int(ranks[s, slot])
            lora.row_start[s, slot] = row
            lora.a[s, row : row + r] = torch.randn(r, k, generator=gen) / k**0.5
            b_rows = torch.randn(r, offs[s + 1] - offs[s], generator=gen) / max(r, 1) ** 0.5
            lora.b[row : row + r, offs[s] : offs[s + 1]] = b_rows
            row += r + int(torch.randint(4, (1,), generator=gen))
    return LoraSlices(lora.a.to(dtype), lora.b.to(dtype), lora.row_start, lora.rank, offs, max_rank)


def lora_to(lora: LoraSlices, dtype: torch.dtype | None = None, device=None) -> LoraSlices:
    def move(t: torch.Tensor, cast: bool) -> torch.Tensor:
        return t.to(device=device, dtype=dtype if cast and dtype is not None else t.dtype)

    return LoraSlices(
        move(lora.a, True), move(lora.b, True), move(lora.row_start, False), move(lora.rank, False),
        lora.out_offsets, lora.max_rank,
    )


def shrink_defined(lora: LoraSlices, slots: torch.Tensor) -> torch.Tensor:
    """[n_slices, T, max_rank] bool: entries lora_shrink defines."""
    has = slots >= 0
    ranks = lora.rank[:, slots.long().clamp(min=0)]  # [n_slices, T]
    ranks = torch.where(has[None, :], ranks, 0)
    cols = torch.arange(lora.max_rank)
    return cols[None, None, :] < ranks[:, :, None].cpu()


def expand_touched(lora: LoraSlices, slots: torch.Tensor) -> torch.Tensor:
    """[T, N] bool: entries lora_expand may change (slot >= 0 and rank > 0 on that slice)."""
    offs = lora.out_offsets
    ranks = lora.rank.cpu()[:, slots.long().clamp(min=0).cpu()]
    touched = torch.zeros(slots.shape[0], offs[-1], dtype=torch.bool)
    for s in range(len(offs) - 1):
        touched[:, offs[s] : offs[s + 1]] = ((slots.cpu() >= 0) & (ranks[s] > 0))[:, None]
    return touched


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def check_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, seed: int, what: str) -> None:
    assert not torch.isnan(out).any(), f"{what}: NaN in output (unwritten or read poison); seed={seed}"
    if ref.numel() == 0:
        return
    assert ref.norm() > 0, f"{what}: reference is all zero, the check would prove nothing; seed={seed}"
    err = rel_err(out, ref)
    assert err <= TOL[dtype], f"{what}: rel err {err:.2e} > {TOL[dtype]:.0e} ({dtype}); seed={seed}"


def pdl_replays(chain, modes: tuple[str, ...], prefetch: int = 0) -> dict[str, torch.Tensor]:
    """chain's output per PDL mode: its CUDA graph (captured with that mode, and with our GEMMs
    prefetching `prefetch` K chunks of weight rows before their wait) replayed three times, the
    three outputs equal (asserted); PDL and prefetch as the environment says afterwards."""
    from adapterserve.kernels import pdl
    from adapterserve.kernels.split_counters import prepare_split_counters
    from benchmarks.measure import capture

    prepare_split_counters("cuda")  # the split-K kernels' counters, before any capture
    outs = {}
    try:
        pdl.set_prefetch(prefetch)
        for mode in modes:
            pdl.set_pdl(mode)
            graph, out = capture(chain)
            replays = []
            for _ in range(3):
                graph.replay()
                replays.append(out.clone())
            torch.cuda.synchronize()
            assert all(torch.equal(r, replays[0]) for r in replays), f"replays differ with PDL {mode}"
            outs[mode] = replays[0]
    finally:
        pdl.set_pdl(None)
        pdl.set_prefetch(None)
    return outs


def compiled_counts(module: str) -> dict:
    """The JSON a PTX-counting module of tests/kernels prints (``python -m module``), run in a
    process of its own without TRITON_INTERPRET: the interpreter compiles nothing."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", module], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
