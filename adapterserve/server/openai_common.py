"""What the OpenAI-compatible routes share: body and field checks, sampling fields, usage, SSE.

Every field has its OpenAI type (null = the default) and SamplingParams' range; a check
names the field. Fields this server does not implement are refused unless they hold
their neutral value (NEUTRAL: never silently ignored); keys it does not know are
ignored (SDKs send some). Extensions, as in vLLM: `top_k`, `seed`, `ignore_eos`,
`stop_token_ids`, `return_token_ids`.
"""
from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from adapterserve import request_fields as check
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError
from adapterserve.server.openai_errors import error_body

MAX_MODEL_CHARS = 1024
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "n")
_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads pairs valid ones: those left are lone
Neutral = dict[str, tuple[str, Callable[[Any], bool]]]  # field -> (its neutral values, in words; test)


def exactly(wanted: Any) -> Callable[[Any], bool]:
    return lambda v: type(v) is type(wanted) and v == wanted


def number_equal(wanted: float) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == wanted


def never(value: Any) -> bool:
    return False


# Sampling fields every generation route refuses unless neutral (or null).
NEUTRAL_SAMPLING: Neutral = {
    "min_p": ("0 or null", number_equal(0)),  # vLLM extensions
    "min_tokens": ("0 or null", number_equal(0)),
}


def check_body(body: Any) -> dict[str, Any]:
    """The body as a JSON object holding no lone surrogate; RequestError otherwise."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {check.short(body)}")
    _refuse_lone_surrogates(body)
    return body


def model_of(body: Mapping[str, Any], what: str) -> str:
    """The required `model` field; `what` says what it may name."""
    model = body.get("model")
    if model is None or model == "":
        raise RequestError(f"'model' is required: {what}")
    return check.text("model", model, MAX_MODEL_CHARS)


def refuse_unsupported(body: Mapping[str, Any], neutral: Neutral) -> None:
    for key, (allowed, is_neutral) in neutral.items():
        value = body.get(key)
        if value is not None and not is_neutral(value):
            raise RequestError(f"{key!r} is not supported by this server (only {allowed}), got {check.short(value)}")


def flag(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    return default if value is None else check.boolean(key, value)


def optional_text(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise RequestError(f"{key!r} must be a string, got {check.short(value)}")
    return value


def include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options.include_usage`; stream_options only with stream."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"'stream_options' must be an object or null, got {check.short(options)}")
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true")
    value = options.get("include_usage")
    return False if value is None else check.boolean("stream_options.include_usage", value)


def sampling_of(body: Mapping[str, Any], **fields: Any) -> SamplingParams:
    """SamplingParams from the body's sampling fields (null = the default), `fields` on top;
    SamplingParams checks every one."""
    given = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    return SamplingParams(**{**given, **fields})


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """The usage block; a generation's (cached_tokens given) says how many prompt tokens the
    prefix cache held."""
    block: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        block["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return block


def by_choice(chunks: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The chunks of each choice (n > 1: chunks carry their choice's `index`), in index order."""
    runs: dict[int, list[Mapping[str, Any]]] = {}
    for c in chunks:
        runs.setdefault(c.get("index", 0), []).append(c)
    return [runs[i] for i in sorted(runs)]


def generation_usage(chunks: Sequence[Mapping[str, Any]], completion_tokens: int) -> dict[str, Any]:
    """The usage block of a generation from its chunks (the first carries the prompt's counts)."""
    first = chunks[0] if chunks else {}
    return usage(first.get("prompt_tokens", 0), completion_tokens, first.get("cached_tokens", 0))


def finish(reason: str | None) -> str | None:
    return reason or None  # the replica sends "" or None until the last chunk


def event(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def sse(chunks: AsyncIterator[Mapping[str, Any]], envelope: Mapping[str, Any],
              choice_of: Callable[[Mapping[str, Any], bool], dict[str, Any]], with_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: `envelope` + one choice per chunk (`choice_of(chunk, first of its
    choice)`, with the chunk's `index`), a usage event if asked (the prompt once, every choice's
    tokens), then `data: [DONE]`. An error after the headers went is reported in the stream."""
    head: dict[str, Any] = {}  # the prompt's counts, from the first chunk
    generated = 0
    started: set[int] = set()  # choices that have sent a chunk
    try:
        async for c in chunks:
            if not started:
                head = {k: c[k] for k in ("prompt_tokens", "cached_tokens") if k in c}
            generated += len(c["token_ids"])
            index = c.get("index", 0)
            yield event({**envelope, "choices": [{**choice_of(c, index not in started), "index": index}]})
            started.add(index)
    except Exception as exc:
        yield event(error_body(exc))
        return
    if with_usage:
        yield event({**envelope, "choices": [], "usage": generation_usage([head], generated)})
    yield "data: [DONE]\n\n"


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
