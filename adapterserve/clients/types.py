"""What the client returns: plain dataclasses made from the gRPC messages."""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import grpc

from adapterserve.proto import adapterserve_pb2 as pb


class ClientError(Exception):
    """The server refused or failed a call; `code` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, deadline_s: float | None = None) -> ClientError:
        if error.code() is grpc.StatusCode.DEADLINE_EXCEEDED and deadline_s is not None:
            return cls(error.code(), f"no reply within the call's deadline of {deadline_s:g} s")
        return cls(error.code(), error.details() or "")


@dataclass(frozen=True)
class Chunk:
    """One streamed piece: the tokens and text new since the previous chunk."""

    token_ids: list[int]
    text: str
    finish_reason: str | None  # set on the last chunk: "stop", "length" or "abort"
    adapter: str  # resolved "name@version" (first chunk only; "" for the base model)
    prompt_tokens: int  # first chunk only
    request_id: str
    cached_tokens: int = 0  # prompt tokens found in the server's prefix cache (first chunk only)
    index: int = 0  # the choice (of n) the tokens belong to; each choice's last chunk has its finish_reason

    @classmethod
    def from_proto(cls, m: pb.GenerateResponse) -> Chunk:
        return cls(list(m.token_ids), m.text, m.finish_reason or None, m.adapter, m.prompt_tokens, m.request_id,
                   m.cached_tokens, m.index)


@dataclass(frozen=True)
class Completion:
    """A whole generation: every chunk put together."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    adapter: str
    prompt_tokens: int
    request_id: str
    cached_tokens: int = 0  # prompt tokens found in the server's prefix cache
    index: int = 0  # which choice this is
    choices: list[Completion] = field(default_factory=list)  # n > 1: every choice in index order (this is choice 0)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Completion:
        """Choice 0 put together; with n > 1 every choice in `choices` (prompt counts from the first chunk)."""
        if not chunks:
            raise ClientError(grpc.StatusCode.UNKNOWN, "the server sent no tokens")
        by_index: dict[int, list[Chunk]] = {}
        for c in chunks:
            by_index.setdefault(c.index, []).append(c)
        choices = [cls._choice(chunks[0], by_index[i], i) for i in sorted(by_index)]
        return choices[0] if len(choices) == 1 else replace(choices[0], choices=choices)

    @classmethod
    def _choice(cls, head: Chunk, chunks: list[Chunk], index: int) -> Completion:
        return cls(
            token_ids=[t for c in chunks for t in c.token_ids],
            text="".join(c.text for c in chunks),
            finish_reason=chunks[-1].finish_reason,
            adapter=head.adapter,
            prompt_tokens=head.prompt_tokens,
            request_id=head.request_id,
            cached_tokens=head.cached_tokens,
            index=index,
        )

    def to_json(self) -> dict:
        body = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "adapter": self.adapter or None, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens}
        if self.choices:
            body["choices"] = [{"index": c.index, "token_ids": c.token_ids, "text": c.text,
                                "finish_reason": c.finish_reason} for c in self.choices]
        return body


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    version: int
    ref: str
    content_hash: str
    tenant: str | None
    public: bool
    created_at: str
    size_bytes: int
    files: list[str]
    kind: str
    rank: int
    target_modules: list[str]

    @classmethod
    def from_proto(cls, m: pb.AdapterInfo) -> AdapterInfo:
        return cls(m.name, m.version, m.ref, m.content_hash, m.tenant or None, m.public, m.created_at,
                   m.size_bytes, list(m.files), m.kind, m.rank, list(m.target_modules))


QUOTAS = ("bytes_stored", "versions_per_adapter", "adapters", "concurrent_requests", "tokens_per_minute")


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's scopes (the calling key's), usage and quotas (None: no limit). Tokens and requests
    in flight are those counted by the ingress replica that answered."""

    tenant: str | None  # None on an open server
    scopes: list[str]
    bytes_stored: int
    adapters: int
    tokens_last_minute: int
    requests_in_flight: int
    quotas: dict[str, int | None]

    @classmethod
    def from_proto(cls, m: pb.TenantUsage) -> TenantUsage:
        quotas = {q: getattr(m.quotas, q) if m.quotas.HasField(q) else None for q in QUOTAS}
        return cls(m.tenant or None, list(m.scopes), m.bytes_stored, m.adapters, m.tokens_last_minute,
                   m.requests_in_flight, quotas)


@dataclass(frozen=True)
class Listing:
    """ListAdapters' reply: the adapters, the caller's usage, every tenant's for an admin key."""

    adapters: list[AdapterInfo]
    usage: TenantUsage
    tenants: list[TenantUsage]

    @classmethod
    def from_proto(cls, m: pb.ListAdaptersResponse) -> Listing:
        return cls([AdapterInfo.from_proto(a) for a in m.adapters], TenantUsage.from_proto(m.usage),
                   [TenantUsage.from_proto(t) for t in m.tenants])


@dataclass(frozen=True)
class ServerInfo:
    backbone_id: str
    model_type: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_model_len: int
    adapter_kinds: list[str]
    max_lora_rank: int
    linear_shapes: dict[str, tuple[int, int]]  # module kind -> (in_features, out_features)
    max_upload_bytes: int
    max_upload_files: int
    num_kv_blocks: int
    free_kv_blocks: int
    running_requests: int
    loaded_adapters: list[str] = field(default_factory=list)
    cancelled_requests: int = 0
    encoder_id: str = ""  # the encoder serving classify/embed; "" if none
    usage: TenantUsage | None = None  # the calling key's tenant
    backbones: list[dict] = field(default_factory=list)  # every backbone's facts, for the upload check

    @classmethod
    def from_proto(cls, m: pb.ServerInfoResponse) -> ServerInfo:
        return cls(
            m.backbone_id, m.model_type, m.num_layers, m.hidden_size, m.vocab_size, m.max_model_len,
            list(m.adapter_kinds), m.max_lora_rank,
            {s.module: (s.in_features, s.out_features) for s in m.linear_shapes},
            m.max_upload_bytes, m.max_upload_files, m.num_kv_blocks, m.free_kv_blocks, m.running_requests,
            list(m.loaded_adapters), m.cancelled_requests, m.encoder_id,
            TenantUsage.from_proto(m.usage) if m.HasField("usage") else None,
            json.loads(m.backbones_json) if m.backbones_json else [],
        )


@dataclass(frozen=True)
class Classification:
    """One text's label from an adapter's classification head."""

    label: str
    label_index: int
    probabilities: list[float]  # one per label, in label order
    labels: list[str]

    @property
    def probability(self) -> float:
        return self.probabilities[self.label_index]

    @classmethod
    def from_proto(cls, m: pb.Classification) -> Classification:
        return cls(m.label, m.label_index, list(m.probabilities), list(m.labels))

    def to_json(self) -> dict:
        return {"label": self.label, "label_index": self.label_index, "probabilities": self.probabilities,
                "labels": self.labels}
