"""OpenAI-compatible /v1/completions bodies (plain and SSE stream).

`model` is the base model's id or an adapter reference (`name` or `name@3`). The
sampling fields and their checks are openai_common's; completions also refuse `best_of`,
`echo`, `logprobs` and `suffix` unless neutral. A prompt is one string of at most 1 Mi
characters or one list of token ids; `return_token_ids` adds `token_ids` to each choice.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from adapterserve import request_fields as check
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError
from adapterserve.server import openai_common as common

NEUTRAL: common.Neutral = {
    **common.NEUTRAL_SAMPLING,
    "best_of": ("1 or null", common.exactly(1)),
    "echo": ("false or null", common.exactly(False)),
    "logprobs": ("null", common.never),
    "suffix": ('"" or null', common.exactly("")),
}


@dataclass(frozen=True)
class CompletionCall:
    model: str
    prompt: str | list[int]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    id: str
    created: int


def model_hint(backbone_id: str) -> str:
    return f"{backbone_id!r} for the base model, or an adapter 'name[@version]'"


def parse_completion(body: Any, backbone_id: str) -> CompletionCall:
    """Check an OpenAI /v1/completions body field by field; RequestError names the field."""
    body = common.check_body(body)
    model = common.model_of(body, model_hint(backbone_id))
    common.refuse_unsupported(body, NEUTRAL)
    stream = common.flag(body, "stream")
    common.optional_text(body, "user")
    return CompletionCall(
        model=model,
        prompt=_prompt(body.get("prompt")),
        sampling=common.sampling_of(body),
        stream=stream,
        include_usage=common.include_usage(body, stream),
        return_token_ids=common.flag(body, "return_token_ids"),
        id=f"cmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


def _prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise RequestError("'prompt' is required: a string or a list of token ids")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):  # a batch
        if len(prompt) > 1:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; this server takes one per request")
        return check.prompt("prompt[0]", prompt[0])
    return check.prompt("prompt", prompt)


def completion_body(call: CompletionCall, chunks: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole (non-streamed) response from every chunk the replica sent: one choice per index."""
    choices = [_choice(run, call.return_token_ids) for run in common.by_choice(chunks)]
    generated = sum(len(c["token_ids"]) for c in chunks)
    return {**_envelope(call), "choices": choices, "usage": common.generation_usage(chunks, generated)}


def _choice(chunks: list[Mapping[str, Any]], return_token_ids: bool) -> dict[str, Any]:
    """One choice from its chunks."""
    choice = {"index": chunks[0].get("index", 0), "text": "".join(c["text"] for c in chunks), "logprobs": None,
              "finish_reason": common.finish(chunks[-1]["finish_reason"])}
    if return_token_ids:
        choice["token_ids"] = [t for c in chunks for t in c["token_ids"]]
    return choice


def sse_events(call: CompletionCall, chunks: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    def choice_of(c: Mapping[str, Any], first: bool) -> dict[str, Any]:
        choice = {"index": 0, "text": c["text"], "logprobs": None, "finish_reason": common.finish(c["finish_reason"])}
        if call.return_token_ids:
            choice["token_ids"] = list(c["token_ids"])
        return choice

    return common.sse(chunks, _envelope(call), choice_of, call.include_usage)


def _envelope(call: CompletionCall) -> dict[str, Any]:
    return {"id": call.id, "object": "text_completion", "created": call.created, "model": call.model}
