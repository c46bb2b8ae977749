"""Waiting and running queues; which requests run in the next step.

A step holds every running request's next token (decode) plus as many waiting
prompts (prefill) as the token budget, the KV cache and the adapter slots allow.
A waiting request is admitted only once its adapter has a slot and the adapter's
copies into it have landed; a request whose adapter cannot be placed now, or is
still loading, is passed over, not blocking the rest. Placing an
adapter never evicts one that other waiting requests need, except for the oldest
waiting request, so a stream of requests for resident adapters cannot starve a
request for a cold one. When the KV
cache runs out during decode, the newest running request is preempted: its
blocks are freed and it is recomputed later from its prompt plus output so far.
A running request whose launched step gives its last result is not scheduled again.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from adapterserve.config import EngineConfig
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.request import Request, RequestStatus

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


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, acquire: AcquireSlot, release: ReleaseSlot) -> None:
        self.config = config
        self.blocks = blocks
        self.acquire = acquire
        self.release = release
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch([], [])
        self._schedule_decodes(batch)
        self._schedule_prefills(batch)
        return batch

    def _schedule_decodes(self, batch: ScheduledBatch) -> None:
        preempted: set[int] = set()
        for request in list(self.running):
            if id(request) in preempted or request.final_launched:  # preempted below / last step in flight
                continue
            while not self.blocks.can_allocate(request.blocks, request.num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(id(victim))
                if victim is request:
                    break
            if id(request) not in preempted:
                self.blocks.grow(request.blocks, request.num_tokens)
                batch.requests.append(request)
                batch.num_new_tokens.append(request.num_tokens - request.num_computed)

    def _schedule_prefills(self, batch: ScheduledBatch) -> None:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return
        budget = self.config.max_num_batched_tokens - batch.num_tokens
        passed_over: list[Request] = []
        needed = {r.adapter_id for r in self.waiting if r.adapter_id is not None}
        oldest = self.waiting[0]
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            if request.pending:  # preempted while its last token was in flight: admit once it lands
                passed_over.append(request)
                continue
            new_tokens = request.num_tokens - request.num_computed
            if new_tokens > budget or not self.blocks.can_allocate(request.blocks, request.num_tokens):
                self.waiting.appendleft(request)
                break
            if request.adapter_id is not None:
                slot = self.acquire(request.adapter_id, () if request is oldest else needed)
                if slot is None:  # no room, or its weights are still being copied in
                    passed_over.append(request)
                    continue
                request.slot = slot
            self.blocks.grow(request.blocks, request.num_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            batch.requests.append(request)
            batch.num_new_tokens.append(new_tokens)
            budget -= new_tokens
        self.waiting.extendleft(reversed(passed_over))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.blocks.release(request.blocks)
        if request.slot >= 0:
            self.release(request.slot)
            request.slot = -1

    def finish(self, request: Request, reason: str) -> None:
        """Take a request out of the queues and free its KV blocks and slot at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
