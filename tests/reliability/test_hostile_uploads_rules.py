"""Uploads through the live server: every family through the CLI (LoRA: the `uploaded` fixture) (checked locally with the
server's own check, from ServerInfo), an unfit (IA)^3 refused alike locally and by the
server, files outside the family refused by name, and `x` beside `x/y` a client mistake;
nothing stored for a refusal."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest
from peft import IA3Config

from adapterserve.clients.types import ClientError
from adapterserve.proto import adapterserve_pb2 as pb
from tests.helpers.families import family_configs, make_peft_adapter
from tests.helpers.live_server import ALICE, run_cli


def _stored(alice, name: str) -> bool:
    return name in {a.name for a in alice.list_adapters()}


ADAPTERHUB = Path(__file__).parents[1] / "fixtures" / "adapterhub"  # bottleneck adapters of the tiny Llama's shape


@pytest.mark.parametrize("family", ["ia3", "prompt", "p-tuning", "prefix", "houlsby", "pfeiffer"])
def test_each_family_uploads_through_the_cli(server, alice, tiny_model, tmp_path, family):
    if family in ("houlsby", "pfeiffer"):  # AdapterHub's format
        path = ADAPTERHUB / f"llama-{family}"
    else:
        path = make_peft_adapter(tiny_model, tmp_path / family, family_configs()[family])
    name = f"cli-{family}"
    status, out, err = run_cli("upload", str(path), "--name", name, "--server", server.grpc, "--api-key", ALICE)
    assert status == 0, err
    assert out.strip().splitlines()[-1] == f"{name}@1"
    alice.delete_adapter(name)


def test_server_info_describes_the_backbones_for_the_check(alice):
    backbones = alice.server_info().backbones
    assert backbones and {"servable", "limits", "linear_shapes"} <= set(backbones[0])
    assert json.loads(json.dumps(backbones)) == backbones


def test_an_unfit_ia3_is_refused_alike_by_the_cli_and_the_server(server, alice, tiny_model, tmp_path):
    config = IA3Config(task_type="CAUSAL_LM", target_modules=["gate_proj", "down_proj"],
                       feedforward_modules=["gate_proj"])
    path = make_peft_adapter(tiny_model, tmp_path / "fused", config)
    argv = ("upload", str(path), "--name", "fused-ia3", "--server", server.grpc, "--api-key", ALICE)
    status, out, local = run_cli(*argv)
    assert status == 2 and "feedforward_modules" in local and out == ""
    status, _, remote = run_cli(*argv, "--no-validate")
    assert status == 1 and remote.startswith("error: INVALID_ARGUMENT") and "feedforward_modules" in remote
    assert not _stored(alice, "fused-ia3")


def test_a_file_outside_the_family_is_refused_by_name(server, alice, lora_dirs, tmp_path):
    path = tmp_path / "with-junk"
    path.mkdir()
    for f in lora_dirs["sql"].iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    with open(path / "optimizer.pt.tar", "wb") as junk:
        junk.truncate(1 << 20)
    status, _, err = run_cli("upload", str(path), "--name", "junk", "--server", server.grpc, "--api-key", ALICE)
    assert status == 2 and "'optimizer.pt.tar' is not part of an adapter" in err
    with pytest.raises(ClientError) as refused:
        alice.upload(path, "junk")  # past the CLI: the server refuses it from the header
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT and "optimizer.pt.tar" in str(refused.value)
    assert not _stored(alice, "junk")


def test_a_file_beside_a_folder_of_its_name_is_invalid_argument(server, alice):
    files = {"x": b"1", "x/y": b"2"}
    entries = [pb.FileEntry(path=p, size=len(d), sha256=hashlib.sha256(d).hexdigest()) for p, d in files.items()]
    messages = [pb.UploadAdapterRequest(header=pb.UploadHeader(name="clash", files=entries))]
    messages += [pb.UploadAdapterRequest(chunk=pb.FileChunk(path=p, offset=0, data=d)) for p, d in files.items()]
    with grpc.insecure_channel(server.grpc) as channel:
        upload = channel.stream_unary("/adapterserve.v1.AdapterServe/UploadAdapter",
                                      request_serializer=pb.UploadAdapterRequest.SerializeToString,
                                      response_deserializer=pb.AdapterInfo.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            upload(iter(messages), metadata=[("authorization", f"Bearer {ALICE}")], timeout=60)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "'x' both as a file and as a folder" in refused.value.details()
    assert not _stored(alice, "clash")
