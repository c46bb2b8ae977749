"""deploy/docker/Dockerfile, checked statically (no Docker engine here): one Ray version
everywhere, a non-root user, no weights in the image."""
from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml

from deploy.kustomize import DEPLOY

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".onnx")


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", " ", "\n".join(lines))
    parts = (line.strip().partition(" ") for line in joined.splitlines())
    return [(op.upper(), args.strip()) for op, _, args in parts if op]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def build_args() -> dict[str, str]:
    return dict(a.split("=", 1) for op, a in instructions() if op == "ARG" and "=" in a)


def test_ray_is_one_version_everywhere():
    import ray

    version = build_args()["RAY_VERSION"]
    assert build_args()["RAY_IMAGE"].startswith("rayproject/ray:${RAY_VERSION}-"), "Ray's image, at RAY_VERSION"
    assert any('"ray[serve]==${RAY_VERSION}"' in a for op, a in final_stage() if op == "RUN"), "pip pins ray"
    base = yaml.safe_load((DEPLOY / "k8s" / "base" / "rayservice.yaml").read_text())
    assert base["spec"]["rayClusterConfig"]["rayVersion"] == version
    assert yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())["applications"]  # parsed by that Ray
    assert ray.__version__ == version, "tests validate serveConfigV2 with the Ray the cluster runs"
    assert _pyproject_allows("ray", version)


def test_runs_as_a_non_root_user():
    users = [a for op, a in final_stage() if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")


def test_no_weights_in_the_image():
    copied = [a for op, a in instructions() if op in ("COPY", "ADD")]
    assert not [a for a in copied if "://" in a], "nothing downloaded by ADD"
    sources = [word for a in copied if "--from=" not in a for word in a.split()[:-1] if not word.startswith("--")]
    assert sorted(sources) == ["README.md", "adapterserve", "pyproject.toml"]
    lines = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    ignore = [line for line in lines if line and not line.startswith("#")]
    assert ignore[0] == "*", "the build context starts empty, then names what it needs"
    assert all(f"**/*{ext}" in ignore for ext in WEIGHTS)


def test_exposes_the_serve_ports():
    serve = yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    exposed = {int(p) for op, a in final_stage() if op == "EXPOSE" for p in a.split()}
    metrics = serve["applications"][0]["args"]["metrics"]["port"]
    assert {serve["http_options"]["port"], serve["grpc_options"]["port"], metrics} <= exposed


def test_runs_serve_as_adapterserve_serve_does():
    from adapterserve.server.serve_env import SERVE_ENV

    env = dict(pair.split("=", 1) for op, a in final_stage() if op == "ENV" for pair in a.split())
    assert SERVE_ENV.items() <= env.items(), "throughput mode and HAProxy ingress, as server/serve_env.py"


def _pyproject_allows(package: str, version: str) -> bool:
    from packaging.requirements import Requirement

    project = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return any(r.name == package and r.specifier.contains(version) for r in requirements)


def test_docker_stop_lets_serve_drain():
    """`docker stop` sends STOPSIGNAL (serve drains on SIGTERM), then SIGKILL after --stop-timeout:
    the documented --stop-timeout is longer than the default grace period."""
    from adapterserve.server.settings import DEFAULTS

    assert [a for op, a in final_stage() if op == "STOPSIGNAL"] == ["SIGTERM"]
    for text in (DOCKERFILE.read_text(), (DEPLOY.parent / "docs" / "reliability.md").read_text()):
        timeouts = [int(t) for t in re.findall(r"--stop-timeout (\d+)", text)]
        assert timeouts and all(t > DEFAULTS["drain_grace_s"] + 15 for t in timeouts)
