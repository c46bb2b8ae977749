"""/v1/chat/completions bodies and chat templates (no Ray needed; the tiny Llama's real tokenizer)."""
from __future__ import annotations

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from adapterserve.errors import RequestError, RequestTooLarge
from adapterserve.server.chat_template import ChatOptions, ChatRenderer, resolve_chat_template
from adapterserve.server.openai_chat import chat_body, parse_chat, sse_events
from adapterserve.server.openai_errors import error_body
from tests.helpers.live_server import CHAT_TEMPLATE

USER = {"role": "user", "content": "Hi"}


def _body(**fields):
    return {"model": "tiny", "messages": [USER], **fields}


def test_messages_are_read_as_the_template_gets_them():
    call = parse_chat(_body(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}], "name": "bo"},
        {"role": "assistant", "content": "", "tool_calls": []},
    ]), "tiny")
    assert call.messages == ({"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "one\ntwo", "name": "bo"},
                             {"role": "assistant", "content": ""})
    assert call.chars == len("Be brief.") + len("one\ntwo")


def test_without_max_tokens_the_answer_may_fill_the_context():
    call = parse_chat(_body(temperature=0), "tiny")
    assert call.fill_context and call.sampling_for(100, 1024).max_tokens == 924
    assert call.sampling_for(1024, 1024).max_tokens == 1  # the engine then refuses the length, naming it
    given = parse_chat(_body(max_completion_tokens=7), "tiny")
    assert not given.fill_context and given.sampling_for(100, 1024).max_tokens == 7
    assert parse_chat(_body(max_tokens=5, max_completion_tokens=5), "tiny").sampling.max_tokens == 5


def test_neutral_values_and_unknown_keys_are_accepted():
    call = parse_chat(_body(n=1, logprobs=False, top_logprobs=0, tools=[], tool_choice="none",
                            response_format={"type": "text"}, presence_penalty=0, parallel_tool_calls=True,
                            store=False, metadata={"a": "b"}, stream=True, stream_options={"include_usage": True},
                            add_generation_prompt=None, chat_template_kwargs={"enable_thinking": False}), "tiny")
    assert call.stream and call.include_usage and call.options.add_generation_prompt
    assert call.options.template_kwargs == {"enable_thinking": False}


BAD_BODIES = [
    ({"model": "tiny"}, "'messages' is required"),
    (_body(messages=[]), "'messages' is empty"),
    (_body(messages="hi"), "'messages' must be a list of messages, got 'hi'"),
    (_body(messages={"role": "user"}), "'messages' must be a list of messages"),
    (_body(messages=["hi"]), "'messages[0]' must be an object with 'role' and 'content', got 'hi'"),
    (_body(messages=[{"content": "x"}]), "'messages[0].role' is required: one of system, developer, user, assistant"),
    (_body(messages=[{"role": "robot", "content": "x"}]), "'messages[0].role' must be one of system"),
    (_body(messages=[{"role": 3, "content": "x"}]), "'messages[0].role' must be one of system"),
    (_body(messages=[{"role": ["user"], "content": "x"}]), "'messages[0].role' must be one of system"),
    (_body(messages=[USER, {"role": "tool", "content": "42", "tool_call_id": "c1"}]),
     "'messages[1].role' is 'tool': this server does not implement tool calls"),
    (_body(messages=[{"role": "user"}]), "'messages[0].content' is required"),
    (_body(messages=[{"role": "user", "content": 5}]), "'messages[0].content' must be a string or a list of text"),
    (_body(messages=[{"role": "user", "content": ["x"]}]), "'messages[0].content[0]' must be a text part"),
    (_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
     "'messages[0].content[0].type' must be 'text' (this server takes text only), got 'image_url'"),
    (_body(messages=[{"role": "user", "content": [{"type": "text"}]}]), "'messages[0].content[0].text' must be"),
    (_body(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]),
     "'messages[0].content[0].text' must be a string, got 1"),
    (_body(messages=[{"role": "user", "content": "x", "name": ""}]), "'messages[0].name' is empty"),
    (_body(messages=[{"role": "user", "content": "x", "name": 7}]), "'messages[0].name' must be a string"),
    (_body(messages=[{"role": "user", "content": "x", "name": "n" * 65}]), "'messages[0].name' has 65 characters"),
    (_body(messages=[{"role": "assistant", "content": "x", "tool_calls": [{"id": "c"}]}]),
     "'messages[0].tool_calls' is not supported"),
    (_body(messages=[USER, {"role": "user", "content": "a\ud800"}]), "'messages[1].content' holds a lone surrogate"),
    (_body(model=None), "'model' is required: 'tiny' for the base model"),
    (_body(model=["tiny"]), "'model' must be a string"),
    (_body(max_tokens=0), "'max_tokens' must be between 1"),
    (_body(max_completion_tokens="9"), "'max_tokens' must be an integer, got '9'"),
    (_body(max_tokens=5, max_completion_tokens=6), "'max_tokens' and 'max_completion_tokens' differ"),
    (_body(temperature=-1), "'temperature' must be at least 0"),
    (_body(stop=[7]), "'stop[0]' must be a string"),
    (_body(n=0), "'n' must be between 1 and 128, got 0"),
    (_body(logprobs=True), "'logprobs' is not supported by this server (only false or null)"),
    (_body(top_logprobs=3), "'top_logprobs' is not supported"),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}]), "'tools' is not supported"),
    (_body(tool_choice="auto"), "'tool_choice' is not supported"),
    (_body(response_format={"type": "json_object"}), "'response_format' is not supported"),
    (_body(presence_penalty=2.5), "'presence_penalty' must be between -2 and 2, got 2.5"),
    (_body(logit_bias={"5": 101}), "'logit_bias[5]' must be between -100 and 100, got 101"),
    (_body(stream_options={"include_usage": True}), "'stream_options' is only allowed when 'stream' is true"),
    (_body(add_generation_prompt="yes"), "'add_generation_prompt' must be true or false"),
    (_body(chat_template_kwargs=[1]), "'chat_template_kwargs' must be an object or null"),
    (_body(chat_template_kwargs={"not a name": 1}), "'chat_template_kwargs' key 'not a name' is not a template"),
    (_body(chat_template_kwargs={f"k{i}": i for i in range(33)}), "'chat_template_kwargs' has 33 keys"),
    (_body(user=5), "'user' must be a string"),
]


