"""Runs one step: its host inputs built from the scheduled requests, the device part
(engine/step_device.py: BatchContext, backbone, logits; on every tensor-parallel rank),
then sampling.

``run`` launches the step and returns at once: the sampled ids stay on the device
(where the next step reads them as its input) and reach the host through a pinned
copy the caller waits for later, so the host can prepare step n+1 while the GPU
runs step n.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adapterserve.engine.adapter_host import family_slots
from adapterserve.engine.attention_meta import SequenceLayout
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.penalties import PenaltyState
from adapterserve.engine.request import Request
from adapterserve.engine.sampler import sample
from adapterserve.engine.scheduler import ScheduledBatch
from adapterserve.engine.step_device import StepDevice, StepInputs, with_sampled_ids  # noqa: F401 (re-exported)
from adapterserve.layers.parallel import SINGLE
from adapterserve.models.decoder import DecoderModel

if TYPE_CHECKING:
    from adapterserve.engine.tp.lockstep import Lockstep


def _completes(request: Request, num_new_tokens: int) -> bool:
    """Whether computing num_new_tokens more brings the request to its last known token."""
    return request.num_computed + num_new_tokens == request.num_tokens


@dataclass
class StepResult:
    """A launched step's results: the generating rows' token ids (host tensor,
    valid once ``ready`` has fired) and each pooling request's hidden state."""

    requests: list[Request]
    tokens: torch.Tensor | None  # [G] long, generating requests in batch order
    ready: torch.cuda.Event | None
    pooled: list[torch.Tensor | None]  # per request: float32 hidden state of a pooling request
    wait: Callable[[torch.cuda.Event], None] | None = None  # how to wait for `ready` (None: synchronize)

    def token_ids(self) -> list[int]:
        """Waits for the GPU to finish the step."""
        if self.ready is not None:
            self.wait(self.ready) if self.wait is not None else self.ready.synchronize()
        return [] if self.tokens is None else self.tokens.tolist()


