"""Prompts at the ingress: the character cap before tokenizing, the backbone's own
tokenization (the ids the engine would make), token ids against the vocabulary, and
prompt + max_tokens against max_model_len (both numbers named)."""
from __future__ import annotations

import asyncio

import pytest

from adapterserve import Engine
from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server.prompts import (
    CHARS_PER_TOKEN,
    PromptLimits,
    limits_of,
    load_tokenizer,
    prompt_token_ids,
    start_loading_tokenizer,
)

LIMITS = PromptLimits(vocab_size=512, max_model_len=64, max_prompt_chars=400)


def _ids(prompt, tokenizer, max_tokens: int = 4, virtual_tokens: int = 0, limits: PromptLimits = LIMITS):
    return asyncio.run(prompt_token_ids(prompt, tokenizer, limits, max_tokens, virtual_tokens))


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def test_text_is_tokenized_as_the_engine_tokenizes_it(tiny_model, tokenizer):
    engine = Engine.from_pretrained(tiny_model, num_kv_blocks=8)
    for text in ("The lighthouse keeper", "  spaces\tand\nnewlines  ", "unicode: café ☕ 東京"):
        assert _ids(text, tokenizer) == engine.add_request(text).prompt_ids


def test_token_ids_pass_when_in_the_vocabulary_and_within_the_context(tokenizer):
    assert _ids([0, 5, 511], tokenizer) == [0, 5, 511]
    assert len(_ids([3] * 60, tokenizer, max_tokens=4)) == 60  # exactly max_model_len


@pytest.mark.parametrize("prompt, says", [
    ([1, 512], "prompt token id 512 at position 1 is not in [0, 512)"),
    ([-1], "prompt token id -1 at position 0"),
    ([1, True], "prompt token id True at position 1"),
    ([*range(500), 3, 512], "prompt token id 512 at position 501"),  # a long prompt: the bad id is still named
    ([], "prompt is empty"),
])
def test_bad_token_ids_are_refused_naming_the_position(tokenizer, prompt, says):
    with pytest.raises(RequestError) as refused:
        _ids(prompt, tokenizer)
    assert says in str(refused.value)


def test_prompt_plus_max_tokens_over_max_model_len_names_both(tokenizer):
    with pytest.raises(RequestError) as refused:
        _ids([3] * 60, tokenizer, max_tokens=5)
    assert str(refused.value).startswith("prompt has 60 tokens and max_tokens is 5: 65 is over this server's "
                                         "max_model_len of 64")
    with pytest.raises(RequestError, match="prompt has 50 tokens \\+ 10 virtual tokens of the adapter and "
                                           "max_tokens is 5: 65"):
        _ids([3] * 50, tokenizer, max_tokens=5, virtual_tokens=10)


def test_a_text_over_the_character_cap_is_refused_before_tokenizing():
    with pytest.raises(RequestTooLarge, match="prompt has 401 characters; this server takes at most 400"):
        _ids("x" * 401, tokenizer=None)  # no tokenizer needed: it never runs


def test_without_a_tokenizer_text_is_refused_and_ids_are_taken(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(RequestError, match="no tokenizer: send prompt token ids"):
        _ids("hello", tokenizer=None)
    assert _ids([1, 2], tokenizer=None) == [1, 2]


def test_the_default_character_cap_follows_max_model_len():
    static = {"vocab_size": 512, "max_model_len": 1024}
    assert limits_of(static, None) == PromptLimits(512, 1024, CHARS_PER_TOKEN * 1024)
    assert limits_of(static, 5000).max_prompt_chars == 5000


def test_a_tokenizer_loaded_meanwhile_is_the_one_load_tokenizer_gives(tiny_model, tmp_path, monkeypatch):
    """start_loading_tokenizer (a replica while its engine process starts): the next load_tokenizer of
    that directory takes the thread's result, once; one without tokenizer files still gives None."""
    from adapterserve.server import prompts

    start_loading_tokenizer(tiny_model)
    start_loading_tokenizer(tmp_path)
    for path in (tiny_model, tmp_path):
        prompts._loading[str(path)].exception(timeout=120)  # both threads done before the reader is replaced
    reads = []
    monkeypatch.setattr(prompts, "_read_tokenizer", lambda path: reads.append(path))
    loaded = load_tokenizer(tiny_model)  # the thread's: no read here
    assert reads == [] and loaded.encode("hello there") == Engine.from_pretrained(tiny_model).tokenizer.encode(
        "hello there")
    assert load_tokenizer(tmp_path) is None and reads == []
    load_tokenizer(tiny_model)  # taken once: a later call reads again
    assert reads == [tiny_model]
