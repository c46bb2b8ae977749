"""fused_expand="fma" on a GPU (the fused linear's LoRA update as rank-one products on the CUDA
cores for tiles whose rows fit in 16) against "dot", LoRA and prefix-tuning rows, CUDA graphs:
held to the bf16 engine's own error against a float32 CPU engine. Fresh random prompts each run."""
import pytest
import torch

from tests.engine.test_kv_fp8_gpu import _rel, _run, setup  # noqa: F401

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

FMA_FACTOR, FMA_FLOOR = 3.0, 0.02  # fma against dot: a few times bf16's own error (sums in another order)


def test_fma_expand_stays_within_bf16_error(setup):  # noqa: F811
    cuda = dict(device="cuda", dtype="bfloat16", lora_decode="fused")
    reference = _run(setup, device="cpu", dtype="float32")
    dot = _run(setup, **cuda, fused_expand="dot")
    fma = _run(setup, **cuda, fused_expand="fma")
    own = _rel(dot, reference)
    assert _rel(fma, dot) < max(FMA_FACTOR * own, FMA_FLOOR), (_rel(fma, dot), own)
