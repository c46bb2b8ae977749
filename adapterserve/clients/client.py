"""Typed gRPC client for an adapterserve server, synchronous and asyncio.

    with Client("localhost:50051", api_key="...") as c:
        c.upload("./my-lora", name="sql")                   # -> AdapterInfo (ref "sql@1")
        print(c.generate("SELECT", adapter="sql", max_tokens=32, temperature=0).text)
        for chunk in c.stream("Hello", max_tokens=16):      # leaving the loop cancels the request
            print(chunk.text, end="")
        c.classify(["a wonderful film"], adapter="sentiment")[0].label  # -> "positive"
        c.embed(["a wonderful film"])[0]                                # -> 384 floats

    async with AsyncClient() as c:
        async for chunk in c.stream("Hello"):
            ...

Calls raise ClientError with the gRPC status code and the server's message.
The address defaults to $ADAPTERSERVE_SERVER or localhost:50051, the key to
$ADAPTERSERVE_API_KEY. Every call has a deadline: `timeout` seconds for the whole call
(a stream: until its last chunk; an upload: until the server has stored it), by default
$ADAPTERSERVE_TIMEOUT or DEFAULT_TIMEOUT_S; past it the call is cancelled and raises
ClientError(DEADLINE_EXCEEDED).
"""
from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from adapterserve.clients.types import (
    AdapterInfo,
    Chunk,
    Classification,
    ClientError,
    Completion,
    Listing,
    ServerInfo,
)
from adapterserve.clients.upload_stream import Progress, collect_files, upload_messages
from adapterserve.proto import adapterserve_pb2 as pb
from adapterserve.proto import adapterserve_pb2_grpc as pb_grpc

DEFAULT_SERVER = "localhost:50051"
DEFAULT_TIMEOUT_S = 600.0  # as OpenAI's clients: room for a long generation, not for a hang
# each client its own connection (gRPC would share one among channels to the same server): clients in one
# process then spread over a server's front workers (replica_grpc.workers) as clients in several do
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
                    ("grpc.use_local_subchannel_pool", 1)]


def default_server() -> str:
    return os.environ.get("ADAPTERSERVE_SERVER") or DEFAULT_SERVER


def deadline_s(timeout: float | None = None) -> float:
    """Seconds a call may take: `timeout`, else $ADAPTERSERVE_TIMEOUT, else DEFAULT_TIMEOUT_S;
    ValueError unless a number of seconds > 0."""
    if timeout is not None:
        return seconds(timeout, "timeout")
    given = os.environ.get("ADAPTERSERVE_TIMEOUT")
    return seconds(given, "$ADAPTERSERVE_TIMEOUT") if given else DEFAULT_TIMEOUT_S


def seconds(value: float | str, name: str) -> float:
    """`value` as a finite number of seconds > 0; ValueError naming `name` otherwise."""
    try:
        number = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0 < number < math.inf:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return number


def generate_request(
    prompt: str | Sequence[int],
    *,
    adapter: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int = 0,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    n: int | None = None,
) -> pb.GenerateRequest:
    """A GenerateRequest; unset sampling fields take the server's defaults. `n`: completions of
    the prompt (chunks carry their choice's index; generate's Completion lists them in `choices`)."""
    optional = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                "presence_penalty": presence_penalty, "frequency_penalty": frequency_penalty,
                "repetition_penalty": repetition_penalty, "n": n}
    sampling = pb.SamplingParams(
        top_k=top_k, stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        logit_bias=dict(logit_bias or {}), **{k: v for k, v in optional.items() if v is not None},
    )
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, adapter=adapter or "", sampling=sampling)
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(prompt)), adapter=adapter or "", sampling=sampling)


def classify_request(texts: Sequence[str], adapter: str) -> pb.ClassifyRequest:
    return pb.ClassifyRequest(texts=_texts(texts), adapter=adapter)


def embed_request(texts: Sequence[str], adapter: str | None = None) -> pb.EmbedRequest:
    return pb.EmbedRequest(texts=_texts(texts), adapter=adapter or "")


def _texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("pass a list of texts; use [text] for one")
    return list(texts)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


