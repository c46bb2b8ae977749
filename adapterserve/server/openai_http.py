"""OpenAI-compatible HTTP bodies: /v1/completions (plain and SSE stream) and /v1/models.

`model` is the base model's id or an adapter reference (`name` or `name@3`).
Extensions, as in vLLM: `top_k`, `seed`, `ignore_eos`, `stop_token_ids`, and
`return_token_ids` (adds `token_ids` to each choice).
"""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError
from adapterserve.server.status import http_status, message_of, status_of

_UNSUPPORTED = {"echo": False, "logprobs": None, "best_of": None, "suffix": None, "n": 1}


@dataclass(frozen=True)
class CompletionCall:
    model: str
    adapter: str | None  # None = base model
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    id: str
    created: int


def parse_completion(body: Any, backbone_id: str) -> CompletionCall:
    """Check an OpenAI /v1/completions body; RequestError says what is wrong."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"'model' is required: {backbone_id!r} for the base model, or an adapter 'name[@version]'")
    for key, default in _UNSUPPORTED.items():
        if body.get(key, default) not in (default, None):
            raise RequestError(f"{key!r} is not supported by this server")
    return CompletionCall(
        model=model,
        adapter=None if model == backbone_id else model,
        prompt=_prompt(body.get("prompt")),
        sampling=_sampling(body),
        stream=bool(body.get("stream", False)),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage", False)),
        return_token_ids=bool(body.get("return_token_ids", False)),
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise RequestError("'prompt' must be a non-empty string or list of token ids (one prompt per request)")


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    fields = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
              if body.get(k) is not None}
    stop = body.get("stop")
    if stop is not None:
        fields["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
    if body.get("stop_token_ids"):
        fields["stop_token_ids"] = tuple(body["stop_token_ids"])
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise RequestError(f"invalid sampling parameters: {exc}") from exc


def completion_body(call: CompletionCall, chunks: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole (non-streamed) response from every chunk the replica sent."""
    token_ids = [t for c in chunks for t in c["token_ids"]]
    choice = {"index": 0, "text": "".join(c["text"] for c in chunks), "logprobs": None,
              "finish_reason": _finish(chunks[-1]["finish_reason"])}
    if call.return_token_ids:
        choice["token_ids"] = token_ids
    return {**_envelope(call), "choices": [choice], "usage": _usage(chunks[0].get("prompt_tokens", 0), len(token_ids))}


async def sse_events(call: CompletionCall, chunks: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    prompt_tokens = generated = 0
    try:
        async for c in chunks:
            prompt_tokens = c.get("prompt_tokens", prompt_tokens)
            generated += len(c["token_ids"])
            choice = {"index": 0, "text": c["text"], "logprobs": None, "finish_reason": _finish(c["finish_reason"])}
            if call.return_token_ids:
                choice["token_ids"] = list(c["token_ids"])
            yield _event({**_envelope(call), "choices": [choice]})
    except Exception as exc:  # headers are sent: report in the stream
        yield _event(error_body(exc))
        return
    if call.include_usage:
        yield _event({**_envelope(call), "choices": [], "usage": _usage(prompt_tokens, generated)})
    yield "data: [DONE]\n\n"


def models_body(backbone_id: str, versions: list[AdapterVersion]) -> dict[str, Any]:
    base = {"id": backbone_id, "object": "model", "created": 0, "owned_by": "adapterserve", "root": backbone_id}
    adapters = [
        {"id": v.ref, "object": "model", "created": int(v.created_at.timestamp()),
         "owned_by": v.tenant or "adapterserve", "root": backbone_id, "parent": backbone_id}
        for v in versions
    ]
    return {"object": "list", "data": [base, *adapters]}


def error_body(exc: BaseException) -> dict[str, Any]:
    code = status_of(exc)
    return {"error": {"message": message_of(exc), "type": code.name.lower(), "code": http_status(exc)}}


def _envelope(call: CompletionCall) -> dict[str, Any]:
    return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish(reason: str | None) -> str | None:
    return reason or None  # the replica sends "" or None until the last chunk


def _event(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
