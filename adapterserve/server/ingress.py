"""The entry deployment: gRPC (through Serve's gRPC proxy) and HTTP (through its HTTP proxy).

Every call: authenticate (API key -> tenant, scopes, quotas), check the key's scope
(PERMISSION_DENIED), take a place in the tenant's quotas (quotas.py: concurrent_requests,
tokens_per_minute) and one at the replica (admission.py: beyond `max_in_flight` calls are
shed with RESOURCE_EXHAUSTED / 429 and retry advice), validate, resolve the adapter name
to an immutable version, tokenize and length-check the prompt
(prompts.py: the engine gets token ids), then forward to an engine replica with the
version's content hash as `multiplexed_model_id`, so replicas that hold it are preferred
(routing.py; routing mode "pow2" sends none: Serve's power of two choices).
Generate goes to the generation backbone, Classify and Embed to the encoder
(backends.py picks the deployment; an adapter goes where it was validated). In direct
mode the generation engine runs in this replica's process (direct.py) and `replica` is
a LocalHandle to it.
Errors become gRPC status codes (see status.py; a failed call ends with its status and
retry metadata rather than raising, which would lose the metadata). The HTTP routes
(OpenAI-compatible, vLLM's adapter routes, GET /health) are openai_routes.py's, mixed in;
gRPC health is health_rpc.py's.
"""
import asyncio
import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from adapterserve import errors
from adapterserve.adapters_store.records import AdapterVersion, parse_ref
from adapterserve.adapters_store.staging import StoreLimits
from adapterserve.adapters_store.store import open_store
from adapterserve.adapters_store.tenants import Caller
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.server import messages
from adapterserve.server.admission import Admission
from adapterserve.server.auth import grpc_caller, load_keys
from adapterserve.server.backends import Backends, Handle
from adapterserve.server.grpc_services import hold_pending_calls, refuse_undecodable
from adapterserve.server.health import DeploymentHealth
from adapterserve.server.health_rpc import HealthRpc
from adapterserve.server.metrics.calls import Call, CallMetrics
from adapterserve.server.openai_routes import OpenAIRoutes, http_app
from adapterserve.server.prompts import limits_of, load_tokenizer, prompt_token_ids
from adapterserve.server.quotas import TenantGate, count_refusal
from adapterserve.server.replies import raise_if_error
from adapterserve.server.resolutions import Resolutions
from adapterserve.server.routing_settings import routes_by_adapter
from adapterserve.server.status import grpc_error, status_of
from adapterserve.server.store_fit import (
    alive_nodes,
    check_store_fits,
    clean_crash_leftovers,
)
from adapterserve.server.tracing import CallTrace, open_tracing
from adapterserve.server.uploads import receive_upload, upload_dir
from adapterserve.server.usage_report import caller_usage, tenant_usage
from adapterserve.server.validation import adapter_validator

logger = logging.getLogger("adapterserve.server")


# Helpers come before the class: serve.ingress captures the class when it is decorated.
def _empty_reply(method: str):
    """An empty message of `method`'s reply type (sent with an error status; clients drop it)."""
    return getattr(pb, pb.DESCRIPTOR.services_by_name["AdapterServe"].methods_by_name[method].output_type.name)()


