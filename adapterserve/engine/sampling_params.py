"""A request's sampling parameters: how its next token is picked."""
from __future__ import annotations

import math
import re
from collections.abc import Mapping
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
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # > 0; the ends keep penalised float32 logits finite
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_N = 128  # choices of one request (the engine also holds n to its max_num_seqs)
_DECIMAL = re.compile(r"[0-9]{1,10}")  # a token id written as a JSON object key


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
    - presence_penalty, frequency_penalty: finite numbers in [-2, 2], 0 is off (OpenAI): each
      token's logit loses presence * (count > 0) + frequency * count, count = how often the
      token is among the request's generated tokens so far.
    - repetition_penalty: finite number in [1e-6, 1e6], 1 is off (Hugging Face, vLLM): the
      logit of every token seen in the prompt or the output so far is divided by it where
      positive and multiplied by it where not.
    - logit_bias: up to 300 token ids, each with a bias in [-100, 100] added to its logit;
      given as a mapping (keys: ints, or decimal strings as in JSON) or as (id, bias) pairs,
      held as (id, bias) pairs sorted by id. The engine checks the ids against its vocabulary.
    - n: int in [1, 128]: how many completions (choices) of the prompt to generate; the
      engine also needs n <= its max_num_seqs. Each choice samples on its own, choice i with
      seed + i (mod 2**64, as vLLM) when a seed is given.

    Order on the logits: logit_bias, repetition_penalty, frequency and presence penalties,
    then temperature, top_k, top_p.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

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
        for name in ("presence_penalty", "frequency_penalty"):
            self._set(name, check.number(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY))
        self._set("repetition_penalty", check.number("repetition_penalty", self.repetition_penalty,
                                                     *REPETITION_PENALTY_RANGE))
        self._set("logit_bias", _logit_bias(self.logit_bias))
        self._set("n", check.integer("n", self.n, 1, MAX_N))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalise in place once, at construction

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice `index` (0 <= index < n): seed + index mod 2**64 (a torch.Generator
        takes seed s and s mod 2**64 alike, so choice 0 draws as the request without n would)."""
        if self.seed is None:
            return None
        return (self.seed + index) % 2**64

    @property
    def penalised(self) -> bool:
        """Whether a penalty depends on the tokens seen so far (state kept across steps)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


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


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    if value is None:
        return ()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    else:
        pairs = check.sequence("logit_bias", value, MAX_LOGIT_BIAS_ENTRIES,
                               "a mapping of token ids to biases, or a list of (token id, bias) pairs")
    if len(pairs) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestError(f"'logit_bias' has {len(pairs)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
    biases: dict[int, float] = {}
    for i, pair in enumerate(pairs):
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RequestError(f"'logit_bias[{i}]' must be a (token id, bias) pair, got {check.short(pair)}")
        token = _bias_token(pair[0])
        if token in biases:
            raise RequestError(f"'logit_bias' gives token id {token} twice")
        biases[token] = check.number(f"logit_bias[{token}]", pair[1], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return tuple(sorted(biases.items()))


def _bias_token(key: Any) -> int:
    """A logit_bias key: an int, or a decimal string (JSON object keys are strings)."""
    if isinstance(key, str) and _DECIMAL.fullmatch(key):
        key = int(key)
    if not check.is_integer(key) or not 0 <= key <= check.MAX_TOKEN_ID:
        raise RequestError(f"'logit_bias' keys must be token ids (integers from 0 to {check.MAX_TOKEN_ID}), "
                           f"got {check.short(key)}")
    return int(key)
