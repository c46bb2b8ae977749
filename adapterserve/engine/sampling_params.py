"""A request's sampling parameters: how its next token is picked."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from adapterserve import request_fields as check
from adapterserve.errors import RequestError

MAX_TOKENS = 2**31 - 1
MIN_TEMPERATURE = 1e-6  # below it (but above 0) float32 logits / temperature overflow
MIN_TOP_P = 1e-9  # below it top_p rounds to 0 in float32 and would keep no token
MAX_TOP_K = 2**63 - 1  # int64; any k over the vocabulary size keeps every token
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes; negative seeds wrap mod 2**64
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # per stop string (streaming holds back that many characters minus one)
MAX_STOP_TOKEN_IDS = 256


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each request's next token. Every field is type- and range-checked
    (RequestError names the field and the bad value):

    - max_tokens: int in [1, 2**31 - 1]; the engine also checks prompt + max_tokens
      against its max_model_len.
    - temperature: finite number; 0 is greedy, otherwise at least 1e-6.
    - top_k: int; 0 (or -1) is off, k >= the vocabulary size keeps every token.
    - top_p: finite number in [1e-9, 1]; 1 is off.
    - seed: None or an int in [-2**63, 2**64 - 1] (negative seeds wrap mod 2**64).
    - stop: a string or up to 16 non-empty strings of at most 256 characters.
    - stop_token_ids: up to 256 token ids >= 0 (the engine checks them against its vocabulary).
    - ignore_eos: bool.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self._set("max_tokens", check.integer("max_tokens", self.max_tokens, 1, MAX_TOKENS))
        self._set("temperature", _temperature(self.temperature))
        self._set("top_k", max(check.integer("top_k", self.top_k, -1, MAX_TOP_K), 0))
        self._set("top_p", check.number("top_p", self.top_p, MIN_TOP_P, 1.0))
        if self.seed is not None:
            self._set("seed", check.integer("seed", self.seed, *SEED_RANGE))
        self._set("stop", _stops(self.stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        self._set("stop_token_ids", check.token_ids("stop_token_ids", ids, MAX_STOP_TOKEN_IDS, allow_empty=True))
        self._set("ignore_eos", check.boolean("ignore_eos", self.ignore_eos))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalise in place once, at construction

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _temperature(value: Any) -> float:
    temperature = check.number("temperature", value, 0.0, math.inf)
    if 0.0 < temperature < MIN_TEMPERATURE:
        raise RequestError(f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, "
                           f"got {check.short(value)}")
    return temperature


def _stops(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (check.text("stop", value, MAX_STOP_CHARS),)
    stops = check.sequence("stop", value, MAX_STOP_STRINGS, "a string or a list of strings")
    return tuple(check.text(f"stop[{i}]", s, MAX_STOP_CHARS) for i, s in enumerate(stops))
