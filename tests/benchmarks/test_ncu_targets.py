"""The Nsight Compute targets launch what they name: each target at small shapes in the
interpreter, and the attention targets' outputs against the float32 twin."""
from __future__ import annotations

import pytest
import torch

from adapterserve.kernels import attention
from adapterserve.kernels import reference
from benchmarks import ncu_targets


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(ncu_targets, "DEVICE", "cpu")
    monkeypatch.setattr(ncu_targets, "DTYPE", torch.float32)  # the interpreter's bf16 arithmetic is wrong
    monkeypatch.setattr(ncu_targets, "BATCH", 2)
    monkeypatch.setattr(ncu_targets, "CONTEXTS", (5, 40))
    monkeypatch.setattr(ncu_targets, "GEMMS", {"fp8_gate_up": (64, 128), "fp8_down": (32, 256)})
    monkeypatch.setattr(ncu_targets, "ROWS", {"fp8_silu_quant": 96, "fp8_norm_quant": 64})
    monkeypatch.setattr(ncu_targets, "LAUNCHES", 1)


def test_every_target_launches(small, monkeypatch):
    monkeypatch.setattr("sys.argv", ["ncu_targets.py"])
    ncu_targets.main()


def test_an_unknown_target_is_refused(small, monkeypatch):
    monkeypatch.setattr("sys.argv", ["ncu_targets.py", "--targets", "attention,nothing"])
    with pytest.raises(SystemExit):
        ncu_targets.main()


def test_the_attention_target_computes_attention(small, monkeypatch):
    launched = {}
    real = attention.paged_decode_attention

    def recording(q, k, v, table, lens, start, page, window, out, **options):
        out.fill_(float("nan"))  # poisoned: the kernel writes every row
        real(q, k, v, table, lens, start, page, window, out, **options)
        launched.update(args=(q, k, v, table, lens, start, page, window), out=out)

    monkeypatch.setattr(ncu_targets, "paged_decode_attention", recording)
    ncu_targets.TARGETS["attention_n64"]()()
    q, k, v, table, lens, start, page, window = launched["args"]
    twin = torch.full_like(q, float("nan"))
    reference.paged_decode_attention(q, k, v, table, lens, start, page, window, twin)
    torch.testing.assert_close(launched["out"], twin, atol=1e-4, rtol=1e-4)
