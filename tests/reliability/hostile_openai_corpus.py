"""Hostile requests for every HTTP route but completions (hostile_corpus.py has those):
chat completions, embeddings, classify, models, vLLM's adapter routes and routing errors,
each with the status it must get and a piece of its message.

The numbers are the live test server's (tiny Llama: 1024 positions; 256 texts a call).
"""
from __future__ import annotations

import json
from typing import Any

from tests.helpers.live_server import BOB
from tests.reliability.hostile_corpus import BASE, HttpCase

ENCODER = "all-MiniLM-L6-v2"
USER = {"role": "user", "content": "Hello there"}
MAX_TEXTS = 256
MAX_TEXT_CHARS = 1 << 16


def _json(fields: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in fields.items() if v is not None}).encode()  # ensure_ascii: \ud800 escapes


def _chat_body(**fields: Any) -> bytes:
    return _json({"model": BASE, "messages": [USER], "max_tokens": 4, "temperature": 0, **fields})


def chat(name: str, says: str, status: int = 400, **fields: Any) -> HttpCase:
    return HttpCase(f"chat: {name}", _chat_body(**fields), status, says, path="/v1/chat/completions")


def message(case: str, says: str, status: int = 400, **item: Any) -> HttpCase:
    return chat(case, says, status, messages=[USER, item])


def embed(name: str, says: str, status: int = 400, **fields: Any) -> HttpCase:
    body = _json({"model": ENCODER, "input": "a wonderful film", **fields})
    return HttpCase(f"embeddings: {name}", body, status, says, path="/v1/embeddings")


def classify(name: str, says: str, status: int = 400, **fields: Any) -> HttpCase:
    body = _json({"model": "sentiment", "input": "a wonderful film", **fields})
    return HttpCase(f"classify: {name}", body, status, says, path="/v1/classify")


def load(name: str, says: str, status: int = 400, **fields: Any) -> HttpCase:
    body = _json({"lora_name": "hostile", "lora_path": "/nowhere/adapter", **fields})
    return HttpCase(f"load: {name}", body, status, says, path="/v1/load_lora_adapter")


