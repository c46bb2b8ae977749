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

import time
from functools import partial
from pathlib import Path

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.adapters_store.formats.types import BackboneSpec, LoraAdapter
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_host import AdapterHost
from adapterserve.engine.adapter_shard import AdapterCutter
from adapterserve.engine.async_front import AsyncFront, Prompt
from adapterserve.engine.detokenizer import Detokenizer
from adapterserve.engine.graphs import graph_limits
from adapterserve.engine.host_threads import apply_host_threads
from adapterserve.engine.kv_cache import BlockManager
from adapterserve.engine.pool_set import build_pools
from adapterserve.engine.prefix_cache import BASE, KvIdentities, PrefixCache, chain_root
from adapterserve.engine.request import ClassifyOutput, EmbedOutput, Request, RequestOutput, RequestTimes
from adapterserve.engine.runner import ModelRunner, StepResult
from adapterserve.engine.sampling_params import SamplingParams
from adapterserve.engine.scheduler import Scheduler
from adapterserve.engine.slots import AdapterSlots
from adapterserve.engine.stats import EngineStats
from adapterserve.engine.step_device import attach_lora_side_stream, use_kernel_options
from adapterserve.engine.stopping import check_stop_token, stream_delta, update_text
from adapterserve.engine.sync_front import SyncFront, final_output
from adapterserve.engine.tp.launch import RayPlacement, start_group
from adapterserve.engine.tp.lockstep import Lockstep
from adapterserve.engine.tp.worker import ModelBuilder, checkpoint_shard
from adapterserve.engine.warmup import WarmupReport, should_warm_up, warm_up
from adapterserve.errors import AdapterNotFound, EngineBroken, Overloaded, RequestError
from adapterserve.layers.parallel import SINGLE
from adapterserve.models.decoder import DecoderModel, check_shardable
from adapterserve.models.decoder_config import DecoderConfig, read_decoder_config
from adapterserve.models.encoder_config import SUPPORTED_MODEL_TYPES as ENCODER_TYPES
from adapterserve.request_fields import plain_ids


