"""lora_decode="fused" on an FP8 backbone (A rows kept apart from the e4m3 weights,
layers/fused_lora.py), on CPU: decode steps with at most two adapters run the fused linear's
twin, steps with more the segment kernels; every request gets the tokens and logits of a
float32 engine on the quantized-then-dequantized checkpoint (the reference path) and of the
same FP8 engine on the separate kernels (W8A8 emulated). LoRA rows share batches with (IA)^3
rows and rows without adapter."""
import pytest
import torch

from adapterserve import Engine
from adapterserve.kernels.stacked import FUSED_MAX_ADAPTERS
from adapterserve.layers import linear as linear_module
from adapterserve.models.tiny import write_tiny_checkpoint
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.lora import make_peft_lora
from tests.helpers.recording import greedy_logits_error, greedy_run
from tests.models.fp8_checkpoints import write_dequantized_checkpoint, write_fp8_checkpoint

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_TOKENS = 8
SAME_MATH_TOL = 1e-5  # the same products summed in another order (float32)
# The same with activations rounded to e4m3 (W8A8): a float32 difference in summation order can
# move an activation across a rounding boundary, a step of up to 1/16 of it, and later layers
# carry that on. Measured over 13 runs: median 6e-7, 1e-4 to 7e-4 in three, 2.5e-2 in one. A
# wrong scale, a lost update or a row given another adapter's gives errors near 1.
W8A8_TOL = 0.1


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8fusedlora")
    float_dir = write_tiny_checkpoint(root / "float", "llama", hidden_size=96, intermediate_size=224,
                                      num_attention_heads=6, num_key_value_heads=2, seed=13)
    dequantized = write_dequantized_checkpoint(write_fp8_checkpoint(float_dir, root / "fp8"), root / "dequantized")
    adapters = {
        "lora-r8": make_peft_lora(float_dir, root / "r8", r=8, lora_alpha=16, target_modules=ALL_LINEAR, seed=1),
        "lora-r4": make_peft_lora(float_dir, root / "r4", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj",
                                                                                            "down_proj"], seed=2),
        "lora-r16": make_peft_lora(float_dir, root / "r16", r=16, lora_alpha=16, target_modules=ALL_LINEAR, seed=4),
        "ia3": make_peft_adapter(float_dir, root / "ia3", family_configs()["ia3"], seed=3),
    }
    return float_dir, dequantized, adapters


def _engine(path, adapters, **options) -> Engine:
    engine = Engine.from_pretrained(path, block_size=8, num_kv_blocks=128, max_loras=4, **options)
    for name, adapter_dir in adapters.items():
        engine.load_adapter(name, adapter_dir)
    return engine


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for length in (2, 9, 17, 30, 5, 12)[:n]]


@pytest.fixture
def fused_calls(monkeypatch):
    """Distinct adapters of each step that ran the fused FP8 linear (per linear call)."""
    calls = []
    real = linear_module.fused_lora_linear

    def counting(x, weight, weight_scale, stacked, lora, meta, *args, **kwargs):
        slots = meta.token_slots.tolist()
        calls.append(len({s for s in slots if s >= 0}))
        return real(x, weight, weight_scale, stacked, lora, meta, *args, **kwargs)

    monkeypatch.setattr(linear_module, "fused_lora_linear", counting)
    return calls


# (adapters of the batch's rows): one shared adapter (fused), two (fused), three (the segment kernels)
BATCHES = [
    [None, "lora-r8", "lora-r8", "ia3"],
    ["lora-r8", "lora-r4", None, "lora-r4"],
    ["lora-r8", "lora-r4", "lora-r16", "ia3", None, "lora-r16"],
]


@pytest.mark.parametrize("ids", BATCHES, ids=["one", "two", "three"])
def test_fused_fp8_lora_matches_float32_on_the_dequantized_weights(setup, fused_calls, ids):
    float_dir, dequantized, adapters = setup
    fp8 = _engine(float_dir, adapters, dtype="fp8", lora_decode="fused")
    ref = _engine(dequantized, adapters, dtype="float32")
    prompts = _prompts(len(ids))
    got, want = greedy_run(fp8, prompts, ids, MAX_TOKENS), greedy_run(ref, prompts, ids, MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in want]
    error, steps = greedy_logits_error(got, want)
    assert steps == len(ids) * MAX_TOKENS and error < SAME_MATH_TOL
    distinct = len({a for a in ids if a and a.startswith("lora")})
    if distinct <= FUSED_MAX_ADAPTERS:
        assert fused_calls and max(fused_calls) == distinct, "its decode steps ran the fused linear"
    else:
        assert max(fused_calls, default=0) <= FUSED_MAX_ADAPTERS, "steps of more adapters ran the segment kernels"
    assert [t for t, _ in greedy_run(ref, prompts[1:2], [None], MAX_TOKENS)] != [got[1][0]], \
        "the adapter changed the tokens: the comparison has teeth"


def test_fused_fp8_lora_gives_the_separate_kernels_tokens_with_rounded_activations(setup, fused_calls):
    """W8A8 (scaled_mm, emulated in float32 on CPU): the fused path's base product is the
    separate kernels' one, its update theirs."""
    float_dir, _, adapters = setup
    ids = BATCHES[0] + BATCHES[1]
    engines = [_engine(float_dir, adapters, dtype="fp8", fp8_gemm="scaled_mm", lora_decode=mode)
               for mode in ("fused", "kernels")]
    prompts = _prompts(6) + _prompts(2)
    got, want = (greedy_run(engine, prompts, ids, MAX_TOKENS) for engine in engines)
    error, steps = greedy_logits_error(got, want)  # steps whose greedy context is the same in both
    assert steps >= len(ids) and error < W8A8_TOL
    assert fused_calls, "the fused engine's decode steps of few adapters ran the fused linear"
