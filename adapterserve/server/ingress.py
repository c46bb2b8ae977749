"""The entry deployment: gRPC (through Serve's gRPC proxy) and HTTP (through its HTTP proxy).

Every call: authenticate (API key -> tenant), take a place (admission.py: beyond
`max_in_flight` calls are shed with RESOURCE_EXHAUSTED / 429 and retry advice), validate,
resolve the adapter name to an immutable version, tokenize and length-check the prompt
(prompts.py: the engine gets token ids), then forward to an engine replica with the
version's content hash as `multiplexed_model_id`, so replicas that hold it are preferred.
Generate goes to the generation backbone, Classify and Embed to the encoder
(backends.py picks the deployment; an adapter goes where it was validated).
Errors become gRPC status codes (see status.py; a failed call ends with its status and
retry metadata rather than raising, which would lose the metadata) or OpenAI-style
HTTP errors. Health: grpc.health.v1 (health_rpc.py) and GET /health.
"""
# No `from __future__ import annotations`: FastAPI reads the route signatures at run time.
import asyncio
import logging
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from adapterserve import errors
from adapterserve.adapters_store.records import AdapterVersion, parse_ref
from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.adapters_store.store import open_store
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.server import messages, openai_http
from adapterserve.server.admission import Admission, Place
from adapterserve.server.auth import grpc_tenant, http_tenant, load_keys
from adapterserve.server.backends import Backends
from adapterserve.server.grpc_services import refuse_undecodable
from adapterserve.server.health import DeploymentHealth
from adapterserve.server.health_rpc import HealthRpc
from adapterserve.server.http_body import read_json
from adapterserve.server.metrics import IngressMetrics
from adapterserve.server.prompts import limits_of, load_tokenizer, prompt_token_ids
from adapterserve.server.proto import adapterserve_pb2 as pb
from adapterserve.server.replies import raise_if_error
from adapterserve.server.status import grpc_error, http_headers, http_status, status_of
from adapterserve.server.uploads import receive_upload
from adapterserve.server.validation import adapter_validator

logger = logging.getLogger("adapterserve.server")
http_app = FastAPI(title="adapterserve", description="OpenAI-compatible completions over many adapters")


# Helpers come before the class: serve.ingress captures the class when it is decorated.
async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for chunk in rest:
        yield chunk


