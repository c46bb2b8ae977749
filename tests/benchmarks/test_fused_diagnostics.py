"""The fused linear's diagnostics: the ablation's source edits still find their lines in the
kernel's module, and a compiled form's programs per multiprocessor."""
from __future__ import annotations

import inspect

import pytest

from adapterserve.kernels import stacked_fused
from benchmarks.compiled_forms import programs_per_sm
from benchmarks.fused_ablation import ABLATIONS, ablated


def test_every_ablation_edits_the_kernel_s_source_once(tmp_path) -> None:
    source = inspect.getsource(stacked_fused)
    for name, edits in ABLATIONS.items():
        module = ablated(name, edits, str(tmp_path))
        edited = inspect.getsource(module)
        for old, new in edits:
            assert source.count(old) == 1 and old not in edited.replace(new, ""), (name, old)
        assert callable(module.stacked_fused)


def test_an_edit_that_matches_nothing_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="matches 0 times"):
        ablated("gone", (("no such line", "x"),), str(tmp_path))


def test_programs_per_multiprocessor_take_the_scarcer_resource() -> None:
    assert programs_per_sm(56, 4, 96 * 1024, 228 * 1024) == 2  # shared memory binds
    assert programs_per_sm(136, 4, 144 * 1024, 228 * 1024) == 1
    assert programs_per_sm(255, 8, 16 * 1024, 228 * 1024) == 1  # registers bind: 255 * 256 of 65536
    assert programs_per_sm(32, 1, 0, 228 * 1024) == 32  # the cap
