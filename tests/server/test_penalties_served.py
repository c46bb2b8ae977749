"""Penalties and logit bias through the server: gRPC and the OpenAI HTTP route give the
greedy tokens of transformers' own generate with the same processors, run alone, and of
each other where transformers has no processor (OpenAI's presence and frequency)."""
from __future__ import annotations

import requests
import torch
from transformers import AutoTokenizer

from tests.helpers.live_server import ALICE
from tests.helpers.lora import load_base

PROMPT = "The keeper climbs the stairs of the old lighthouse"
GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)


def _hf_greedy(model_dir, **processors) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    enc = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        out = load_base(model_dir).generate(**enc, max_new_tokens=GREEDY["max_tokens"], do_sample=False,
                                            pad_token_id=tokenizer.pad_token_id, eos_token_id=None, **processors)
    return out[0, enc.input_ids.shape[1]:].tolist()


def _http(server, **fields) -> list[int]:
    body = {"model": "tiny-llama", "prompt": PROMPT, "return_token_ids": True, **GREEDY, **fields}
    reply = requests.post(f"{server.http}/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {ALICE}"})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["token_ids"]


def test_repetition_penalty_and_logit_bias_equal_transformers(server, alice, tiny_model):
    plain = alice.generate(PROMPT, **GREEDY).token_ids
    biased_token = plain[3]
    want = _hf_greedy(tiny_model, repetition_penalty=1.8, sequence_bias={(biased_token,): -50.0})
    got = alice.generate(PROMPT, repetition_penalty=1.8, logit_bias={biased_token: -50.0}, **GREEDY).token_ids
    assert got == want and biased_token not in got and got != plain
    assert _http(server, repetition_penalty=1.8, logit_bias={str(biased_token): -50.0}) == want


def test_presence_and_frequency_penalties_agree_across_apis(server, alice):
    plain = alice.generate(PROMPT, **GREEDY).token_ids
    penalised = alice.generate(PROMPT, presence_penalty=2.0, frequency_penalty=2.0, **GREEDY).token_ids
    assert penalised != plain
    assert len(set(penalised)) > len(set(plain))  # generated tokens are repeated less
    assert _http(server, presence_penalty=2.0, frequency_penalty=2.0) == penalised