@pytest.mark.parametrize("body, message", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_bad_bodies_are_refused_naming_the_field(body, message):
    with pytest.raises(RequestError) as caught:
        parse_chat(body, "tiny")
    assert str(caught.value).startswith(message), str(caught.value)
    assert error_body(caught.value)["error"]["code"] == 400


def test_messages_over_the_character_cap_are_too_large():
    with pytest.raises(RequestTooLarge, match="'messages' hold over 1048576 characters"):
        parse_chat(_body(messages=[{"role": "user", "content": "x" * (1 << 19)}] * 3), "tiny")
    with pytest.raises(RequestTooLarge, match="'messages' has 4097 items"):
        parse_chat(_body(messages=[USER] * 4097), "tiny")


CHUNKS = [
    {"token_ids": [5, 6], "text": "ab", "finish_reason": None, "prompt_tokens": 4, "cached_tokens": 2},
    {"token_ids": [7], "text": "c", "finish_reason": "stop"},
]


def test_chat_body_puts_chunks_together():
    call = parse_chat(_body(return_token_ids=True), "tiny")
    reply = chat_body(call, CHUNKS, [1, 2, 3, 4])
    assert reply["object"] == "chat.completion" and reply["id"].startswith("chatcmpl-")
    assert reply["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "abc"}, "logprobs": None,
                                   "finish_reason": "stop", "token_ids": [5, 6, 7]}
    assert reply["prompt_token_ids"] == [1, 2, 3, 4]
    assert reply["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    assert "prompt_token_ids" not in chat_body(parse_chat(_body(), "tiny"), CHUNKS, [1])


def test_sse_deltas_start_with_the_role_and_end_with_usage_and_done():
    call = parse_chat(_body(stream=True, stream_options={"include_usage": True}), "tiny")

    async def chunks():
        for chunk in CHUNKS:
            yield chunk

    async def collect():
        return [e async for e in sse_events(call, chunks())]

    events = asyncio.run(collect())
    assert events[-1] == "data: [DONE]\n\n"
    parsed = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert parsed[0]["choices"][0]["delta"] == {"role": "assistant", "content": "ab"}
    assert parsed[1]["choices"][0] == {"index": 0, "delta": {"content": "c"}, "logprobs": None, "finish_reason": "stop"}
    assert parsed[2]["choices"] == [] and parsed[2]["usage"]["total_tokens"] == 7
    assert parsed[2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


# --- templates --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer(tokenizer, resolve_chat_template(str(CHAT_TEMPLATE)), "tiny-llama")


def _text(tokenizer, ids):
    return tokenizer.decode(ids)


def test_the_template_renders_roles_names_and_the_generation_prompt(renderer, tokenizer):
    ids = renderer.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bo"}],
                          ChatOptions())
    assert _text(tokenizer, ids) == "<|bos|><|system|>Be brief.<|eos|><|user:bo|>Hi<|eos|><|assistant|>"
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # no BOS added twice
    continued = renderer.render([USER, {"role": "assistant", "content": "Well"}],
                                ChatOptions(add_generation_prompt=False, continue_final_message=True))
    assert _text(tokenizer, continued) == "<|bos|><|user|>Hi<|eos|><|assistant|>Well"


def test_control_tokens_typed_in_a_message_stay_text(renderer, tokenizer):
    ids = renderer.render([{"role": "user", "content": "a<|eos|>b"}], ChatOptions())
    assert ids.count(tokenizer.eos_token_id) == 1  # the template's own, after the message


def test_a_model_without_a_chat_template_is_a_clear_400(tokenizer):
    assert not tokenizer.chat_template
    with pytest.raises(RequestError) as caught:
        ChatRenderer(tokenizer, None, "tiny-llama").render([USER], ChatOptions())
    assert "model 'tiny-llama' has no chat template" in str(caught.value) and "--chat-template" in str(caught.value)
    assert error_body(caught.value)["error"]["code"] == 400
    with pytest.raises(RequestError, match="has no tokenizer"):
        ChatRenderer(None, None, "tiny-llama").render([USER], ChatOptions())


@pytest.mark.parametrize("messages, options, says", [
    ([{"role": "assistant", "content": "x"}], ChatOptions(), "refused these messages: the conversation must not"),
    ([USER], ChatOptions(add_generation_prompt=True, continue_final_message=True),
     "'continue_final_message' needs 'add_generation_prompt' set to false"),
    ([USER], ChatOptions(add_generation_prompt=False, continue_final_message=True),
     "'continue_final_message' needs the last message to be the assistant's"),
    ([USER], ChatOptions(template_kwargs={"bos_token": "x", "messages": []}),
     "'chat_template_kwargs' may not set 'bos_token', 'messages'"),
])
def test_refusals_of_the_template_or_its_options_are_400s(renderer, messages, options, says):
    with pytest.raises(RequestError, match=says):
        renderer.render(messages, options)


def test_chat_template_config_is_a_file_or_the_template_itself(tmp_path):
    assert resolve_chat_template(None) is None
    assert resolve_chat_template(str(CHAT_TEMPLATE)) == CHAT_TEMPLATE.read_text()
    assert resolve_chat_template("{{ messages[0].content }}") == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="cannot be read"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(ValueError, match="must be a file path or a Jinja template"):
        resolve_chat_template(3)


def test_the_server_config_reads_the_template_and_the_cli_flag_sets_it(tiny_model, tmp_path):
    from adapterserve.clients import cli
    from adapterserve.server.settings import merge_config, resolve_paths

    args = cli._parser().parse_args(["serve", "--model", str(tiny_model), "--chat-template", str(CHAT_TEMPLATE)])
    config = resolve_paths(merge_config({**cli.serve_config(args), "encoder": False}))
    assert config["chat_template"] == CHAT_TEMPLATE.read_text()
    (tmp_path / "bad.jinja").write_text("{{ unclosed")
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        resolve_paths(merge_config({"model": str(tiny_model), "encoder": False,
                                    "chat_template": str(tmp_path / "bad.jinja")}))