class Client:
    """Blocking client. `generate`/`stream` take the keyword arguments of `generate_request`;
    `timeout` is each call's deadline in seconds (default: see `deadline_s`)."""

    def __init__(self, server: str | None = None, api_key: str | None = None, *, timeout: float | None = None):
        self.server = server or default_server()
        self._metadata = _metadata(api_key if api_key is not None else os.environ.get("ADAPTERSERVE_API_KEY"))
        self.timeout = deadline_s(timeout)
        self._channel = grpc.insecure_channel(self.server, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.AdapterServeStub(self._channel)

    def stream(self, prompt: str | Sequence[int], **kwargs) -> Iterator[Chunk]:
        """Yield chunks as they are generated; closing the iterator early cancels the request."""
        call = self._stub.Generate(generate_request(prompt, **kwargs), metadata=self._metadata, timeout=self.timeout)
        try:
            for message in call:
                yield Chunk.from_proto(message)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e, self.timeout) from None
        finally:
            call.cancel()  # no-op once the call is complete

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        return Completion.from_chunks(list(self.stream(prompt, **kwargs)))

    def classify(self, texts: Sequence[str], adapter: str) -> list[Classification]:
        """Label each text with `adapter`'s classification head ("name" or "name@N")."""
        reply = self._call(self._stub.Classify, classify_request(texts, adapter))
        return [Classification.from_proto(r) for r in reply.results]

    def embed(self, texts: Sequence[str], adapter: str | None = None) -> list[list[float]]:
        """One vector per text from the encoder (through `adapter` if given)."""
        reply = self._call(self._stub.Embed, embed_request(texts, adapter))
        return [list(e.values) for e in reply.embeddings]

    def upload(self, directory: str | Path, name: str, *, public: bool = False,
               progress: Progress | None = None) -> AdapterInfo:
        messages = upload_messages(name, collect_files(directory), public=public, progress=progress)
        return AdapterInfo.from_proto(self._call(self._stub.UploadAdapter, messages))

    def list_adapters(self, name: str | None = None) -> list[AdapterInfo]:
        return self.listing(name).adapters

    def listing(self, name: str | None = None) -> Listing:
        """The adapters the key may use (of `name` if given), with its tenant's scopes and usage."""
        return Listing.from_proto(self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(name=name or "")))

    def get_adapter(self, ref: str) -> AdapterInfo:
        return AdapterInfo.from_proto(self._call(self._stub.GetAdapter, pb.GetAdapterRequest(ref=ref)))

    def delete_adapter(self, ref: str) -> list[str]:
        """Delete `name@version`, or every version of `name`; returns the refs deleted."""
        return list(self._call(self._stub.DeleteAdapter, pb.DeleteAdapterRequest(ref=ref)).deleted)

    def server_info(self) -> ServerInfo:
        return ServerInfo.from_proto(self._call(self._stub.ServerInfo, pb.ServerInfoRequest()))

    def health(self) -> str:
        """'SERVING' or 'NOT_SERVING' (grpc.health.v1)."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        reply = self._call(stub.Check, health_pb2.HealthCheckRequest())
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def _call(self, method, request):
        try:
            return method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e, self.timeout) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient:
    """asyncio client with the same methods as Client, as coroutines / async iterators."""

    def __init__(self, server: str | None = None, api_key: str | None = None, *, timeout: float | None = None):
        self.server = server or default_server()
        self._metadata = _metadata(api_key if api_key is not None else os.environ.get("ADAPTERSERVE_API_KEY"))
        self.timeout = deadline_s(timeout)
        self._channel = grpc.aio.insecure_channel(self.server, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.AdapterServeStub(self._channel)

    async def stream(self, prompt: str | Sequence[int], **kwargs) -> AsyncIterator[Chunk]:
        """Yield chunks as they are generated; closing the iterator (or cancelling) cancels the request."""
        call = self._stub.Generate(generate_request(prompt, **kwargs), metadata=self._metadata, timeout=self.timeout)
        try:
            async for message in call:
                yield Chunk.from_proto(message)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e, self.timeout) from None
        finally:
            call.cancel()

    async def generate(self, prompt: str | Sequence[int], **kwargs) -> Completion:
        return Completion.from_chunks([c async for c in self.stream(prompt, **kwargs)])

    async def classify(self, texts: Sequence[str], adapter: str) -> list[Classification]:
        reply = await self._call(self._stub.Classify, classify_request(texts, adapter))
        return [Classification.from_proto(r) for r in reply.results]

    async def embed(self, texts: Sequence[str], adapter: str | None = None) -> list[list[float]]:
        reply = await self._call(self._stub.Embed, embed_request(texts, adapter))
        return [list(e.values) for e in reply.embeddings]

    async def upload(self, directory: str | Path, name: str, *, public: bool = False,
                     progress: Progress | None = None) -> AdapterInfo:
        messages = upload_messages(name, collect_files(directory), public=public, progress=progress)
        return AdapterInfo.from_proto(await self._call(self._stub.UploadAdapter, messages))

    async def list_adapters(self, name: str | None = None) -> list[AdapterInfo]:
        return (await self.listing(name)).adapters

    async def listing(self, name: str | None = None) -> Listing:
        reply = await self._call(self._stub.ListAdapters, pb.ListAdaptersRequest(name=name or ""))
        return Listing.from_proto(reply)

    async def get_adapter(self, ref: str) -> AdapterInfo:
        return AdapterInfo.from_proto(await self._call(self._stub.GetAdapter, pb.GetAdapterRequest(ref=ref)))

    async def delete_adapter(self, ref: str) -> list[str]:
        return list((await self._call(self._stub.DeleteAdapter, pb.DeleteAdapterRequest(ref=ref))).deleted)

    async def server_info(self) -> ServerInfo:
        return ServerInfo.from_proto(await self._call(self._stub.ServerInfo, pb.ServerInfoRequest()))

    async def _call(self, method, request):
        try:
            return await method(request, metadata=self._metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            raise ClientError.from_rpc(e, self.timeout) from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
