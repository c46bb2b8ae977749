"""Hostile requests for the live test server, each with the answer it must get.

HTTP cases carry raw body bytes (malformed ones included) and the status they must
get; gRPC cases carry serialized request bytes (garbage included), sent with identity
(de)serializers, and the status code they must get. `says` is a piece of the error
message: it names the field or the problem.

The numbers are the test server's: the tiny Llama has 512 tokens and 1024 positions.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc

from adapterserve.proto import adapterserve_pb2 as pb
from tests.helpers.live_server import ALICE, BOB, BUSY, BUSY_CONCURRENCY, MAX_RUNNING

VOCAB = 512
MAX_MODEL_LEN = 1024
BASE = "tiny-llama"
MAX_PROMPT_CHARS = 1 << 20
MAX_TEXT_CHARS = 1 << 16
INVALID = grpc.StatusCode.INVALID_ARGUMENT
TOO_LARGE = grpc.StatusCode.RESOURCE_EXHAUSTED  # RequestTooLarge (HTTP 413)


@dataclass(frozen=True)
class HttpCase:
    name: str
    body: bytes
    status: int
    says: str
    headers: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {ALICE}"})
    path: str = "/v1/completions"
    method: str = "POST"


@dataclass(frozen=True)
class GrpcCase:
    name: str
    method: str  # Generate (server streaming), Classify or Embed (unary)
    request: bytes
    code: grpc.StatusCode
    says: str
    api_key: str = ALICE


def _json(**fields: Any) -> bytes:
    """A completions body: the base model, a short prompt, greedy, then `fields` (None removes one)."""
    body = {"model": BASE, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not None}).encode()  # ensure_ascii: \ud800 escapes


def _bad_field(name: str, value: Any, says: str, status: int = 400) -> HttpCase:
    return HttpCase(f"{name}={value!r}"[:60], _json(**{name: value}), status, says)


HTTP_CASES: list[HttpCase] = [
    # not JSON, or JSON the server must not parse
    HttpCase("malformed json", b'{"model": "tiny-llama", "prompt": "hi",', 400, "not valid JSON"),
    HttpCase("empty body", b"", 400, "empty"),
    HttpCase("json array", b"[1, 2, 3]", 400, "must be a JSON object"),
    HttpCase("not utf-8", b'{"model": "tiny-llama", "prompt": "caf\xe9"}', 400, "not UTF-8"),
    HttpCase("utf-16", json.dumps({"model": BASE, "prompt": "hi"}).encode("utf-16"), 400, "not UTF-8"),
    HttpCase("NaN", b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}', 400, "NaN is not a JSON number"),
    HttpCase("deep nesting", b'{"model": "tiny-llama", "prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000
             + b"}", 400, "nests"),
    HttpCase("deep objects", b'{"a":' * 50_000, 400, "nests"),
    HttpCase("20000-digit number", b'{"model": "tiny-llama", "prompt": "hi", "seed": ' + b"7" * 20_000 + b"}", 400,
             "not valid JSON"),
    HttpCase("lone surrogate in prompt", _json(prompt="abc\ud800"), 400, "'prompt' holds a lone surrogate"),
    HttpCase("lone surrogate in stop", _json(stop=["ok", "\udfff"]), 400, "'stop[1]' holds a lone surrogate"),
    HttpCase("lone surrogate in a key", _json(**{"\ud800": 1}), 400, "lone surrogate"),
    # wrong types and out-of-range values
    _bad_field("stop", [1], "'stop[0]' must be a string"),
    _bad_field("stop", [["x"]], "'stop[0]' must be a string"),
    _bad_field("stop", 5, "'stop' must be a string or a list of strings"),
    _bad_field("stop", [""], "'stop[0]' is empty"),
    _bad_field("stop", ["s"] * 100, "'stop' has 100 items"),
    _bad_field("top_k", 10**30, "'top_k' must be between -1 and"),
    _bad_field("top_k", 1e30, "'top_k' must be an integer"),
    _bad_field("top_k", -5, "'top_k' must be between -1 and"),
    _bad_field("seed", "x", "'seed' must be an integer"),
    _bad_field("seed", 10**30, "'seed' must be between"),
    _bad_field("temperature", -1, "'temperature' must be at least 0"),
    _bad_field("temperature", "hot", "'temperature' must be a number"),
    _bad_field("temperature", 1e-30, "'temperature' must be 0 (greedy) or at least"),
    _bad_field("top_p", 0, "'top_p' must be between"),
    _bad_field("top_p", 1.5, "'top_p' must be between"),
    _bad_field("max_tokens", 0, "'max_tokens' must be between 1 and"),
    _bad_field("max_tokens", True, "'max_tokens' must be an integer"),
    _bad_field("max_tokens", "5", "'max_tokens' must be an integer"),
    _bad_field("max_tokens", 2**31 - 1, "2147483647"),  # the engine: prompt + max_tokens over max_model_len
    _bad_field("stop_token_ids", [-1], "'stop_token_ids[0]' must be a token id"),
    _bad_field("stop_token_ids", [VOCAB + 7], "stop_token_ids"),  # the engine checks them against its vocabulary
    _bad_field("ignore_eos", "yes", "'ignore_eos' must be true or false"),
    _bad_field("stream", "yes", "'stream' must be true or false"),
    HttpCase("stream_options='x'", _json(stream=True, stream_options="x"), 400,
             "'stream_options' must be an object or null, got 'x'"),
    HttpCase("include_usage=1", _json(stream=True, stream_options={"include_usage": 1}), 400,
             "'stream_options.include_usage' must be true or false"),
    _bad_field("logprobs", 5, "'logprobs' is not supported"),
    _bad_field("echo", True, "'echo' is not supported"),
    _bad_field("best_of", 4, "'best_of' is not supported"),
    _bad_field("logit_bias", {"50": 101}, "'logit_bias[50]' must be between -100 and 100"),
    _bad_field("logit_bias", {"9999": 1}, "logit_bias token ids must be in [0, 512)"),
    _bad_field("logit_bias", {str(i): 1 for i in range(301)}, "'logit_bias' has 301 entries"),
    _bad_field("logit_bias", "x", "'logit_bias'"),
    _bad_field("presence_penalty", 2.5, "'presence_penalty' must be between -2 and 2"),
    _bad_field("frequency_penalty", "high", "'frequency_penalty' must be a number"),
    _bad_field("repetition_penalty", -1, "'repetition_penalty' must be between"),
    _bad_field("user", 12, "'user' must be a string"),
    # n: completions of one prompt, each a sequence (null is the default, 1)
    _bad_field("n", 0, "'n' must be between 1 and 128, got 0"),
    _bad_field("n", -2, "'n' must be between 1 and 128, got -2"),
    _bad_field("n", 129, "'n' must be between 1 and 128, got 129"),
    _bad_field("n", 10**30, "'n' must be between 1 and 128"),
    _bad_field("n", 2.5, "'n' must be an integer, got 2.5"),
    _bad_field("n", 2.0, "'n' must be an integer, got 2.0"),
    _bad_field("n", "2", "'n' must be an integer, got '2'"),
    _bad_field("n", True, "'n' must be an integer, got True"),
    _bad_field("n", [2], "'n' must be an integer"),
    _bad_field("n", MAX_RUNNING + 1, f"'n' is {MAX_RUNNING + 1}, but this engine runs at most {MAX_RUNNING} sequences"),
    HttpCase("n over the tenant's concurrent_requests", _json(n=BUSY_CONCURRENCY + 1), 400,
             f"'n' is {BUSY_CONCURRENCY + 1}, but tenant busy may run {BUSY_CONCURRENCY} requests at once",
             headers={"Authorization": f"Bearer {BUSY}"}),
    # prompts
    _bad_field("prompt", "", "'prompt' is empty"),
    _bad_field("prompt", [], "'prompt' is empty"),
    _bad_field("prompt", [1, -1], "'prompt[1]' must be a token id"),
    _bad_field("prompt", [1, VOCAB], f"[0, {VOCAB})"),  # the engine checks ids against its vocabulary
    _bad_field("prompt", [1, "a"], "'prompt[1]' must be a token id"),
    _bad_field("prompt", ["a", "b"], "'prompt' holds 2 prompts"),
    _bad_field("prompt", {"text": "hi"}, "'prompt' must be a string or a list of token ids"),
    HttpCase("prompt over the character cap", _json(prompt="x" * (MAX_PROMPT_CHARS + 1)), 413, "characters"),
    HttpCase("prompt over max_model_len (ids)", _json(prompt=[5] * 2000), 400, "2000"),
    HttpCase("prompt over max_model_len (text)", _json(prompt="many words " * 1500), 400, "tokens"),
    HttpCase("prompt + max_tokens over max_model_len", _json(prompt=[5] * 1000, max_tokens=100), 400, "1024"),
    # models
    _bad_field("model", 5, "'model' must be a string"),
    _bad_field("model", "no-such-adapter", "no-such-adapter", status=404),
    _bad_field("model", "sentiment", "made for backbone"),  # an encoder adapter cannot generate
    HttpCase("no api key", _json(), 401, "API key", headers={}),
]


def _generate(prompt: str | list[int] = "Hello there", adapter: str = "", **sampling: Any) -> bytes:
    params = pb.SamplingParams(**{"max_tokens": 4, "temperature": 0.0, **sampling})
    if isinstance(prompt, str):
        return pb.GenerateRequest(text=prompt, adapter=adapter, sampling=params).SerializeToString()
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), adapter=adapter, sampling=params).SerializeToString()


def _sampling(says: str, **sampling: Any) -> GrpcCase:
    name = ", ".join(f"{k}={v!r}" for k, v in sampling.items())[:60]
    return GrpcCase(name, "Generate", _generate(**sampling), INVALID, says)


GRPC_CASES: list[GrpcCase] = [
    # bytes that are no GenerateRequest
    GrpcCase("garbage bytes", "Generate", b"\xff\xff\xff\xff\xff\xff", INVALID, "GenerateRequest"),
    GrpcCase("truncated field", "Generate", b"\x0a\xff\xff\xff\x0f", INVALID, "GenerateRequest"),
    GrpcCase("text not utf-8", "Generate", b"\x0a\x02\xc3\x28", INVALID, "GenerateRequest"),
    GrpcCase("wrong wire type", "Generate", b"\x20\x01" * 3 + b"\x0d\x00\x00", INVALID, "GenerateRequest"),
    # sampling values the proto's types allow but the server must refuse
    _sampling("'temperature' must be a finite number", temperature=float("nan")),
    _sampling("'temperature' must be a finite number", temperature=float("inf")),
    _sampling("'temperature' must be at least 0", temperature=-2.0),
    _sampling("'top_p' must be between", top_p=0.0),
    _sampling("'top_p' must be a finite number", top_p=float("nan")),
    _sampling("'top_p' must be between", top_p=3.0),
    _sampling("'max_tokens' must be between 1 and", max_tokens=0),
    _sampling("'max_tokens' must be between 1 and", max_tokens=2**32 - 1),
    _sampling("2147483647", max_tokens=2**31 - 1),  # the engine: prompt + max_tokens over max_model_len
    _sampling("'stop[0]' is empty", stop=[""]),
    _sampling("'stop' has 40 items", stop=["s"] * 40),
    _sampling("'stop[0]' has 1000 characters", stop=["y" * 1000]),
    _sampling("'stop_token_ids[1]' must be a token id", stop_token_ids=[2, -9]),
    _sampling("stop_token_ids", stop_token_ids=[VOCAB + 3]),  # the engine checks them against its vocabulary
    _sampling("'n' must be between 1 and 128, got 0", n=0),
    _sampling("'n' must be between 1 and 128, got 129", n=129),
    _sampling("'n' must be between 1 and 128, got 4294967295", n=2**32 - 1),
    _sampling(f"'n' is {MAX_RUNNING + 1}, but this engine runs at most {MAX_RUNNING} sequences", n=MAX_RUNNING + 1),
    GrpcCase("n over the tenant's concurrent_requests", "Generate", _generate(n=BUSY_CONCURRENCY + 1), INVALID,
             f"'n' is {BUSY_CONCURRENCY + 1}, but tenant busy may run {BUSY_CONCURRENCY}", api_key=BUSY),
    # prompts
    GrpcCase("no prompt", "Generate", pb.GenerateRequest(adapter="").SerializeToString(), INVALID, "set the prompt"),
    GrpcCase("empty text", "Generate", _generate(""), INVALID, "'text' is empty"),
    GrpcCase("empty token ids", "Generate", _generate([]), INVALID, "'token_ids' is empty"),
    GrpcCase("negative token id", "Generate", _generate([1, 2, -4]), INVALID, "'token_ids[2]' must be a token id"),
    GrpcCase("token id = vocab", "Generate", _generate([1, VOCAB]), INVALID, f"[0, {VOCAB})"),
    GrpcCase("token id = int32 max", "Generate", _generate([2**31 - 1]), INVALID, f"[0, {VOCAB})"),
    GrpcCase("text over the character cap", "Generate", _generate("x" * (MAX_PROMPT_CHARS + 1)), TOO_LARGE,
             "characters"),
    GrpcCase("prompt over max_model_len", "Generate", _generate([7] * 3000), INVALID, "3000"),
    GrpcCase("prompt + max_tokens over max_model_len", "Generate", _generate([7] * 1000, max_tokens=200), INVALID,
             "1024"),
    # adapters
    GrpcCase("unknown adapter", "Generate", _generate(adapter="no-such-adapter"), grpc.StatusCode.NOT_FOUND,
             "no-such-adapter"),
    GrpcCase("encoder adapter for Generate", "Generate", _generate(adapter="sentiment"),
             grpc.StatusCode.FAILED_PRECONDITION, "made for backbone"),
    GrpcCase("another tenant's adapter", "Generate", _generate(adapter="sql"), grpc.StatusCode.NOT_FOUND,
             "no adapter named 'sql'", api_key=BOB),  # as if it did not exist (docs/tenancy.md)
    GrpcCase("unknown api key", "Generate", _generate(), grpc.StatusCode.UNAUTHENTICATED, "API key",
             api_key="not-a-key"),
    # encoder texts
    GrpcCase("classify empty text", "Classify", pb.ClassifyRequest(texts=["fine", ""], adapter="sentiment")
             .SerializeToString(), INVALID, "'texts[1]' is empty"),
    GrpcCase("classify text over the cap", "Classify", pb.ClassifyRequest(
        texts=["z" * (MAX_TEXT_CHARS + 1)], adapter="sentiment").SerializeToString(), TOO_LARGE, "characters"),
    GrpcCase("embed empty text", "Embed", pb.EmbedRequest(texts=[""]).SerializeToString(), INVALID,
             "'texts[0]' is empty"),
    GrpcCase("classify garbage bytes", "Classify", b"\x0a\xff\xff\xff\xff\xff", INVALID, "ClassifyRequest"),
]
