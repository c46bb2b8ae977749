"""The official `openai` SDK against the live server: models, completions, chat (plain and
streamed), embeddings, errors. A chat completion is token-identical to the completion of
its prompt rendered by transformers with the same template, and to transformers/PEFT
generating greedily from those ids one request at a time."""
from __future__ import annotations

import json

import pytest
import requests
import torch
from transformers import AutoTokenizer

from tests.helpers.live_server import ALICE, BOB, CHAT_TEMPLATE
from tests.helpers.lora import load_base, load_peft

openai = pytest.importorskip("openai")

BASE, ENCODER = "tiny-llama", "all-MiniLM-L6-v2"
MAX_TOKENS = 10
MESSAGES = [{"role": "system", "content": "You answer in one line."},
            {"role": "user", "content": "Where does the lighthouse keeper live?"}]
GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0}


@pytest.fixture(scope="module")
def sdk(server):
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key=ALICE, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def rendered(tiny_model) -> list[int]:
    """MESSAGES rendered as the server should: transformers' apply_chat_template, the same template."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer.apply_chat_template(MESSAGES, chat_template=CHAT_TEMPLATE.read_text(), add_generation_prompt=True,
                                         tokenize=True, return_dict=False, sanitize_control_tokens=True)


def _greedy_reference(tiny_model, adapter_dir, ids: list[int]) -> list[int]:
    """transformers (+ PEFT) alone, from the token ids: generated tokens up to and with EOS."""
    model = load_base(tiny_model) if adapter_dir is None else load_peft(tiny_model, adapter_dir)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=model.config.pad_token_id)
    tokens = out[0, len(ids):].tolist()
    return tokens[:next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


# --- models ------------------------------------------------------------------------------


def test_models_list_the_backbones_and_every_adapter_with_its_parent(sdk, uploaded):
    models = {m.id: m for m in sdk.models.list()}
    assert list(models)[:2] == [BASE, ENCODER]
    for name, ref in uploaded.items():
        assert models[name].root == ref and models[ref].parent == BASE and models[ref].owned_by == "alice"
    assert models["sentiment"].parent == ENCODER  # an example adapter for the encoder, public


def test_models_retrieve_resolves_names_and_refuses_unknown_ones(sdk, uploaded):
    assert sdk.models.retrieve(BASE).id == BASE and sdk.models.retrieve(ENCODER).id == ENCODER
    sql = sdk.models.retrieve("sql")
    assert (sql.id, sql.root, sql.parent) == ("sql", uploaded["sql"], BASE)
    assert sdk.models.retrieve(uploaded["sql"]).id == uploaded["sql"]
    for unknown in ("no-such-adapter", "sql@99", "Not A Model"):
        with pytest.raises(openai.NotFoundError) as caught:
            sdk.models.retrieve(unknown)
        assert caught.value.type == "not_found_error" and caught.value.param == "model"


# --- generation --------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [None, "chat"])
def test_chat_is_token_identical_to_the_completion_of_its_rendered_prompt(sdk, uploaded, lora_dirs, tiny_model,
                                                                          rendered, adapter):
    model = adapter or BASE
    chat = sdk.chat.completions.create(model=model, messages=MESSAGES, extra_body={"return_token_ids": True},
                                       **GREEDY)
    assert chat.prompt_token_ids == rendered
    completion = sdk.completions.create(model=model, prompt=rendered, extra_body={"return_token_ids": True}, **GREEDY)
    choice = chat.choices[0]
    assert choice.token_ids == completion.choices[0].token_ids
    assert choice.message.content == completion.choices[0].text and choice.message.role == "assistant"
    assert choice.token_ids == _greedy_reference(tiny_model, lora_dirs.get(adapter), rendered)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(rendered), len(choice.token_ids))
    assert choice.finish_reason in ("stop", "length") and chat.object == "chat.completion"


def test_a_streamed_chat_sends_the_same_tokens(sdk, uploaded):
    plain = sdk.chat.completions.create(model="sql", messages=MESSAGES, **GREEDY)
    stream = sdk.chat.completions.create(model="sql", messages=MESSAGES, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason


def test_completions_plain_and_streamed(sdk, uploaded):
    plain = sdk.completions.create(model="poem@1", prompt="The lighthouse keeper", **GREEDY)
    streamed = sdk.completions.create(model="poem@1", prompt="The lighthouse keeper", stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text
    assert plain.usage.completion_tokens >= 1 and plain.model == "poem@1"


# --- embeddings and classify ---------------------------------------------------------------


@pytest.mark.parametrize("model, adapter", [(ENCODER, None), ("sentiment", "sentiment")])
def test_embeddings_as_floats_and_base64_are_the_grpc_vectors(sdk, alice, model, adapter):
    texts = ["a wonderful, moving film", "a dull and boring mess"]
    expected = alice.embed(texts, adapter)
    as_base64 = sdk.embeddings.create(model=model, input=texts)  # the SDK asks for base64 and decodes it
    as_floats = sdk.embeddings.create(model=model, input=texts, encoding_format="float")
    for reply in (as_base64, as_floats):
        assert [d.embedding for d in reply.data] == expected and reply.model == model
    tokenizer = AutoTokenizer.from_pretrained(_encoder_dir())
    assert as_floats.usage.prompt_tokens == sum(len(ids) for ids in tokenizer(texts).input_ids)


def _encoder_dir():
    from adapterserve.models.encoder_loader import default_encoder_dir

    return default_encoder_dir()


@pytest.mark.parametrize("route", ["/v1/classify", "/classify"])
def test_classify_answers_like_vllm_with_the_grpc_labels(server, alice, route):
    texts = ["what a wonderful, moving film", "a dull and boring mess"]
    reply = requests.post(f"{server.http}{route}", json={"model": "sentiment", "input": texts},
                          headers={"Authorization": f"Bearer {ALICE}"}, timeout=120)
    assert reply.status_code == 200, reply.text
    expected = alice.classify(texts, "sentiment")
    for got, want in zip(reply.json()["data"], expected):
        assert (got["label"], got["labels"], got["num_classes"]) == (want.label, want.labels, len(want.labels))
        assert got["probs"] == pytest.approx(want.probabilities, abs=1e-6)


# --- errors ------------------------------------------------------------------------------


def test_unknown_models_are_not_found(sdk):
    for call in (lambda: sdk.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2),
                 lambda: sdk.completions.create(model="nope@2", prompt="hi", max_tokens=2),
                 lambda: sdk.embeddings.create(model="nope", input="hi")):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.param == "model" and "nope" in caught.value.message


def test_bad_fields_are_bad_requests_naming_the_field(sdk, uploaded):
    cases = [
        (lambda: sdk.chat.completions.create(model=BASE, messages=MESSAGES, n=0), "n"),
        (lambda: sdk.chat.completions.create(model=BASE, messages=MESSAGES, logprobs=True), "logprobs"),
        (lambda: sdk.chat.completions.create(model=BASE, messages=[{"role": "user"}]), "messages[0].content"),
        (lambda: sdk.chat.completions.create(model="sentiment", messages=MESSAGES), "model"),
        (lambda: sdk.chat.completions.create(model=ENCODER, messages=MESSAGES), "model"),
        (lambda: sdk.completions.create(model=BASE, prompt="hi", max_tokens=0), "max_tokens"),
        (lambda: sdk.embeddings.create(model=BASE, input="hi"), "model"),
        (lambda: sdk.embeddings.create(model=ENCODER, input=[[101, 102]]), "input"),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert (caught.value.type, caught.value.param, caught.value.code) == ("invalid_request_error", param, "400")


def test_keys_and_tenants(server, uploaded):
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key="not-a-key", max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError) as caught:
            stranger.models.list()
        assert caught.value.type == "authentication_error"
    with openai.OpenAI(base_url=f"{server.http}/v1", api_key=BOB, max_retries=0) as bob:
        assert "sql" not in {m.id for m in bob.models.list()}
        with pytest.raises(openai.NotFoundError) as caught:  # another tenant's private adapter: as if none
            bob.completions.create(model="sql", prompt="hi", max_tokens=2)
        assert caught.value.type == "not_found_error"


def test_routing_errors_have_openais_shape(server, sdk):
    wrong_method = requests.get(f"{server.http}/v1/chat/completions", timeout=60)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    no_route = requests.post(f"{server.http}/v1/responses", json={}, timeout=60)
    for reply, kind in ((wrong_method, "invalid_request_error"), (no_route, "not_found_error")):
        error = reply.json()["error"]
        assert (error["type"], error["code"]) == (kind, reply.status_code) and set(error) >= {"message", "param"}
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=BASE, input="hi")
    not_json = requests.post(f"{server.http}/v1/chat/completions", data=b"{", timeout=60,
                             headers={"Authorization": f"Bearer {ALICE}"})
    assert not_json.status_code == 400 and "not valid JSON" in json.loads(not_json.text)["error"]["message"]
