"""Decode attention's other launches in a whole engine on a GPU (CUDA graphs, LoRA and
prefix-tuning rows, a bf16 and an FP8 KV cache): the batch's tiles dealt evenly among resident
programs (ADAPTERSERVE_ATTENTION_BALANCED=1) and every context split in two parts
(ADAPTERSERVE_ATTENTION_SPLITS=2) against the engine's default launch, held to a few times the
bf16 engine's own error against a float32 CPU engine. Fresh random prompts each run."""
import pytest
import torch

from tests.engine.test_kv_fp8_gpu import _rel, _run, setup  # noqa: F401

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA device of sm_89 or later", allow_module_level=True)

LAUNCH_FACTOR, LAUNCH_FLOOR = 3.0, 0.02  # another order of float32 sums: a few times bf16's own error


@pytest.mark.parametrize("launch", ["ADAPTERSERVE_ATTENTION_BALANCED=1", "ADAPTERSERVE_ATTENTION_SPLITS=2"])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_other_launches_stay_within_bf16_error(setup, monkeypatch, launch, cache):  # noqa: F811
    cuda = dict(device="cuda", dtype="bfloat16", kv_cache_dtype=cache)
    reference = _run(setup, device="cpu", dtype="float32")
    default = _run(setup, **cuda)
    monkeypatch.setenv(*launch.split("="))
    other = _run(setup, **cuda)
    own = _rel(default, reference)
    assert _rel(other, default) < max(LAUNCH_FACTOR * own, LAUNCH_FLOOR), (_rel(other, default), own)
