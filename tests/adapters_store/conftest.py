"""Fixtures for the adapter store: one real S3-compatible server (moto, over HTTP on
loopback) per session, a fresh bucket per test, and small dummy adapter directories."""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.adapters_store.store import AdapterStore

_AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    """URL of a moto S3 server on 127.0.0.1, with fake credentials in the environment."""
    server_mod = pytest.importorskip("moto.server")
    pytest.importorskip("boto3")
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _AWS_ENV.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN"):
            mp.delenv(name, raising=False)
        server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        yield f"http://{host}:{port}"
        server.stop()


@pytest.fixture
def s3_client(s3_endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint)


@pytest.fixture
def s3_bucket(s3_client) -> str:
    """A fresh, empty bucket for this test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    s3_client.create_bucket(Bucket=name)
    return name


StoreFactory = Callable[..., AdapterStore]


@pytest.fixture(params=["local", "s3"])
def make_store(request, tmp_path: Path) -> StoreFactory:
    """Builds store objects over one fresh root (directory or bucket); call again to 'restart'."""
    if request.param == "local":
        from adapterserve.adapters_store.local import LocalStore

        return lambda limits=None: LocalStore(tmp_path / "store", limits=limits)
    from adapterserve.adapters_store.s3 import S3Store

    endpoint, bucket = request.getfixturevalue("s3_endpoint"), request.getfixturevalue("s3_bucket")
    counter = iter(range(1_000_000))

    def build(limits: StoreLimits | None = None) -> AdapterStore:
        cache = tmp_path / f"s3-cache-{next(counter)}"  # a fresh download cache per store object
        return S3Store(f"s3://{bucket}/adapters", endpoint_url=endpoint, cache_dir=cache, limits=limits)

    return build


@pytest.fixture
def store(make_store: StoreFactory) -> AdapterStore:
    return make_store()


def write_adapter(directory: Path, seed: int = 0, rank: int = 2, extra: dict[str, bytes] | None = None) -> Path:
    """A tiny PEFT-looking LoRA: adapter_config.json + adapter_model.safetensors (+ `extra` files)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(rank, 8, generator=g),
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, rank, generator=g),
    }
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    for name, data in (extra or {}).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Callable[..., Path]:
    """`adapter_dir(seed)` -> a fresh dummy adapter directory; equal seeds give equal bytes."""
    counter = iter(range(1_000_000))
    return lambda seed=0, **kw: write_adapter(tmp_path / f"adapter-{next(counter)}", seed, **kw)
