"""OpenAI-compatible /v1/chat/completions bodies (plain and SSE stream).

`messages`: 1 to MAX_MESSAGES objects, each with a `role` (system, developer, user or
assistant; developer is given to the template as system), a `content` that is a string
or a list of text parts (`{"type": "text", "text": ...}`, joined with newlines), and
an optional `name`. Tools, tool and function messages, and parts other than text are
refused. The sampling fields are the completions' (openai_common), with
`max_completion_tokens` as another name of `max_tokens`; without either, an answer may
fill the context. Extensions, as in vLLM: `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `return_token_ids` (adds `token_ids`
to the choice and `prompt_token_ids` to the response).
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adapterserve import request_fields as check
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server import openai_common as common
from adapterserve.server.chat_template import ChatOptions
from adapterserve.server.openai_http import model_hint

ROLES = ("system", "developer", "user", "assistant")
MAX_MESSAGES = 4096
MAX_PARTS = 1024  # text parts of one message
MAX_NAME_CHARS = 64
MAX_TEMPLATE_KWARGS = 32
NEUTRAL: common.Neutral = {
    **common.NEUTRAL_SAMPLING,
    "logprobs": ("false or null", common.exactly(False)),
    "top_logprobs": ("0 or null", common.exactly(0)),
    "echo": ("false or null", common.exactly(False)),
    "tools": ("[] or null: tool calls are not implemented", common.exactly([])),
    "functions": ("[] or null: function calls are not implemented", common.exactly([])),
    "tool_choice": ('"none" or null', common.exactly("none")),
    "function_call": ('"none" or null', common.exactly("none")),
    "response_format": ('{"type": "text"} or null', common.exactly({"type": "text"})),
    "modalities": ('["text"] or null', common.exactly(["text"])),
    "audio": ("null", common.never),
    "prediction": ("null", common.never),
}


@dataclass(frozen=True)
class ChatCall:
    model: str
    messages: tuple[Mapping[str, str], ...]
    chars: int  # characters of every message's content
    options: ChatOptions
    sampling: SamplingParams
    fill_context: bool  # no max_tokens given: the answer may use what the prompt leaves
    stream: bool
    include_usage: bool
    return_token_ids: bool
    id: str
    created: int

    def sampling_for(self, prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """The sampling, with max_tokens = the room the prompt leaves when none was given."""
        if not self.fill_context:
            return self.sampling
        return dataclasses.replace(self.sampling, max_tokens=max(1, max_model_len - prompt_tokens))


def parse_chat(body: Any, backbone_id: str) -> ChatCall:
    """Check a /v1/chat/completions body field by field; RequestError names the field."""
    body = common.check_body(body)
    model = common.model_of(body, model_hint(backbone_id))
    common.refuse_unsupported(body, NEUTRAL)
    messages = messages_of(body.get("messages"))
    stream = common.flag(body, "stream")
    common.optional_text(body, "user")
    max_tokens = _max_tokens(body)
    return ChatCall(
        model=model,
        messages=tuple(messages),
        chars=sum(len(m["content"]) for m in messages),
        options=_options(body),
        sampling=common.sampling_of(body, **({} if max_tokens is None else {"max_tokens": max_tokens})),
        fill_context=max_tokens is None,
        stream=stream,
        include_usage=common.include_usage(body, stream),
        return_token_ids=common.flag(body, "return_token_ids"),
        id=f"chatcmpl-{uuid.uuid4().hex}",
        created=int(time.time()),
    )


def messages_of(value: Any) -> list[dict[str, str]]:
    """The messages as the template gets them: role, content (a string), name if given."""
    if value is None:
        raise RequestError("'messages' is required: a list of {\"role\", \"content\"} objects")
    items = check.sequence("messages", value, MAX_MESSAGES, "a list of messages", too_long=RequestTooLarge)
    if not items:
        raise RequestError("'messages' is empty: send at least one message")
    messages, chars = [], 0
    for i, item in enumerate(items):
        messages.append(_message(f"messages[{i}]", item))
        chars += len(messages[-1]["content"])
        if chars > check.MAX_PROMPT_CHARS:
            raise RequestTooLarge(f"'messages' hold over {check.MAX_PROMPT_CHARS} characters; this server takes "
                                  f"at most {check.MAX_PROMPT_CHARS}")
    return messages


def _message(where: str, item: Any) -> dict[str, str]:
    if not isinstance(item, dict):
        raise RequestError(f"'{where}' must be an object with 'role' and 'content', got {check.short(item)}")
    role = _role(where, item.get("role"))
    for key in ("tool_calls", "function_call"):
        if item.get(key) not in (None, []):
            raise RequestError(f"'{where}.{key}' is not supported: this server does not implement tool calls")
    message = {"role": "system" if role == "developer" else role, "content": _content(where, item.get("content"))}
    if item.get("name") is not None:
        message["name"] = check.text(f"{where}.name", item["name"], MAX_NAME_CHARS)
    return message


def _role(where: str, role: Any) -> str:
    if role is None:
        raise RequestError(f"'{where}.role' is required: one of {', '.join(ROLES)}")
    if role in ("tool", "function"):
        raise RequestError(f"'{where}.role' is {role!r}: this server does not implement tool calls")
    if not isinstance(role, str) or role not in ROLES:
        raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}, got {check.short(role)}")
    return role


def _content(where: str, content: Any) -> str:
    if content is None:
        raise RequestError(f"'{where}.content' is required: a string or a list of text parts")
    if isinstance(content, str):
        return content
    parts = check.sequence(f"{where}.content", content, MAX_PARTS, "a string or a list of text parts")
    return "\n".join(_text_part(f"{where}.content[{i}]", part) for i, part in enumerate(parts))


def _text_part(where: str, part: Any) -> str:
    if not isinstance(part, dict):
        raise RequestError(f"'{where}' must be a text part {{\"type\": \"text\", \"text\": ...}}, "
                           f"got {check.short(part)}")
    if part.get("type") != "text":
        raise RequestError(f"'{where}.type' must be 'text' (this server takes text only), "
                           f"got {check.short(part.get('type'))}")
    text = part.get("text")
    if not isinstance(text, str):
        raise RequestError(f"'{where}.text' must be a string, got {check.short(text)}")
    return text


def _max_tokens(body: Mapping[str, Any]) -> Any:
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    if len(given) == 2 and given["max_tokens"] != given["max_completion_tokens"]:
        raise RequestError("'max_tokens' and 'max_completion_tokens' differ: give one of them")
    return next(iter(given.values()), None)


def _options(body: Mapping[str, Any]) -> ChatOptions:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise RequestError(f"'chat_template_kwargs' must be an object or null, got {check.short(kwargs)}")
    if kwargs and len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"'chat_template_kwargs' has {len(kwargs)} keys; at most {MAX_TEMPLATE_KWARGS} are allowed")
    for key in kwargs or {}:
        if not key.isidentifier():
            raise RequestError(f"'chat_template_kwargs' key {check.short(key)} is not a template variable name")
    return ChatOptions(add_generation_prompt=common.flag(body, "add_generation_prompt", default=True),
                       continue_final_message=common.flag(body, "continue_final_message"),
                       template_kwargs=dict(kwargs or {}))


def chat_body(call: ChatCall, chunks: Sequence[Mapping[str, Any]], prompt_ids: Sequence[int]) -> dict[str, Any]:
    """The whole (non-streamed) response from every chunk the replica sent: one choice per index."""
    choices = [_choice(run, call.return_token_ids) for run in common.by_choice(chunks)]
    generated = sum(len(c["token_ids"]) for c in chunks)
    reply = {**_envelope(call, "chat.completion"), "choices": choices,
             "usage": common.generation_usage(chunks, generated)}
    if call.return_token_ids:
        reply["prompt_token_ids"] = list(prompt_ids)
    return reply


def _choice(chunks: Sequence[Mapping[str, Any]], return_token_ids: bool) -> dict[str, Any]:
    """One choice from its chunks."""
    choice = {"index": chunks[0].get("index", 0), "message": {"role": "assistant", "content": "".join(c["text"] for c in chunks)},
              "logprobs": None, "finish_reason": common.finish(chunks[-1]["finish_reason"])}
    if return_token_ids:
        choice["token_ids"] = [t for c in chunks for t in c["token_ids"]]
    return choice


def sse_events(call: ChatCall, chunks: AsyncIterator[Mapping[str, Any]]) -> AsyncIterator[str]:
    """chat.completion.chunk events: the first delta carries the role; then usage if asked, [DONE]."""
    def choice_of(c: Mapping[str, Any], first: bool) -> dict[str, Any]:
        delta = {"role": "assistant", "content": c["text"]} if first else {"content": c["text"]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": common.finish(c["finish_reason"])}
        if call.return_token_ids:
            choice["token_ids"] = list(c["token_ids"])
        return choice

    return common.sse(chunks, _envelope(call, "chat.completion.chunk"), choice_of, call.include_usage)


def _envelope(call: ChatCall, kind: str) -> dict[str, Any]:
    return {"id": call.id, "object": kind, "created": call.created, "model": call.model}
