"""The fused LoRA linear with its A rows kept apart from its weight (kernels/stacked_fused.py
with BaseApart, lora_decode="fused"): a weight in the activations' dtype, or e4m3 (W8A8 or
weight-only), against float32 torch: the (dequantized) weight times the activations (W8A8:
their per-token e4m3 rounding) plus the reference shrink and expand of the unrounded
activations. The stacked path's cases (every popularity pattern, mixed ranks, tokens without
adapter, bias, ragged slices); with no adapter row in use, the bits of the plain decode GEMM;
a PTX compile for both float8 targets; on a GPU the 8B's shapes and a CUDA graph replay with
PDL on against off."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adapterserve.kernels.decode_gemm import (
    DecodeGemmConfig,
    decode_config,
    decode_gemm,
    fp8_decode_config,
    fp8_fused_config,
    fp8_decode_gemm,
)
from adapterserve.kernels.fp8 import quantize_rows_reference
from adapterserve.kernels.lora_slices import LoraSlices
from adapterserve.kernels.metadata import build_adapter_meta
from adapterserve.kernels.stacked import RowsInUse, stack_apart
from adapterserve.kernels.stacked_fused import BaseApart, ShrinkTiles, finer_split, shrink_tiles, stacked_fused
from adapterserve.models.fp8 import dequantize, quantize_per_channel

from .cases import (
    check_close,
    compiled_counts,
    fresh_generator,
    gpu,
    gpu_pdl_modes,
    interpreted,
    needs_cuda,
    pdl_replays,
)
from .fused_apart_ptx import PROJECTIONS_8B, SHARED_MEMORY
from .test_stacked import _stacked_case, add_update_oracle
from .test_stacked_fused import CPU_FUSED, GPU_FUSED

MODES = ("plain", "w8a8", "weight_only")  # plain: the weight in the activations' dtype
E4M3 = torch.float8_e4m3fn


def _apart_case(case, dtype, gen, mode):
    """The stacked case with its A rows kept apart; its weight rounded to e4m3 per channel
    unless ``mode`` is plain. (x, A rows, weight, scale or None, lora, bias, slots, rows)"""
    x, joint, lora, bias, slots, rows = _stacked_case(case, dtype, gen)
    if mode == "plain":
        weight, scale = joint.weight().clone(), None
    else:
        weight, scale = quantize_per_channel(joint.weight().float())
    apart = stack_apart(weight, joint.n_slices, joint.pool_rows, RowsInUse(), dtype)
    apart.lora_a().copy_(joint.lora_a())
    lora = LoraSlices(apart.lora_a(), lora.b, lora.row_start, lora.rank, lora.out_offsets, lora.max_rank)
    return x, apart, weight, scale, lora, bias, slots, rows


def _oracle(x, weight, scale, lora, bias, slots, mode) -> torch.Tensor:
    base_in = x.float()
    if mode == "w8a8":
        xq, x_scale = quantize_rows_reference(x)
        base_in = xq.float() * x_scale.float()
    w32 = weight.float() if scale is None else dequantize(weight, scale)
    y = F.linear(base_in, w32, None if bias is None else bias.float())
    return add_update_oracle(x, lora, slots, y)


def _base(x, weight, scale, mode) -> BaseApart:
    return BaseApart(weight, scale, quantize_rows_reference(x) if mode == "w8a8" else None)


def _to(device, x, apart, weight, scale, lora, bias, slots):
    apart.buffer = apart.buffer.to(device)
    lora_dev = LoraSlices(apart.lora_a(), lora.b.to(device), lora.row_start.to(device), lora.rank.to(device),
                          lora.out_offsets, lora.max_rank)
    meta = build_adapter_meta(slots.to(device), lora.rank.shape[1])
    return (x.to(device), apart, weight.to(device), None if scale is None else scale.to(device), lora_dev,
            None if bias is None else bias.to(device), meta)


def _run(case, dtype, mode, device, config):
    gen, seed = fresh_generator()
    x, apart, weight, scale, lora, bias, slots, rows = _apart_case(case, dtype, gen, mode)
    ref = _oracle(x, weight, scale, lora, bias, slots, mode)
    x_d, apart, w_d, scale_d, lora_d, bias_d, meta = _to(device, x, apart, weight, scale, lora, bias, slots)
    y = stacked_fused(x_d, apart, lora_d, meta, rows, bias_d, config, _base(x_d, w_d, scale_d, mode)).cpu()
    check_close(y, ref, dtype, seed, f"fused apart {mode} {case}")


# every mode in float32 over whole K; split K in float16 for the plain form (the forms differ only
# in what the K loop reads and in the scales after the split sum, which test_no_rows_in_use checks
# split three ways bit for bit: the interpreter is slow)
FORMS = [(torch.float32, 1, m) for m in MODES] + [(torch.float16, 2, "plain")]


@interpreted
@pytest.mark.parametrize("dtype,split,mode", FORMS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("case", CPU_FUSED, ids=str)
def test_fused_apart_interpreted(case, dtype, split, mode):
    _run(case, dtype, mode, "cpu", DecodeGemmConfig(block_n=16, block_k=32, split_k=split))


@interpreted
@pytest.mark.parametrize("mode", MODES)
def test_no_rows_in_use_gives_the_decode_gemm_bits(mode):
    """With no pool row covered the launch is the plain decode GEMM (same tiles, same split,
    same order of sums, same scales): bit for bit."""
    gen, seed = fresh_generator()
    x, apart, weight, scale, lora, _, slots, _ = _apart_case(CPU_FUSED[0], torch.float32, gen, mode)
    config = DecodeGemmConfig(block_n=16, block_k=32, split_k=3)
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    y = stacked_fused(x, apart, lora, meta, 0, None, config, _base(x, weight, scale, mode))
    if mode == "w8a8":
        xq, x_scale = quantize_rows_reference(x)
        plain = fp8_decode_gemm(xq, weight, scale, x_scale, x.dtype, config)
    elif mode == "weight_only":
        plain = fp8_decode_gemm(x, weight, scale, config=config)
    else:
        plain = decode_gemm(x, weight, config)
    assert torch.equal(y, plain), f"seed {seed}"


HOPPER_SHARED = SHARED_MEMORY[90]


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("projection", list(PROJECTIONS_8B))
def test_the_shrink_loop_fits_beside_the_base_loop(projection, block_m):
    """On the 8B's projections: both K loops' pipeline buffers within sm_90's shared memory (two
    loops of the base's tiles asked 294,912 bytes at 64 tokens and could not launch), the
    shrink split a multiple of the base's; one loop for a bf16 weight."""
    _, n, k = PROJECTIONS_8B[projection]
    for name, (x_size, base_size, w_size) in {"w8a8": (2, 1, 1), "weight_only": (2, 2, 1)}.items():
        config = fp8_fused_config(n, k)
        for split in (1, 2, 4):
            tiles = shrink_tiles(config, block_m, split, k, x_size, base_size, w_size, HOPPER_SHARED)
            base_bytes = config.num_stages * config.block_k * (block_m * base_size + config.block_n * w_size)
            shrink_bytes = tiles.stages * tiles.block_k * (block_m + config.block_n) * x_size
            assert base_bytes + shrink_bytes <= HOPPER_SHARED, (name, split, tiles)
            assert tiles.stages >= 1 and tiles.block_k * x_size == config.block_k * w_size, (name, tiles)
            assert tiles.split % split == 0 and k >= tiles.block_k * tiles.split * 2, (name, split, tiles)
    config = decode_config(n, k)
    assert shrink_tiles(config, block_m, 2, k, 2, 2, 2, HOPPER_SHARED) == ShrinkTiles(0, 0, 2)


