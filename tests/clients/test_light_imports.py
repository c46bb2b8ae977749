"""The client side stays light: importing the package, the client or the CLI, and a CLI
session against a live server, never import the engine's or the server's packages
(each checked in a fresh interpreter where all of them are installed). The server's own
command and app import no model package either: only its engine processes need them."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.live_server import ALICE

HEAVY = ["torch", "transformers", "triton", "ray", "numpy", "safetensors"]
LOADED_HEAVY = f"sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})"


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.parametrize("module", ["adapterserve", "adapterserve.clients.cli", "adapterserve.clients.client",
                                    "adapterserve.proto.adapterserve_pb2_grpc"])
def test_importing_the_client_side_imports_no_heavy_package(module):
    assert json.loads(_python(f"import sys, json, {module}; print(json.dumps({LOADED_HEAVY}))")) == []


@pytest.mark.parametrize("module", ["adapterserve.server.serve_command", "adapterserve.server.app"])
def test_the_server_imports_no_model_package_before_its_engine_runs(module):
    """`adapterserve serve` starts Ray with no torch or transformers loaded, and every deployment's
    module imports without them: a replica starts its engine process first, then loads them
    beside it."""
    code = f"import sys, json, {module}; print(json.dumps({LOADED_HEAVY}))"
    assert set(json.loads(_python(code))) <= {"ray", "numpy"}


def test_the_engine_names_still_load_on_first_use():
    code = ("import sys, adapterserve; assert 'torch' not in sys.modules; "
            "print(adapterserve.Engine.__module__, 'torch' in sys.modules)")
    assert _python(code).split() == ["adapterserve.engine.engine", "True"]


def test_a_cli_session_imports_no_heavy_package(server, uploaded):
    commands = [["list"], ["list", "sql"], ["info"], ["generate", "--max-tokens", "4", "Hello"],
                ["classify", "--adapter", "sentiment", "a wonderful film"], ["embed", "a wonderful film"]]
    code = (
        "import json, sys, contextlib, io\n"
        "from adapterserve.clients import cli\n"
        f"flags = ['--server', {server.grpc!r}, '--api-key', {ALICE!r}]\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    statuses = [cli.main([*argv, *flags]) for argv in {commands!r}]\n"
        f"print(json.dumps([statuses, {LOADED_HEAVY}]))\n"
    )
    statuses, heavy = json.loads(_python(code))
    assert statuses == [0] * len(commands)
    assert heavy == []
