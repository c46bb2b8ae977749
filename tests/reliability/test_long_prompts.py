"""Prompts against the engine's step budget and context, through the live server."""
from __future__ import annotations

import grpc
import pytest

from adapterserve.clients.types import ClientError
from tests.helpers.live_server import STEP_BUDGET

PROMPT = "the keeper climbs the stairs of the old lighthouse at dusk, " * 30  # ~6x the step budget


def test_a_prompt_far_over_the_step_budget_completes_with_its_reference_tokens(alice, uploaded, reference):
    tokens, text = reference("chat", PROMPT, 12)
    chunks = list(alice.stream(PROMPT, adapter="chat", max_tokens=12, temperature=0.0))
    prompt_tokens = chunks[0].prompt_tokens
    assert prompt_tokens > 4 * STEP_BUDGET
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert "".join(c.text for c in chunks) == text


def test_prompt_plus_max_tokens_over_the_context_is_refused_naming_both(alice):
    with pytest.raises(ClientError) as refused:
        alice.generate(PROMPT, max_tokens=1000, temperature=0.0)
    assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens is 1000" in refused.value.details and "1024" in refused.value.details
