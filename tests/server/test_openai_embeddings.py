"""/v1/embeddings and /v1/classify bodies (no Ray needed)."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server.openai_embeddings import classify_body, embeddings_body, parse_classify, parse_embeddings

ENCODER = "all-MiniLM-L6-v2"


def _body(**fields):
    return {"model": ENCODER, "input": "a wonderful film", **fields}


def test_string_and_list_inputs():
    assert parse_embeddings(_body(), ENCODER, 8).texts == ["a wonderful film"]
    call = parse_embeddings(_body(input=["a", "b"], encoding_format="base64", user="u"), ENCODER, 8)
    assert (call.texts, call.base64) == (["a", "b"], True)
    assert parse_embeddings(_body(encoding_format=None, dimensions=None), ENCODER, 8).base64 is False
    assert parse_classify({"model": "sentiment", "input": ["x", "y"]}, 8).texts == ["x", "y"]


BAD = [
    (_body(model=None), "'model' is required: 'all-MiniLM-L6-v2' for the encoder"),
    ({"model": ENCODER}, "'input' is required: a string or a list of strings"),
    (_body(input=""), "'input' is empty"),
    (_body(input=[]), "'input' is empty"),
    (_body(input=["ok", ""]), "'input[1]' is empty"),
    (_body(input=["ok", 5.5]), "'input[1]' must be a string, got 5.5"),
    (_body(input=[101, 2023, 102]), "'input' holds token ids; this server embeds and classifies text only"),
    (_body(input=[[101, 102]]), "'input' holds token ids"),
    (_body(input={"text": "x"}), "'input' must be a string or a list of strings"),
    (_body(input=["x"] * 9), "'input' has 9 items; at most 8 are allowed"),
    (_body(encoding_format="int8"), "'encoding_format' must be 'float' or 'base64', got 'int8'"),
    (_body(dimensions=64), "'dimensions' is not supported by this server"),
    (_body(user=1), "'user' must be a string"),
    (_body(input="\udc00"), "'input' holds a lone surrogate"),
]


@pytest.mark.parametrize("body, says", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_embedding_bodies_name_the_field(body, says):
    with pytest.raises(RequestError) as caught:
        parse_embeddings(body, ENCODER, 8)
    assert str(caught.value).startswith(says), str(caught.value)


def test_without_an_encoder_the_model_hint_says_so():
    with pytest.raises(RequestError, match="this server runs no encoder"):
        parse_embeddings(_body(model=""), None, 8)


def test_a_text_over_the_cap_is_too_large():
    with pytest.raises(RequestTooLarge, match="'input\\[0\\]' has 65537 characters"):
        parse_embeddings(_body(input=["x" * 65537]), ENCODER, 8)
    with pytest.raises(RequestError, match="'model' is required"):
        parse_classify({"input": "x"}, 8)


def test_base64_is_little_endian_float32_as_the_openai_sdk_decodes_it():
    vector = [0.5, -1.25, 3.0e-8]
    call = parse_embeddings(_body(encoding_format="base64"), ENCODER, 8)
    reply = embeddings_body(call, [vector], 5)
    decoded = np.frombuffer(base64.b64decode(reply["data"][0]["embedding"]), dtype="float32")
    assert decoded.tolist() == np.asarray(vector, dtype="float32").tolist()
    assert reply["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
    plain = embeddings_body(parse_embeddings(_body(), ENCODER, 8), [vector, vector], 9)
    assert [d["index"] for d in plain["data"]] == [0, 1] and plain["data"][1]["embedding"] == vector
    assert plain["object"] == "list" and plain["model"] == ENCODER


def test_classify_body_has_vllms_fields_and_the_label_names():
    call = parse_classify({"model": "sentiment@1", "input": "x"}, 8)
    results = [{"label": "positive", "label_index": 1, "probabilities": [0.1, 0.9], "labels": ["negative", "positive"]}]
    reply = classify_body(call, results, 4)
    assert reply["data"] == [{"index": 0, "label": "positive", "probs": [0.1, 0.9], "num_classes": 2,
                              "labels": ["negative", "positive"]}]
    assert reply["model"] == "sentiment@1" and reply["usage"]["prompt_tokens"] == 4
