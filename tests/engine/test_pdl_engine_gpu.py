"""A whole engine with programmatic dependent launch against the same engine without it: an
FP8 backbone on our decode GEMM and a bf16 one on it or on cuBLAS, LoRA rows in the batch, decode steps
replayed from CUDA graphs; first with decode attention kept out of the PDL chain, then with it
in (attention.PDL, the default) and weight prefetch too. PDL and prefetch only move launches
and reads earlier, so greedy tokens and every sampled logit must be bit for bit the same.
Fresh random prompts each run."""
import pytest
import torch

from adapterserve import Engine
from adapterserve.kernels import attention
from adapterserve.kernels.pdl import pdl_mode, set_pdl, set_prefetch
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import greedy_run

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
    pytest.skip("needs a CUDA device of sm_90 or later (PDL)", allow_module_level=True)

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = [None, "lora", "lora", None, "lora"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("pdl_engine")
    model_dir = write_tiny_checkpoint(root / "model", "llama", num_layers=3, hidden_size=512,
                                      intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
                                      vocab_size=1024, seed=5)
    lora = make_peft_lora(model_dir, root / "r8", r=8, lora_alpha=16, target_modules=ALL_LINEAR, seed=6)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (1, 9, 40, 77, 130)]
    return model_dir, lora, prompts


def _run(model_dir, lora, prompts, mode: str, **options) -> list[tuple[list[int], torch.Tensor]]:
    try:
        # no warm-up: each step's graph is captured at its first replay, with the mode under test
        engine = Engine.from_pretrained(model_dir, device="cuda", block_size=16, num_kv_blocks=128, max_loras=2,
                                        pdl=mode, warmup=False, **options)
        assert pdl_mode() == mode
        engine.load_adapter("lora", lora)
        return greedy_run(engine, prompts, ADAPTERS, 6)
    finally:
        set_pdl(None)
        set_prefetch(None)


@pytest.mark.parametrize("options", [dict(dtype="fp8", fp8_gemm="auto"),
                                     dict(dtype="bfloat16", decode_gemm="triton"),
                                     dict(dtype="bfloat16")],  # cuBLAS and the fused LoRA linear: "auto" early
                         ids=["fp8", "bf16", "bf16-cublas"])
def test_pdl_early_gives_the_bits_of_pdl_off(setup, options, monkeypatch):
    monkeypatch.delenv(attention.PDL_ENV, raising=False)
    monkeypatch.setattr(attention, "PDL", False)
    off = _run(*setup, "off", **options)
    early = _run(*setup, "early", **options)
    for (off_tokens, off_logits), (early_tokens, early_logits) in zip(off, early):
        assert early_tokens == off_tokens
        assert torch.equal(early_logits, off_logits)


@pytest.mark.parametrize("options", [dict(dtype="fp8", fp8_gemm="auto", weight_prefetch=4),
                                     dict(dtype="bfloat16", decode_gemm="triton", weight_prefetch=8)],
                         ids=["fp8", "bf16"])
def test_attention_in_the_chain_and_prefetch_give_the_bits_of_pdl_off(setup, options, monkeypatch):
    monkeypatch.delenv(attention.PDL_ENV, raising=False)
    monkeypatch.setattr(attention, "PDL", True)
    off = _run(*setup, "off", **options)  # PDL off: neither attention's wait nor any prefetch
    early = _run(*setup, "early", **options)
    for (off_tokens, off_logits), (early_tokens, early_logits) in zip(off, early):
        assert early_tokens == off_tokens
        assert torch.equal(early_logits, off_logits)
