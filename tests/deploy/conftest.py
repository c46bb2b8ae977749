"""Rendered manifests for the deploy tests: `kubectl kustomize` of the base and every overlay.

kubectl is required in CI (CI=true): there a missing kubectl fails these tests;
on a developer machine without it they are skipped (scripts/install_kubectl.sh).
"""
from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest

from deploy.kustomize import K8S, KubectlMissing, find, kubectl, kustomization_dirs, render


@pytest.fixture(scope="session")
def kubectl_path() -> str:
    try:
        path = kubectl()
        version = subprocess.run([path, "version", "--client"], capture_output=True, text=True).stdout
        major = re.search(r"Kustomize Version: v(\d+)", version)
        if not major or int(major.group(1)) < 5:
            raise KubectlMissing(f"{path} lacks Kustomize v5+ ({version.strip()!r}): run scripts/install_kubectl.sh")
    except KubectlMissing as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    return path


@pytest.fixture(scope="session")
def rendered(kubectl_path) -> dict[str, list[dict[str, Any]]]:
    """'base' or 'overlays/NAME' -> its rendered documents."""
    return {d.relative_to(K8S).as_posix(): render(d) for d in kustomization_dirs()}


@pytest.fixture(scope="session")
def rayservices(rendered) -> dict[str, dict[str, Any]]:
    return {name: find(docs, "RayService") for name, docs in rendered.items()}
