"""The engine process's pipe format (wire.py): a stream's first chunk crosses as a packed
tuple and comes back as the RequestOutput the engine made."""
from __future__ import annotations

import random

import pytest

from adapterserve.engine.request import RequestOutput
from adapterserve.server.engine_process import wire


@pytest.mark.parametrize("prompt_len", [0, 1, 257])
def test_a_first_chunk_comes_back_equal(prompt_len: int) -> None:
    prompt = [random.randrange(0, 2**31 - 1) for _ in range(prompt_len)]
    out = RequestOutput(f"req-{random.randrange(10**6)}", [random.randrange(32000)], " the", None,
                        adapter_id=random.choice([None, "a@3"]), prompt_token_ids=prompt,
                        cached_tokens=random.randrange(prompt_len + 1), index=random.randrange(4))
    back = wire.output_of_head(wire.decode(wire.encode(wire.head(out))))
    assert back == out
    assert type(back.prompt_token_ids) is list and all(type(i) is int for i in back.prompt_token_ids)


def test_a_finished_first_chunk_keeps_its_reason() -> None:
    out = RequestOutput("r", [5, 6], "ab", "length", None, [1, 2, 3], cached_tokens=0, index=1)
    assert wire.output_of_head(wire.decode(wire.encode(wire.head(out)))) == out
