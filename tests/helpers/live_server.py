"""One real Ray cluster and one adapterserve application for the whole session (a pytest
plugin registered by tests/conftest.py: tests/server and tests/reliability share it).

The server is started the way `adapterserve serve` starts it (the CLI's flags ->
config -> launch.start), on free loopback ports, with a tenants file (TENANTS): alice and
bob (use + publish, no quotas), and tenants for the tenancy tests (scoped keys, an admin,
quotas), and small limits so that overload and oversized uploads are cheap
to provoke. Three PEFT LoRA adapters are uploaded by alice with the CLI. The tiny Llama's
tokenizer has no chat template: the server gets the one the embedded default uses
(adapterserve/models/tiny_chat_template.jinja, through --chat-template). Adapters may be loaded by path from `lora_sources`: a local folder and
one prefix of a bucket on a moto S3 server (`moto_s3`). Traces go to an OTLP receiver in this
process (`otlp_collector`, gRPC on loopback) for the whole session.
"""
from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from adapterserve.server.serve_env import free_port
from adapterserve.server.settings import TINY_CHAT_TEMPLATE
from tests.helpers.lora import load_base, load_peft, make_peft_lora
from tests.helpers.moto_s3 import MotoS3, start_moto

if TYPE_CHECKING:
    from tests.helpers.otlp_collector import Collector

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")

ALICE, BOB = "alice-key-0123", "bob-key-4567"
# tests/server/test_tenancy.py's keys: read-only and publish-only keys of carol, an admin, and
# tenants with quotas (the store's; concurrent requests; tokens per minute)
CAROL_USE, CAROL_PUBLISH, ADMIN = "carol-use-key-1", "carol-publish-key-2", "ops-admin-key-3"
SMALL, BUSY, METERED = "small-key-4", "busy-key-5", "metered-key-6"
BUSY_CONCURRENCY, METERED_TOKENS = 2, 24
TENANTS = f"""# test tenants
tenants:
  alice:
    keys: [{{key: "{ALICE}", scopes: [use, publish]}}]
  bob:
    keys: [{{key: "{BOB}", scopes: [use, publish]}}]
  carol:
    keys:
      - {{key: "{CAROL_USE}", scopes: [use]}}
      - {{key: "{CAROL_PUBLISH}", scopes: [publish]}}
  ops:
    keys: [{{key: "{ADMIN}", scopes: [admin]}}]
  small:
    keys: [{{key: "{SMALL}", scopes: [use, publish]}}]
    quotas: {{versions_per_adapter: 2, adapters: 1}}
  busy:
    keys: [{{key: "{BUSY}", scopes: [use, publish]}}]
    quotas: {{concurrent_requests: {BUSY_CONCURRENCY}}}
  metered:
    keys: [{{key: "{METERED}", scopes: [use]}}]
    quotas: {{tokens_per_minute: {METERED_TOKENS}}}
"""
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # three adapters of different ranks and targets
    "sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], seed=1),
    "chat": dict(r=8, lora_alpha=16, target_modules=ALL, seed=2),
    "poem": dict(r=2, lora_alpha=4, target_modules=["o_proj", "down_proj"], use_rslora=True, seed=3),
}
MAX_RUNNING, MAX_WAITING = 8, 4  # per engine: max_num_seqs, max_queued_requests (beyond: shed)
MAX_IN_FLIGHT, MAX_HEALTH_WATCHES = 32, 4  # per ingress replica (beyond: shed)
MAX_UPLOAD_BYTES = 256 << 10
NUM_KV_BLOCKS = 64  # x 16 tokens: max_model_len 1024
STEP_BUDGET = 128  # tokens per engine step: longer prompts run in chunks
CHAT_TEMPLATE = TINY_CHAT_TEMPLATE
S3_ALLOWED = "allowed"  # the prefix of moto_s3's bucket the server may load adapters from
METRICS_ADAPTER_LABELS = 2  # adapters named in the metrics' adapter label (the session uses more)


@dataclass(frozen=True)
class Server:
    grpc: str
    http: str
    config: dict
    store_dir: Path
    grpc_port: int
    http_port: int
    metrics: str  # the metrics port's scrape URL (every series); GET {http}/metrics: the public ones



@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from adapterserve.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny-llama", "llama", seed=5)


