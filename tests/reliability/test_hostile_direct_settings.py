"""Hostile `direct` settings (server/direct_settings.py): every value but "auto", true and false,
of every type, is refused before anything starts, naming the setting; given to `adapterserve
serve --config`, in one line with exit status 2 and no Ray started."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from adapterserve.server.app import build_app
from adapterserve.server.ports import free_port

MODEL = Path(__file__).parents[1] / "fixtures" / "adapterhub" / "tiny-llama"
SAYS = 'direct must be "auto", true or false'
BAD = ["yes", "on", "true", "True", "AUTO", " auto", "", 0, 1, 2, -1, 1.0, 0.0, math.nan, math.inf, None,
       [], ["auto"], [True], {}, {"auto": True}, b"auto"]


@pytest.mark.parametrize("value", BAD, ids=[repr(v) for v in BAD])
def test_a_bad_direct_value_is_refused_naming_it(value):
    with pytest.raises(ValueError) as refused:
        build_app({"model": str(MODEL), "encoder": False, "direct": value})
    assert str(refused.value).startswith(SAYS) and str(refused.value).endswith(f"got {value!r}")


@pytest.mark.parametrize("value", ["auto", True, False])
def test_good_values_build_the_app(value):
    build_app({"model": str(MODEL), "encoder": False, "direct": value})


def test_a_bad_direct_value_stops_the_server_before_it_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"direct": "yes"}))
    done = subprocess.run(
        [sys.executable, "-m", "adapterserve.clients.cli", "serve", "--model", str(MODEL), "--no-encoder",
         "--store", str(tmp_path / "store"), "--config", str(tmp_path / "config.json"),
         "--grpc-port", str(free_port()), "--http-port", str(free_port())],
        capture_output=True, text=True, timeout=300, start_new_session=True, check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and SAYS in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Ray" not in done.stdout
