"""An engine with an FP8 KV cache (kv_cache_dtype="fp8", CPU: the float32 twins read the
dequantized cache): its logits against the same engine with a float32 cache, one batch
holding LoRA, prefix tuning (its pages written into the FP8 cache), prompt tuning,
(IA)^3, bottleneck adapters and base rows; n choices sharing a prompt's blocks (the
copied last block carries its scales); the cache's dtype and bytes."""
import pytest
import torch

from adapterserve import Engine, SamplingParams
from adapterserve.config import EngineConfig
from adapterserve.kernels.fp8 import FP8
from adapterserve.kernels.kv_fp8 import dequantize_kv, quantize_kv
from adapterserve.layers.attention import PagedAttention
from tests.helpers.families import every_family
from tests.helpers.recording import greedy_logits_error, greedy_run, record_logits

MODEL_ADAPTERS = ["lora", "prefix", "prompt", "ia3", "houlsby", None]
# relative L2 error of each step's logits while the greedy tokens before it agree:
# - against a float32 cache holding the same e4m3-rounded values (fake quantization): only
#   float32 arithmetic order differs
FAKE_QUANT_REL_TOL = 1e-4
# - against the float32 cache: rounding keys and values to e4m3 (3 mantissa bits) moves this
#   tiny random model's logits by 5-6% (median) and up to 15% (12 seeds measured); an
#   unrelated computation is about sqrt(2) away
UNQUANTIZED_REL_TOL = 0.3


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    return every_family(llama_dir, tmp_path_factory.mktemp("kv_fp8"))


def _run(llama_dir, adapters, prompts, **config) -> list[tuple[list[int], list[torch.Tensor]]]:
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=128, max_loras=8, **config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return greedy_run(engine, prompts, MODEL_ADAPTERS[: len(prompts)], 5)


def _fake_quantized_writes(monkeypatch) -> None:
    """Float32 caches written with each (token, head) vector rounded as the FP8 cache rounds it."""
    write = PagedAttention.write

    def rounded(self, index, k, v):
        write(self, index, *(dequantize_kv(*quantize_kv(t.float())).to(t.dtype) for t in (k, v)))
    monkeypatch.setattr(PagedAttention, "write", rounded)


def test_fp8_cache_engine_against_float32_caches(llama_dir, adapters, monkeypatch):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 9, 17, 6, 23, 12)]
    got = _run(llama_dir, adapters, prompts, kv_cache_dtype="fp8")
    error, steps = greedy_logits_error(got, _run(llama_dir, adapters, prompts))
    assert error < UNQUANTIZED_REL_TOL and steps >= len(prompts) * 2, (error, steps)
    _fake_quantized_writes(monkeypatch)
    error, steps = greedy_logits_error(got, _run(llama_dir, adapters, prompts))
    assert error < FAKE_QUANT_REL_TOL and steps == len(prompts) * 5, (error, steps)


def test_the_cache_is_e4m3_with_a_scale_per_token_and_head(llama_dir):
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=16, kv_cache_dtype="fp8")
    plain = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=16)
    for attn, ref in zip(engine.model.attention_layers(), plain.model.attention_layers()):
        assert attn.k_cache.dtype == attn.v_cache.dtype == FP8
        assert attn.k_scale.shape == attn.v_scale.shape == attn.k_cache.shape[:2]
        assert ref.k_scale is None and ref.k_cache.dtype == torch.float32
        fp8_bytes = sum(t.numel() * t.element_size() for t in attn.cache_tensors())
        plain_bytes = sum(t.numel() * t.element_size() for t in ref.cache_tensors())
        assert fp8_bytes == plain_bytes // 4 * (1 + 4 / attn.head_dim)  # 1 byte an entry, 4 a scale


@pytest.mark.parametrize("caching", [False, True])
def test_choices_sharing_a_prompt_equal_one_request_with_the_fp8_cache(llama_dir, caching):
    """Greedy choices copy the prompt's last block (entries and scales) and must each equal
    the request run with n = 1 (with prefix caching: on the blocks that request left)."""
    engine = Engine.from_pretrained(llama_dir, block_size=4, num_kv_blocks=64, kv_cache_dtype="fp8",
                                    enable_prefix_caching=caching)
    prompt = torch.randint(3, 500, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    captured = record_logits(engine)
    alone = engine.generate([prompt], SamplingParams(**greedy))[0]
    choices = engine.generate([prompt], SamplingParams(n=3, **greedy))
    assert [c.token_ids for c in choices] == [alone.token_ids] * 3
    alone_logits = torch.stack(captured[alone.request_id][:6])
    choice_logits = captured[choices[0].request_id]  # every choice's rows, step by step
    assert len(choice_logits) >= 3 * 5
    for row in choice_logits[:16]:  # each is one of the lone request's steps, to float32 order
        assert (alone_logits - row).abs().amax(dim=1).min() < 1e-4


def test_an_unknown_cache_dtype_is_refused():
    for bad in ("int8", "e4m3", "", None, 8):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
            EngineConfig(kv_cache_dtype=bad)