@pytest.fixture(scope="session")
def lora_dirs(tiny_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_lora(tiny_model, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="session")
def moto_s3() -> MotoS3:
    """An S3 server with one empty bucket, for adapters loaded by reference."""
    pytest.importorskip("moto.server")
    running, s3 = start_moto()
    try:
        yield s3
    finally:
        running.stop()


@pytest.fixture(scope="session")
def otlp_collector() -> Collector:
    """The OTLP trace receiver the live server sends its spans to."""
    from tests.helpers.otlp_collector import collecting  # OpenTelemetry: only where it is installed

    with collecting("grpc") as collector:
        yield collector


@pytest.fixture(scope="session")
def server(ray_session, tiny_model, moto_s3, otlp_collector, tmp_path_factory) -> Server:
    """`adapterserve serve --model ... --store ... --api-keys ... --config ...` on free ports."""
    from ray import serve

    from adapterserve.clients import cli
    from adapterserve.server import launch

    root = tmp_path_factory.mktemp("server")
    (root / "keys").write_text(TENANTS)
    overrides = {
        "max_upload_bytes": MAX_UPLOAD_BYTES,
        "engine": {"max_lora_rank": 16, "max_loras": 4, "num_kv_blocks": NUM_KV_BLOCKS, "max_num_seqs": MAX_RUNNING,
                   "max_queued_requests": MAX_WAITING,
                   "max_num_batched_tokens": STEP_BUDGET},
        "max_in_flight": MAX_IN_FLIGHT,
        "max_health_watches": MAX_HEALTH_WATCHES,
        # two tiers (Ingress -> EngineReplica deployment); direct mode: tests/server/test_direct_served.py
        "direct": False,
        "encoder_pinned_adapters": ["sentiment"],  # an example adapter, published by the encoder at start
        "lora_sources": [str(root / "sources"), f"s3://{moto_s3.bucket}/{S3_ALLOWED}"],
        "lora_s3_options": moto_s3.options,
        "tracing": {"otlp_endpoint": otlp_collector.endpoint},
        # few adapter names, a table that never changes within a session, frequent reports
        "metrics": {"adapter_labels": METRICS_ADAPTER_LABELS, "label_refresh_s": 86400, "push_interval_s": 0.25},
    }
    (root / "sources").mkdir()
    (root / "config.json").write_text(json.dumps(overrides))
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    args = cli._parser().parse_args([
        "serve", "--model", str(tiny_model), "--store", str(root / "store"), "--api-keys", str(root / "keys"),
        "--config", str(root / "config.json"), "--grpc-port", str(grpc_port), "--http-port", str(http_port),
        "--chat-template", str(CHAT_TEMPLATE), "--metrics-port", str(metrics_port),
    ])
    config = cli.serve_config(args)
    try:
        endpoints = launch.start(config, grpc_port=grpc_port, http_port=http_port)
        yield Server(endpoints.grpc, endpoints.http, config, root / "store", grpc_port, http_port, endpoints.metrics)
    finally:
        serve.shutdown()


def run_cli(*argv: str) -> tuple[int, str, str]:
    """Run `adapterserve ARGV` in-process; returns (exit status, stdout, stderr)."""
    from adapterserve.clients import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(list(argv))
    return status, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def uploaded(server, lora_dirs) -> dict[str, str]:
    """alice uploads the three adapters with the CLI; name -> printed NAME@VERSION."""
    refs = {}
    for name, path in lora_dirs.items():
        status, out, err = run_cli("upload", str(path), "--name", name, "--server", server.grpc, "--api-key", ALICE)
        assert status == 0, err
        refs[name] = out.strip().splitlines()[-1]
    return refs


@pytest.fixture
def alice(server):
    from adapterserve.clients.client import Client

    with Client(server.grpc, api_key=ALICE, timeout=120) as client:
        yield client


@pytest.fixture
def bob(server):
    from adapterserve.clients.client import Client

    with Client(server.grpc, api_key=BOB, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def reference(tiny_model, lora_dirs):
    """(adapter name or None, prompt text, max_tokens) -> (token ids, text) from PEFT +
    transformers generating greedily, one request at a time."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    models: dict = {}
    eos = set(_eos_ids(tiny_model))

    def run(adapter: str | None, prompt: str, max_tokens: int) -> tuple[list[int], str]:
        if adapter not in models:
            models[adapter] = load_base(tiny_model) if adapter is None else load_peft(tiny_model, lora_dirs[adapter])
        enc = tokenizer(prompt, return_tensors="pt")  # with its attention mask: BOS is not padding
        with torch.no_grad():
            out = models[adapter].generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                                           pad_token_id=tokenizer.pad_token_id)
        tokens = out[0, enc.input_ids.shape[1]:].tolist()
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        tokens = tokens[:cut]
        text_ids = tokens[:-1] if tokens and tokens[-1] in eos else tokens
        return tokens, tokenizer.decode(text_ids, skip_special_tokens=True)

    return run


def _eos_ids(model_dir: Path) -> list[int]:
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    return eos if isinstance(eos, list) else [eos]
