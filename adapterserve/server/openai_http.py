"""OpenAI-compatible HTTP bodies: /v1/completions (plain and SSE stream) and /v1/models.

`model` is the base model's id or an adapter reference (`name` or `name@3`).
Extensions, as in vLLM: `top_k`, `seed`, `ignore_eos`, `stop_token_ids`, and
`return_token_ids` (adds `token_ids` to each choice). Every field has its OpenAI
type (null = the default) and SamplingParams' range; fields this server does not
implement (`n`, `best_of`, `echo`, `logprobs`, `suffix`, penalties, `logit_bias`)
are refused unless neutral. A prompt is one string of at most 1 Mi characters or
one list of token ids.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adapterserve import request_fields as check
from adapterserve.adapters_store.records import AdapterVersion
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError
from adapterserve.server.status import http_status, message_of, status_of

MAX_MODEL_CHARS = 1024
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid ones: those left are lone


def _exactly(wanted: Any) -> Callable[[Any], bool]:
    return lambda v: type(v) is type(wanted) and v == wanted


def _number(wanted: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == wanted


# Fields this server does not implement, accepted only at their neutral value (or null).
_NEUTRAL: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "n": ("1 or null", _exactly(1)),
    "best_of": ("1 or null", _exactly(1)),
    "echo": ("false or null", _exactly(False)),
    "logprobs": ("null", lambda v: False),
    "suffix": ('"" or null', _exactly("")),
    "presence_penalty": ("0 or null", _number(0)),
    "frequency_penalty": ("0 or null", _number(0)),
    "logit_bias": ("{} or null", _exactly({})),
    "min_p": ("0 or null", _number(0)),  # vLLM extensions
    "repetition_penalty": ("1 or null", _number(1)),
    "min_tokens": ("0 or null", _number(0)),
}


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
    """Check an OpenAI /v1/completions body field by field; RequestError names the field.
    Keys this server does not know are ignored (SDKs send some)."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {check.short(body)}")
    _refuse_lone_surrogates(body)
    model = _model(body.get("model"), backbone_id)
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise RequestError(f"'user' must be a string, got {check.short(body['user'])}")
    return CompletionCall(
        model=model,
        adapter=None if model == backbone_id else model,
        prompt=_prompt(body.get("prompt")),
        sampling=_sampling(body),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        return_token_ids=_flag(body, "return_token_ids"),
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


def _model(model: Any, backbone_id: str) -> str:
    if model is None or model == "":
        raise RequestError(f"'model' is required: {backbone_id!r} for the base model, or an adapter 'name[@version]'")
    return check.text("model", model, MAX_MODEL_CHARS)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for key, (neutral, is_neutral) in _NEUTRAL.items():
        value = body.get(key)
        if value is not None and not is_neutral(value):
            raise RequestError(f"{key!r} is not supported by this server (only {neutral}), "
                               f"got {check.short(value)}")


def _flag(body: Mapping[str, Any], key: str) -> bool:
    value = body.get(key)
    return False if value is None else check.boolean(key, value)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object or null, got {check.short(options)}")
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true")
    value = options.get("include_usage")
    return False if value is None else check.boolean("stream_options.include_usage", value)


def _prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise RequestError("'prompt' is required: a string or a list of token ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch
        if len(prompt) > 1:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; this server takes one per request")
        return check.prompt("prompt[0]", prompt[0])
    return check.prompt("prompt", prompt)


def _sampling(body: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams checks every field; null means its default."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")
    return SamplingParams(**{k: body[k] for k in names if body.get(k) is not None})


def _refuse_lone_surrogates(body: dict[str, Any]) -> None:
    """RequestError naming the first string (value or key) with a lone surrogate: it cannot
    be encoded, tokenized or echoed back."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            _check_unicode(check.short(path), value)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_unicode(f"a key in {check.short(path) if path else 'the body'}", key)
                stack.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value) if isinstance(v, (str, list, dict)))


def _check_unicode(where: str, value: str) -> None:
    found = _SURROGATE.search(value)
    if found:
        raise RequestError(f"{where} holds a lone surrogate (U+{ord(found.group()):04X} at character "
                           f"{found.start()}): send valid Unicode (JSON escapes of surrogates must come in pairs)")


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
