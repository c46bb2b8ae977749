"""The command line without a server: argument handling, config from flags, exit codes."""
from __future__ import annotations

import io
import json

import pytest

from adapterserve.clients import cli
from adapterserve.clients.client import generate_request


def _serve_args(*extra: str):
    return cli._parser().parse_args(["serve", *extra])


def test_serve_without_flags_is_the_embedded_default():
    assert cli.serve_config(_serve_args()) == {}


def test_serve_flags_become_config_overrides(tmp_path):
    (tmp_path / "c.yaml").write_text("engine: {max_loras: 4}\nreplica: {max_queued_requests: 9}\n")
    args = _serve_args("--model", "/m", "--store", "s3://b/p", "--replicas", "3", "--device", "cuda",
                       "--api-keys", "/k", "--config", str(tmp_path / "c.yaml"))
    assert cli.serve_config(args) == {
        "model": "/m", "store": "s3://b/p", "api_keys_file": "/k",
        "engine": {"max_loras": 4, "device": "cuda"},
        "replica": {"max_queued_requests": 9, "num_replicas": 3},
    }


def test_serve_no_warmup_turns_the_engine_warm_up_off():
    assert cli.serve_config(_serve_args("--no-warmup")) == {"engine": {"warmup": False}}


def test_generate_needs_exactly_one_prompt(capsys):
    assert cli.main(["generate", "--server", "127.0.0.1:1"]) == 2
    assert "either PROMPT or --prompt-token-ids" in capsys.readouterr().err
    assert cli.main(["generate", "--server", "127.0.0.1:1", "--prompt-token-ids", "1,x"]) == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_unreachable_server_is_reported(capsys):
    status = cli.main(["list", "--server", "127.0.0.1:1"])
    assert status == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")


def test_upload_of_a_missing_directory_is_a_local_error(capsys, tmp_path):
    assert cli.main(["upload", str(tmp_path / "none"), "--name", "x", "--server", "127.0.0.1:1"]) == 2


def test_request_fields():
    r = generate_request([1, 2], adapter="a@2", max_tokens=5, temperature=0.0, seed=3, stop=["."])
    assert list(r.token_ids.ids) == [1, 2] and r.adapter == "a@2"
    assert r.sampling.HasField("temperature") and r.sampling.temperature == 0.0
    assert not r.sampling.HasField("top_p")
    assert json.loads(json.dumps(list(r.sampling.stop))) == ["."]


def test_missing_command_is_a_usage_error():
    with pytest.raises(SystemExit):
        cli.main([])


def test_serve_encoder_flags():
    assert cli.serve_config(_serve_args("--encoder", "/enc")) == {"encoder": "/enc"}
    assert cli.serve_config(_serve_args("--no-encoder")) == {"encoder": False}
    with pytest.raises(ValueError, match="not both"):
        cli.serve_config(_serve_args("--encoder", "/enc", "--no-encoder"))


def test_classify_needs_an_adapter_and_texts():
    with pytest.raises(SystemExit):
        cli.main(["classify", "--server", "127.0.0.1:1", "some text"])
    with pytest.raises(SystemExit):
        cli.main(["classify", "--server", "127.0.0.1:1", "--adapter", "sentiment"])


def test_serve_grace_period_flag():
    assert cli.serve_config(_serve_args("--grace-period", "45")) == {"drain_grace_s": 45.0}
    assert cli.serve_config(_serve_args("--grace-period", "0")) == {"drain_grace_s": 0.0}  # cut at once
    with pytest.raises(SystemExit):
        _serve_args("--grace-period", "-1")


def test_version_is_the_package_version(capsys):
    import importlib.metadata

    import adapterserve

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"adapterserve {adapterserve.__version__}\n"
    assert importlib.metadata.version("adapterserve") == adapterserve.__version__, "one version, from __init__"


@pytest.mark.parametrize("argv, stdin, message", [
    (["generate", "-"], "", "error: PROMPT is - but stdin held no text\n"),
    (["generate", "-"], "\n", "error: PROMPT is - but stdin held no text\n"),
    (["classify", "--adapter", "sentiment", "-"], "\n  \n", "error: TEXT is - but stdin held no text (one text per line)\n"),
    (["embed", "-", "-"], "a\n", "error: give - (stdin) as TEXT once\n"),
])
def test_stdin_that_holds_no_input_is_a_local_error(argv, stdin, message, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert cli.main([*argv, "--server", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == message


def test_stdin_that_is_not_text_is_a_local_error(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9 au lait\n"), encoding="utf-8"))
    assert cli.main(["embed", "-", "--server", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "error: stdin is not utf-8 text: invalid continuation byte at byte 3\n"



def test_serve_direct_flag_maps_to_the_setting():
    assert cli.serve_config(_serve_args("--direct", "on")) == {"direct": True}
    assert cli.serve_config(_serve_args("--direct", "off")) == {"direct": False}
    assert cli.serve_config(_serve_args("--direct", "auto")) == {"direct": "auto"}
    with pytest.raises(SystemExit):
        _serve_args("--direct", "yes")


def test_serve_replica_grpc_port_flag_maps_to_the_setting_on_host():
    assert cli.serve_config(_serve_args("--replica-grpc-port", "50061")) == {
        "replica_grpc": {"port": 50061, "host": "127.0.0.1"}}
    assert cli.serve_config(_serve_args("--replica-grpc-port", "50061", "--host", "0.0.0.0")) == {
        "replica_grpc": {"port": 50061, "host": "0.0.0.0"}}
    with pytest.raises(SystemExit):
        _serve_args("--replica-grpc-port", "many")


def test_serve_replica_grpc_workers_flag_maps_to_the_setting():
    assert cli.serve_config(_serve_args("--replica-grpc-port", "50061", "--replica-grpc-workers", "4")) == {
        "replica_grpc": {"port": 50061, "host": "127.0.0.1", "workers": 4}}
    assert cli.serve_config(_serve_args("--replica-grpc-workers", "0")) == {"replica_grpc": {"workers": 0}}
    with pytest.raises(SystemExit):
        _serve_args("--replica-grpc-workers", "four")
