"""The engine deployment: one Engine per replica, adapters loaded through Serve's multiplexer.

A request names its adapter by content hash (`multiplexed_model_id`), so Serve
routes it to a replica that already holds it. Loading reads the files from the
store into the host cache and registers the adapter with the engine, all off
the event loop, so running requests keep streaming while another adapter loads;
the registered adapters' host copies are bounded in bytes (server/registrations.py).
Many requests run at once on one replica: the engine batches them. The engine runs
in a child process of its own (`engine_process: true`, the default), so this
process's event loop only relays chunks; `false` keeps it in this process.

Health: Serve calls `check_health` every health_check_period_s. It probes the engine
(engine_process/supervisor.py): one that is gone, broken, stalled or wedged is ended
(its requests fail with UNAVAILABLE at once) and restarted in place; the check fails,
and Serve replaces the replica, only when that cannot help. `health()` tells the
ingress whether the replica serves now (its gRPC health and /health).

The same class serves the generation backbone (role "model": Generate) and the
encoder (role "encoder": Classify and Embed, with the example adapters
published into the store at start when the config lists them).
"""
from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial
from pathlib import Path
from threading import Thread
from typing import Any

from ray import serve

from adapterserve.adapters_store.cache import HostAdapterCache
from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.adapters_store.servable import check_servable
from adapterserve.adapters_store.store import open_store
from adapterserve.engine.request import EmbedOutput, RequestOutput
from adapterserve.errors import (
    AdapterError,
    AdapterIntegrityError,
    AdapterNotFound,
    CapacityError,
    EngineBroken,
    EngineDied,
    RequestError,
)
from adapterserve.server.engine_process import EngineSupervisor, start_engine
from adapterserve.server.loaded import LoadedAdapter
from adapterserve.server.metrics.replica_metrics import ReplicaMetrics
from adapterserve.server.registrations import Advertised, EngineRegistry
from adapterserve.server.relay import RelayPacer
from adapterserve.server.replies import error_reply
from adapterserve.server.tracing import ReplicaTrace, open_tracing
from adapterserve.server.validation import backbone_facts, describe_adapter

ADAPTER_KINDS = ("lora", "ia3", "prompt_tuning", "p_tuning", "prefix_tuning", "bottleneck", "classifier_head")
ENCODER_ADAPTER_KINDS = ("lora", "ia3", "bottleneck", "classifier_head")
# role -> config keys of its checkpoint, backbone id, engine options and pinned adapters
ROLES = {"model": ("model", "model_id", "engine", "pinned_adapters"),
         "encoder": ("encoder", "encoder_id", "encoder_engine", "encoder_pinned_adapters")}
# Errors a request can meet in the replica; sent back as data so their type survives Ray.
_REQUEST_ERRORS = (AdapterError, AdapterNotFound, AdapterIntegrityError, RequestError, CapacityError, EngineDied,
                   EngineBroken)


def check_pinnable(version: AdapterVersion, backbone_id: str) -> None:
    """A pinned adapter must have been validated for this replica's backbone."""
    backbone = (version.info or {}).get("backbone")
    if backbone is not None and backbone != backbone_id:
        raise AdapterError(f"pinned adapter {version.ref!r} was validated for backbone {backbone!r}; this "
                           f"replica serves {backbone_id!r}: list it under the other backbone's pinned adapters")


def cache_salt(version: AdapterVersion | None) -> str:
    """Prefix-cache salt of a request: a private adapter's requests share cached KV blocks only
    within its owning tenant; the base model's and public adapters' are shared by all
    (docs/prefix_caching.md)."""
    if version is None or version.public or version.tenant is None:
        return ""
    return f"tenant:{version.tenant}"