@serve.deployment
@serve.ingress(http_app)
class Ingress(HealthRpc, OpenAIRoutes):
    def __init__(self, replica: Handle, config: dict[str, Any],
                 encoder: DeploymentHandle | None = None, metrics_hub: DeploymentHandle | None = None) -> None:
        hold_pending_calls()  # before Serve starts this replica's gRPC server
        self.backends = Backends(replica, encoder, config)
        self.replica = self.backends.model  # the generation backbone: ServerInfo asks it
        self.admission = Admission(config["max_in_flight"], config["max_health_watches"])
        self.health = DeploymentHealth(self.backends.deployments())
        self.tokenizer = load_tokenizer(config["model"])  # the generation backbone's
        self.max_prompt_chars = config["max_prompt_chars"]
        self.max_texts = config["max_texts_per_request"]
        self.max_request_bytes = config["max_request_bytes"]
        self.backbone_id = config["model_id"]
        # adapter affinity: the version's content hash routes (routing.py); pow2: Serve's default, no id
        self.route_by_adapter = routes_by_adapter(config["routing"])
        self.limits = StoreLimits(max_total_bytes=config["max_upload_bytes"], max_files=config["max_upload_files"])
        # resolutions are cached here, on the loop (resolutions.py), not in the store as well
        self.store = open_store(config["store"], limits=self.limits, **config["store_options"])
        self.resolutions = Resolutions(config["resolve_ttl_s"])
        check_store_fits(self.store, alive_nodes())
        clean_crash_leftovers(self.store, config["stale_upload_s"])
        self.keys = load_keys(config["api_keys_file"])
        self.gate = TenantGate(config["ingress"]["num_replicas"])  # per-tenant quotas at this replica
        self.metrics = CallMetrics(metrics_hub, config["metrics"])  # reports to the hub; GET /metrics
        self.tracing = open_tracing(config, "ingress")
        self._gc_every, self._gc_grace = config["gc_interval_s"], config["gc_grace_s"]
        self._gc_task: asyncio.Task | None = None
        self._init_http(config)

    # --- gRPC: generation ---------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateResponse]:
        counted, code = self.metrics.start("Generate"), "OK"
        call = self.tracing.grpc_call("Generate", grpc_context.invocation_metadata())
        try:
            caller = grpc_caller(self.keys, grpc_context)
            counted.tenant = caller.tenant
            caller.require("Generate")
            refuse_undecodable(request)
            with self.admission.admit(self.gate.enter(caller, "Generate")) as place:
                prompt, sampling = messages.prompt_of(request), messages.sampling_of(request.sampling)
                place.widen(sampling.n)  # each of n choices holds a place
                chunks = self._generate(prompt, sampling, messages.adapter_ref_of(request.adapter), caller, call)
                async with aclosing(chunks):  # closed at once if the caller goes
                    first = True
                    async for chunk in chunks:  # counted inline: no generator of its own per chunk
                        self._count(chunk, counted, first)
                        first = False
                        yield messages.chunk_message(chunk)
        except Exception as exc:
            code = status_of(exc).name
            count_refusal(self.metrics, counted.tenant, exc)
            grpc_error(grpc_context, exc)  # the stream ends with this status
        except (asyncio.CancelledError, GeneratorExit):
            code = "CANCELLED"
            raise
        finally:
            counted.end(code)
            call.tag_grpc(grpc_context)
            call.finish(code)

    async def _generate(
        self, prompt: messages.Prompt, sampling: SamplingParams, adapter: str | AdapterVersion | None,
        caller: Caller, call: CallTrace
    ) -> AsyncIterator[dict[str, Any]]:
        """Resolve the adapter (a ref; a version is used as it is), tokenize, then stream the
        replica's chunks (errors raised as ours)."""
        self._ensure_gc()
        if isinstance(adapter, str):
            with call.span("resolve"):
                adapter = await self._resolve(adapter, caller)
        version = adapter
        call.resolved(version)
        self.metrics.uses(version)
        routing = {"multiplexed_model_id": version.content_hash} if version and self.route_by_adapter else {}
        handle = (await self.backends.for_call("generate", version)).options(stream=True, **routing)
        with call.span("tokenize"):
            ids = await self._token_ids(prompt, sampling, version)
        call.tokenized(len(ids))
        request = {"prompt": ids, "sampling": sampling, "adapter": version, "request_id": uuid.uuid4().hex,
                   "trace": call.handoff()}
        response, ended = handle.generate.remote(request), False
        try:
            async for chunk in response:
                raise_if_error(chunk)
                call.relayed(chunk)
                yield chunk
            ended = True
        finally:
            call.replica_done()
            if not ended:  # closed early (the caller went away): the replica aborts the request
                response.cancel()

    async def _token_ids(self, prompt: messages.Prompt, sampling: SamplingParams,
                         version: AdapterVersion | None) -> list[int]:
        limits = limits_of(await self.backends.static(self.backends.model_id), self.max_prompt_chars)
        virtual_tokens = int((version.info or {}).get("virtual_tokens", 0)) if version else 0
        return await prompt_token_ids(prompt, self.tokenizer, limits, sampling.max_tokens, virtual_tokens)

    async def _measured(self, chunks: AsyncGenerator[dict, None], counted: Call) -> AsyncIterator[dict]:
        """The chunks, counted: time to the first, prompt tokens, tokens sent; an error or a
        cancel inside the stream is the call's status."""
        first = True
        try:
            async for chunk in chunks:
                self._count(chunk, counted, first)
                first = False
                yield chunk
        except Exception as exc:
            counted.failed_with = status_of(exc).name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            counted.failed_with = "CANCELLED"
            raise
        finally:
            await chunks.aclose()  # closed early: so is the source

    def _count(self, chunk: dict, counted: Call, first: bool) -> None:
        """A relayed chunk's tokens, in the call's metrics and its tenant's quota; the first's
        time and prompt tokens too."""
        if first:
            prompt_tokens = chunk.get("prompt_tokens", 0)
            counted.first_token(prompt_tokens)
            self.gate.count_tokens(counted.tenant, prompt_tokens)
        tokens = len(chunk["token_ids"])
        counted.tokens(tokens)
        self.gate.count_tokens(counted.tenant, tokens)

    async def _resolve(self, ref: str, caller: Caller) -> AdapterVersion:
        """The version `ref` names for the caller: recently resolved (no store read), else from the store."""
        if (version := self.resolutions.get(ref, caller.store_view)) is not None:
            return version
        version = await asyncio.to_thread(self.store.resolve, ref, tenant=caller.store_view)
        self.resolutions.put(ref, caller.store_view, version)
        return version

    # --- gRPC: encoder tasks ------------------------------------------------

    async def Classify(self, request: pb.ClassifyRequest, grpc_context) -> pb.ClassifyResponse:
        call = self.tracing.grpc_call("Classify", grpc_context.invocation_metadata())

        async def run(caller: Caller, request: pb.ClassifyRequest) -> pb.ClassifyResponse:
            texts = messages.texts_of(request.texts, self.max_texts)
            ref = messages.adapter_ref_of(request.adapter)
            if ref is None:
                raise errors.RequestError("classify needs an adapter with a classification head: set adapter")
            with call.span("resolve"):
                version = await self._resolve(ref, caller)
            messages.check_has_head(version)
            return messages.classify_response(await self._pooled("classify", texts, version, call))

        return await self._unary("Classify", grpc_context, run, request, call)

    async def Embed(self, request: pb.EmbedRequest, grpc_context) -> pb.EmbedResponse:
        call = self.tracing.grpc_call("Embed", grpc_context.invocation_metadata())

        async def run(caller: Caller, request: pb.EmbedRequest) -> pb.EmbedResponse:
            texts = messages.texts_of(request.texts, self.max_texts)
            ref = messages.adapter_ref_of(request.adapter)
            version = None
            if ref:
                with call.span("resolve"):
                    version = await self._resolve(ref, caller)
            return messages.embed_response(await self._pooled("embed", texts, version, call))

        return await self._unary("Embed", grpc_context, run, request, call)

    async def _pooled(self, task: str, texts: list[str], version: AdapterVersion | None,
                      call: CallTrace) -> dict[str, Any]:
        """Run classify/embed on the backbone that serves it; replica errors raised as ours."""
        self._ensure_gc()
        call.resolved(version)
        self.metrics.uses(version)
        handle = await self.backends.for_call(task, version)
        if version:
            handle = handle.options(multiplexed_model_id=version.content_hash)
        request = {"texts": texts, "adapter": version, "trace": call.handoff()}
        try:
            reply = await getattr(handle, task).remote(request)
        finally:
            call.replica_done()
        raise_if_error(reply)
        return reply

    # --- gRPC: adapters -----------------------------------------------------

    async def UploadAdapter(self, request_stream, grpc_context) -> pb.AdapterInfo:
        return await self._unary("UploadAdapter", grpc_context, self._upload, request_stream)

    async def _upload(self, caller: Caller, request_stream) -> pb.AdapterInfo:
        statics = await self.backends.statics()
        with upload_dir() as tmp:
            header = await receive_upload(request_stream, tmp, self.limits)
            validator = adapter_validator(statics, header.name)
            version = await asyncio.to_thread(
                self.store.publish, header.name, tmp, tenant=caller.tenant, public=header.public,
                validator=validator, quotas=caller.quotas,
            )
        self.resolutions.forget(header.name)
        return messages.adapter_info(version)

    async def ListAdapters(self, request: pb.ListAdaptersRequest, grpc_context) -> pb.ListAdaptersResponse:
        async def run(caller: Caller, request: pb.ListAdaptersRequest) -> pb.ListAdaptersResponse:
            found = await asyncio.to_thread(self.store.list, tenant=caller.store_view, name=request.name or None)
            return pb.ListAdaptersResponse(adapters=[messages.adapter_info(v) for v in found],
                                           usage=await self._usage(caller), tenants=await self._all_usage(caller))

        return await self._unary("ListAdapters", grpc_context, run, request)

    async def GetAdapter(self, request: pb.GetAdapterRequest, grpc_context) -> pb.AdapterInfo:
        async def run(caller: Caller, request: pb.GetAdapterRequest) -> pb.AdapterInfo:
            found = await asyncio.to_thread(self.store.describe, request.ref, tenant=caller.store_view)
            return messages.adapter_info(found)

        return await self._unary("GetAdapter", grpc_context, run, request)

    async def DeleteAdapter(self, request: pb.DeleteAdapterRequest, grpc_context) -> pb.DeleteAdapterResponse:
        """Tombstones the version(s): new requests are refused at once, running ones finish."""
        async def run(caller: Caller, request: pb.DeleteAdapterRequest) -> pb.DeleteAdapterResponse:
            name, number = parse_ref(request.ref)
            try:
                gone = await asyncio.to_thread(self.store.delete, name, number, tenant=caller.store_view)
            finally:  # a delete that failed part-way may have tombstoned some versions
                self.resolutions.forget(name)
            return pb.DeleteAdapterResponse(deleted=[v.ref for v in gone])

        return await self._unary("DeleteAdapter", grpc_context, run, request)

    async def ServerInfo(self, request: pb.ServerInfoRequest, grpc_context) -> pb.ServerInfoResponse:
        async def run(caller: Caller, request: pb.ServerInfoRequest) -> pb.ServerInfoResponse:
            facts = await self.replica.describe.remote()
            limits = {"max_upload_bytes": self.limits.max_total_bytes, "max_upload_files": self.limits.max_files}
            info = messages.server_info(self.backbone_id, facts["static"], facts["live"], limits)
            info.encoder_id = self.backends.encoder_id or ""
            info.backbones_json = json.dumps(await self.backends.statics())  # the CLI's upload check
            info.usage.CopyFrom(await self._usage(caller))
            return info

        return await self._unary("ServerInfo", grpc_context, run, request)

    async def _unary(self, method: str, grpc_context, run, request, call: CallTrace | None = None):
        """Authenticate, check the scope, take a place, run; an error ends the call with its status
        (and an empty reply, which the client never sees). Counts the call; traces it (as `call` if
        given)."""
        counted, code = self.metrics.start(method), "OK"
        call = call or self.tracing.grpc_call(method, grpc_context.invocation_metadata())
        try:
            caller = grpc_caller(self.keys, grpc_context)
            counted.tenant = caller.tenant
            caller.require(method)
            refuse_undecodable(request)
            with self.admission.admit(self.gate.enter(caller, method)):
                return await run(caller, request)
        except Exception as exc:
            code = status_of(exc).name
            count_refusal(self.metrics, counted.tenant, exc)
            grpc_error(grpc_context, exc)
            return _empty_reply(method)
        finally:
            counted.end(code)
            call.tag_grpc(grpc_context)
            call.finish(code)

    # --- tenants' usage -------------------------------------------------------

    async def _usage(self, caller: Caller) -> pb.TenantUsage:
        return caller_usage(caller, await asyncio.to_thread(self.store.usage, caller.tenant), self.gate)

    async def _all_usage(self, caller: Caller) -> list[pb.TenantUsage]:
        """Every tenant's usage, for an admin key of a server with keys (else none)."""
        if caller.tenant is None or not caller.is_admin:
            return []
        quotas = self.keys.quotas()
        stored = await asyncio.to_thread(self.store.usages, sorted(quotas))
        return [tenant_usage(t, [], quotas[t], stored[t], self.gate) for t in sorted(quotas)]

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
