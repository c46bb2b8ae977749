"""Bad uploads are refused with INVALID_ARGUMENT and leave nothing in the store:
unfit adapters (checked against the served backbone), and broken transfers."""
from __future__ import annotations

import grpc
import pytest

from adapterserve.clients.types import ClientError
from adapterserve.clients.upload_stream import collect_files, upload_messages
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc
from tests.helpers import PICKLE_SENTINEL, make_bad_adapter, make_peft_lora
from tests.helpers.live_server import ALICE, MAX_UPLOAD_BYTES, run_cli

UNFIT = ["invalid_config", "no_config", "out_features_mismatch", "in_features_mismatch", "layer_out_of_range",
         "nan_weights", "inf_weights", "pickle_only", "corrupt_weights", "missing_lora_b", "dora"]


def _assert_nothing_stored(server, alice, name: str) -> None:
    assert name not in {a.name for a in alice.list_adapters()}
    assert not (server.store_dir / "meta" / name).exists()
    assert not (server.store_dir / "data" / name).exists()


def _refused(alice, directory, name: str) -> ClientError:
    with pytest.raises(ClientError) as info:
        alice.upload(directory, name)
    assert info.value.code is grpc.StatusCode.INVALID_ARGUMENT, info.value
    return info.value


@pytest.mark.parametrize("case", UNFIT)
def test_unfit_adapter_is_refused(server, alice, tiny_model, lora_dirs, tmp_path, case):
    bad = make_bad_adapter(case, tiny_model, lora_dirs["chat"], tmp_path / case)
    name = f"bad-{case.replace('_', '-')}"
    _refused(alice, bad, name)
    _assert_nothing_stored(server, alice, name)
    assert not (bad / PICKLE_SENTINEL).exists(), "the server unpickled an upload"


def test_truncated_safetensors_is_refused(server, alice, lora_dirs, tmp_path):
    import shutil

    bad = shutil.copytree(lora_dirs["sql"], tmp_path / "cut")
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    error = _refused(alice, bad, "cut")
    assert "safetensors" in error.details or "adapter_model" in error.details
    _assert_nothing_stored(server, alice, "cut")


def test_rank_above_the_servers_limit_is_refused(server, alice, tiny_model, tmp_path):
    big = make_peft_lora(tiny_model, tmp_path / "r32", r=32, lora_alpha=32, target_modules=["q_proj"])
    assert "maximum rank 16" in _refused(alice, big, "big-rank").details
    _assert_nothing_stored(server, alice, "big-rank")


def test_oversized_upload_is_refused(server, alice, lora_dirs, tmp_path):
    import shutil

    big = shutil.copytree(lora_dirs["sql"], tmp_path / "big")
    (big / "adapter.safetensors").write_bytes(b"x" * MAX_UPLOAD_BYTES)  # an accepted name, too big
    assert f"limit of {MAX_UPLOAD_BYTES} bytes" in _refused(alice, big, "oversized").details
    _assert_nothing_stored(server, alice, "oversized")


def _send(server, messages) -> grpc.RpcError:
    with grpc.insecure_channel(server.grpc) as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.AdapterServeStub(channel).UploadAdapter(iter(messages), metadata=[("x-api-key", ALICE)],
                                                            timeout=60)
    return info.value


def _messages(directory, name):
    return list(upload_messages(name, collect_files(directory)))


@pytest.mark.parametrize("damage", ["truncated", "extra_bytes", "wrong_sha", "unsafe_path", "no_header"])
def test_broken_transfer_is_refused(server, alice, lora_dirs, damage):
    name = f"broken-{damage.replace('_', '-')}"
    messages = _messages(lora_dirs["chat"], name)
    header, chunks = messages[0], messages[1:]
    if damage == "truncated":
        last = chunks[-1].chunk
        chunks[-1].chunk.data = last.data[: len(last.data) // 2]
    elif damage == "extra_bytes":
        chunks[-1].chunk.data += b"\0" * 16
    elif damage == "wrong_sha":
        header.header.files[0].sha256 = "0" * 64
    elif damage == "unsafe_path":
        header.header.files[0].path = "../escape.json"
    elif damage == "no_header":
        header = None
    error = _send(server, [m for m in [header, *chunks] if m is not None])
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error.details()
    _assert_nothing_stored(server, alice, name)


def test_cli_validates_locally_before_sending(server, alice, tiny_model, lora_dirs, tmp_path):
    bad = make_bad_adapter("nan_weights", tiny_model, lora_dirs["chat"], tmp_path / "nan")
    status, out, err = run_cli("upload", str(bad), "--name", "nan-cli", "--server", server.grpc, "--api-key", ALICE)
    assert status == 2 and "NaN" in err and out == ""
    status, _, err = run_cli("upload", str(bad), "--name", "nan-cli", "--server", server.grpc, "--api-key", ALICE,
                             "--no-validate")
    assert status == 1 and err.startswith("error: INVALID_ARGUMENT")
    _assert_nothing_stored(server, alice, "nan-cli")


def test_same_content_again_is_the_same_version(alice, lora_dirs, uploaded):
    assert alice.upload(lora_dirs["sql"], "sql").ref == uploaded["sql"]
