"""The .proto the package ships is enough to talk to the server: Python stubs freshly
generated from it (grpc_tools.protoc into a temporary directory, imported from there in a
process of their own, never our modules) call every RPC against the live server and get
what our client gets. The file also names its Go and Java packages."""
from __future__ import annotations

import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from tests.helpers.live_server import ALICE

pytest.importorskip("grpc_tools")

SHIPPED = importlib.resources.files("adapterserve.proto") / "adapterserve.proto"
TEXTS = ["what a wonderful, moving film", "a dull and boring mess"]  # as fresh_stubs.py sends them


def _protoc(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{Path(str(SHIPPED)).parent}", *args,
                           str(SHIPPED)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_shipped_proto_names_packages_for_go_and_java(tmp_path):
    _protoc(f"--descriptor_set_out={tmp_path / 'set.pb'}")
    (file,) = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file
    assert file.package == "adapterserve.v1"
    assert file.options.go_package.endswith(";adapterservev1")
    assert file.options.java_package.endswith(".v1") and file.options.java_multiple_files


@pytest.fixture(scope="module")
def fresh(server, uploaded, lora_dirs, tmp_path_factory) -> dict:
    """What fresh_stubs.py got back, uploading the `sql` adapter's files as `stub-sql`."""
    stubs = tmp_path_factory.mktemp("stubs")
    _protoc(f"--python_out={stubs}", f"--grpc_python_out={stubs}")
    script = Path(__file__).with_name("fresh_stubs.py")
    done = subprocess.run([sys.executable, "-I", str(script), str(stubs), server.grpc, ALICE, str(lora_dirs["sql"]),
                           "stub-sql"], capture_output=True, text=True, timeout=300, cwd=stubs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_stubs_are_fresh(fresh):
    assert Path(fresh["stub_module"]).parent.name.startswith("stubs")
    assert fresh["ours_imported"] == []


def test_health_and_server_info(fresh, alice):
    assert fresh["health"] == {"": "SERVING", "adapterserve.v1.AdapterServe": "SERVING"}
    info, ours = fresh["server_info"], alice.server_info()
    assert (info["backbone_id"], info["vocab_size"], info["encoder_id"]) == (ours.backbone_id, ours.vocab_size,
                                                                             ours.encoder_id)
    assert {s["module"] for s in info["linear_shapes"]} == set(ours.linear_shapes)


def test_generate_streams_what_our_client_gets(fresh, alice, uploaded):
    ours = alice.generate("The lighthouse keeper", adapter="sql", max_tokens=8, temperature=0.0, ignore_eos=True)
    chunks = fresh["generate"]
    assert [t for c in chunks for t in c.get("token_ids", [])] == ours.token_ids and len(ours.token_ids) == 8
    assert "".join(c.get("text", "") for c in chunks) == ours.text
    assert chunks[0]["adapter"] == uploaded["sql"] and chunks[-1]["finish_reason"] == "length"
    assert fresh["generate_unknown_adapter"] == "NOT_FOUND"


def test_classify_and_embed_answer_as_for_our_client(fresh, alice):
    ours = alice.classify(TEXTS, "sentiment")
    assert [r["label"] for r in fresh["classify"]["results"]] == [c.label for c in ours]
    for got, want in zip(fresh["classify"]["results"], ours):
        assert got["probabilities"] == pytest.approx(want.probabilities, abs=1e-5)
    vectors = [e["values"] for e in fresh["embed"]["embeddings"]]
    for got, want in zip(vectors, alice.embed(TEXTS), strict=True):
        assert len(got) == len(want) > 0 and got == pytest.approx(want, abs=1e-5)


def test_upload_list_get_delete(fresh, alice, uploaded):
    upload = fresh["upload"]
    assert (upload["ref"], upload["kind"], upload["rank"]) == ("stub-sql@1", "lora", 4)
    assert upload["content_hash"] == alice.get_adapter(uploaded["sql"]).content_hash, "the same files"
    assert [a["ref"] for a in fresh["list"]["adapters"]] == ["stub-sql@1"]
    assert fresh["get"] == upload
    assert fresh["delete"]["deleted"] == ["stub-sql@1"]
    assert fresh["get_deleted"] == "NOT_FOUND"
