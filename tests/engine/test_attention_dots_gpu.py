"""decode_attention_dots="input" on a GPU (bf16 tensor-core products in the decode attention
kernel, the softmax weights rounded to bf16) against the float32 products, with a bf16 and an
FP8 KV cache, LoRA and prefix-tuning rows, CUDA graphs: both held to the bf16 engine's own
error against a float32 CPU engine. Fresh random prompts each run."""
import pytest
import torch

from tests.engine.test_kv_fp8_gpu import _rel, _run, setup  # noqa: F401

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA device of sm_89 or later", allow_module_level=True)

DOTS_FACTOR, DOTS_FLOOR = 3.0, 0.02  # input against float32 dots: a few times bf16's own error


@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_input_dots_stay_within_bf16_error(setup, cache):  # noqa: F811
    cuda = dict(device="cuda", dtype="bfloat16", kv_cache_dtype=cache)
    reference = _run(setup, device="cpu", dtype="float32")
    float32_dots = _run(setup, **cuda, decode_attention_dots="float32")
    input_dots = _run(setup, **cuda, decode_attention_dots="input")
    own = _rel(float32_dots, reference)
    assert _rel(input_dots, float32_dots) < max(DOTS_FACTOR * own, DOTS_FLOOR), (_rel(input_dots, float32_dots), own)