def test_w8a8_shrink_tiles_are_the_swept_best():
    """The loop benchmarks/fp8_lora_fused.py --sweep timed fastest on an H200 (8B, 64 tokens, one
    adapter): 128-column chunks, three stages, four times the base's K splits."""
    config = fp8_fused_config(6144, 4096)
    assert shrink_tiles(config, 64, 2, 4096, 2, 1, 1, HOPPER_SHARED) == ShrinkTiles(128, 3, 8)


def test_wide_fp8_outputs_take_the_fused_linear_s_own_tiles():
    """gate|up: 128 columns, K chunks of 128, 8 warps (the fastest one-adapter tiles of
    benchmarks/fused_tiles.py on an H200: half the output tiles, each paying the LoRA epilogue
    once); narrower outputs the plain product's tiles."""
    wide = fp8_fused_config(28672, 4096)
    assert (wide.block_n, wide.block_k, wide.num_stages, wide.num_warps) == (128, 128, 3, 8)
    assert wide != fp8_decode_config(28672, 4096)
    for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)):
        assert fp8_fused_config(n, k) == fp8_decode_config(n, k)


def test_fused_apart_refuses_what_it_cannot_take():
    gen, _ = fresh_generator()
    x, apart, q, scale, lora, _, slots, rows = _apart_case(CPU_FUSED[0], torch.float32, gen, "w8a8")
    meta = build_adapter_meta(slots, lora.rank.shape[1])
    with pytest.raises(ValueError, match="A rows only"):
        stacked_fused(x, apart, lora, meta, rows)
    with pytest.raises(ValueError, match="must be torch.float32 or torch.float8_e4m3fn"):
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q.half()))
    with pytest.raises(ValueError, match="with an e4m3 weight only"):
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q.float(), scale))
    with pytest.raises(ValueError, match="channel scales"):
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q))
    with pytest.raises(ValueError, match="channel scales"):
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q, scale[:-1]))
    with pytest.raises(ValueError, match="rounded activations"):
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q, scale, (x, torch.ones(x.shape[0]))))
    with pytest.raises(ValueError, match="rounded activations"):
        xq, x_scale = quantize_rows_reference(x)
        stacked_fused(x, apart, lora, meta, rows, apart=BaseApart(q, scale, (xq, x_scale[:-1])))
    with pytest.raises(ValueError, match="share"):
        stacked_fused(x.half(), apart, lora, meta, rows, apart=BaseApart(q, scale))


