"""Classify and Embed through real Ray Serve + gRPC: the embedded default encoder
(all-MiniLM-L6-v2) with the example adapters preloaded gives what EncoderEngine
gives in-process on the same texts; refusals carry the right status codes."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from tests.helpers.live_server import ALICE, run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "adapters"
TEXTS = {
    "sentiment": ["what a wonderful, moving film", "a dull and boring mess", "I loved every minute"],
    "topic": ["the team won the match in extra time", "shares fell after the earnings call",
              "the new phone has a faster chip"],
}
TOL = 1e-4


@pytest.fixture(scope="module")
def local_engine():
    """The reference: EncoderEngine in this process with the example adapters."""
    from adapterserve.engine.encoder_engine import EncoderEngine
    from adapterserve.models.encoder_loader import default_encoder_dir

    engine = EncoderEngine.from_pretrained(default_encoder_dir())
    engine.load_adapter("sentiment", EXAMPLES / "sentiment-lora")
    engine.load_adapter("topic", EXAMPLES / "topic-bottleneck")
    return engine


def _slim_lora(path: Path, head: bool) -> Path:
    """The sentiment LoRA on `query` only (under the test server's upload limit), with or without its head."""
    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True)
    config = json.loads((EXAMPLES / "sentiment-lora" / "adapter_config.json").read_text())
    config["target_modules"] = ["query"]
    if not head:
        config.update(modules_to_save=None, task_type="FEATURE_EXTRACTION")
    (path / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(EXAMPLES / "sentiment-lora" / "adapter_model.safetensors")
    keep = {k: v for k, v in tensors.items() if ".query." in k or (head and "classifier" in k)}
    save_file(keep, path / "adapter_model.safetensors")
    return path


@pytest.fixture(scope="module")
def slim(server, tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """alice uploads (with the CLI) the slim LoRA with and without head: kind -> (directory, ref)."""
    root, refs = tmp_path_factory.mktemp("slim"), {}
    for name, head in (("slim-head", True), ("slim-plain", False)):
        path = _slim_lora(root / name, head)
        status, out, err = run_cli("upload", str(path), "--name", name, "--server", server.grpc, "--api-key", ALICE)
        assert status == 0, err
        refs[name] = (path, out.strip().splitlines()[-1])
    return refs


@pytest.mark.parametrize("task", ["sentiment", "topic"])
def test_classify_equals_the_engine_in_process(alice, local_engine, task):
    served = alice.classify(TEXTS[task], adapter=task)
    expected = local_engine.classify(TEXTS[task], task)
    assert [r.label for r in served] == [e.label for e in expected]
    for r, e in zip(served, expected):
        assert r.labels == e.labels and r.label_index == e.label_index
        assert r.probabilities == pytest.approx(e.probabilities, abs=TOL)


def test_classify_gives_meaningful_answers(alice):
    assert [r.label for r in alice.classify(TEXTS["sentiment"], adapter="sentiment")] == \
        ["positive", "negative", "positive"]
    assert [r.label for r in alice.classify(TEXTS["topic"], adapter="topic")] == ["sports", "business", "tech"]


def test_embed_equals_the_engine_in_process(alice, local_engine):
    texts = TEXTS["sentiment"]
    for adapter in (None, "sentiment"):
        served = alice.embed(texts, adapter=adapter)
        expected = local_engine.embed(texts, adapter)
        assert len(served[0]) == 384
        for s, e in zip(served, expected):
            assert s == pytest.approx(e.embedding, abs=TOL)


def test_an_uploaded_encoder_adapter_is_served(alice, local_engine, slim):
    path, ref = slim["slim-head"]
    assert alice.get_adapter(ref).kind == "lora"
    local_engine.load_adapter("slim-head", path)
    try:
        expected = local_engine.classify(TEXTS["sentiment"], "slim-head")
    finally:
        local_engine.unload_adapter("slim-head")
    served = alice.classify(TEXTS["sentiment"], adapter=ref)
    assert [r.probabilities for r in served] == [pytest.approx(e.probabilities, abs=TOL) for e in expected]


def test_unknown_adapter_is_not_found(alice):
    from adapterserve.clients.types import ClientError

    for call in (lambda: alice.classify(["x"], adapter="no-such"), lambda: alice.embed(["x"], adapter="no-such")):
        with pytest.raises(ClientError) as e:
            call()
        assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_adapter_without_head_cannot_classify(alice, slim):
    from adapterserve.clients.types import ClientError

    headless = slim["slim-plain"][1]
    with pytest.raises(ClientError) as e:
        alice.classify(["x"], adapter=headless)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no classification head" in e.value.details
    assert len(alice.embed(["x"], adapter=headless)[0]) == 384


@pytest.mark.parametrize("texts, message", [([], "texts is empty"), (["x"] * 300, "at most 256")])
def test_bad_text_lists_are_invalid(alice, texts, message):
    from adapterserve.clients.types import ClientError

    with pytest.raises(ClientError) as e:
        alice.classify(texts, adapter="sentiment")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details


def test_generate_with_an_encoder_adapter_is_refused(alice):
    from adapterserve.clients.types import ClientError

    with pytest.raises(ClientError) as e:
        alice.generate("Hello", adapter="sentiment", max_tokens=2)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "serves classify and embed only" in e.value.details and "adapterserve generate" in e.value.details


def test_classify_with_a_generation_adapter_is_refused(alice, uploaded):
    from adapterserve.clients.types import ClientError

    with pytest.raises(ClientError) as e:
        alice.classify(["x"], adapter="sql")
    assert e.value.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


def test_server_info_names_the_encoder(alice):
    info = alice.server_info()
    assert info.encoder_id and info.encoder_id != info.backbone_id
    assert info.model_type == "llama"


def test_cli_classify_and_embed(server):
    base = ("--server", server.grpc, "--api-key", ALICE)
    status, out, err = run_cli("classify", "--adapter", "sentiment", *base, *TEXTS["sentiment"][:2])
    assert status == 0, err
    lines = out.strip().splitlines()
    assert [line.split("\t")[0] for line in lines] == ["positive", "negative"]
    assert 0.5 < float(lines[0].split("\t")[1]) <= 1.0
    status, out, err = run_cli("classify", "--adapter", "topic", "--json", *base, TEXTS["topic"][0])
    assert status == 0 and json.loads(out)["label"] == "sports"
    status, out, err = run_cli("embed", "--json", *base, "hello", "world")
    assert status == 0 and [len(json.loads(line)) for line in out.strip().splitlines()] == [384, 384]
    status, out, err = run_cli("embed", *base, "hello")
    assert status == 0 and out.startswith("384 dims: [")
    status, out, err = run_cli("classify", "--adapter", "nope", *base, "x")
    assert status == 1 and "NOT_FOUND" in err


def test_async_client_classify(server):
    from adapterserve.clients.client import AsyncClient

    async def run():
        async with AsyncClient(server.grpc, api_key=ALICE, timeout=60) as client:
            return await client.classify(TEXTS["sentiment"][:1], adapter="sentiment"), await client.embed(["hello"])

    results, vectors = asyncio.run(run())
    assert results[0].label == "positive" and len(vectors[0]) == 384


def test_a_pinned_adapter_is_loaded_at_start_and_kept(server):
    from ray import serve

    from adapterserve.adapters_store.store import open_store
    from adapterserve.server.settings import DEFAULTS

    app = server.config.get("app_name", DEFAULTS["app_name"])
    sentiment = open_store(str(server.store_dir)).resolve("sentiment", tenant=None)
    async def describe(deployment: str) -> dict:  # handles run on the caller's event loop here
        handle = serve.get_deployment_handle(deployment, app_name=app)
        return (await handle.describe.remote())["live"]

    async def both() -> tuple[dict, dict]:
        return await describe("EncoderReplica"), await describe("EngineReplica")

    encoder, model = asyncio.run(both())
    assert encoder["pinned_adapters"] == [sentiment.content_hash]
    assert sentiment.content_hash in encoder["loaded_adapters"]
    assert model["pinned_adapters"] == []
