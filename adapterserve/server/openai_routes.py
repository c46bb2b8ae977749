"""The ingress's HTTP routes: OpenAI-compatible, vLLM's adapter routes, /health and /metrics.

    GET  /v1/models, /v1/models/{model}     the backbones and the adapters the key may use
    POST /v1/completions, /v1/chat/completions   generation (plain, or SSE with "stream": true)
    POST /v1/embeddings, /v1/classify (/classify)   the encoder's tasks
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   publish from a path / delete
    GET  /health, /metrics

Every call but /health and /metrics is authenticated (Authorization: Bearer KEY), needs its key's
scope (adapters_store/tenants.py: 403 without), holds a place in its tenant's quotas and an admission
place while it runs (a stream: until its last event), is counted and traced (its response
names its trace: x-trace-id, traceresponse; server/tracing); its errors, and
routing errors, come in OpenAI's shape (openai_errors.py). `model` names the generation
backbone, the encoder, or an adapter `name[@N]` (`name`: its newest version).
"""
# No `from __future__ import annotations`: FastAPI reads the route signatures at run time.
import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.adapters_store.tenants import Caller
from adapterserve.errors import AdapterNotFound, RequestError, RequestTooLarge
from adapterserve.server import (
    openai_chat,
    openai_embeddings,
    openai_errors,
    openai_http,
    openai_models,
    vllm_lora,
)
from adapterserve.server.admission import Place
from adapterserve.server.auth import http_caller
from adapterserve.server.backends import NotServed
from adapterserve.server.chat_template import ChatRenderer
from adapterserve.server.http_body import read_json
from adapterserve.server.lora_sources import AdapterSources
from adapterserve.server.messages import check_has_head
from adapterserve.server.metrics.calls import Call
from adapterserve.server.metrics.exposition import CONTENT_TYPE
from adapterserve.server.metrics.scrape import MetricsUnavailable
from adapterserve.server.prompts import limits_of, load_tokenizer
from adapterserve.server.quotas import count_refusal
from adapterserve.server.status import status_of
from adapterserve.server.tracing import CallTrace
from adapterserve.server.usage_report import caller_usage, usage_json
from adapterserve.server.validation import adapter_validator

http_app = FastAPI(title="adapterserve", description="OpenAI-compatible routes over many adapters")
openai_errors.install(http_app)
Handler = Callable[[Request, Any, Place, Call], Awaitable[Response]]


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for chunk in rest:
        yield chunk


async def _holding(place: Place, events: AsyncIterator[str], trace: CallTrace, counted: Call) -> AsyncIterator[str]:
    """A stream's events, its admission place given back (and its trace ended, its call
    counted) when it ends."""
    try:
        async for event in events:
            yield event
    finally:
        place.release()
        trace.close()
        counted.end("OK", by_stream=True)  # or the status the stream failed with


def _trace(request: Request) -> CallTrace:
    """The call's trace, as _http_call made it."""
    return request.state.trace


def _route(request: Request) -> str:
    """The route's path template (never a path holding a model name)."""
    return getattr(request.scope.get("route"), "path", "") or "unmatched"