def test_the_fused_linear_compiles_for_sm_89_and_sm_90():
    """Kept apart from an e4m3 weight, the W8A8 form runs e4m3 tensor-core products (the base
    tiles) and bf16 ones (shrink and expand); weight-only and the bf16 forms none in e4m3."""
    for name, per_target in compiled_counts("tests.kernels.fused_apart_ptx").items():
        for target, found in per_target.items():
            assert (found["e4m3_mma"] > 0) == name.startswith("apart_w8a8"), (name, target, found)
            assert found["bf16_mma"] > 0, (name, target, found)


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", GPU_FUSED, ids=str)
def test_fused_apart_gpu(case, mode):
    if mode == "w8a8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 dots need sm_89")
    n, k = sum(case[4]), case[3]
    _run(case, torch.bfloat16, mode, "cuda", decode_config(n, k) if mode == "plain" else fp8_fused_config(n, k))


@gpu_pdl_modes
def test_fused_apart_chain_in_a_graph_gives_the_bits_of_pdl_off(mode):
    """Two FP8 fused linears back to back, replayed: PDL on gives PDL off's bits, every replay."""
    gen, seed = fresh_generator()
    case = ("uniform", 64, 8, 4096, (4096,), 16, 0.1, False, "bucket")
    x, apart, q, scale, lora, _, slots, rows = _apart_case(case, torch.bfloat16, gen, "weight_only")
    x, apart, q, scale, lora, _, meta = _to("cuda", x, apart, q, scale, lora, None, slots)
    config = fp8_fused_config(4096, 4096)

    def linear(h):
        return stacked_fused(h, apart, lora, meta, rows, None, config, BaseApart(q, scale))

    outs = pdl_replays(lambda: linear(torch.relu(linear(x))), ("off", mode))
    outs["prefetch"] = pdl_replays(lambda: linear(torch.relu(linear(x))), (mode,), prefetch=4)[mode]  # rows asked first
    assert torch.equal(outs["off"], outs[mode]) and torch.equal(outs["off"], outs["prefetch"]), f"seed {seed}"


def test_a_finer_split_keeps_two_k_chunks_a_split():
    assert finer_split(2, 4, 4096, 128) == 8  # 4096 / 128 = 32 chunks: 4 a split
    assert finer_split(2, 4, 1024, 128) == 4  # 8 chunks: halved once, 2 a split
    assert finer_split(3, 8, 128, 128) == 3  # never below the split it started from
