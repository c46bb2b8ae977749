"""OpenAI-compatible /v1/embeddings and vLLM-style /v1/classify bodies (the encoder's tasks).

Both take `model` (the encoder's id, or an adapter made for the encoder; classify needs
one with a classification head) and `input`: a string or a list of 1 to
`max_texts_per_request` non-empty strings of at most MAX_TEXT_CHARS characters (a
longer text is cut to the encoder's context, as Embed and Classify do). Token-id
inputs are refused: the encoder takes text. Embeddings come as float lists, or with
`encoding_format: "base64"` as base64 of little-endian float32 (what the OpenAI SDK
asks for by default). `dimensions` is refused (the vectors have a fixed size).

Classify answers like vLLM's /classify: per input `label`, `probs`, `num_classes`,
and (added here) `labels`, the label names in the order of `probs`.
"""
from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapterserve import request_fields as check
from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server import openai_common as common

ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EncoderCall:
    model: str
    texts: list[str]
    base64: bool = False  # embeddings only


def parse_embeddings(body: Any, encoder_id: str | None, max_texts: int) -> EncoderCall:
    body = common.check_body(body)
    model = common.model_of(body, _model_hint(encoder_id))
    common.optional_text(body, "user")
    if body.get("dimensions") is not None:
        raise RequestError(f"'dimensions' is not supported by this server (the encoder's vectors have a fixed "
                           f"size), got {check.short(body['dimensions'])}")
    encoding = body.get("encoding_format")
    if encoding is not None and encoding not in ENCODINGS:
        raise RequestError(f"'encoding_format' must be 'float' or 'base64', got {check.short(encoding)}")
    return EncoderCall(model, texts_of(body.get("input"), max_texts), base64=encoding == "base64")


def parse_classify(body: Any, max_texts: int) -> EncoderCall:
    body = common.check_body(body)
    model = common.model_of(body, "an adapter with a classification head, 'name[@version]'")
    common.optional_text(body, "user")
    return EncoderCall(model, texts_of(body.get("input"), max_texts))


def texts_of(value: Any, max_texts: int) -> list[str]:
    """`input` as a list of texts; RequestError (RequestTooLarge) names the first bad one."""
    if value is None:
        raise RequestError("'input' is required: a string or a list of strings")
    if isinstance(value, str):
        return [check.text("input", value, check.MAX_TEXT_CHARS, too_long=RequestTooLarge)]
    items = check.sequence("input", value, max_texts, "a string or a list of strings")
    if not items:
        raise RequestError("'input' is empty: send at least one text")
    if all(check.is_integer(t) for t in items) or all(isinstance(t, list) for t in items):
        raise RequestError("'input' holds token ids; this server embeds and classifies text only: send strings")
    return [check.text(f"input[{i}]", t, check.MAX_TEXT_CHARS, too_long=RequestTooLarge) for i, t in enumerate(items)]


def embeddings_body(call: EncoderCall, vectors: Sequence[Sequence[float]], prompt_tokens: int) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, call.base64)} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": call.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def classify_body(call: EncoderCall, results: Sequence[Mapping[str, Any]], prompt_tokens: int) -> dict[str, Any]:
    data = [{"index": i, "label": r["label"], "probs": list(r["probabilities"]), "num_classes": len(r["labels"]),
             "labels": list(r["labels"])} for i, r in enumerate(results)]
    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": call.model, "data": data, "usage": common.usage(prompt_tokens, 0)}


def _encoded(vector: Sequence[float], as_base64: bool) -> list[float] | str:
    if not as_base64:
        return list(vector)
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _model_hint(encoder_id: str | None) -> str:
    if encoder_id is None:
        return "this server runs no encoder, so it has no embedding model"
    return f"{encoder_id!r} for the encoder, or an adapter made for it, 'name[@version]'"
