"""vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, and `adapterserve upload s3://...`,
against the live server: adapters read from its allowed local folder and from an allowed
prefix of a real S3 server (moto) generate exactly as the same files uploaded; everything
else is refused with the field named and nothing stored."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

from tests.helpers.live_server import ALICE, BOB, S3_ALLOWED, run_cli

GREEDY = {"prompt": "To make bread you need", "max_tokens": 8, "temperature": 0, "return_token_ids": True}


def _post(server, route: str, body: dict, key: str | None = ALICE) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{server.http}/v1/{route}", json=body, headers=headers, timeout=120)


def _tokens(server, model: str) -> list[int]:
    reply = _post(server, "completions", {"model": model, **GREEDY})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def _local_source(server, name: str, source: Path) -> Path:
    target = Path(server.config["lora_sources"][0]) / name
    if not target.exists():
        shutil.copytree(source, target)
    return target


def test_a_local_directory_loads_as_the_next_version_and_generates_as_uploaded(server, uploaded, lora_dirs):
    path = _local_source(server, "poem-copy", lora_dirs["poem"])
    reply = _post(server, "load_lora_adapter", {"lora_name": "byref-local", "lora_path": str(path)})
    assert reply.status_code == 200, reply.text
    loaded = reply.json()
    assert (loaded["id"], loaded["lora_name"], loaded["version"], loaded["parent"]) == (
        "byref-local@1", "byref-local", 1, "tiny-llama")
    again = _post(server, "load_lora_adapter", {"lora_name": "byref-local", "lora_path": str(path)})
    assert again.json()["id"] == "byref-local@1"  # the same content: the same version
    assert _tokens(server, "byref-local") == _tokens(server, uploaded["poem"])


def test_an_s3_prefix_loads_and_the_cli_loads_by_reference(server, moto_s3, uploaded, lora_dirs):
    uri = moto_s3.put_dir(lora_dirs["sql"], f"{S3_ALLOWED}/sql")
    reply = _post(server, "load_lora_adapter", {"lora_name": "byref-s3", "lora_path": uri})
    assert reply.status_code == 200, reply.text
    assert _tokens(server, reply.json()["id"]) == _tokens(server, uploaded["sql"])
    uri = moto_s3.put_dir(lora_dirs["chat"], f"{S3_ALLOWED}/chat")
    status, out, err = run_cli("upload", uri, "--name", "byref-cli", "--server", server.grpc, "--http-url",
                               server.http, "--api-key", ALICE)
    assert (status, out.strip()) == (0, "byref-cli@1"), err
    assert _tokens(server, "byref-cli") == _tokens(server, uploaded["chat"])
    status, out, err = run_cli("upload", f"s3://{moto_s3.bucket}/elsewhere", "--name", "x", "--server", server.grpc,
                               "--http-url", server.http, "--api-key", ALICE)
    assert status == 1 and "HTTP 403" in err and "is not under an S3 location" in err


def _refusal(reply: requests.Response) -> tuple[int, str | None, str]:
    error = reply.json()["error"]
    return reply.status_code, error["param"], error["message"]


@pytest.fixture(scope="module")
def bad_adapter(server, lora_dirs) -> Path:
    path = _local_source(server, "bad", lora_dirs["sql"])
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["nope"]}))
    return path


def test_loads_outside_the_sources_or_of_unfit_files_are_refused_and_store_nothing(server, alice, moto_s3,
                                                                                    uploaded, bad_adapter):
    allowed = Path(server.config["lora_sources"][0])
    cases = [
        ({"lora_name": "r1", "lora_path": str(allowed.parent)}, 403, "lora_path", "is not under a directory"),
        ({"lora_name": "r2", "lora_path": str(server.store_dir)}, 403, "lora_path", "is not under a directory"),
        ({"lora_name": "r3", "lora_path": "sources/x"}, 400, "lora_path", "must be an absolute path"),
        ({"lora_name": "r4", "lora_path": str(allowed / "missing")}, 400, None, "does not exist"),
        ({"lora_name": "r5", "lora_path": str(bad_adapter)}, 400, None, "adapter_config.json"),
        ({"lora_name": "r6", "lora_path": f"s3://{moto_s3.bucket}/other"}, 403, "lora_path", "not under an S3"),
        ({"lora_name": "r7", "lora_path": f"s3://{moto_s3.bucket}/{S3_ALLOWED}/none"}, 404, "lora_path",
         "holds no adapter files"),
        ({"lora_name": "R8", "lora_path": str(bad_adapter)}, 400, "lora_name", "is invalid"),
    ]
    for body, status, param, says in cases:
        got = _refusal(_post(server, "load_lora_adapter", body))
        assert got[:2] == (status, param) and says in got[2], (body, got)
        assert not [a for a in alice.list_adapters() if a.name == body["lora_name"]]
    taken = _refusal(_post(server, "load_lora_adapter", {"lora_name": "sql", "lora_path": str(bad_adapter)}, BOB))
    assert taken[:2] == (403, "lora_name") and "belongs to another tenant" in taken[2]
    assert _post(server, "load_lora_adapter", {"lora_name": "r9", "lora_path": "/x"}, key=None).status_code == 401


def test_unload_deletes_like_delete_adapter(server, uploaded, lora_dirs):
    path = _local_source(server, "poem-unload", lora_dirs["poem"])
    assert _post(server, "load_lora_adapter", {"lora_name": "byref-gone", "lora_path": str(path)}).status_code == 200
    assert _post(server, "completions", {"model": "byref-gone@1", **GREEDY}).status_code == 200  # resolved: cached
    assert _refusal(_post(server, "unload_lora_adapter", {"lora_name": "byref-gone"}, BOB))[:2] == (404, "lora_name")
    reply = _post(server, "unload_lora_adapter", {"lora_name": "byref-gone"})
    assert reply.status_code == 200 and reply.json() == {"deleted": ["byref-gone@1"]}
    gone = _post(server, "completions", {"model": "byref-gone@1", **GREEDY})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    assert _refusal(_post(server, "unload_lora_adapter", {"lora_name": "byref-gone"}))[:2] == (404, "lora_name")


def test_the_openai_sdk_loads_as_docs_switching_shows(server, moto_s3, uploaded, lora_dirs):
    openai = pytest.importorskip("openai")
    uri = moto_s3.put_dir(lora_dirs["poem"], f"{S3_ALLOWED}/poem")
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key=ALICE, max_retries=0) as client:
        loaded = client.post("/load_lora_adapter", body={"lora_name": "byref-sdk", "lora_path": uri}, cast_to=object)
        reply = client.chat.completions.create(model="byref-sdk", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": "Top 5 customers?"}])
    assert loaded["id"] == "byref-sdk@1" and reply.choices[0].message.content is not None
