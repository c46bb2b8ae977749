"""Hostile `routing` settings (docs/scaling.md) given to `adapterserve serve --config`: refused
before anything starts, in one line naming the setting, exit status 2, no Ray started."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapterserve.server.ports import free_port

CASES = [  # each a server start (a process): the full set of values is tests/server/test_routing.py's
    ({"mode": ["adapter"]}, "routing.mode must be one of adapter, pow2, got ['adapter']"),
    ({"spill_queue_depth": "64"}, "routing.spill_queue_depth must be an integer >= 1 (requests a replica runs or "
                                  "queues before an adapter's requests go elsewhere) or null (the engine's "
                                  "max_num_seqs), got '64'"),
]


@pytest.mark.parametrize("routing, says", CASES, ids=[json.dumps(r) for r, _ in CASES])
def test_bad_routing_settings_stop_the_server_before_it_starts(tiny_model, tmp_path, routing, says):
    (tmp_path / "config.json").write_text(json.dumps({"routing": routing}))
    done = subprocess.run(
        [sys.executable, "-m", "adapterserve.clients.cli", "serve", "--model", str(tiny_model), "--no-encoder",
         "--store", str(tmp_path / "store"), "--config", str(tmp_path / "config.json"),
         "--grpc-port", str(free_port()), "--http-port", str(free_port())],
        capture_output=True, text=True, timeout=300, start_new_session=True,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: ") and says in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Ray" not in done.stdout
