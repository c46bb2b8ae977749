"""ADAPTERSERVE_GIL_SWITCH_MS: the interpreter lock's switch interval of a server process."""
from __future__ import annotations

import sys

import pytest

from adapterserve.server.gil_switch import ENV, apply_gil_switch


@pytest.fixture
def restored():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unset_leaves_pythons_interval(monkeypatch, restored):
    monkeypatch.delenv(ENV, raising=False)
    sys.setswitchinterval(0.004)
    apply_gil_switch()
    assert sys.getswitchinterval() == pytest.approx(0.004)


@pytest.mark.parametrize("value, seconds", [("0.5", 0.0005), (" 2 ", 0.002), ("10", 0.01)])
def test_a_value_sets_the_interval_in_ms(monkeypatch, restored, value, seconds):
    monkeypatch.setenv(ENV, value)
    apply_gil_switch()
    assert sys.getswitchinterval() == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["0", "-1", "fast", "inf", "nan", "1e400", "0x10"])
def test_a_bad_value_is_refused_by_name_and_changes_nothing(monkeypatch, restored, value):
    monkeypatch.setenv(ENV, value)
    sys.setswitchinterval(0.004)
    with pytest.raises(ValueError, match=ENV):
        apply_gil_switch()
    assert sys.getswitchinterval() == pytest.approx(0.004)