class OpenAIRoutes:
    """Mixed into the Ingress: uses its keys, admission, metrics, tracing, backends, store,
    limits, tokenizer, resolutions, _generate, _measured, _resolve and _pooled."""

    def _init_http(self, config: dict[str, Any]) -> None:
        self.chat = ChatRenderer(self.tokenizer, config["chat_template"], config["model_id"])
        self.encoder_tokenizer = load_tokenizer(config["encoder"]) if config["encoder"] else None
        self.sources = AdapterSources(config["lora_sources"], config["lora_s3_options"], config["store"],
                                      config["store_options"])

    async def _http_call(self, method: str, request: Request, handler: Handler, model_param: str = "model"):
        """Authenticate, check the scope, take a place, run `handler(request, caller, place, counted)`;
        errors in OpenAI's shape. A stream takes the place over (released when its events end)."""
        counted, code = self.metrics.start(method), "OK"
        trace = request.state.trace = self.tracing.http_call(request.method, _route(request), request.headers.items())
        try:
            caller = http_caller(self.keys, request.headers)
            counted.tenant = caller.tenant
            caller.require(method)
            place = self.admission.take(self.gate.enter(caller, method))
            try:
                return trace.tag(await handler(request, caller, place, counted))
            finally:
                place.release()
        except Exception as exc:
            code = status_of(exc).name
            count_refusal(self.metrics, counted.tenant, exc)
            return trace.tag(openai_errors.error_response(exc, model_param))
        finally:
            counted.end(code)  # a stream's call is counted when the stream ends
            trace.finish(code)  # a stream's trace ends with the stream

    async def _body(self, request: Request) -> Any:
        return await read_json(request, self.max_request_bytes)

    # --- health and models ----------------------------------------------------

    @http_app.get("/health")
    async def health_route(self) -> JSONResponse:
        """200 while every engine deployment serves, else 503; the body says which does not."""
        report = await self.health.report()
        serving = not self.admission.draining and all(state == "ok" for state in report.values())
        body = {"status": "ok" if serving else "unavailable", "draining": self.admission.draining,
                "deployments": report}
        return JSONResponse(body, status_code=200 if serving else 503)

    @http_app.get("/metrics")
    async def metrics_route(self) -> Response:
        """Prometheus' scrape of the whole server, no API key (metrics.http_route "public": what any
        client may know; "full": every series; "off": no such route). docs/observability.md"""
        if self.metrics.scrapes.view == "off":
            raise HTTPException(404)
        try:
            text = await self.metrics.scrapes.text()
        except MetricsUnavailable as exc:
            return JSONResponse(openai_errors.body(str(exc), 503), status_code=503, headers={"Retry-After": "1"})
        return Response(text, media_type=CONTENT_TYPE)

    @http_app.get("/v1/models")
    async def models(self, request: Request):
        async def run(request: Request, caller: Caller, place: Place, counted: Call) -> Response:
            versions = await asyncio.to_thread(self.store.list, tenant=caller.store_view)
            body = openai_models.models_body(self.backbone_id, self.backends.encoder_id, versions)
            stored = await asyncio.to_thread(self.store.usage, caller.tenant)
            body["tenant"] = usage_json(caller_usage(caller, stored, self.gate))  # the key's own scopes and usage
            return JSONResponse(body)

        return await self._http_call("models", request, run)

    @http_app.get("/v1/models/{model:path}")
    async def retrieve_model(self, request: Request, model: str):
        async def run(request: Request, caller: Caller, place: Place, counted: Call) -> Response:
            if model in (self.backbone_id, self.backends.encoder_id):
                return JSONResponse(openai_models.backbone_entry(model))
            version = await self._model_version(model, caller)
            return JSONResponse(openai_models.adapter_entry(version, model, self.backbone_id))

        return await self._http_call("models", request, run)

    async def _model_version(self, model: str, caller: Caller) -> AdapterVersion:
        """The adapter version `model` names; a name no adapter can have is not found."""
        try:
            return await self._resolve(model, caller)
        except RequestError:
            raise AdapterNotFound(f"no model {model!r}: this server serves {self._served()} and adapters "
                                  "'name' or 'name@N'") from None

    def _served(self) -> str:
        return " and ".join(repr(m) for m in (self.backbone_id, self.backends.encoder_id) if m)

    # --- generation -------------------------------------------------------------

    async def _generation_version(self, model: str, caller: Caller) -> AdapterVersion | None:
        if model == self.backbone_id:
            return None
        if model == self.backends.encoder_id:
            raise NotServed(f"model {model!r} is the encoder: it serves /v1/embeddings and /v1/classify; "
                            f"generate with {self.backbone_id!r} or an adapter made for it")
        return await self._model_version(model, caller)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._http_call("completions", request, self._complete)

    async def _complete(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        call = openai_http.parse_completion(await self._body(request), self.backbone_id)
        place.widen(call.sampling.n)  # each of n choices holds a place
        with _trace(request).span("resolve"):
            version = await self._generation_version(call.model, caller)
        generated = self._generate(call.prompt, call.sampling, version, caller, _trace(request))
        chunks = self._measured(generated, counted)
        first = await anext(chunks)  # errors before the first token get a proper HTTP status
        if call.stream:
            events = openai_http.sse_events(call, _prepend(first, chunks))
            return StreamingResponse(_holding(place.hand_over(), events, _trace(request).hand_over(), counted.hand_over()),
                                     media_type="text/event-stream")
        rest = [c async for c in chunks]
        return JSONResponse(openai_http.completion_body(call, [first, *rest]))

    @http_app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._http_call("chat_completions", request, self._chat)

    async def _chat(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        call = openai_chat.parse_chat(await self._body(request), self.backbone_id)
        place.widen(call.sampling.n)  # each of n choices holds a place
        with _trace(request).span("resolve"):
            version = await self._generation_version(call.model, caller)
        limits = limits_of(await self.backends.static(self.backends.model_id), self.max_prompt_chars)
        if call.chars > limits.max_prompt_chars:
            raise RequestTooLarge(f"'messages' hold {call.chars} characters; this server takes at most "
                                  f"{limits.max_prompt_chars} (max_prompt_chars) before rendering")
        with _trace(request).span("chat_template"):
            ids = await asyncio.to_thread(self.chat.render, call.messages, call.options)
        virtual = int((version.info or {}).get("virtual_tokens", 0)) if version else 0
        sampling = call.sampling_for(len(ids) + virtual, limits.max_model_len)
        generated = self._generate(ids, sampling, version, caller, _trace(request))
        chunks = self._measured(generated, counted)
        first = await anext(chunks)
        if call.stream:
            events = openai_chat.sse_events(call, _prepend(first, chunks))
            return StreamingResponse(_holding(place.hand_over(), events, _trace(request).hand_over(), counted.hand_over()),
                                     media_type="text/event-stream")
        rest = [c async for c in chunks]
        return JSONResponse(openai_chat.chat_body(call, [first, *rest], ids))

    # --- the encoder's tasks ------------------------------------------------------

    async def _encoder_version(self, model: str, caller: Caller) -> AdapterVersion | None:
        if model == self.backends.encoder_id:
            return None
        if model == self.backbone_id:
            what = f"use {self.backends.encoder_id!r}" if self.backends.encoder_id else "this server runs no encoder"
            raise NotServed(f"model {model!r} is the generation backbone, which serves completions only; {what}")
        return await self._model_version(model, caller)

    async def _encoder_tokens(self, texts: list[str]) -> int:
        """Tokens the encoder reads of `texts` (each cut to its context), for usage."""
        if self.encoder_tokenizer is None:
            return 0
        most = int((await self.backends.static(self.backends.encoder_id))["max_model_len"])
        encoded = await asyncio.to_thread(self.encoder_tokenizer, texts)
        return sum(min(len(ids), most) for ids in encoded.input_ids)

    @http_app.post("/v1/embeddings")
    async def embeddings(self, request: Request):
        return await self._http_call("embeddings", request, self._embed_http)

    async def _embed_http(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        call = openai_embeddings.parse_embeddings(await self._body(request), self.backends.encoder_id, self.max_texts)
        with _trace(request).span("resolve"):
            version = await self._encoder_version(call.model, caller)
        reply = await self._pooled("embed", call.texts, version, _trace(request))
        tokens = await self._encoder_tokens(call.texts)
        return JSONResponse(openai_embeddings.embeddings_body(call, reply["embeddings"], tokens))

    @http_app.post("/v1/classify")
    @http_app.post("/classify")
    async def classify(self, request: Request):
        return await self._http_call("classify", request, self._classify_http)

    async def _classify_http(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        call = openai_embeddings.parse_classify(await self._body(request), self.max_texts)
        with _trace(request).span("resolve"):
            version = await self._encoder_version(call.model, caller)
        if version is None:
            raise RequestError(f"'model' {call.model!r} is the encoder, which has no classification head: name an "
                               "adapter with one")
        check_has_head(version)
        reply = await self._pooled("classify", call.texts, version, _trace(request))
        tokens = await self._encoder_tokens(call.texts)
        return JSONResponse(openai_embeddings.classify_body(call, reply["results"], tokens))

    # --- adapters by reference (vLLM's routes) -------------------------------------

    @http_app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request):
        return await self._http_call("load_lora_adapter", request, self._load_lora, model_param="lora_name")

    async def _load_lora(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        call = vllm_lora.parse_load(await self._body(request))
        validator = adapter_validator(await self.backends.statics(), call.name)
        version = await asyncio.to_thread(self._publish_from, call, caller, validator)
        self.resolutions.forget(call.name)
        return JSONResponse(vllm_lora.loaded_body(version, self.backbone_id))

    def _publish_from(self, call: vllm_lora.LoadCall, caller: Caller, validator: Any) -> AdapterVersion:
        """Publish the adapter at `call.path` (blocking: runs in a thread)."""
        if not call.on_s3:
            source = self.sources.local(call.path)
            return self.store.publish(call.name, source, tenant=caller.tenant, public=call.public, validator=validator,
                                      quotas=caller.quotas)
        location = self.sources.s3(call.path)
        with tempfile.TemporaryDirectory(prefix="adapterserve-load-") as tmp:
            self.sources.download(location, Path(tmp), self.limits)
            return self.store.publish(call.name, tmp, tenant=caller.tenant, public=call.public, validator=validator,
                                      quotas=caller.quotas)

    @http_app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request):
        return await self._http_call("unload_lora_adapter", request, self._unload_lora, model_param="lora_name")

    async def _unload_lora(self, request: Request, caller: Caller, place: Place, counted: Call) -> Response:
        name, number = vllm_lora.parse_unload(await self._body(request))
        try:
            deleted = await asyncio.to_thread(self.store.delete, name, number, tenant=caller.store_view)
        finally:
            self.resolutions.forget(name)
        return JSONResponse(vllm_lora.unloaded_body(deleted))
