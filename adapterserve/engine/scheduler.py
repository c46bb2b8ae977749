"""Waiting and running queues; which requests run in the next step, and how many of
their tokens.

Each step has a budget of `max_num_batched_tokens`. Running requests come first:
decodes (one token each), then prompts part-way through their prefill; waiting
requests are admitted with what is left. A prompt longer than what is left runs in
chunks over several steps (chunked prefill): its KV blocks grow chunk by chunk, and
it samples only once its last chunk is computed. A request admitted starts after the
blocks of its prefix already in the prefix cache (engine/prefix_cache.py). So any request that fits
`max_model_len` completes whatever the budget, and one long prompt never holds the
queue behind it for more than the steps its chunks take.

A waiting request is admitted only once its adapter has a slot and the adapter's
copies into it have landed; a request whose adapter cannot be placed now, or is
still loading, is passed over, not blocking the rest. Placing an adapter never
evicts one that other waiting requests need, except for the oldest waiting request,
so a stream of requests for resident adapters cannot starve a request for a cold
one. When the KV cache runs out, the newest running request is preempted: its blocks
are freed and it is recomputed later, in chunks, from its prompt plus output so far.
A running request whose launched step gives its last result is not scheduled again.
A request that cannot be served at all (its adapter is gone, or it needs more KV
blocks than the cache has) is set aside in `failed` with its error, for the engine
to end alone.

A request of n > 1 choices waits for n seats (max_num_seqs) and room for its prompt plus
one block per other choice; choice 0 computes the prompt, and once the step that completes
it is launched the others fork from it (`fork`: the prompt's blocks shared, the block of its
last token copied), then run as requests of their own. An abort or an error ends them all.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from adapterserve.config import EngineConfig
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.prefix_cache import PrefixCache
from adapterserve.engine.request import Request, RequestStatus
from adapterserve.errors import AdapterError, AdapterNotFound, CapacityError, RequestError

_ENDS_ALL = ("abort", "error")  # finish reasons that end every choice of a request

# acquire(adapter_id, keep: adapter ids not to evict for it) -> slot, or None (no room, or
# the adapter's copies into its slot have not landed yet); release(slot)
AcquireSlot = Callable[[str, Collection[str]], "int | None"]
ReleaseSlot = Callable[[int], None]


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # tokens each request computes this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_new_tokens.append(num_tokens)


def _prefilling(entry: tuple[Request, int]) -> bool:
    """Whether a (request, tokens left) entry has more than a decode's one token to compute."""
    return entry[1] > 1


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, acquire: AcquireSlot, release: ReleaseSlot,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.prefix_cache = prefix_cache or PrefixCache(blocks, enabled=False)
        self.acquire = acquire
        self.release = release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.failed: list[tuple[Request, Exception]] = []  # taken out of the queues; the engine ends them
        self.preemptions = 0  # running requests sent back to wait (KV cache full), so far (metrics)

    def add(self, request: Request) -> None:
        """Queue a request; one of n > 1 choices (RequestError if n is over max_num_seqs) queues
        as its choice 0 alone, the others forked from it once it has computed the prompt."""
        n, most = request.sampling.n, self.config.max_num_seqs
        if n > 1 and request.pooling:
            raise RequestError(f"'n' must be 1 for {request.task}, got {n}")
        if n > most:
            raise RequestError(f"'n' is {n}, but this engine runs at most {most} sequences at once "
                               f"(max_num_seqs): ask for n <= {most}")
        request.add_choices()
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self._schedule_waiting(batch, budget)
        return batch

    # running requests: decodes, then unfinished prefills

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        # (request, its tokens not yet computed), not those whose last step is in flight
        ready = [(r, r.num_tokens - r.num_computed) for r in self.running if not r.final_launched]
        ready.sort(key=_prefilling)  # decodes first, order kept
        preempted: set[int] = set()
        block_size = self.blocks.block_size
        for request, left in ready:
            if budget == 0:
                break
            if id(request) in preempted:
                continue
            n = min(left, budget)
            end = request.num_computed + n
            if end > len(request.blocks) * block_size:  # it needs another block
                if not self._make_room(request, end, preempted):
                    continue
                self.blocks.grow(request.blocks, end)
            batch.add(request, n)
            budget -= n
        return budget

    def _make_room(self, request: Request, num_tokens: int, preempted: set[int]) -> bool:
        """Preempt the newest running requests until `request` can hold num_tokens; False
        if it was preempted itself (or set aside: the cache cannot hold it even alone)."""
        while not self.blocks.can_allocate(request.blocks, num_tokens):
            victim = self.running[-1]
            if victim is request and len(self.running) == 1:
                self._fail_too_long(request, num_tokens)
                return False
            self._preempt(victim)
            preempted.add(id(victim))
            if victim is request:
                return False
        return True

    def _fail_too_long(self, request: Request, num_tokens: int) -> None:
        blocks = self.blocks.blocks_needed(num_tokens)
        room = self.blocks.num_free + len(request.blocks)
        self._set_aside(request, CapacityError(
            f"request needs {blocks} KV blocks for {num_tokens} tokens; with nothing else running the cache "
            f"has {room} of its {self.blocks.num_blocks} for it (prefix-tuning prefixes hold the rest)"))

    # waiting requests

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return
        passed_over: list[Request] = []
        needed = {r.adapter_id for r in self.waiting if r.adapter_id is not None}
        oldest = self.waiting[0]
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.pending:  # preempted while its last token was in flight: admit once it lands
                passed_over.append(request)
                continue
            if len(self.running) + 1 + len(request.to_fork) > self.config.max_num_seqs:  # seats for its choices
                self.waiting.appendleft(request)
                break
            self.prefix_cache.match(request)
            n = min(request.num_tokens - request.num_computed, budget)
            if not self._admissible(request, n):
                tokens = request.num_computed + n
                self.prefix_cache.unmatch(request)
                if self.running:
                    self.waiting.appendleft(request)
                else:  # even alone it does not fit: it never will
                    self._fail_too_long(request, tokens)
                break
            if request.adapter_id is not None:
                try:
                    slot = self.acquire(request.adapter_id, () if request is oldest else needed)
                except (AdapterError, AdapterNotFound, CapacityError) as exc:  # its adapter cannot be placed
                    self.failed.append((request, exc))
                    continue
                if slot is None:  # no room, or its weights are still being copied in
                    self.prefix_cache.unmatch(request)
                    passed_over.append(request)
                    continue
                request.slot = slot
            self.blocks.grow(request.blocks, request.num_computed + n)
            self.prefix_cache.admitted(request)
            request.status = RequestStatus.RUNNING
            if request.times is not None and not request.times.scheduled_ns:
                request.times.scheduled_ns = time.time_ns()
            self.running.append(request)
            batch.add(request, n)
            budget -= n
        self.waiting.extendleft(reversed(passed_over))

    def _admissible(self, request: Request, n: int) -> bool:
        """Room for the whole request (its later chunks too), or, with nothing running,
        for this chunk (a request that fits nowhere else runs alone)."""
        forks = len(request.to_fork)  # a block each, the copy of the prompt's last block
        if self.blocks.can_allocate(request.blocks, request.num_tokens + forks * self.blocks.block_size):
            return True
        return not self.running and self.blocks.can_allocate(request.blocks, request.num_computed + n)

    def take_failed(self) -> list[tuple[Request, Exception]]:
        """The requests set aside since the last call, each with its error."""
        failed, self.failed = self.failed, []
        return failed

    def _set_aside(self, request: Request, error: Exception) -> None:
        """Out of the queues (blocks and slot freed), for the engine to end with `error`."""
        self._take_out(request)
        self.failed.append((request, error))

    # preemption and the end of a request

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.preemptions += 1
        self._free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.prefix_cache.remember(request)
        self.blocks.release(request.blocks)
        request.num_remembered = 0
        if request.slot >= 0:
            self.release(request.slot)
            request.slot = -1

    def _take_out(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the queues and free its KV blocks and slot at once. An abort
        or an error ends every unfinished choice of the request (with the same error)."""
        ending = [c for c in request.all_choices if not c.finished] if reason in _ENDS_ALL else [request]
        for choice in ending:
            if choice is not request:
                choice.error = request.error
            self._take_out(choice)
            choice.status = RequestStatus.FINISHED
            choice.finish_reason = reason
        if reason in _ENDS_ALL:
            request.all_choices[0].to_fork = []

    # the choices of a request of n > 1

    def fork(self, requests: list[Request]) -> tuple[list[int], list[int]]:
        """Give the choices waiting on each of `requests` whose prompt a launched step has just
        completed the prompt's blocks: every full block shared, and a copy of the block that
        holds the prompt's last token, which each choice computes again for its own first
        token. Returns the copies to make on the device, (source blocks, destination blocks).
        A choice that finds no free block or seat waits to be admitted on its own."""
        sources: list[int] = []
        copies: list[int] = []
        for first in requests:
            if not first.to_fork or first.num_outputs == 0 or first.finished:
                continue
            for choice in first.to_fork:
                if self.blocks.num_free == 0 or len(self.running) >= self.config.max_num_seqs \
                        or not self._seat(choice, first):
                    self.waiting.appendleft(choice)
                    continue
                choice.blocks = self.blocks.share(first.blocks[:-1])
                self.blocks.grow(choice.blocks, len(first.blocks) * self.blocks.block_size)  # one block more
                sources.append(first.blocks[-1])
                copies.append(choice.blocks[-1])
                self._start_fork(choice, first)
            first.to_fork = []
        return sources, copies

    def _seat(self, choice: Request, first: Request) -> bool:
        """The adapter slot of the first choice, held by `choice` too (False if not placed)."""
        if first.slot < 0:
            return True
        slot = self.acquire(first.adapter_id, ())
        if slot is None:
            return False
        choice.slot = slot
        return True

    def _start_fork(self, choice: Request, first: Request) -> None:
        choice.num_computed = first.num_computed - 1  # its first token comes from the prompt's last again
        shared = len(first.blocks) - 1
        choice.block_keys = first.block_keys[:shared]
        choice.num_remembered = min(first.num_remembered, shared)
        choice.cached_tokens = first.cached_tokens
        choice.scheduled_at = first.scheduled_at or time.monotonic()  # queued as one request: counted once
        choice.status = RequestStatus.RUNNING
        self.running.append(choice)
