"""Engine: one frozen backbone, many adapters, one continuous batch per step.

    engine = Engine.from_pretrained(model_dir, device="cpu", dtype="float32")
    engine.load_adapter("sql", "/path/to/peft_lora_dir")
    outs = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0),
                           adapter_ids=["sql", None])

Each step: the scheduler picks requests (decodes plus new prefills whose adapter
has a slot), the runner runs the backbone once for all of them, and every
request gets its next token; finished requests free their KV blocks and slots.

Steps overlap: ``step`` launches step n+1 (its decode inputs are step n's sampled
ids, still on the device) before it waits for step n's tokens and handles them
(text, stop checks, streaming). The host's work hides behind the GPU's. A request
that a stop token ends at step n has one more, discarded, row in step n+1; a
request's last step by length is known at launch, so it is not scheduled again.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.types import BackboneSpec
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_host import AdapterHost
from adapterserve.engine.detokenizer import Detokenizer
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.pools.bottleneck import BottleneckPools
from adapterserve.engine.pools.head import HeadPool
from adapterserve.engine.pools.ia3 import Ia3Pool
from adapterserve.engine.pools.lora import LoraPool
from adapterserve.engine.pools.prefix import PrefixPool
from adapterserve.engine.pools.prompt import PromptPool
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, Request, RequestOutput
from adapterserve.engine.runner import ModelRunner, StepResult
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.engine.scheduler import Scheduler
from adapterserve.engine.slots import AdapterSlots
from adapterserve.engine.stopping import check_stop_token, stream_delta, update_text
from adapterserve.errors import AdapterNotFound, RequestError
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.decoder_config import DecoderConfig
from adapterserve.models.encoder_config import SUPPORTED_MODEL_TYPES as ENCODER_TYPES
from adapterserve.models.loader import load_decoder

Prompt = str | Sequence[int]


class Engine(AdapterHost):
    def __init__(self, model: DecoderModel, tokenizer, config: EngineConfig) -> None:
        super().__init__()
        self.model = model
        self.model_config: DecoderConfig = model.cfg
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer) if tokenizer is not None else None
        self.config = config
        cache_tokens = config.num_kv_blocks * config.block_size
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            cache_tokens,
        )
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.runner = ModelRunner(
            model, self.blocks, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens, config.seed
        )
        on_gpu = torch.device(config.device).type == "cuda"
        copy_stream = torch.cuda.Stream(device=config.device) if on_gpu else None
        self.slots = AdapterSlots(config.max_loras, self._pools(), copy_stream=copy_stream)
        self.runner.families_of = self._families_of
        self.runner.prefix_pages = self.prefix_pool.pages.__getitem__
        if config.lora_side_stream and on_gpu:
            side = torch.cuda.Stream(device=config.device)
            for _, linear in model.adapter_linears():
                linear.side_stream = side
        if config.cuda_graphs and on_gpu:
            pages = -(-self.max_model_len // config.block_size) + -(-config.max_virtual_tokens // config.block_size)
            self.runner.enable_cuda_graphs(config.max_num_seqs, pages)
            self.runner.graph_signature = self.bottleneck_pools.activations
        self.scheduler = Scheduler(config, self.blocks, self._acquire_slot, self.slots.release)
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, asyncio.Queue] = {}
        self._pooling: dict[str, tuple[Request, asyncio.Future]] = {}  # async classify/embed waiters
        self._loop_task: asyncio.Task | None = None
        self._in_flight: StepResult | None = None  # launched, results not yet handled

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_lora_rank: int = 64,
        **overrides,
    ) -> "Engine":
        """Load a Hugging Face checkpoint directory (safetensors) and its tokenizer.
        A BERT-family checkpoint gives an EncoderEngine (classify and embed)."""
        if _model_type(model_dir) in ENCODER_TYPES:
            from adapterserve.engine.encoder_engine import EncoderEngine

            return EncoderEngine.from_pretrained(model_dir, device, dtype, max_lora_rank, **overrides)
        config = EngineConfig(device=device, dtype=dtype, max_lora_rank=max_lora_rank, **overrides)
        model, _ = load_decoder(model_dir, config.torch_dtype, device)
        return cls(model, _load_tokenizer(model_dir), config)

    def _pools(self) -> list:
        cfg, model = self.config, self.model
        linears = list(model.adapter_linears())
        dtype, device = cfg.torch_dtype, cfg.device
        prompt = PromptPool(cfg.max_loras, cfg.max_virtual_tokens, self.model_config.hidden_size, dtype, device)
        model.prompt_embeddings = prompt.embeddings
        self.prefix_pool = PrefixPool(self.blocks, model.attention_layers())
        self.head_pool = HeadPool(cfg.max_loras, cfg.max_labels, cfg.max_head_layers, self.model_config.hidden_size,
                                  ("last",), dtype, device)
        self.lora_pool = LoraPool(linears, cfg.max_loras, cfg.pool_rows, cfg.max_lora_rank, dtype, device)
        self.bottleneck_pools = BottleneckPools(list(model.layers), self.model_config.hidden_size, cfg.max_loras,
                                                cfg.max_bottleneck_rank, cfg.max_num_batched_tokens, dtype, device)
        return [
            self.lora_pool,
            self.bottleneck_pools,
            self.head_pool,
            Ia3Pool(linears, cfg.max_loras, dtype, device),
            prompt,
            self.prefix_pool,
        ]

    # adapters

    @property
    def backbone_spec(self) -> BackboneSpec:
        cfg = self.model_config
        h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
        shapes = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        }
        return BackboneSpec(cfg.model_type, cfg.num_layers, h, shapes, cfg.num_kv_heads, cfg.head_dim)

    # requests

    def add_request(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        adapter_id: str | None = None,
        request_id: str | None = None,
        task: str = "generate",
    ) -> Request:
        sampling = sampling or SamplingParams()
        prompt_ids = self._prompt_ids(prompt)
        request = Request(prompt_ids=prompt_ids, sampling=sampling, adapter_id=adapter_id, task=task)
        if request_id is not None:
            request.request_id = request_id
        if sampling.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(sampling.seed)
        with self._lock:
            if adapter_id is not None:
                self._bind_adapter(request, adapter_id)
            elif task == "classify":
                raise RequestError("classify needs an adapter with a classification head")
            if request.request_id in self.requests:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self.requests[request.request_id] = request
            self.scheduler.add(request)
        return request

    def _bind_adapter(self, request: Request, adapter_id: str) -> None:
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            raise AdapterNotFound(f"no adapter {adapter_id!r} is loaded; loaded: {self.list_adapters()}")
        if request.task == "classify" and adapter.head is None:
            raise RequestError(f"adapter {adapter_id!r} has no classification head; classify needs one")
        request.num_virtual, request.prefix_len = adapter.num_virtual, adapter.prefix_len
        extra = request.num_virtual + request.prefix_len
        if extra and len(request.prompt_ids) + extra >= self.max_model_len:
            raise RequestError(
                f"prompt has {len(request.prompt_ids)} tokens; with adapter {adapter_id!r}'s {extra} virtual "
                f"tokens this engine takes at most {self.max_model_len - extra - 1}"
            )

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this backbone has no tokenizer: send prompt token ids")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len or len(ids) > self.config.max_num_batched_tokens:
            limit = min(self.max_model_len - 1, self.config.max_num_batched_tokens)
            raise RequestError(f"prompt has {len(ids)} tokens; this engine takes at most {limit}")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or done."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is None or request.finished:
                return False
            self._finish(request, "abort")
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # the loop

    def step(self) -> list[RequestOutput]:
        """Launch the next batch, then return the new tokens and text of every request
        the previously launched batch moved (waiting for the GPU to finish it)."""
        with self._lock:
            batch = self.scheduler.schedule()
            launched = self._launch(batch) if batch.requests else None
            done, self._in_flight = self._in_flight, launched
            return self._resolve(done) if done is not None else []

    def _launch(self, batch) -> StepResult:
        result = self.runner.run(batch, [r.generator for r in batch.requests])
        for request in batch.requests:
            request.num_computed = request.num_tokens
            if request.pooling:
                request.final_launched = True
            else:
                request.pending += 1
                request.final_launched = self._reaches_length(request, request.num_outputs, request.num_tokens)
        return result

    def _reaches_length(self, request: Request, outputs: int, tokens: int) -> bool:
        return outputs >= request.sampling.max_tokens or tokens + request.prefix_len >= self.max_model_len

    def _resolve(self, result: StepResult) -> list[RequestOutput]:
        """Handle a launched step's results; requests finished meanwhile (aborted, or
        stopped by the step before) are skipped."""
        tokens = iter(result.token_ids())
        outputs, pooled = [], []
        for request, hidden in zip(result.requests, result.pooled):
            token = None if request.pooling else next(tokens)
            if request.finished:
                continue
            if request.pooling:
                pooled.append((request, hidden))
            else:
                outputs.append(self._advance(request, token))
        self._pool_results(pooled)
        return outputs

    def _pool_results(self, pooled: list[tuple[Request, torch.Tensor]]) -> None:
        """Finish pooling requests: classify through their slot's head, embed as is."""
        classify = [(r, h) for r, h in pooled if r.task == "classify"]
        if classify:
            slots = [r.slot for r, _ in classify]
            probs = self.head_pool.logits(torch.stack([h for _, h in classify]), slots).softmax(-1)
            for (r, _), p in zip(classify, probs):
                r.result = self._classification(r, p)
        for r, h in pooled:
            if r.task == "embed":
                r.result = EmbedOutput(r.request_id, h.tolist(), r.adapter_id)
            self._finish(r, "stop")

    def _classification(self, request: Request, probs: torch.Tensor) -> ClassifyOutput:
        head = self.head_pool.heads[request.slot]
        labels = [head.id2label[i] for i in range(head.num_labels)]
        n = head.num_labels
        values = probs[:n].tolist()
        best = max(range(n), key=values.__getitem__)
        return ClassifyOutput(request.request_id, labels[best], best, values, labels, request.adapter_id)

    def _advance(self, request: Request, token: int) -> RequestOutput:
        request.pending -= 1
        request.output_ids.append(token)
        stop_token = check_stop_token(request, self.model_config.eos_token_ids)
        stop_string = update_text(request, self.detokenizer, stop_token)
        if stop_token or stop_string:
            self._finish(request, "stop")
        elif self._reaches_length(request, len(request.output_ids), request.num_tokens - request.pending):
            self._finish(request, "length")
        return self._chunk(request)

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        self.requests.pop(request.request_id, None)

    def _chunk(self, request: Request) -> RequestOutput:
        ids, text = stream_delta(request)
        return RequestOutput(request.request_id, ids, text, request.finish_reason, request.adapter_id,
                             request.prompt_ids)

    # synchronous and streaming front ends

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter_ids: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion in shared batches; outputs in prompt order."""
        if isinstance(prompts, str):
            raise RequestError("generate takes a list of prompts; use [prompt] for one")
        n = len(prompts)
        params = _per_prompt(sampling or SamplingParams(), n, "sampling")
        adapters = _per_prompt(adapter_ids, n, "adapter_ids") if adapter_ids is not None else [None] * n
        requests = [self.add_request(p, s, a) for p, s, a in zip(prompts, params, adapters)]
        while any(not r.finished for r in requests):
            self.step()
        return [_final(r) for r in requests]

    def classify(self, texts: Sequence[Prompt], adapter_ids: Sequence[str] | str) -> list[ClassifyOutput]:
        """Label each text with its adapter's classification head, in shared batches."""
        return self._pool(texts, adapter_ids, "classify")

    def embed(self, texts: Sequence[Prompt], adapter_ids: Sequence[str | None] | str | None = None) -> list[EmbedOutput]:
        """Pooled hidden state of each text (last token, after the final norm)."""
        return self._pool(texts, adapter_ids, "embed")

    def _pool(self, texts, adapter_ids, task: str) -> list:
        if isinstance(texts, str):
            raise RequestError(f"{task} takes a list of texts; use [text] for one")
        ids = _per_prompt(adapter_ids, len(texts), "adapter_ids")
        requests = [self.add_request(t, SamplingParams(max_tokens=1), a, task=task) for t, a in zip(texts, ids)]
        while any(not r.finished for r in requests):
            self.step()
        return [r.result for r in requests]

    async def stream(
        self, prompt: Prompt, sampling: SamplingParams | None = None, adapter_id: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield new tokens and text as steps produce them; the last chunk has finish_reason.
        Steps that finished while the consumer was busy arrive merged in one chunk, so a
        slow consumer (a server relaying each chunk) pays per chunk, not per token.
        Closing the iterator early (or cancelling its task) aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        request = self.add_request(prompt, sampling, adapter_id, request_id)
        self._streams[request.request_id] = queue
        self._ensure_loop()
        try:
            while True:
                chunk = _merged([await queue.get()], queue)
                yield chunk
                if chunk.finished:
                    return
        finally:
            self._streams.pop(request.request_id, None)
            if not request.finished:
                self.abort(request.request_id)

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    async def classify_async(self, texts: Sequence[Prompt], adapter_ids: Sequence[str] | str) -> list[ClassifyOutput]:
        """classify, batched by the running step loop with streams and other requests."""
        return await self._pool_async(texts, adapter_ids, "classify")

    async def embed_async(self, texts: Sequence[Prompt],
                          adapter_ids: Sequence[str | None] | str | None = None) -> list[EmbedOutput]:
        return await self._pool_async(texts, adapter_ids, "embed")

    async def _pool_async(self, texts, adapter_ids, task: str) -> list:
        if isinstance(texts, str):
            raise RequestError(f"{task} takes a list of texts; use [text] for one")
        ids = _per_prompt(adapter_ids, len(texts), "adapter_ids")
        loop = asyncio.get_running_loop()
        requests = [self.add_request(t, SamplingParams(max_tokens=1), a, task=task) for t, a in zip(texts, ids)]
        futures = [loop.create_future() for _ in requests]
        self._pooling.update({r.request_id: (r, f) for r, f in zip(requests, futures)})
        self._ensure_loop()
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for r in requests:
                self._pooling.pop(r.request_id, None)
                if not r.finished:
                    self.abort(r.request_id)

    async def _run_loop(self) -> None:
        while self.has_unfinished():
            try:
                outputs = await asyncio.to_thread(self.step)
            except Exception as exc:  # deliver to every waiter, then stop
                for queue in self._streams.values():
                    queue.put_nowait(exc)
                for _, future in self._pooling.values():
                    if not future.done():
                        future.set_exception(exc)
                raise
            for out in outputs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for request, future in list(self._pooling.values()):
                if request.finished and not future.done():
                    future.set_result(request.result)
            await asyncio.sleep(0)


def _merged(chunks: list, queue: asyncio.Queue) -> RequestOutput:
    """One chunk from the first and every chunk already waiting (errors raise)."""
    while not queue.empty() and not getattr(chunks[-1], "finished", False):
        chunks.append(queue.get_nowait())
    errors = [c for c in chunks if isinstance(c, BaseException)]
    if errors:
        raise errors[0]
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return RequestOutput(last.request_id, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                         last.finish_reason, last.adapter_id, last.prompt_token_ids)


def _per_prompt(value, n: int, name: str) -> list:
    if value is None or isinstance(value, (SamplingParams, str)):
        return [value] * n
    value = list(value)
    if len(value) != n:
        raise RequestError(f"{name} has {len(value)} entries for {n} prompts")
    return value


def _final(request: Request) -> RequestOutput:
    return RequestOutput(request.request_id, list(request.output_ids), request.text, request.finish_reason,
                         request.adapter_id, request.prompt_ids)


def _model_type(model_dir: str | Path) -> str | None:
    import json

    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def _load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError):
        return None
