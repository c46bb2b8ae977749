"""Programmatic dependent launch (kernels/pdl.py): the switch, the PTX of every kernel
with a USE_PDL path (compiled for sm_90 on any machine), and on a Hopper GPU the same
decode chain in a CUDA graph with PDL off and on giving identical outputs."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from adapterserve.kernels import pdl
from adapterserve.kernels.fused import add_rms_norm, rms_norm, rope_and_cache, silu_mul
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.ops import lora_expand, lora_shrink, stacked_expand
from adapterserve.kernels.stacked import (
    RowsInUse,
    row_bucket,
    stack_weight,
    stacked_gemm,
)
from benchmarks.measure import capture

from .cases import (
    fresh_generator,
    gpu,
    interpreted,
    lora_to,
    make_lora,
    needs_cuda,
    needs_hopper,
    slot_ranks,
    token_slots,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _pdl_as_the_environment_says():
    pdl.set_pdl(None)  # an engine built earlier in this process set its own mode
    pdl.set_prefetch(None)
    yield
    pdl.set_pdl(None)
    pdl.set_prefetch(None)


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv(pdl.ENV, raising=False)
    assert pdl.pdl_mode() == "off"
    monkeypatch.setenv(pdl.ENV, "1")
    assert pdl.pdl_mode() == "early"
    monkeypatch.setenv(pdl.ENV, "exit")
    assert pdl.pdl_mode() == "exit"
    pdl.set_pdl(False)  # set_pdl wins over the environment
    assert pdl.pdl_mode() == "off"
    pdl.set_pdl(True)
    assert pdl.pdl_mode() == "early"


def test_a_bad_mode_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="set_pdl: PDL mode must be one of"):
        pdl.set_pdl("late")
    monkeypatch.setenv(pdl.ENV, "yes")
    with pytest.raises(ValueError, match="ADAPTERSERVE_PDL: PDL mode must be one of"):
        pdl.pdl_mode()


def test_always_off_on_cpu_tensors():
    for mode in ("early", "exit"):
        pdl.set_pdl(mode)
        assert pdl.use_pdl(torch.zeros(1)) == 0
        assert pdl.pdl_args(torch.zeros(1)) == {}


def test_prefetch_off_unless_asked_and_never_without_pdl(monkeypatch):
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.prefetch_setting() == 0
    monkeypatch.setenv(pdl.PREFETCH_ENV, " 4 ")
    assert pdl.prefetch_setting() == 4
    pdl.set_prefetch(2)  # set_prefetch wins over the environment
    assert pdl.prefetch_setting() == 2
    pdl.set_pdl("early")  # CPU tensors: no PDL, so no prefetch either
    assert pdl.pdl_args(torch.zeros(1), prefetch=True) == {}


@pytest.mark.parametrize("value", [-1, pdl.MAX_PREFETCH + 1, True, 2.5, "x", "", "4.0", "-1", [4]], ids=repr)
def test_a_bad_prefetch_is_refused(value, monkeypatch):
    with pytest.raises(ValueError, match="set_prefetch: prefetch chunks must be an integer from 0 to 16"):
        pdl.set_prefetch(value)
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        monkeypatch.setenv(pdl.PREFETCH_ENV, str(value))
        with pytest.raises(ValueError, match="ADAPTERSERVE_PREFETCH: prefetch chunks must be"):
            pdl.prefetch_setting()


@interpreted
def test_interpreted_kernels_ignore_the_switch():
    """Switched on, the Triton kernels still run under the interpreter (which has no grid
    dependency ops) and give the bits they give switched off."""
    from adapterserve.kernels.fused import rms_norm_triton, silu_mul_triton

    gen, seed = fresh_generator()
    x = torch.randn(5, 40, generator=gen)
    w = torch.randn(40, generator=gen)
    gate_up = torch.randn(5, 80, generator=gen)
    lora = make_lora(40, (24, 16), slot_ranks(8, 2, 3, gen), torch.float32, gen)
    meta = build_adapter_meta(token_slots("uniform", 5, 3, gen, 0.2), 3)

    def outputs():
        from adapterserve.kernels import lora as triton_lora

        v = torch.zeros(2, 5, lora.max_rank)
        y = torch.zeros(5, 40)
        triton_lora.lora_shrink(x, lora, meta, v)
        triton_lora.lora_expand(v, lora, meta, y)
        return rms_norm_triton(x, w, 1e-5), silu_mul_triton(gate_up), y

    pdl.set_pdl("off")
    want = outputs()
    pdl.set_pdl("early")
    for got, ref in zip(outputs(), want):
        assert torch.equal(got, ref), f"seed={seed}"


@functools.cache
def _ptx_summary() -> dict:
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.pdl_ptx"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ptx_waits_before_any_store_and_only_with_pdl():
    """USE_PDL 0: no grid dependency op (today's kernel); 1: a wait, then the next kernel
    let launch; 2: a wait alone. With PDL, no global store before the first wait."""
    for name, modes in _ptx_summary().items():
        off, early, at_exit = modes["0"], modes["1"], modes["2"]
        assert off["waits"] == off["launches"] == 0, name
        assert early["waits"] >= 1 and early["launches"] == early["waits"], name
        assert at_exit["waits"] >= 1 and at_exit["launches"] == 0, name
        assert early["stores_before_wait"] == at_exit["stores_before_wait"] == 0, name


def test_ptx_prefetches_before_the_wait_only_where_asked():
    """A kernel compiled with PREFETCH asks L2 for its weight rows before its first wait (and
    reads nothing more there than without it); no other kernel prefetches."""
    from tests.kernels.pdl_ptx import PREFETCHING

    summary = _ptx_summary()
    assert PREFETCHING and PREFETCHING < set(summary)
    for name, modes in summary.items():
        for mode in ("1", "2"):
            got = modes[mode]
            if name in PREFETCHING:
                assert got["prefetches"] > 0 and got["prefetches_before_wait"] == got["prefetches"], (name, mode)
                plain = summary[name.replace("_prefetch", "")][mode]
                assert got["loads_before_wait"] == plain["loads_before_wait"], (name, mode)
            else:
                assert got["prefetches"] == 0, (name, mode)


class Chain:
    """A decode step's kernels in launch order, each reading what the one before wrote:
    add + norm, GEMM, segmented shrink and expand, RoPE + cache, norm, the stacked GEMM
    and both stacked expands, SiLU-mul."""

    def __init__(self, gen: torch.Generator, tokens: int = 64, hidden: int = 512, slots: int = 8) -> None:
        dev, dt = "cuda", torch.bfloat16
        self.widths, self.heads, self.dim = (hidden, 128, 128), (hidden // 64, 2), 64
        pool = make_lora(hidden, self.widths, slot_ranks("mixed", 3, slots, gen), torch.float32, gen)
        weight = (torch.randn(sum(self.widths), hidden, generator=gen) / hidden**0.5).to(dt)
        self.stacked = stack_weight(weight, 3, pool.a.shape[1], RowsInUse())
        self.stacked.lora_a().copy_(pool.a)
        self.stacked.buffer = self.stacked.buffer.to(dev)
        self.lora = lora_to(pool, dt, dev)
        self.lora_stacked = LoraSlices(self.stacked.lora_a(), self.lora.b, self.lora.row_start, self.lora.rank,
                                       pool.out_offsets, pool.max_rank)
        self.rows = row_bucket(int((pool.row_start + pool.rank).max()), self.stacked.pool_rows)
        self.meta = build_adapter_meta(token_slots("zipf", tokens, slots, gen, 0.2).to(dev), slots)
        self.pending = torch.randn(tokens, hidden, generator=gen).to(dev, dt)
        self.residual0 = torch.randn(tokens, hidden, generator=gen).to(dev, dt)
        self.residual = self.residual0.clone()
        self.norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dev, dt)
        self.workspace = torch.zeros(3, tokens, pool.max_rank, device=dev, dtype=dt)
        self.positions = torch.randint(0, 256, (tokens,), generator=gen).to(dev)
        self.write_slots = torch.randperm(2 * tokens, generator=gen)[:tokens].to(dev)
        angles = torch.randn(256, self.dim // 2, generator=gen)
        self.cos, self.sin = angles.cos().to(dev), angles.sin().to(dev)
        self.k_cache = torch.zeros(2 * tokens, self.heads[1], self.dim, device=dev, dtype=dt)
        self.v_cache = torch.zeros_like(self.k_cache)

    def run(self) -> tuple[torch.Tensor, ...]:
        self.residual.copy_(self.residual0)
        self.k_cache.zero_()
        self.v_cache.zero_()
        h = add_rms_norm(self.pending, self.residual, self.norm_w, 1e-5)
        y = F.linear(h, self.stacked.weight())
        lora_shrink(h, self.lora, self.meta, self.workspace)
        lora_expand(self.workspace, self.lora, self.meta, y)
        q, k, v = (t.reshape(t.shape[0], -1, self.dim) for t in y.split(self.widths, -1))
        rope_and_cache(q, k, v, self.positions, self.cos, self.sin, self.k_cache, self.v_cache, self.write_slots)
        normed = rms_norm(y[:, : self.widths[0]], self.norm_w, 1e-5)
        out = stacked_gemm(normed, self.stacked, self.rows)
        tiled, grouped = (torch.empty_like(y) for _ in range(2))
        stacked_expand(out, self.lora_stacked, self.meta, tiled, expand="tiled")
        stacked_expand(out, self.lora_stacked, self.meta, grouped, expand="grouped")
        gated = silu_mul(grouped[:, : 2 * 128])
        return self.residual, h, self.workspace, y, self.k_cache, self.v_cache, normed, tiled, grouped, gated


def _replayed(chain: Chain) -> list[tuple[torch.Tensor, ...]]:
    graph, outs = capture(chain.run)  # compiled and warmed up outside the capture
    results = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        results.append(tuple(t.clone() for t in outs))
    return results


@gpu
@needs_cuda
@needs_hopper
def test_pdl_in_a_cuda_graph_gives_the_bits_of_pdl_off():
    gen, seed = fresh_generator()
    chain = Chain(gen)
    pdl.set_pdl("off")
    want = _replayed(chain)[0]
    for mode in ("early", "exit"):
        pdl.set_pdl(mode)
        assert pdl.use_pdl(chain.pending) == pdl.MODES[mode]
        for replay in _replayed(chain):
            for i, (got, ref) in enumerate(zip(replay, want)):
                assert torch.equal(got, ref), f"output {i} differs with PDL {mode}; seed={seed}"