class ModelRunner:
    """Rank 0's step: the host inputs built from the scheduled requests, the device part
    (``StepDevice``, on every rank: ``lockstep`` hands the inputs to the other ranks
    first), then sampling."""

    def __init__(self, model: DecoderModel, blocks: BlockManager, num_slots: int, max_rank: int, max_tokens: int,
                 seed: int, lockstep: Lockstep | None = None, kv_fp8: bool = False) -> None:
        self.model = model
        self.blocks = blocks
        self.num_slots = num_slots
        self.lockstep = lockstep  # the other tensor-parallel ranks (None: this rank alone)
        tp = lockstep.tp if lockstep is not None else SINGLE
        num_cache_slots = blocks.num_blocks * blocks.block_size + 1  # the last: trash for padding rows
        self.device_part = StepDevice(model, num_cache_slots, blocks.block_size, num_slots, max_rank, max_tokens, tp,
                                      kv_fp8)
        self.device = self.device_part.device
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self.penalties = PenaltyState(model.cfg.vocab_size, self.device)
        self.families_of = lambda slot: frozenset()  # slot -> families it holds; bound by the engine
        self.prefix_pages = lambda slot: []  # slot -> KV blocks of its prefix; bound by the engine
        self.graph_signature = lambda: ()  # host state a captured graph depends on; bound by the engine
        self.step_scope = lambda family_slots, mixed: nullcontext()  # a step's host state; bound by the engine

    @property
    def graphs(self):
        """DecodeGraphs (None without CUDA graphs)."""
        return self.device_part.graphs

    @property
    def mixed_graphs(self):
        """MixedGraphs (None without mixed-step graphs)."""
        return self.device_part.mixed_graphs

    @property
    def sampled(self) -> torch.Tensor:
        return self.device_part.sampled

    @property
    def lora_workspace(self) -> torch.Tensor:
        return self.device_part.lora_workspace

    def enable_cuda_graphs(self, max_batch: int, max_pages: int, mixed_tokens: int = 0, max_requests: int = 0
                           ) -> None:
        """Decode graphs, and with mixed_tokens mixed-step graphs (StepDevice.enable_cuda_graphs), on every rank."""
        self.device_part.enable_cuda_graphs(max_batch, max_pages, mixed_tokens, max_requests)
        if self.lockstep is not None:
            self.lockstep.enable_cuda_graphs(max_batch, max_pages, mixed_tokens, max_requests)

    def capture_graph(self, bucket: int, families: tuple[bool, ...], stacked_rows: int = 0, mixed: bool = False
                      ) -> None:
        """Capture a decode graph (mixed: a mixed-step graph of that token bucket) ahead
        (warm-up) on every rank, with the stacked GEMMs covering `stacked_rows` pool rows
        (0: as they are)."""
        signature = self.graph_signature()
        if self.lockstep is not None:
            self.lockstep.capture(bucket, families, signature, stacked_rows, mixed)
        (self.mixed_graphs if mixed else self.graphs).capture(bucket, families, signature)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, generators: list[torch.Generator | None]) -> StepResult:
        """Launch one forward pass over the batch. Each request whose tokens this step
        completes gets a result: a generating one samples its next token, a pooling one
        (classify, embed) gets its pooled hidden state; a prompt chunk short of the end
        of its request only fills the KV cache."""
        requests = batch.requests
        done = [i for i, (r, n) in enumerate(zip(requests, batch.num_new_tokens)) if _completes(r, n)]
        inputs = self._host_batch(batch)
        inputs.generating = [i for i in done if not requests[i].pooling]
        inputs.graph = self._graph_ready(inputs, batch)
        inputs.mixed = not inputs.graph and self._mixed_ready(inputs, batch)
        with self.step_scope(inputs.family_slots, inputs.mixed):
            if inputs.graph or inputs.mixed:
                inputs.signature = self.graph_signature()
            if self.lockstep is not None:
                self.lockstep.step(inputs)
            logits, last = self.device_part.forward(inputs)
        self.last_logits = logits
        pooled = [last[i].float() if requests[i].pooling else None for i in done] if last is not None \
            else [None] * len(done)
        finished = [requests[i] for i in done]
        if not inputs.generating:
            return self._publish(finished, None, pooled)
        rows = [requests[i] for i in inputs.generating]  # in the order of the logits' rows
        penalties = self.penalties.prepare(rows)
        tokens = sample(logits, [r.sampling for r in rows], [generators[i] for i in inputs.generating],
                        self.generator, penalties)
        self.penalties.record(penalties, tokens)
        for row, i in enumerate(inputs.generating):
            requests[i].pending_row = row
        return self._publish(finished, tokens, pooled)

    def copy_blocks(self, sources: list[int], copies: list[int]) -> None:
        """KV block sources[i] copied into copies[i] in every layer, on every rank (the choices
        of a request of n > 1 fork from its first)."""
        if self.lockstep is not None:
            self.lockstep.copy_blocks(sources, copies)
        self.device_part.copy_blocks(sources, copies)

    @staticmethod
    def completing(batch: ScheduledBatch) -> list[Request]:
        """The batch's requests whose tokens this step completes (they get a result)."""
        return [r for r, n in zip(batch.requests, batch.num_new_tokens) if _completes(r, n)]

    def _publish(self, requests: list[Request], tokens: torch.Tensor | None, pooled: list) -> StepResult:
        """Keep the ids on the device (every rank) for the next step's input; start their copy
        to the host. With other ranks, the host later waits for the step through `lockstep`
        (watching the workers), pooled results included."""
        if tokens is not None:
            self.device_part.keep_sampled(tokens, tokens.shape[0])
        waiter = self.lockstep.wait if self.lockstep is not None else None
        if self.device.type != "cuda" or (tokens is None and waiter is None):
            return StepResult(requests, None if tokens is None else tokens.clone(), None, pooled)
        host = None
        if tokens is not None:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return StepResult(requests, host, ready, pooled, waiter)

    def _graph_ready(self, inputs: StepInputs, batch: ScheduledBatch) -> bool:
        # every request samples (none is pooling, none a chunk short of its end) one token
        return (self.graphs is not None and len(inputs.generating) == len(batch.requests)
                and all(n == 1 for n in batch.num_new_tokens) and not inputs.virtual[0]
                and self.graphs.fits(len(batch.requests), max(len(s.pages) for s in inputs.layouts)))

    def _mixed_ready(self, inputs: StepInputs, batch: ScheduledBatch) -> bool:
        # stay eager: prompt-tuning rows (a list of varying length, scattered into the embeddings),
        # pooling requests (their hidden states, which a graph does not keep), steps above the
        # largest token bucket (mixed_graph_tokens: the graphs' memory)
        return (self.mixed_graphs is not None and not inputs.virtual[0]
                and not any(r.pooling for r in batch.requests)
                and self.mixed_graphs.fits(len(inputs.ids), len(inputs.layouts),
                                           max(len(s.pages) for s in inputs.layouts)))

    def _host_batch(self, batch: ScheduledBatch) -> StepInputs:
        inputs = StepInputs()
        for request, n in zip(batch.requests, batch.num_new_tokens):
            self._add_request(inputs, request, n)
        inputs.family_slots = family_slots(inputs.slots, self.families_of)
        return inputs

    def _add_request(self, host: StepInputs, request: Request, n: int) -> None:
        """The request's next n tokens (from its first not yet computed): a whole prompt,
        a chunk of one, or a decode's one token."""
        start, end = request.num_computed, request.num_computed + n
        if n == 1 and start >= request.num_virtual:
            self._add_token(host, request, start)
        else:
            self._add_tokens(host, request, start, end)
        prefix = self.prefix_pages(request.slot) if request.prefix_len else []
        aligned = len(prefix) * self.blocks.block_size
        host.layouts.append(SequenceLayout(prefix + request.blocks, aligned - request.prefix_len, aligned + end, n))
        host.last_rows.append(len(host.ids) - 1)

    @staticmethod
    def _add_token(host: StepInputs, request: Request, position: int) -> None:
        """One token, not a virtual one (a decode's, or a prompt's last one)."""
        ids = request.token_ids(position, position + 1)
        host.ids.append(ids[0] if ids else 0)
        host.sources.append(-1 if ids else request.pending_row)  # not yet on the host: the step before sampled it
        host.positions.append(request.prefix_len + position)
        host.slots.append(request.slot)

    @staticmethod
    def _add_tokens(host: StepInputs, request: Request, start: int, end: int) -> None:
        n, first_row = end - start, len(host.ids)
        ids = request.token_ids(start, end)
        host.sources.extend([-1] * len(ids))
        if len(ids) < n:  # the last input: sampled by the step before, not yet on the host
            ids.append(0)
            host.sources.append(request.pending_row)
        host.ids.extend(ids)
        host.positions.extend(range(request.prefix_len + start, request.prefix_len + end))
        host.slots.extend([request.slot] * n)
        for i in range(start, min(request.num_virtual, end)):
            host.virtual[0].append(first_row + i - start)
            host.virtual[1].append(request.slot)
            host.virtual[2].append(i)
