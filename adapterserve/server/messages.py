"""Conversions between the gRPC messages and the engine's and store's types."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from adapterserve import request_fields as check
from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.proto import adapterserve_pb2 as pb

Prompt = str | list[int]
RECENT_SAMPLINGS = 256  # sampling messages remembered with their checked SamplingParams
MAX_SAMPLING_KEY_BYTES = 512  # larger ones (long stop lists, logit biases) are checked every time
_recent_sampling: dict[bytes, SamplingParams] = {}  # serialized message -> its params, oldest first


def prompt_of(request: pb.GenerateRequest) -> Prompt:
    """The prompt: text of at most MAX_PROMPT_CHARS characters, or token ids >= 0
    (RequestTooLarge if longer)."""
    which = request.WhichOneof("prompt")
    if which == "text":
        return check.prompt("text", request.text)
    if which == "token_ids":
        return check.prompt("token_ids", list(request.token_ids.ids))
    raise RequestError("set the prompt: either text or token_ids")


def sampling_of(p: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep the engine's defaults; SamplingParams checks every field.
    Checked params are frozen, so a message seen recently gives the same object back (most
    calls send one of a few settings); one that fails its check is checked again each time."""
    key = p.SerializeToString(deterministic=True)
    if (known := _recent_sampling.get(key)) is not None:
        return known
    params = _checked_sampling(p)
    if len(key) <= MAX_SAMPLING_KEY_BYTES:
        if len(_recent_sampling) >= RECENT_SAMPLINGS:
            _recent_sampling.pop(next(iter(_recent_sampling), None), None)  # the oldest
        _recent_sampling[key] = params
    return params


def _checked_sampling(p: pb.SamplingParams) -> SamplingParams:
    fields: dict[str, Any] = {
        "top_k": p.top_k,
        "stop_token_ids": tuple(p.stop_token_ids),
        "stop": tuple(p.stop),
        "ignore_eos": p.ignore_eos,
    }
    for name in ("max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "n"):
        if p.HasField(name):
            fields[name] = getattr(p, name)
    if p.logit_bias:
        fields["logit_bias"] = dict(p.logit_bias)
    return SamplingParams(**fields)


def adapter_ref_of(ref: str) -> str | None:
    return ref.strip() or None


def texts_of(texts: Sequence[str], limit: int) -> list[str]:
    """The texts of a Classify/Embed call: 1 to `limit` texts, each non-empty and at most
    MAX_TEXT_CHARS characters; RequestError (RequestTooLarge) names the first that is not."""
    if not texts:
        raise RequestError("texts is empty: send at least one text")
    if len(texts) > limit:
        raise RequestError(f"{len(texts)} texts in one call; this server takes at most {limit}: split the call")
    return [check.text(f"texts[{i}]", t, check.MAX_TEXT_CHARS, too_long=RequestTooLarge) for i, t in enumerate(texts)]


def check_has_head(version: AdapterVersion) -> None:
    """RequestError unless the store recorded a classification head for this version."""
    if not (version.info or {}).get("labels"):
        raise RequestError(f"adapter {version.ref!r} ({(version.info or {}).get('kind', 'unknown kind')}) has no "
                           "classification head; classify needs one (use embed, or an adapter saved with its head)")


def classify_response(reply: Mapping[str, Any]) -> pb.ClassifyResponse:
    return pb.ClassifyResponse(results=[pb.Classification(**r) for r in reply["results"]], adapter=reply["adapter"])


def embed_response(reply: Mapping[str, Any]) -> pb.EmbedResponse:
    return pb.EmbedResponse(embeddings=[pb.Embedding(values=v) for v in reply["embeddings"]], adapter=reply["adapter"])


def adapter_info(v: AdapterVersion) -> pb.AdapterInfo:
    info = v.info or {}
    return pb.AdapterInfo(
        name=v.name,
        version=v.version,
        ref=v.ref,
        content_hash=v.content_hash,
        tenant=v.tenant or "",
        public=v.public,
        created_at=v.created_at.isoformat(),
        size_bytes=v.size_bytes,
        files=list(v.files),
        kind=str(info.get("kind", "")),
        rank=int(info.get("rank", 0)),
        target_modules=list(info.get("target_modules", [])),
    )


def server_info(backbone_id: str, static: Mapping[str, Any], live: Mapping[str, Any],
                limits: Mapping[str, int]) -> pb.ServerInfoResponse:
    """`static`/`live` come from a replica's `describe()`; `limits` from the ingress's store."""
    return pb.ServerInfoResponse(
        backbone_id=backbone_id,
        model_type=static["model_type"],
        num_layers=static["num_layers"],
        hidden_size=static["hidden_size"],
        vocab_size=static["vocab_size"],
        max_model_len=static["max_model_len"],
        adapter_kinds=list(static["adapter_kinds"]),
        max_lora_rank=static["max_lora_rank"],
        linear_shapes=[
            pb.LinearShape(module=k, in_features=i, out_features=o) for k, (i, o) in static["linear_shapes"].items()
        ],
        max_upload_bytes=limits["max_upload_bytes"],
        max_upload_files=limits["max_upload_files"],
        num_kv_blocks=static["num_kv_blocks"],
        free_kv_blocks=live["free_kv_blocks"],
        running_requests=live["running_requests"],
        loaded_adapters=list(live["loaded_adapters"]),
        cancelled_requests=live["cancelled_requests"],
    )


def chunk_message(chunk: Mapping[str, Any]) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        token_ids=chunk["token_ids"],
        text=chunk["text"],
        finish_reason=chunk["finish_reason"] or "",
        adapter=chunk.get("adapter") or "",
        prompt_tokens=chunk.get("prompt_tokens", 0),
        request_id=chunk["request_id"],
        cached_tokens=chunk.get("cached_tokens", 0),
        index=chunk.get("index", 0),
    )
