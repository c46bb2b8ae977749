"""The FP8 KV cache on a GPU (bf16 activations, CUDA graphs, the fused RoPE + e4m3 cache
write, both Triton attention kernels reading e4m3) with LoRA and prefix-tuning rows: its
logits against a float32 CPU engine whose cache holds the same e4m3 rounding (fake
quantization), and against the unquantized float32 engine. Fresh random prompts each run."""
import pytest
import torch

from adapterserve import Engine
from adapterserve.kernels.kv_fp8 import dequantize_kv, quantize_kv
from adapterserve.layers.attention import PagedAttention
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import greedy_logits_error, greedy_run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA device of sm_89 or later (float8)", allow_module_level=True)

ADAPTERS = [None, "lora", "prefix", "lora", None]
# relative L2 logits error while greedy tokens agree. bf16 activations round keys and values
# before their e4m3 rounding, so some entries land on the other side of a rounding midpoint
# than in the float32 twin: the GPU engine is held to a few times the bf16 engine's own error
# against float32, and to the CPU test's bound against the unquantized cache
FAKE_QUANT_FACTOR, FAKE_QUANT_FLOOR = 3.0, 0.1
UNQUANTIZED_REL_TOL = 0.3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_fp8_gpu")
    model = write_tiny_checkpoint(root / "model", "llama", num_layers=3, hidden_size=512, intermediate_size=1408,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1024, seed=7)
    adapters = {"lora": make_peft_lora(model, root / "lora", r=8, lora_alpha=16, target_modules="all-linear", seed=8),
                "prefix": make_peft_adapter(model, root / "prefix", family_configs()["prefix"], seed=9)}
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 9, 40, 77, 130)]
    return model, adapters, prompts


def _run(setup, **config) -> list[tuple[list[int], torch.Tensor]]:
    model, adapters, prompts = setup
    engine = Engine.from_pretrained(model, block_size=16, num_kv_blocks=128, max_loras=2, warmup=False, **config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return greedy_run(engine, prompts, ADAPTERS, 6)


def _rel(got, want) -> float:
    return greedy_logits_error(got, want)[0]


def test_fp8_cache_on_gpu_against_float32_engines(setup, monkeypatch):
    cuda = dict(device="cuda", dtype="bfloat16")
    unquantized = _run(setup, device="cpu", dtype="float32")
    bf16 = _rel(_run(setup, **cuda), unquantized)
    got = _run(setup, **cuda, kv_cache_dtype="fp8")
    assert _rel(got, unquantized) < UNQUANTIZED_REL_TOL, (_rel(got, unquantized), bf16)
    write = PagedAttention.write
    monkeypatch.setattr(PagedAttention, "write", lambda self, index, k, v: write(
        self, index, *(dequantize_kv(*quantize_kv(t.float())).to(t.dtype) for t in (k, v))))
    fake = _rel(got, _run(setup, device="cpu", dtype="float32"))
    assert fake < max(FAKE_QUANT_FACTOR * bf16, FAKE_QUANT_FLOOR), (fake, bf16)