@serve.deployment
class EngineReplica:
    async def __init__(self, config: dict[str, Any], role: str = "model", metrics_hub: Any | None = None) -> None:
        path_key, id_key, engine_key, pinned_key = ROLES[role]
        own_process = config["engine_process"]
        if own_process:  # the engine's facts name a torch dtype: import it while the engine process starts
            Thread(target=importlib.import_module, args=("torch",), name="adapterserve-torch", daemon=True).start()
        self.engine = EngineSupervisor(partial(start_engine, config[path_key], config[engine_key], own_process),
                                       restartable=own_process, stall_timeout_s=config["stall_timeout_s"],
                                       start_timeout_s=config["engine_start_timeout_s"])
        self.backbone_id: str = config[id_key]
        self.store = open_store(config["store"], **config["store_options"])
        self.cache = HostAdapterCache(config["host_cache_bytes"], self._read, fetch=self.store.fetch)
        self.metrics = ReplicaMetrics(metrics_hub, role, config[id_key], config["metrics"]["push_interval_s"],
                                      self.engine.stats)  # reported to the hub (metrics_hub: its handle)
        self.tracing = open_tracing(config, role)
        self.registry = EngineRegistry(self.engine, self.cache, self.metrics, config["registered_adapter_bytes"])
        self._cancelled = 0  # requests stopped because the caller went away
        self._pooling = 0  # classify/embed calls in progress
        self._pacer = RelayPacer(config["relay_chunk_ms"] / 1000)

        async def advertise(content_hash: str) -> Advertised:  # a plain function: Serve keeps its LRU on it
            return Advertised(content_hash, self.registry)

        self._advertise = serve.multiplexed(max_num_models_per_replica=config["max_adapters_per_replica"])(advertise)
        if role == "encoder":
            self._preload(config["preload_adapters"])
        await self._pin(config[pinned_key])
        self.metrics.start()

    def _preload(self, adapters: dict[str, str]) -> None:
        """Publish each {name: directory} as a public adapter (a no-op when already stored)."""
        for name, path in adapters.items():
            self.store.publish(name, path, tenant=None, public=True, validator=self.validate)

    async def _pin(self, refs: list[str]) -> None:
        """Load each adapter ref into the engine now and keep it there (never evicted); a
        ref that is unknown or made for another backbone fails the replica's start."""
        for ref in refs:
            version = await asyncio.to_thread(self.store.resolve, ref, tenant=None)
            check_pinnable(version, self.backbone_id)
            await self.registry.pin(version)

    def validate(self, path) -> dict[str, Any]:
        """Store validator for this backbone: what the store records, with the backbone's id."""
        return {**describe_adapter(self._read(path)), "backbone": self.backbone_id}

    def _read(self, path):
        """Read and check an adapter as the engine will hold it (the host cache's loader)."""
        from adapterserve.adapters_store.formats.read import read_adapter  # the readers import torch

        facts = self.engine.facts
        adapter = read_adapter(path, facts.backbone_spec, facts.adapter_limits, dtype=facts.host_dtype)
        check_servable(adapter, Path(path).name, facts.serving_rules)
        return adapter

    async def check_health(self) -> None:
        """Serve's health check: probe the engine (a failed one restarts in place); raise, so that
        Serve replaces this replica, when its engine will not serve again here."""
        await self.engine.check()
        self.metrics.engine_restarts(self.engine.restarts)
        if (why := self.engine.failed) is not None:
            raise EngineDied(f"{why}; this replica must be replaced")

    async def health(self) -> str | None:
        """None while this replica serves; else why not (as of the latest check, and restarts)."""
        if self.engine.failed is None and self.engine.restarting:
            return f"its engine is restarting ({self.engine.problem})"
        return self.engine.failed or self.engine.problem

    def __del__(self) -> None:  # Serve calls it on a graceful shutdown
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()

    # adapters

    async def _acquire(self, version: AdapterVersion) -> LoadedAdapter:
        """The engine registration of `version`, counted as in use by the caller."""
        if version.content_hash not in self.registry.pinned():
            await self._advertise(version.content_hash)  # Serve routes this adapter's requests here
        return await self.registry.acquire(version)

    # requests

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks {token_ids, text, finish_reason, request_id, ...}; a request error
        arrives as one chunk {"error": class name, "message": ...}."""
        version: AdapterVersion | None = request["adapter"]
        trace = self.tracing.replica_call("generate", request.get("trace"))
        loaded = None
        try:
            loaded = await self._traced_acquire(version, trace)
            stream = self.engine.stream(
                request["prompt"], request["sampling"], adapter_id=loaded.engine_id if loaded else None,
                request_id=request["request_id"], times=trace.times, cache_salt=cache_salt(version),
                pause_s=self._pacer.pause_s,  # paced while other streams run (server/relay.py)
            )
            async with aclosing(stream):  # closing it aborts the engine request (frees its KV blocks)
                with self._pacer.stream():
                    first = True
                    async for out in stream:
                        yield _chunk(out, version, first)
                        first = False
        except _REQUEST_ERRORS as exc:
            trace.failed(exc)
            yield error_reply(exc)
        except (asyncio.CancelledError, GeneratorExit):  # the caller went away
            self._cancelled += 1
            trace.failed("cancelled")
            raise
        finally:
            if loaded is not None:
                loaded.release()
            trace.finish()

    async def _traced_acquire(self, version: AdapterVersion | None, trace: ReplicaTrace) -> LoadedAdapter | None:
        """_acquire, in the trace's `adapter` span (None: the base model)."""
        if version is None:
            return None
        with trace.span("adapter", {"adapterserve.adapter": version.ref}):
            return await self._acquire(version)

    async def classify(self, request: dict[str, Any]) -> dict[str, Any]:
        """{"results": [ClassifyOutput fields]} or {"error", "message"}."""
        return await self._pooled(request, self.engine.classify, "results")

    async def embed(self, request: dict[str, Any]) -> dict[str, Any]:
        """{"embeddings": [vectors]} or {"error", "message"}."""
        return await self._pooled(request, self.engine.embed, "embeddings")

    async def _pooled(self, request: dict[str, Any], task, key: str) -> dict[str, Any]:
        version: AdapterVersion | None = request["adapter"]
        trace = self.tracing.replica_call(task.__name__, request.get("trace"))
        loaded = None
        self._pooling += 1
        try:
            loaded = await self._traced_acquire(version, trace)
            outputs = await task(request["texts"], loaded.engine_id if loaded else None)
            return {key: [_plain(o) for o in outputs], "adapter": version.ref if version else ""}
        except _REQUEST_ERRORS as exc:
            trace.failed(exc)
            return error_reply(exc)
        finally:
            self._pooling -= 1
            if loaded is not None:
                loaded.release()
            trace.finish()

    # facts

    async def describe(self) -> dict[str, Any]:
        """What the ingress and ServerInfo report: fixed facts and the current load."""
        facts, load = self.engine.facts, await self.engine.load()
        spec, encoder = facts.backbone_spec, facts.encoder
        static = {
            **backbone_facts(self.backbone_id, spec, facts.adapter_limits, facts.serving_rules),
            "tasks": ["classify", "embed"] if encoder else ["generate"],
            "vocab_size": facts.vocab_size,
            "max_model_len": facts.max_model_len,
            "adapter_kinds": list(ENCODER_ADAPTER_KINDS if encoder else ADAPTER_KINDS),
            "max_lora_rank": facts.max_lora_rank,
            "num_kv_blocks": facts.num_kv_blocks,
        }
        live = {
            "free_kv_blocks": load.free_kv_blocks,
            "running_requests": self._pooling + load.requests,
            "loaded_adapters": sorted(self.registry.registered()),
            "pinned_adapters": sorted(self.registry.pinned()),
            "cancelled_requests": self._cancelled,
            "engine_pid": self.engine.pid,  # None when the engine runs in this process
            "engine_restarts": self.engine.restarts,
            "engine_problem": self.engine.failed or self.engine.problem,
        }
        return {"static": static, "live": live}


def _chunk(out: RequestOutput, version: AdapterVersion | None, first: bool) -> dict[str, Any]:
    """An engine output as the chunk the ingress relays; the first also names the adapter and
    counts the prompt's tokens (and those found in the prefix cache)."""
    chunk = {"request_id": out.request_id, "token_ids": out.token_ids, "text": out.text,
             "finish_reason": out.finish_reason, "index": out.index}
    if first:
        chunk.update(adapter=version.ref if version else "", prompt_tokens=len(out.prompt_token_ids),
                     cached_tokens=out.cached_tokens)
    return chunk


def _plain(output) -> Any:
    """An engine output as Ray-friendly data: a classification's fields, or an embedding's vector."""
    if isinstance(output, EmbedOutput):
        return list(output.embedding)
    return {"label": output.label, "label_index": output.label_index,
            "probabilities": list(output.probabilities), "labels": list(output.labels)}
