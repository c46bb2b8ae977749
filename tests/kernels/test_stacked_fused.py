"""The fused stacked LoRA linear (kernels/stacked_fused.py: base GEMM, shrink and expand in
one launch) against the float32 base GEMM plus the reference shrink and expand, with the
stacked path's cases (every popularity pattern, mixed ranks, tokens without adapter,
bias, ragged slices), output poisoned before use; on a GPU also the 8B's shapes and CUDA
graph replays with PDL on and off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapterserve.kernels import reference
from adapterserve.kernels.decode_gemm import DecodeGemmConfig
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.split_counters import split_counters
from adapterserve.kernels.stacked import row_bucket
from adapterserve.kernels.stacked_fused import stacked_fused
from adapterserve.layers.fused_lora import fused_lora_linear

from .cases import (
    check_close,
    compiled_counts,
    expand_touched,
    fresh_generator,
    gpu,
    gpu_pdl_modes,
    interpreted,
    needs_cuda,
    pdl_replays,
)
from .test_stacked import CPU_CASES, GPU_CASES, _high_water, _oracle, _stacked_case

CPU_FUSED = [c for c in CPU_CASES if c[1] <= 64]
# at most 64 tokens, and gate|up at decode size (wide outputs take other tiles: decode_config, fp8_fused_config)
GPU_FUSED = [c for c in GPU_CASES if c[1] <= 64] + [("uniform", 64, 64, 4096, (14336, 14336), 16, 0.1, False, "bucket")]
SMALL = DecodeGemmConfig(block_n=16, block_k=32, split_k=1)


def _on(device: str, x, stacked, lora, bias, slots):
    stacked.buffer = stacked.buffer.to(device)
    lora_dev = LoraSlices(stacked.lora_a(), lora.b.to(device), lora.row_start.to(device), lora.rank.to(device),
                          lora.out_offsets, lora.max_rank)
    meta = build_adapter_meta(slots.to(device), lora.rank.shape[1])
    return x.to(device), stacked, lora_dev, None if bias is None else bias.to(device), meta


def _run(case, dtype, device, config):
    gen, seed = fresh_generator()
    x, stacked, lora, bias, slots, rows = _stacked_case(case, dtype, gen)
    ref = _oracle(x, stacked, lora, bias, slots)
    x_dev, stacked, lora_dev, bias_dev, meta = _on(device, x, stacked, lora, bias, slots)
    y = stacked_fused(x_dev, stacked, lora_dev, meta, rows, bias_dev, config).cpu()
    check_close(y, ref, dtype, seed, f"fused {case}")
    touched = expand_touched(lora, slots)
    base32 = F.linear(x.float(), stacked.weight().float().cpu(), None if bias is None else bias.float())
    if touched.any():
        check_close((y.float() - base32)[touched], (ref - base32)[touched], dtype, seed, f"update {case}")
    if (~touched).any():
        check_close(y[~touched].float(), base32[~touched], dtype, seed, f"untouched {case}")


@interpreted
@pytest.mark.parametrize("dtype,split", [(torch.float32, 1), (torch.float16, 2)], ids=["f32-whole-k", "f16-split-k"])
@pytest.mark.parametrize("case", CPU_FUSED, ids=str)
def test_fused_interpreted(case, dtype, split):
    _run(case, dtype, "cpu", DecodeGemmConfig(block_n=16, block_k=32, split_k=split))


def _top_slots_case(case, dtype, gen, count: int):
    """The case's pool with tokens on its ``count`` slots whose rows sit highest (their lowest row
    over the slices) and on no adapter, and the row bucket of those slots' widest span on a slice:
    windows far above pool row 0."""
    x, stacked, lora, bias, _, _ = _stacked_case(case, dtype, gen)
    lowest = torch.where(lora.rank > 0, lora.row_start, stacked.pool_rows).min(0).values
    top = lowest.argsort(descending=True)[:count]
    slots = torch.cat([top, torch.tensor([-1])]).repeat(x.shape[0])[: x.shape[0]].to(torch.int32)
    spans = []
    for starts, ranks in zip(lora.row_start[:, top], lora.rank[:, top]):
        live = ranks > 0
        if live.any():
            spans.append(int((starts + ranks)[live].max() - starts[live].min()))
    return x, stacked, lora, bias, slots, row_bucket(max(spans), stacked.pool_rows)


@interpreted
@pytest.mark.parametrize("case,count", [(CPU_FUSED[1], 1), (CPU_FUSED[3], 1), (CPU_FUSED[3], 2)],
                         ids=["3-slices-one-adapter", "1-slice-one-adapter", "1-slice-two-adapters"])
def test_fused_window_begins_at_the_step_s_lowest_row(case, count):
    """Tokens of the pool's highest adapters, the launch covering only the bucket of their rows'
    span: each slice's window begins at their lowest row there (or ends at the pool's end), so every
    token gets its whole update, as the oracle's and the CPU twin's (layers/fused_lora.py)."""
    gen, seed = fresh_generator()
    x, stacked, lora, bias, slots, rows = _top_slots_case(case, torch.float32, gen, count)
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    bases = reference.window_bases(lora, meta, rows, stacked.pool_rows)
    assert min(bases) > 0 and rows < row_bucket(_high_water(lora), stacked.pool_rows), (bases, rows)
    ref = _oracle(x, stacked, lora, bias, slots)
    y = stacked_fused(x, stacked, lora, meta, rows, bias, SMALL)
    check_close(y, ref, torch.float32, seed, f"window {case}")
    twin = fused_lora_linear(x, stacked.weight(), None, stacked, lora, meta, rows, bias, "auto")
    check_close(twin, ref, torch.float32, seed, f"twin window {case}")


@interpreted
def test_fused_twice_resets_its_counters():
    """Every counter back at zero after a launch, so a second launch waits for its own shrink tiles."""
    case = CPU_FUSED[0]
    for _ in range(2):
        _run(case, torch.float32, "cpu", DecodeGemmConfig(block_n=16, block_k=32, split_k=3))
        assert not split_counters(torch.device("cpu")).any()


def test_fused_refuses_what_it_cannot_take():
    gen, _ = fresh_generator()
    x, stacked, lora, bias, slots, rows = _stacked_case(CPU_FUSED[0], torch.float32, gen)
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    with pytest.raises(ValueError, match="T <= 64"):
        stacked_fused(torch.zeros(65, x.shape[1]), stacked, lora, meta, rows)
    with pytest.raises(ValueError, match="rows must be"):
        stacked_fused(x, stacked, lora, meta, stacked.pool_rows + 1)
    with pytest.raises(ValueError, match="share a dtype"):
        stacked_fused(x, stacked, LoraSlices(lora.a, lora.b.half(), lora.row_start, lora.rank, lora.out_offsets,
                                             lora.max_rank), meta, rows)


@gpu
@needs_cuda
@pytest.mark.parametrize("config", [DecodeGemmConfig(), DecodeGemmConfig(block_n=64, split_k=4)],
                         ids=["default", "n64-split4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("case", GPU_FUSED, ids=str)
def test_fused_gpu(case, dtype, config):
    _run(case, dtype, "cuda", config)


@gpu_pdl_modes
def test_fused_chain_in_a_graph_gives_the_bits_of_pdl_off(mode):
    """Two fused linears back to back, replayed: PDL on gives PDL off's bits, every replay."""
    gen, seed = fresh_generator()
    case = ("uniform", 64, 8, 4096, (4096,), 16, 0.1, False, "bucket")
    x, stacked, lora, bias, slots, rows = _stacked_case(case, torch.bfloat16, gen)
    x, stacked, lora, _, meta = _on("cuda", x, stacked, lora, bias, slots)

    def chain():
        return stacked_fused(torch.relu(stacked_fused(x, stacked, lora, meta, rows)), stacked, lora, meta, rows)

    outs = pdl_replays(chain, ("off", mode))
    outs["prefetch"] = pdl_replays(chain, (mode,), prefetch=4)[mode]  # weight rows asked for first
    assert torch.equal(outs["off"], outs[mode]) and torch.equal(outs["off"], outs["prefetch"]), f"seed {seed}"


def test_the_fused_linear_s_weight_rows_stream_through_its_pipeline():
    """Compiled for sm_90, the bf16 fused linear's K loop keeps NUM_STAGES chunks of weight rows
    in flight (its shrink tiles read A rows in the same loop: the rows' base is chosen per program)."""
    form = compiled_counts("tests.kernels.pipeline_ptx")["fused_linear"]
    assert form["weight_buffers"] == [form["stages"]], form
