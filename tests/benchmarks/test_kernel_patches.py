"""benchmarks/kernel_patches.py: a workload suffix patches the attribute the engine calls for
that workload only, whatever happens inside, and plan() carries the suffixes."""
import pytest
import torch

from adapterserve.kernels import decode_gemm, fp8
from adapterserve.models import decoder
from benchmarks.kernel_patches import patched
from benchmarks.workloads import plan


def test_stream_k_configs_inside_the_block_only():
    original = decode_gemm.fp8_decode_config
    with patched(("+sk",)):
        inside = decode_gemm.fp8_decode_config(4096, 4096)
    assert inside.stream_k and inside.block_n == original(4096, 4096).block_n
    assert decode_gemm.fp8_decode_config is original and not original(4096, 4096).stream_k


def test_silu_parts_fall_back_on_cpu_and_are_undone_after_an_error():
    original = decoder.silu_mul_quant
    gate_up = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match="inside"):
        with patched(("+sk", "+sp4")):
            assert decoder.silu_mul_quant is not original
            for got, want in zip(decoder.silu_mul_quant(gate_up), original(gate_up)):
                assert torch.equal(got, want)  # a CPU tensor: the one-program-a-row path
            raise RuntimeError("inside")
    assert decoder.silu_mul_quant is original


def test_row_quantization_parts_fall_back_on_cpu():
    original = fp8.quantize_rows
    x = torch.randn(3, 64)
    with patched(("+qp4",)):
        assert fp8.quantize_rows is not original
        for got, want in zip(fp8.quantize_rows(x), original(x)):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert fp8.quantize_rows is original


def test_plan_carries_patch_suffixes_beside_option_suffixes():
    p = plan("base+sp2+ad+sk", 2, None, {}, None, False)
    assert p.name == "base+sp2+ad+sk" and p.patches == ("+sp2", "+sk")
    assert p.engine_options == {"decode_attention_dots": "input"}
