"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias: type- and
range-checked with errors naming the field; logit_bias ids checked against the
vocabulary when the engine takes the request, nothing queued otherwise."""
from __future__ import annotations

import dataclasses
import math
import pickle
from types import MappingProxyType

import numpy as np
import pytest

from adapterserve import Engine
from adapterserve.engine.sampling_params import MAX_LOGIT_BIAS_ENTRIES, REPETITION_PENALTY_RANGE, SamplingParams
from adapterserve.errors import RequestError


def test_defaults_are_off():
    p = SamplingParams()
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (0.0, 0.0, 1.0, ())
    assert not p.penalised
    assert SamplingParams(logit_bias=None, presence_penalty=0, repetition_penalty=1) == p


def test_valid_values_are_normalised():
    p = SamplingParams(presence_penalty=-2, frequency_penalty=np.float32(1.5), repetition_penalty=1e6,
                       logit_bias={"50256": -100, 7: 0.5, "0": np.int64(100)})
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 1.5, 1e6)
    assert type(p.presence_penalty) is float and type(p.frequency_penalty) is float
    assert p.logit_bias == ((0, 100.0), (7, 0.5), (50256, -100.0))
    assert all(type(t) is int and type(b) is float for t, b in p.logit_bias)
    assert p.penalised


def test_logit_bias_forms_agree_and_stay_hashable():
    mapping = SamplingParams(logit_bias={3: 1.0, 1: -2.0})
    assert SamplingParams(logit_bias=[(1, -2.0), [3, 1]]) == mapping
    assert SamplingParams(logit_bias=MappingProxyType({"3": 1, "1": -2})) == mapping
    assert dataclasses.replace(mapping) == mapping  # the normalised form is accepted as input
    assert hash(mapping) == hash(SamplingParams(logit_bias={1: -2.0, 3: 1.0}))
    assert pickle.loads(pickle.dumps(mapping)) == mapping
    assert not SamplingParams(logit_bias={}).logit_bias and not mapping.penalised


def test_each_penalty_alone_counts_as_penalised():
    for fields in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 0.9}):
        assert SamplingParams(**fields).penalised


BAD = [
    ({"presence_penalty": 2.01}, "'presence_penalty' must be between -2 and 2, got 2.01"),
    ({"presence_penalty": -3}, "'presence_penalty' must be between -2 and 2, got -3"),
    ({"presence_penalty": "1"}, "'presence_penalty' must be a number, got '1'"),
    ({"presence_penalty": True}, "'presence_penalty' must be a number, got True"),
    ({"frequency_penalty": math.nan}, "'frequency_penalty' must be a finite number, got nan"),
    ({"frequency_penalty": -math.inf}, "'frequency_penalty' must be a finite number, got -inf"),
    ({"frequency_penalty": [1]}, "'frequency_penalty' must be a number, got [1]"),
    ({"repetition_penalty": 0}, "'repetition_penalty' must be between 1e-06 and 1e+06, got 0"),
    ({"repetition_penalty": -1.1}, "'repetition_penalty' must be between 1e-06 and 1e+06, got -1.1"),
    ({"repetition_penalty": 1e7}, "'repetition_penalty' must be between 1e-06 and 1e+06"),
    ({"repetition_penalty": math.inf}, "'repetition_penalty' must be a finite number, got inf"),
    ({"repetition_penalty": None}, "'repetition_penalty' must be a number, got None"),
    ({"logit_bias": 5}, "'logit_bias' must be a mapping of token ids to biases, or a list of (token id, bias)"),
    ({"logit_bias": "5:1"}, "'logit_bias' must be a mapping of token ids to biases"),
    ({"logit_bias": {"5": 101}}, "'logit_bias[5]' must be between -100 and 100, got 101"),
    ({"logit_bias": {5: -100.5}}, "'logit_bias[5]' must be between -100 and 100, got -100.5"),
    ({"logit_bias": {5: math.nan}}, "'logit_bias[5]' must be a finite number, got nan"),
    ({"logit_bias": {5: "1"}}, "'logit_bias[5]' must be a number, got '1'"),
    ({"logit_bias": {5: None}}, "'logit_bias[5]' must be a number, got None"),
    ({"logit_bias": {5: False}}, "'logit_bias[5]' must be a number, got False"),
    ({"logit_bias": {"abc": 1}}, "'logit_bias' keys must be token ids (integers from 0 to 2147483647), got 'abc'"),
    ({"logit_bias": {"-1": 1}}, "'logit_bias' keys must be token ids (integers from 0 to 2147483647), got '-1'"),
    ({"logit_bias": {" 5": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"5.0": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"1" * 40: 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {-1: 1}}, "'logit_bias' keys must be token ids (integers from 0 to 2147483647), got -1"),
    ({"logit_bias": {2**31: 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {True: 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {1.0: 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {"5": 1, "05": 2}}, "'logit_bias' gives token id 5 twice"),
    ({"logit_bias": [(5, 1), (5, 2)]}, "'logit_bias' gives token id 5 twice"),
    ({"logit_bias": [5]}, "'logit_bias[0]' must be a (token id, bias) pair, got 5"),
    ({"logit_bias": [(5, 1, 2)]}, "'logit_bias[0]' must be a (token id, bias) pair, got (5, 1, 2)"),
    ({"logit_bias": ["ab"]}, "'logit_bias[0]' must be a (token id, bias) pair, got 'ab'"),
    ({"logit_bias": {i: 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}},
     "'logit_bias' has 301 entries; at most 300 are allowed"),
    ({"logit_bias": [(i, 1) for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)]},
     "'logit_bias' has 301 items; at most 300 are allowed"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_values_are_refused_naming_field_and_value(fields, message):
    with pytest.raises(RequestError) as caught:
        SamplingParams(**fields)
    assert str(caught.value).startswith(message)


def test_range_ends_are_accepted():
    low, high = REPETITION_PENALTY_RANGE
    for value in (low, high):
        assert SamplingParams(repetition_penalty=value).repetition_penalty == value
    biases = {i: (-100 if i % 2 else 100) for i in range(MAX_LOGIT_BIAS_ENTRIES)}
    assert len(SamplingParams(logit_bias=biases).logit_bias) == MAX_LOGIT_BIAS_ENTRIES


def test_engine_refuses_logit_bias_ids_outside_its_vocabulary(llama_dir):
    engine = Engine.from_pretrained(llama_dir)
    vocab = engine.model_config.vocab_size
    with pytest.raises(RequestError, match=rf"logit_bias token ids must be in \[0, {vocab}\), got \[{vocab}\]"):
        engine.add_request([1, 2, 3], SamplingParams(logit_bias={1: 1.0, vocab: 2.0}))
    assert not engine.has_unfinished() and not engine.requests
    request = engine.add_request([1, 2, 3], SamplingParams(logit_bias={vocab - 1: 1.0}, max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    assert request.finish_reason == "length"