async def _holding(place: Place, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, its admission place given back when it ends."""
    try:
        async for event in events:
            yield event
    finally:
        place.release()


def _empty_reply(method: str):
    """An empty message of `method`'s reply type (sent with an error status; clients drop it)."""
    return getattr(pb, pb.DESCRIPTOR.services_by_name["AdapterServe"].methods_by_name[method].output_type.name)()


def _http_error(exc: BaseException) -> JSONResponse:
    return JSONResponse(openai_http.error_body(exc), status_code=http_status(exc), headers=http_headers(exc))


@serve.deployment
@serve.ingress(http_app)
class Ingress(HealthRpc):
    def __init__(self, replica: DeploymentHandle, config: dict[str, Any],
                 encoder: DeploymentHandle | None = None) -> None:
        self.backends = Backends(replica, encoder, config)
        self.replica = self.backends.model  # the generation backbone: ServerInfo asks it
        self.admission = Admission(config["max_in_flight"], config["max_health_watches"])
        self.health = DeploymentHealth(self.backends.deployments())
        self.tokenizer = load_tokenizer(config["model"])  # the generation backbone's
        self.max_prompt_chars = config["max_prompt_chars"]
        self.max_texts = config["max_texts_per_request"]
        self.max_request_bytes = config["max_request_bytes"]
        self.backbone_id = config["model_id"]
        self.limits = StoreLimits(max_total_bytes=config["max_upload_bytes"], max_files=config["max_upload_files"])
        self.store = open_store(config["store"], limits=self.limits, **config["store_options"])
        self.keys = load_keys(config["api_keys_file"])
        self.metrics = IngressMetrics()
        self._gc_every, self._gc_grace = config["gc_interval_s"], config["gc_grace_s"]
        self._gc_task: asyncio.Task | None = None

    # --- gRPC: generation ---------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        started, code = time.monotonic(), "OK"
        try:
            tenant = grpc_tenant(self.keys, grpc_context)
            refuse_undecodable(request)
            with self.admission.admit():
                chunks = self._generate(messages.prompt_of(request), messages.sampling_of(request.sampling),
                                        messages.adapter_ref_of(request.adapter), tenant)
                async with aclosing(self._measured(chunks, started)) as relayed:  # closed at once if the caller goes
                    async for chunk in relayed:
                        yield messages.chunk_message(chunk)
        except Exception as exc:
            code = status_of(exc).name
            grpc_error(grpc_context, exc)  # the stream ends with this status
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            self.metrics.finished("Generate", code, time.monotonic() - started)

    async def _generate(
        self, prompt: messages.Prompt, sampling: SamplingParams, ref: str | None, tenant: str | None
    ) -> AsyncIterator[dict[str, Any]]:
        """Resolve the adapter, tokenize, then stream the replica's chunks (errors raised as ours)."""
        self._ensure_gc()
        version = await self._resolve(ref, tenant) if ref else None
        routing = {"multiplexed_model_id": version.content_hash} if version else {}
        handle = (await self.backends.for_call("generate", version)).options(stream=True, **routing)
        ids = await self._token_ids(prompt, sampling, version)
        request = {"prompt": ids, "sampling": sampling, "adapter": version, "request_id": uuid.uuid4().hex}
        response, ended = handle.generate.remote(request), False
        try:
            async for chunk in response:
                raise_if_error(chunk)
                yield chunk
            ended = True
        finally:
            if not ended:  # closed early (the caller went away): the replica aborts the request
                response.cancel()

    async def _token_ids(self, prompt: messages.Prompt, sampling: SamplingParams,
                         version: AdapterVersion | None) -> list[int]:
        limits = limits_of(await self.backends.static(self.backends.model_id), self.max_prompt_chars)
        virtual_tokens = int((version.info or {}).get("virtual_tokens", 0)) if version else 0
        return await prompt_token_ids(prompt, self.tokenizer, limits, sampling.max_tokens, virtual_tokens)

    async def _measured(self, chunks: AsyncGenerator[dict, None], started: float) -> AsyncIterator[dict]:
        """The chunks, counted: time to the first, prompt tokens, tokens sent (once, at the end)."""
        first, sent = True, 0
        try:
            async for chunk in chunks:
                if first:
                    self.metrics.ttft.observe(time.monotonic() - started)
                    self.metrics.prompt_tokens.inc(chunk.get("prompt_tokens", 0))
                    first = False
                sent += len(chunk["token_ids"])
                yield chunk
        finally:
            await chunks.aclose()  # closed early: so is the source
            if sent:  # a Counter refuses 0
                self.metrics.generated_tokens.inc(sent)

    async def _resolve(self, ref: str, tenant: str | None) -> AdapterVersion:
        return await asyncio.to_thread(self.store.resolve, ref, tenant=tenant)

    # --- gRPC: encoder tasks ------------------------------------------------

    async def Classify(self, request: pb.ClassifyRequest, grpc_context) -> pb.ClassifyResponse:
        async def run(tenant: str | None, request: pb.ClassifyRequest) -> pb.ClassifyResponse:
            texts = messages.texts_of(request.texts, self.max_texts)
            ref = messages.adapter_ref_of(request.adapter)
            if ref is None:
                raise errors.RequestError("classify needs an adapter with a classification head: set adapter")
            version = await self._resolve(ref, tenant)
            messages.check_has_head(version)
            return messages.classify_response(await self._pooled("classify", texts, version))

        return await self._unary("Classify", grpc_context, run, request)

    async def Embed(self, request: pb.EmbedRequest, grpc_context) -> pb.EmbedResponse:
        async def run(tenant: str | None, request: pb.EmbedRequest) -> pb.EmbedResponse:
            texts = messages.texts_of(request.texts, self.max_texts)
            ref = messages.adapter_ref_of(request.adapter)
            version = await self._resolve(ref, tenant) if ref else None
            return messages.embed_response(await self._pooled("embed", texts, version))

        return await self._unary("Embed", grpc_context, run, request)

    async def _pooled(self, task: str, texts: list[str], version: AdapterVersion | None) -> dict[str, Any]:
        """Run classify/embed on the backbone that serves it; replica errors raised as ours."""
        self._ensure_gc()
        handle = await self.backends.for_call(task, version)
        if version:
            handle = handle.options(multiplexed_model_id=version.content_hash)
        reply = await getattr(handle, task).remote({"texts": texts, "adapter": version})
        raise_if_error(reply)
        return reply

    # --- gRPC: adapters -----------------------------------------------------

    async def UploadAdapter(self, request_stream, grpc_context) -> pb.AdapterInfo:
        return await self._unary("UploadAdapter", grpc_context, self._upload, request_stream)

    async def _upload(self, tenant: str | None, request_stream) -> pb.AdapterInfo:
        statics = await self.backends.statics()
        with tempfile.TemporaryDirectory(prefix="adapterserve-upload-") as tmp:
            header = await receive_upload(request_stream, Path(tmp), self.limits)
            validator = adapter_validator(statics, header.name)
            version = await asyncio.to_thread(
                self.store.publish, header.name, tmp, tenant=tenant, public=header.public, validator=validator
            )
        return messages.adapter_info(version)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, grpc_context) -> pb.ListAdaptersResponse:
        async def run(tenant: str | None, request: pb.ListAdaptersRequest) -> pb.ListAdaptersResponse:
            found = await asyncio.to_thread(self.store.list, tenant=tenant, name=request.name or None)
            return pb.ListAdaptersResponse(adapters=[messages.adapter_info(v) for v in found])

        return await self._unary("ListAdapters", grpc_context, run, request)

    async def GetAdapter(self, request: pb.GetAdapterRequest, grpc_context) -> pb.AdapterInfo:
        async def run(tenant: str | None, request: pb.GetAdapterRequest) -> pb.AdapterInfo:
            return messages.adapter_info(await asyncio.to_thread(self.store.describe, request.ref, tenant=tenant))

        return await self._unary("GetAdapter", grpc_context, run, request)

    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, grpc_context) -> pb.DeleteAdapterResponse:
        """Tombstones the version(s): new requests are refused at once, running ones finish."""
        async def run(tenant: str | None, request: pb.DeleteAdapterRequest) -> pb.DeleteAdapterResponse:
            name, number = parse_ref(request.ref)
            gone = await asyncio.to_thread(self.store.delete, name, number, tenant=tenant)
            return pb.DeleteAdapterResponse(deleted=[v.ref for v in gone])

        return await self._unary("DeleteAdapter", grpc_context, run, request)

    async def ServerInfo(self, request: pb.ServerInfoRequest, grpc_context) -> pb.ServerInfoResponse:
        async def run(tenant: str | None, request: pb.ServerInfoRequest) -> pb.ServerInfoResponse:
            facts = await self.replica.describe.remote()
            limits = {"max_upload_bytes": self.limits.max_total_bytes, "max_upload_files": self.limits.max_files}
            info = messages.server_info(self.backbone_id, facts["static"], facts["live"], limits)
            info.encoder_id = self.backends.encoder_id or ""
            return info

        return await self._unary("ServerInfo", grpc_context, run, request)

    async def _unary(self, method: str, grpc_context, run, request):
        """Authenticate, take a place, run; an error ends the call with its status (and an empty
        reply, which the client never sees). Counts the call."""
        started, code = time.monotonic(), "OK"
        try:
            tenant = grpc_tenant(self.keys, grpc_context)
            refuse_undecodable(request)
            with self.admission.admit():
                return await run(tenant, request)
        except Exception as exc:
            code = status_of(exc).name
            grpc_error(grpc_context, exc)
            return _empty_reply(method)
        finally:
            self.metrics.finished(method, code, time.monotonic() - started)

    # --- HTTP (OpenAI-compatible) ---------------------------------------------

    @http_app.get("/health")
    async def health_route(self) -> JSONResponse:
        """200 while every engine deployment serves, else 503; the body says which does not."""
        report = await self.health.report()
        serving = not self.admission.draining and all(state == "ok" for state in report.values())
        body = {"status": "ok" if serving else "unavailable", "draining": self.admission.draining,
                "deployments": report}
        return JSONResponse(body, status_code=200 if serving else 503)

    @http_app.get("/v1/models")
    async def models(self, request: Request) -> JSONResponse:
        try:
            tenant = http_tenant(self.keys, request.headers)
            with self.admission.admit():
                versions = await asyncio.to_thread(self.store.list, tenant=tenant)
            return JSONResponse(openai_http.models_body(self.backbone_id, versions))
        except Exception as exc:
            return _http_error(exc)

    @http_app.post("/v1/completions")
    async def completions(self, request: Request):
        started, code = time.monotonic(), "OK"
        try:
            tenant = http_tenant(self.keys, request.headers)
            place = self.admission.take()
            try:
                return await self._complete(request, tenant, place, started)
            finally:
                place.release()  # a stream took it over (released when its events end); else the call is done
        except Exception as exc:
            code = status_of(exc).name
            return _http_error(exc)
        finally:
            self.metrics.finished("completions", code, time.monotonic() - started)

    async def _complete(self, request: Request, tenant: str | None, place: Place, started: float):
        call = openai_http.parse_completion(await read_json(request, self.max_request_bytes), self.backbone_id)
        chunks = self._measured(self._generate(call.prompt, call.sampling, call.adapter, tenant), started)
        first = await anext(chunks)  # errors before the first token get a proper HTTP status
        if call.stream:
            events = openai_http.sse_events(call, _prepend(first, chunks))
            return StreamingResponse(_holding(place.hand_over(), events), media_type="text/event-stream")
        rest = [c async for c in chunks]
        return JSONResponse(openai_http.completion_body(call, [first, *rest]))

    # --- lifecycle: `adapterserve serve` drains every replica (drain.py) -----

    async def drain(self) -> int:
        """Take no new calls from now on (UNAVAILABLE); returns the calls still in flight."""
        self.admission.drain()
        return self.admission.in_flight

    async def in_flight(self) -> int:
        """Calls this replica holds now (health watches apart)."""
        return self.admission.in_flight

    # --- housekeeping -------------------------------------------------------

    def _ensure_gc(self) -> None:
        """Start the loop that removes files of versions deleted over gc_grace_s ago."""
        if self._gc_task is None or self._gc_task.done():
            self._gc_task = asyncio.get_running_loop().create_task(self._gc_loop())

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self._gc_every)
            try:
                await asyncio.to_thread(self.store.gc, grace_s=self._gc_grace)
            except Exception:  # a store hiccup must not stop later collections
                logger.exception("removing deleted adapter files failed; retrying in %.0f s", self._gc_every)
