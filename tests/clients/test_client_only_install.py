"""A client-only install: the working tree built as a wheel and installed with the
[client] extra alone into a fresh venv (one pip install, from the package index), where
torch and the rest of the engine and the server cannot be imported. That venv's
`adapterserve` runs a session against the live server: info, list, generate (the tokens
of PEFT + transformers), classify, upload (its local check without torch), delete."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from tests.helpers.live_server import ALICE

ROOT = Path(__file__).parents[2]
ABSENT = ["torch", "transformers", "triton", "numpy", "safetensors", "ray", "yaml"]
PROMPT = "The lighthouse keeper"


def _run(*argv: str | Path, cwd: Path, timeout: float = 120, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ADAPTERSERVE_")}
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=timeout)


def _wheel(out: Path) -> Path:
    """The working tree's wheel (built from a copy, so no build files land in the tree)."""
    source = out / "source"
    shutil.copytree(ROOT / "adapterserve", source / "adapterserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out,
                 source, cwd=out, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("adapterserve-*.whl")
    return wheel


@pytest.fixture(scope="module")
def thin(tmp_path_factory) -> Path:
    """A venv holding adapterserve[client] and nothing else; returns its bin directory."""
    root = tmp_path_factory.mktemp("thin")
    wheel = _wheel(root)
    venv.create(root / "venv", with_pip=True)
    bin_dir = root / "venv" / "bin"
    installed = _run(bin_dir / "pip", "install", "-q", f"{wheel}[client]", cwd=root, timeout=600)
    assert installed.returncode == 0, installed.stderr
    return bin_dir


def test_the_wheel_ships_the_proto(thin):
    (wheel,) = thin.parents[1].glob("adapterserve-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert "go_package" in z.read("adapterserve/proto/adapterserve.proto").decode()


def test_only_the_client_is_installed(thin):
    code = (f"import importlib.util, json, adapterserve; print(json.dumps([adapterserve.__file__, "
            f"[m for m in {ABSENT!r} if importlib.util.find_spec(m)]]))")
    done = _run(thin / "python", "-c", code, cwd=thin)
    assert done.returncode == 0, done.stderr
    package, importable = json.loads(done.stdout)
    assert Path(package).is_relative_to(thin.parent) and importable == []
    done = _run(thin / "python", "-c", "import adapterserve; adapterserve.Engine", cwd=thin)
    assert "pip install 'adapterserve[engine]'" in done.stderr.splitlines()[-1]
    done = _run(thin / "adapterserve", "serve", cwd=thin)
    assert done.returncode == 2 and done.stderr.endswith("serving needs pip install 'adapterserve[serve]'\n")


def test_a_session_with_the_thin_cli(thin, server, uploaded, lora_dirs, reference, alice):
    def cli(*argv: str, stdin: str | None = None) -> str:
        done = _run(thin / "adapterserve", *argv, "--server", server.grpc, "--api-key", ALICE, cwd=thin, stdin=stdin)
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert json.loads(cli("info"))["backbone_id"] == alice.server_info().backbone_id
    assert set(uploaded.values()) <= {line.split()[0] for line in cli("list").splitlines()[1:]}
    got = json.loads(cli("generate", "--json", "--temperature", "0", "--max-tokens", "8", "--adapter", "sql", PROMPT))
    assert got["token_ids"] == reference("sql", PROMPT, 8)[0]
    labels = [line.split("\t")[0] for line in cli("classify", "--adapter", "sentiment", "-",
                                                  stdin="what a wonderful film\na dull and boring mess\n").splitlines()]
    assert labels == [c.label for c in alice.classify(["what a wonderful film", "a dull and boring mess"], "sentiment")]
    assert cli("upload", str(lora_dirs["poem"]), "--name", "thin-poem").splitlines()[-1] == "thin-poem@1"
    assert alice.get_adapter("thin-poem").content_hash == alice.get_adapter(uploaded["poem"]).content_hash
    assert cli("delete", "thin-poem") == "deleted thin-poem@1\n"


def test_an_unfit_adapter_is_refused_by_the_server(thin, server, tiny_model, lora_dirs, alice, tmp_path):
    from adapterserve.clients.types import ClientError
    from tests.helpers import make_bad_adapter

    bad = make_bad_adapter("nan_weights", tiny_model, lora_dirs["chat"], tmp_path / "nan")
    done = _run(thin / "adapterserve", "upload", bad, "--name", "thin-bad", "--server", server.grpc,
                "--api-key", ALICE, cwd=thin)
    assert done.returncode == 1 and done.stderr.startswith("error: INVALID_ARGUMENT: ")  # checked there, not here
    assert "NaN or Inf values" in done.stderr and done.stderr.count("\n") == 1
    with pytest.raises(ClientError, match="NOT_FOUND"):
        alice.get_adapter("thin-bad")