CHAT_CASES: list[HttpCase] = [
    HttpCase("chat: malformed json", b'{"model": "tiny-llama", "messages": [', 400, "not valid JSON",
             path="/v1/chat/completions"),
    HttpCase("chat: json array", b"[]", 400, "must be a JSON object", path="/v1/chat/completions"),
    chat("no messages", "'messages' is required", messages=None),
    chat("empty messages", "'messages' is empty", messages=[]),
    chat("messages a string", "'messages' must be a list of messages", messages="Hello"),
    chat("message a string", "'messages[0]' must be an object", messages=["Hello"]),
    chat("4097 messages", "'messages' has 4097 items", status=413, messages=[USER] * 4097),
    chat("content over the cap", "characters", status=413,
         messages=[{"role": "user", "content": "x" * ((1 << 20) + 1)}]),
    chat("prompt over max_model_len", "max_model_len", messages=[{"role": "user", "content": "many words " * 1500}]),
    chat("prompt + max_tokens over max_model_len", "1024", max_tokens=1020),
    message("no role", "'messages[1].role' is required", content="x"),
    message("unknown role", "'messages[1].role' must be one of", role="robot", content="x"),
    message("role not a string", "'messages[1].role' must be one of", role={"r": 1}, content="x"),
    message("tool role", "'messages[1].role' is 'tool'", role="tool", content="x", tool_call_id="c"),
    message("no content", "'messages[1].content' is required", role="user"),
    message("content a number", "'messages[1].content' must be a string or a list", role="user", content=7),
    message("image part", "'messages[1].content[0].type' must be 'text'", role="user",
            content=[{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]),
    message("text part without text", "'messages[1].content[0].text' must be a string", role="user",
            content=[{"type": "text"}]),
    message("part a string", "'messages[1].content[0]' must be a text part", role="user", content=["x"]),
    message("empty name", "'messages[1].name' is empty", role="user", content="x", name=""),
    message("long name", "'messages[1].name' has 65 characters", role="user", content="x", name="n" * 65),
    message("tool calls", "'messages[1].tool_calls' is not supported", role="assistant", content="x",
            tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    message("lone surrogate", "'messages[1].content' holds a lone surrogate", role="user", content="ab\udc00"),
    chat("template refuses", "refused these messages", messages=[{"role": "assistant", "content": "x"}]),
    chat("continue without assistant", "'continue_final_message' needs", continue_final_message=True,
         add_generation_prompt=False),
    chat("continue and generation prompt", "'continue_final_message' needs 'add_generation_prompt'",
         continue_final_message=True),
    chat("template kwargs overriding", "'chat_template_kwargs' may not set 'eos_token'",
         chat_template_kwargs={"eos_token": "<|bos|>"}),
    chat("template kwargs a list", "'chat_template_kwargs' must be an object", chat_template_kwargs=[1]),
    chat("n=0", "'n' must be between 1 and 128, got 0", n=0),
    chat("n a string", "'n' must be an integer, got 'three'", n="three"),
    chat("n a float", "'n' must be an integer, got 1.5", n=1.5),
    chat("logprobs", "'logprobs' is not supported", logprobs=True, top_logprobs=2),
    chat("tools", "'tools' is not supported", tools=[{"type": "function", "function": {"name": "f"}}]),
    chat("json mode", "'response_format' is not supported", response_format={"type": "json_object"}),
    chat("frequency_penalty", "'frequency_penalty' must be between -2 and 2", frequency_penalty=3.0),
    chat("logit_bias out of range", "'logit_bias[3]' must be between -100 and 100", logit_bias={"3": -200}),
    chat("max_tokens differ", "'max_tokens' and 'max_completion_tokens' differ", max_tokens=4,
         max_completion_tokens=5),
    chat("max_completion_tokens=0", "'max_tokens' must be between 1", max_tokens=None, max_completion_tokens=0),
    chat("temperature string", "'temperature' must be a number", temperature="hot"),
    chat("stop numbers", "'stop[0]' must be a string", stop=[1]),
    chat("stream string", "'stream' must be true or false", stream="yes"),
    chat("encoder as model", "is the encoder", model=ENCODER),
    chat("encoder adapter", "made for backbone", model="sentiment"),
    chat("unknown model", "no-such-adapter", status=404, model="no-such-adapter"),
    HttpCase("chat: another tenant's adapter", _chat_body(model="sql"), 404, "no adapter named 'sql'",
             headers={"Authorization": f"Bearer {BOB}"}, path="/v1/chat/completions"),
    HttpCase("chat: no api key", _chat_body(), 401, "API key", headers={}, path="/v1/chat/completions"),
]

ENCODER_CASES: list[HttpCase] = [
    embed("no input", "'input' is required", input=None),
    embed("empty input", "'input' is empty", input=""),
    embed("token ids", "holds token ids", input=[101, 2023, 102]),
    embed("a number among texts", "'input[1]' must be a string", input=["ok", 3]),
    embed("an empty text", "'input[1]' is empty", input=["ok", ""]),
    embed("257 texts", "'input' has 257 items", input=["x"] * (MAX_TEXTS + 1)),
    embed("text over the cap", "characters", status=413, input=["z" * (MAX_TEXT_CHARS + 1)]),
    embed("encoding int8", "'encoding_format' must be 'float' or 'base64'", encoding_format="int8"),
    embed("dimensions", "'dimensions' is not supported", dimensions=8),
    embed("generation backbone", "is the generation backbone", model=BASE),
    embed("generation adapter", "made for backbone", model="sql"),
    embed("unknown model", "no-such-adapter", status=404, model="no-such-adapter"),
    embed("lone surrogate", "'input' holds a lone surrogate", input="\ud83d"),
    classify("encoder without a head", "has no classification head", model=ENCODER),
    classify("generation adapter", "'sql@1' (lora) has no classification head", model="sql"),
    classify("no input", "'input' is required", input=None),
    classify("no model", "'model' is required", model=None),
]

ADAPTER_CASES: list[HttpCase] = [
    load("path outside the sources", "is not under a directory", status=403),
    load("relative path", "must be an absolute path", lora_path="../../etc"),
    load("http path", "must be a directory on the server or an s3:// URI", lora_path="http://hub/x"),
    load("bucket not allowed", "is not under an S3 location", status=403, lora_path="s3://someone-elses/x"),
    load("invalid name", "'lora_name' is invalid", lora_name="../x"),
    load("no path", "'lora_path' is required", lora_path=None),
    HttpCase("unload: no name", b"{}", 400, "'lora_name' is required", path="/v1/unload_lora_adapter"),
    HttpCase("unload: unknown", b'{"lora_name": "no-such-adapter"}', 404, "no-such-adapter",
             path="/v1/unload_lora_adapter"),
    HttpCase("models: unknown", b"", 404, "no-such-adapter", path="/v1/models/no-such-adapter", method="GET"),
    HttpCase("route: unknown", b"{}", 404, "no route POST /v1/responses", path="/v1/responses"),
    HttpCase("route: wrong method", b"", 405, "GET /v1/chat/completions is not allowed",
             path="/v1/chat/completions", method="GET"),
]

ROUTE_CASES = CHAT_CASES + ENCODER_CASES + ADAPTER_CASES
