"""Requests, their sampling parameters, and what the engine returns for them."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from adapterserve.engine.detokenizer import DecodeState
from adapterserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


@dataclass
class RequestTimes:
    """When a streamed request reached each stage in the engine, as time.time_ns() (0: not
    reached). Recorded only for a request that brings one (a traced request); read by traces."""

    added_ns: int = 0
    scheduled_ns: int = 0  # first admitted to a batch: its wait in the queue ends
    first_token_ns: int = 0  # its first token reached its stream
    finished_ns: int = 0


@dataclass(eq=False)
class Request:
    """One generation request as the scheduler and runner see it."""

    prompt_ids: list[int]
    sampling: SamplingParams
    adapter_id: str | None = None
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    task: str = "generate"  # "generate", or a pooling task: "classify", "embed"
    slot: int = -1  # adapter slot while running; -1 = base model
    num_virtual: int = 0  # prompt-tuning virtual tokens in front of the prompt
    prefix_len: int = 0  # prefix-tuning keys/values attended before everything
    blocks: list[int] = field(default_factory=list)
    cache_root: bytes = b""  # where its blocks' prefix-cache keys start (KV identity and salt)
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full blocks so far
    num_remembered: int = 0  # leading blocks the prefix cache knows (found there, or made findable)
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (set on first admission)
    num_computed: int = 0  # tokens whose k/v are in the cache (or written by a launched step)
    pending: int = 0  # sampled by a launched step, value not yet on the host (0 or 1)
    pending_row: int = -1  # where that token sits in the runner's sampled-token buffer
    final_launched: bool = False  # the launched step gives its last result: schedule it no more
    text: str = ""
    decoded: DecodeState = field(default_factory=DecodeState)  # how far text is decoded incrementally
    emitted_chars: int = 0  # text already streamed
    emitted_tokens: int = 0  # output ids already streamed
    generator: object = None  # torch.Generator of a seeded request
    result: object = None  # ClassifyOutput or EmbedOutput of a finished pooling request
    error: Exception | None = None  # why the engine ended it alone (finish_reason "error")
    times: RequestTimes | None = None  # stage times, kept only when the request brings one
    arrived_at: float = field(default_factory=time.monotonic)  # when it was queued (metrics)
    scheduled_at: float | None = None  # when a step first ran it: its queue time ends (metrics)
    index: int = 0  # which of its request's n choices (sampling.n) it is
    choices: list[Request] | None = None  # all n choices, in index order (shared list); None when n == 1
    to_fork: list[Request] = field(default_factory=list)  # choice 0 only: choices to fork once its prompt is in

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of the request's own KV entries [start, end) (virtual tokens as 0); a pending
        token is not among them (the runner reads it on the device)."""
        virtual, prompt = self.num_virtual, len(self.prompt_ids)
        if start >= virtual + prompt:  # output tokens only (a decode)
            return self.output_ids[start - virtual - prompt:end - virtual - prompt]
        ids = [0] * max(0, min(end, virtual) - start)
        ids += self.prompt_ids[max(start - virtual, 0):max(end - virtual, 0)]
        ids += self.output_ids[max(start - virtual - prompt, 0):max(end - virtual - prompt, 0)]
        return ids

    @property
    def num_tokens(self) -> int:
        """Tokens in the request's own KV blocks: virtual, prompt, output and pending."""
        return self.num_virtual + len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_outputs(self) -> int:
        """Output tokens sampled so far, pending included."""
        return len(self.output_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def pooling(self) -> bool:
        return self.task != "generate"

    @property
    def all_choices(self) -> list[Request]:
        return self.choices if self.choices is not None else [self]

    @property
    def done(self) -> bool:
        """Whether every choice of the request has finished."""
        return all(c.finished for c in self.all_choices)

    def add_choices(self) -> None:
        """Make choices 1 .. n-1 of a request of n > 1 choices (this one is choice 0). They wait
        in `to_fork` until this one has computed the prompt, then share its KV blocks."""
        n = self.sampling.n
        if n == 1:
            return
        self.choices = [self]
        for index in range(1, n):
            other = Request(self.prompt_ids, self.sampling, self.adapter_id, self.request_id, task=self.task,
                            num_virtual=self.num_virtual, prefix_len=self.prefix_len, cache_root=self.cache_root,
                            index=index, choices=self.choices)
            seed = self.sampling.choice_seed(index)
            if seed is not None and self.generator is not None:
                other.generator = type(self.generator)(device=self.generator.device).manual_seed(seed)  # torch's
            self.choices.append(other)
        self.to_fork = self.choices[1:]


@dataclass(frozen=True)
class RequestOutput:
    """A finished request (from generate) or one streamed chunk (from stream)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    adapter_id: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    error: Exception | None = None  # set with finish_reason "error": why this request alone failed
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    index: int = 0  # the choice (of the request's sampling.n) these tokens belong to

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ClassifyOutput:
    """A classification: the top label and every label's probability."""

    request_id: str
    label: str
    label_index: int
    probabilities: list[float]
    labels: list[str]
    adapter_id: str | None = None


@dataclass(frozen=True)
class EmbedOutput:
    """A pooled embedding of the input."""

    request_id: str
    embedding: list[float]
    adapter_id: str | None = None