class Engine(AdapterHost, AsyncFront, SyncFront):
    def __init__(self, model: DecoderModel, tokenizer, config: EngineConfig, lockstep: Lockstep | None = None) -> None:
        """``lockstep``: the other ranks of a tensor-parallel group (model is rank 0's shard);
        None for one device."""
        super().__init__()
        self._init_async_front()
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
        self.lockstep = lockstep
        self.runner = ModelRunner(
            model, self.blocks, config.max_loras, config.max_lora_rank, config.max_num_batched_tokens, config.seed,
            lockstep, config.kv_fp8,
        )
        on_gpu = torch.device(config.device).type == "cuda"
        copy_stream = torch.cuda.Stream(device=config.device) if on_gpu else None
        pools = build_pools(config, model, self.blocks)
        self.lora_pool, self.bottleneck_pools, self.head_pool = pools.lora, pools.bottleneck, pools.head
        self.prefix_pool, self.pools = pools.prefix, pools
        self.slots = AdapterSlots(config.max_loras, pools.all(), copy_stream=copy_stream, mirror=lockstep)
        if lockstep is not None:
            lockstep.prefix_pages = lambda slot: self.prefix_pool.pages.get(slot, [])
            lockstep.cut = AdapterCutter(model.adapter_linears(), model.cfg.num_kv_heads, config.torch_dtype,
                                         lockstep.tp.world_size)
        self.runner.families_of = self._families_of
        self.runner.prefix_pages = self.prefix_pool.pages.__getitem__
        if config.lora_side_stream and on_gpu:
            attach_lora_side_stream(model, config.device)
        use_kernel_options(model, config)
        if config.cuda_graphs and on_gpu:
            self.runner.enable_cuda_graphs(*graph_limits(config, self.max_model_len))
        self.runner.graph_signature = pools.graph_signature
        self.runner.step_scope = pools.for_step  # a step's LoRA rows and (IA)^3 scales: its own adapters'
        self.prefix_cache = PrefixCache(self.blocks, config.enable_prefix_caching)
        self.kv_identities = KvIdentities(self.model_config.num_layers)
        self.scheduler = Scheduler(config, self.blocks, self._acquire_slot, self.slots.release, self.prefix_cache)
        self.requests: dict[str, Request] = {}
        self._in_flight: StepResult | None = None  # launched, results not yet handled
        self._broken: str | None = None  # why a failed step broke the engine; None while it serves
        self._last_progress = time.monotonic()  # when the step loop last moved a request
        self.stats = EngineStats()  # steps, batch sizes, queue times (metrics)
        # every kernel variant and decode graph compiled now, before anyone sends a request
        self.warmup: WarmupReport | None = warm_up(self) if should_warm_up(config) else None

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_lora_rank: int = 64,
        placement: RayPlacement | None = None,
        **overrides,
    ) -> "Engine":
        """Load a Hugging Face checkpoint directory (safetensors) and its tokenizer.
        A BERT-family checkpoint gives an EncoderEngine (classify and embed).
        ``placement``: with tensor_parallel_size > 1, the Ray placement group whose bundles
        1..N-1 take the workers, when this process is not the Ray actor holding it."""
        if _model_type(model_dir) in ENCODER_TYPES:
            if overrides.get("tensor_parallel_size", 1) != 1:
                raise ValueError("tensor_parallel_size > 1 splits decoders (Llama family); a BERT-family encoder "
                                 "runs on one device: use tensor_parallel_size 1 (and replicas to scale out)")
            from adapterserve.engine.encoder_engine import EncoderEngine

            return EncoderEngine.from_pretrained(model_dir, device, dtype, max_lora_rank, **overrides)
        config = EngineConfig(device=device, dtype=dtype, max_lora_rank=max_lora_rank, **overrides)
        build = partial(checkpoint_shard, str(model_dir), config.torch_dtype, config.fp8_gemm if config.fp8 else None)
        return cls.from_model(build, read_decoder_config(Path(model_dir)), _load_tokenizer(model_dir), config,
                              placement)

    @classmethod
    def from_model(cls, build_model: ModelBuilder, model_config: DecoderConfig, tokenizer, config: EngineConfig,
                   placement: RayPlacement | None = None) -> "Engine":
        """An engine whose backbone ``build_model(tp, device)`` makes (a picklable callable: with
        tensor_parallel_size N > 1 every rank calls it for its shard, rank 0 here, ranks 1..N-1
        in their workers, engine/tp/launch.py)."""
        apply_host_threads(config, config.tensor_parallel_size)
        if config.tensor_parallel_size == 1:
            return cls(build_model(SINGLE, config.device), tokenizer, config)
        check_shardable(model_config, config.tensor_parallel_size)
        lockstep = start_group(build_model, config, placement, model_config.hidden_size)
        try:
            model = build_model(lockstep.tp, config.device)
            lockstep.wait_ready()
            return cls(model, tokenizer, config, lockstep)
        except BaseException:
            lockstep.close()
            raise

    @property
    def broken(self) -> str | None:
        """Why the engine serves no more requests (a failed step, a tensor-parallel worker gone,
        even while idle: health reads this); None while it serves."""
        if self._broken is None and self.lockstep is not None:
            try:
                self.lockstep.check()
            except EngineBroken as exc:
                self._broken = str(exc)
        return self._broken

    @broken.setter
    def broken(self, reason: str | None) -> None:
        self._broken = reason

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one device); the engine serves no more."""
        if self.lockstep is not None:
            with self._lock:
                healthy = self.broken is None and self.lockstep.broken is None
                self.runner.device_part.release_graphs(wait=healthy)  # NCCL leaves no group whose graphs live
                self.lockstep.close()
                self.broken = self.broken or "closed"

    # adapters

    def add_adapter(self, adapter_id: str, adapter, pinned: bool = False) -> None:
        """AdapterHost.add_adapter, and the adapter's KV identity (prefix cache) computed now,
        not on its first request. With tensor-parallel workers, its tensors go to them now."""
        if isinstance(adapter, LoraAdapter):
            adapter = Adapter("lora", lora=adapter, config=adapter.config)
        if self.lockstep is not None:
            self.check_servable(adapter, adapter_id)  # nothing refused is sent
            self.lockstep.share(adapter)
        try:
            super().add_adapter(adapter_id, adapter, pinned)
        except BaseException:
            if self.lockstep is not None:
                self.lockstep.forget(adapter)
            raise
        registered = self.adapters.get(adapter_id)
        if registered is not None:
            self.kv_identities.of(adapter_id, registered, self.adapters)

    def _unstage(self, adapter_id: str, adapter: Adapter) -> None:
        super()._unstage(adapter_id, adapter)
        if self.lockstep is not None:
            self.lockstep.forget(adapter)

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
        times: RequestTimes | None = None,
        cache_salt: str = "",
    ) -> Request:
        """Queue a request (RequestError if it is invalid, Overloaded if the queue is full);
        `times`, if given, gets the time it is first scheduled. `cache_salt`: requests share
        prefix-cache blocks only with requests of the same salt (e.g. a tenant)."""
        sampling = sampling or SamplingParams()
        self._check_serving()
        request = Request(prompt_ids=self._prompt_ids(prompt), sampling=sampling, adapter_id=adapter_id, task=task,
                          times=times)
        if request_id is not None:
            request.request_id = request_id
        self._check_token_ids(sampling)
        if sampling.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(sampling.seed)
        with self._lock:
            self._check_serving()
            identity = BASE
            if adapter_id is not None:
                identity = self._bind_adapter(request, adapter_id)
            elif task == "classify":
                raise RequestError("classify needs an adapter with a classification head")
            request.cache_root = chain_root(identity, cache_salt)
            self._check_length(request)
            if request.request_id in self.requests:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self._check_queue()
            if not self.has_unfinished():
                self._last_progress = time.monotonic()  # an idle engine's stall clock starts now
            self.scheduler.add(request)  # first: it refuses an n it cannot run (n > 1: the choices' hook)
            self.requests[request.request_id] = request
        return request

    def _check_serving(self) -> None:
        if self.broken is not None:
            raise EngineBroken(f"the engine is broken ({self.broken}) and serves no more requests")

    def _check_queue(self) -> None:
        waiting, limit = len(self.scheduler.waiting), self.config.max_queued_requests
        if waiting >= limit:
            raise Overloaded(f"the engine has {waiting} requests waiting (max_queued_requests {limit}); "
                             "retry in a moment")

    def _queued_for(self, adapter_id: str) -> int:
        return sum(1 for r in list(self.requests.values())
                   if r.adapter_id == adapter_id and r.slot < 0 and not r.finished)

    def _bind_adapter(self, request: Request, adapter_id: str) -> bytes:
        """Bind a request to its adapter; the adapter's KV identity (prefix cache)."""
        adapter = self.adapters.get(adapter_id)
        if adapter is None:
            raise AdapterNotFound(f"no adapter {adapter_id!r} is loaded; loaded: {self.list_adapters()}")
        if request.task == "classify" and adapter.head is None:
            raise RequestError(f"adapter {adapter_id!r} has no classification head; classify needs one")
        request.num_virtual, request.prefix_len = adapter.num_virtual, adapter.prefix_len
        return self.kv_identities.of(adapter_id, adapter, self.adapters)

    def _check_length(self, request: Request) -> None:
        """prompt (+ an adapter's virtual tokens) + max_tokens must fit max_model_len."""
        prompt, extra = len(request.prompt_ids), request.num_virtual + request.prefix_len
        wanted = 0 if request.pooling else request.sampling.max_tokens
        if prompt + extra + wanted <= self.max_model_len:
            return
        virtual = f" + {extra} virtual tokens of adapter {request.adapter_id!r}" if extra else ""
        if request.pooling:
            raise RequestError(f"prompt has {prompt} tokens{virtual}; this engine's max_model_len is "
                               f"{self.max_model_len}")
        raise RequestError(f"prompt has {prompt} tokens{virtual} and max_tokens is {wanted}: "
                           f"{prompt + extra + wanted} is over this engine's max_model_len of {self.max_model_len}")

    def _check_token_ids(self, sampling: SamplingParams) -> None:
        vocab = self.model_config.vocab_size
        for name, ids in (("stop_token_ids", sampling.stop_token_ids),
                          ("logit_bias token ids", [t for t, _ in sampling.logit_bias])):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name} must be in [0, {vocab}), got {bad[:4]}")

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this backbone has no tokenizer: send prompt token ids")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = list(prompt)
        if not ids:
            raise RequestError("prompt is empty")
        vocab = self.model_config.vocab_size
        if plain_ids(ids, vocab):  # checked in C: a long prompt is not looped over in Python
            return ids
        ids = _token_ids(ids)
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or done."""
        with self._lock:
            request = self.requests.get(request_id)
            if request is None or request.done:  # done: every choice of it (n > 1: the choices' hook)
                return False
            self._finish(request, "abort")
            return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def seconds_without_progress(self) -> float:
        """0.0 while the engine has no work; else seconds since its step loop last moved a
        request (health: a loop that stops moving with work queued is stalled)."""
        if not self.has_unfinished():
            return 0.0
        return time.monotonic() - self._last_progress

    # the loop

    def step(self) -> list[RequestOutput]:
        """Launch the next batch, then return the new tokens and text of every request
        the previously launched batch moved (waiting for the GPU to finish it), and the
        final output of every request that failed alone. A step that fails as a whole
        breaks the engine: EngineBroken."""
        with self._lock:
            self._check_serving()
            started = time.perf_counter()
            try:
                batch = self.scheduler.schedule()
                failed = [self._fail(r, exc) for r, exc in self.scheduler.take_failed()]
                launched = self._launch(batch) if batch.requests else None
                done, self._in_flight = self._in_flight, launched
                outputs = self._resolve(done) if done is not None else []
            except Exception as exc:
                raise self._break(exc) from exc
            if launched is not None:
                self.stats.step(batch.requests, batch.num_tokens, time.perf_counter() - started)
            if launched is not None or done is not None or failed:
                self._last_progress = time.monotonic()
            return failed + outputs

    def _launch(self, batch) -> StepResult:
        result = self.runner.run(batch, [r.generator for r in batch.requests])
        completing = {id(r) for r in result.requests}  # those whose tokens the step completes
        for request, n in zip(batch.requests, batch.num_new_tokens):
            request.num_computed += n
            if id(request) in completing:  # else a prompt chunk short of the end: no result yet
                self._launched_last(request)
            self.prefix_cache.remember(request)
        sources, copies = self.scheduler.fork(batch.requests)  # n > 1: the choices' hook
        if copies:
            self.runner.copy_blocks(sources, copies)
        return result

    def _launched_last(self, request: Request) -> None:
        """A launched step computes the request's last known token: its result is coming."""
        if request.pooling:
            request.final_launched = True
            return
        request.pending += 1
        request.final_launched = self._reaches_length(request, request.num_outputs, request.num_tokens)

    def _reaches_length(self, request: Request, outputs: int, tokens: int) -> bool:
        return outputs >= request.sampling.max_tokens or tokens + request.prefix_len >= self.max_model_len

    def _resolve(self, result: StepResult) -> list[RequestOutput]:
        """Handle a launched step's results; requests finished meanwhile (aborted, or
        stopped by the step before) are skipped. A request whose handling fails ends alone."""
        tokens = iter(result.token_ids())
        outputs, pooled = [], []
        for request, hidden in zip(result.requests, result.pooled):
            pooling = request.pooling
            token = None if pooling else next(tokens)
            if request.finished:
                continue
            if pooling:
                pooled.append((request, hidden))
                continue
            try:
                outputs.append(self._advance(request, token))
            except Exception as exc:  # this request's text or stop handling: it alone fails
                outputs.append(self._fail(request, exc))
        self._pool_results(pooled)
        return outputs

    def _pool_results(self, pooled: list[tuple[Request, torch.Tensor]]) -> None:
        """Finish pooling requests: classify through their slot's head, embed as is."""
        classify = [(r, h) for r, h in pooled if r.task == "classify"]
        if classify:
            slots = [r.slot for r, _ in classify]
            probs = self.head_pool.logits(torch.stack([h for _, h in classify]), slots).softmax(-1)
            for (r, _), p in zip(classify, probs):
                try:
                    r.result = self._classification(r, p)
                except Exception as exc:  # its head's labels: it alone fails
                    self._fail(r, exc)
        for r, h in pooled:
            if r.task == "embed":
                r.result = EmbedOutput(r.request_id, h.tolist(), r.adapter_id)
            if not r.finished:
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
        if request.done:  # its last choice (n > 1: the choices' hook)
            self.requests.pop(request.request_id, None)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """End one request with `error` (its KV blocks and slot freed); its final output."""
        request.error = error
        self._finish(request, "error")
        return final_output(request)

    def _break(self, cause: Exception) -> EngineBroken:
        """A step failed as a whole: fail every request and refuse all later calls."""
        self.broken = f"{type(cause).__name__}: {cause}"
        if self.lockstep is not None and not isinstance(cause, EngineBroken):
            worker = self.lockstep.failed_worker()  # a dead rank shows as its peers' failed collective
            self.broken = f"{worker}; {self.broken}" if worker else self.broken
        if self.lockstep is not None:
            self.runner.device_part.release_graphs(wait=False)
            self.lockstep.close(wait_s=0.0, abort=True)  # no rank may wait in a collective for ever
        error = EngineBroken(f"the engine failed a step and serves no more requests ({self.broken}); "
                             "retry: its replica is being replaced")
        self._in_flight = None
        for request in list(self.requests.values()):
            self._fail(request, error)
        return error

    def _chunk(self, request: Request) -> RequestOutput:
        ids, text = stream_delta(request)
        return RequestOutput(request.request_id, ids, text, request.finish_reason, request.adapter_id,
                             request.prompt_ids, cached_tokens=request.cached_tokens or 0, index=request.index)


def _token_ids(ids: list) -> list[int]:
    """Ids of any integer type as ints (RequestError for anything else)."""
    if any(isinstance(t, bool) or not hasattr(t, "__index__") for t in ids):
        raise RequestError("prompt token ids must be integers")
    return [t.__index__() for t in ids]


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
