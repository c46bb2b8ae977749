"""The decoder's fused FP8 activation quantization (RMSNorm -> q|k|v and gate|up, SiLU-mul
-> down), on CPU where scaled_mm is emulated in float32: every quantized input a base
product is handed is exactly quantize_rows of the x it comes with, o_proj's and (IA)^3
rows' inputs are quantized by the GEMM itself, and the engine's tokens and logits are
those of the same engine with the fusion off. LoRA, (IA)^3 and bottleneck rows share
the batches."""
from pathlib import Path

import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.kernels.fp8 import quantize_rows_reference
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import record_logits

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERHUB = Path(__file__).parents[1] / "fixtures" / "adapterhub"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8fused")
    float_dir = write_tiny_checkpoint(root / "float", "llama", hidden_size=96, intermediate_size=224,
                                      num_attention_heads=6, num_key_value_heads=2, seed=11)
    adapters = {
        "lora": make_peft_lora(float_dir, root / "r8", r=8, lora_alpha=16, target_modules=ALL_LINEAR, seed=1),
        "ia3": make_peft_adapter(float_dir, root / "ia3", family_configs()["ia3"], seed=3),
    }
    return float_dir, adapters


def _engine(path, adapters, fused: bool, fp8_gemm: str = "scaled_mm") -> Engine:
    engine = Engine.from_pretrained(path, dtype="fp8", fp8_gemm=fp8_gemm, block_size=8, num_kv_blocks=128,
                                    max_loras=4)
    for name, adapter_dir in adapters.items():
        engine.load_adapter(name, adapter_dir)
    for _, linear in engine.model.adapter_linears():
        linear.fuse_input_quant = fused
    return engine


def _record_quantized_inputs(engine) -> list[tuple[str, torch.Tensor, tuple | None]]:
    """Wrap every linear's base product: (kind, x, quantized pair or None) per call."""
    records = []
    for _, linear in engine.model.adapter_linears():
        def recording(x, quantized=None, linear=linear, base=linear.base_product):
            records.append((linear.slice_kinds[0], x.clone(), quantized))
            return base(x, quantized)
        linear.base_product = recording
    return records


def _run(engine, prompts, ids):
    logits = record_logits(engine)
    outs = engine.generate(prompts, GREEDY, adapter_ids=ids)
    return [(o.token_ids, torch.stack(logits[o.request_id][: GREEDY.max_tokens])) for o in outs]


def _assert_same_run(got, want):
    for (got_tokens, got_logits), (want_tokens, want_logits) in zip(got, want):
        assert got_tokens == want_tokens
        assert ((got_logits - want_logits).norm() / want_logits.norm()).item() < 1e-5


def _assert_each_pair_is_quantize_rows_of_its_input(records):
    fused = [(kind, x, pair) for kind, x, pair in records if pair is not None]
    assert {kind for kind, _, _ in fused} == {"q_proj", "gate_proj", "down_proj"}  # o_proj quantizes its own
    for kind, x, (q, scale) in fused:
        q_want, scale_want = quantize_rows_reference(x)
        assert torch.equal(scale, scale_want), kind
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)), kind


def _prompts(lengths):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("fp8_gemm", ["scaled_mm", "w8a8_triton", "decode_w8a8"])
def test_fused_quantization_changes_nothing_with_lora_and_ia3_rows(tiny, fp8_gemm):
    float_dir, adapters = tiny
    # one run without (IA)^3 rows (the fused path), one with (the GEMMs quantize the scaled x)
    runs = [(_prompts((2, 9, 30, 5)), [None, "lora", None, "lora"]), (_prompts((17, 4, 8)), [None, "ia3", "lora"])]
    fused, unfused = _engine(float_dir, adapters, True, fp8_gemm), _engine(float_dir, adapters, False, fp8_gemm)
    records = _record_quantized_inputs(fused)
    for prompts, ids in runs:
        _assert_same_run(_run(fused, prompts, ids), _run(unfused, prompts, ids))
    _assert_each_pair_is_quantize_rows_of_its_input(records)
    assert any(kind == "down_proj" and pair is None for kind, _, pair in records)
    # the emulation really rounds activations: not the reference path's logits
    prompts, ids = runs[0][0][:1], runs[0][1][:1]
    got, want = _run(fused, prompts, ids)[0][1], _run(_engine(float_dir, adapters, True, "reference"), prompts, ids)[0][1]
    assert ((got - want).norm() / want.norm()).item() > 1e-4


def test_fused_quantization_changes_nothing_with_bottleneck_rows(tmp_path):
    tiny_llama = ADAPTERHUB / "tiny-llama"
    adapters = {
        "houlsby": ADAPTERHUB / "llama-houlsby",
        "lora": make_peft_lora(tiny_llama, tmp_path / "lora", r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    }
    prompts, ids = _prompts((3, 11, 6)), ["houlsby", None, "lora"]
    fused, unfused = _engine(tiny_llama, adapters, True), _engine(tiny_llama, adapters, False)
    records = _record_quantized_inputs(fused)
    _assert_same_run(_run(fused, prompts, ids), _run(unfused, prompts, ids))
    _assert_each_pair_is_quantize_rows_of_its_input(records)


def test_the_engine_applies_its_fp8_gemm_to_a_model_loaded_with_another(tiny):
    from adapterserve.config import EngineConfig
    from adapterserve.models.loader import load_decoder

    float_dir, _ = tiny
    model, _ = load_decoder(float_dir, torch.float32, "cpu", fp8_gemm="auto")
    engine = Engine(model, None, EngineConfig(dtype="fp8", fp8_gemm="decode_w8a8", block_size=8, num_kv_blocks=32,
                                              max_loras=1))
    kernels = {linear.fp8_gemm for _, linear in engine.model.adapter_linears()}
    assert kernels == {"decode_w8a8"}
