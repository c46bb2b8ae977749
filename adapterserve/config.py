"""Engine configuration: one frozen dataclass, checked on construction (torch is imported only
where a value needs it: the server's processes check their settings without it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "float16", "bfloat16")  # torch's names of the activations' dtypes
FP8 = "fp8"  # float8_e4m3fn linear weights (Llama-family decoders); see EngineConfig.dtype
FP8_GEMMS = ("auto", "scaled_mm", "w8a8_triton", "weight_only", "decode_w8a8", "decode_weight_only",
             "reference")  # layers.base_gemm's kernels
LORA_DECODES = ("auto", "kernels", "stacked", "fused")  # EngineConfig.lora_decode
FUSED_MIN_CAPABILITY = 9  # lora_decode="auto" takes "fused" on CUDA devices of this major capability on
# the fused linear's kernel is compiled for pool-row counts divisible by this (Triton specialises
# an integer argument on it; kernels/stacked_fused.py), so "fused" pools round their rows up to it
FUSED_ROW_ALIGN = 16
STACKED_DECODES = ("stacked", "fused")  # the lora_decode values that keep A rows per linear (kernels/stacked.py)
DECODE_GEMMS = ("cublas", "triton", "auto")  # EngineConfig.decode_gemm (layers.base_gemm)
PDL_MODES = ("auto", "off", "early", "exit")  # EngineConfig.pdl (kernels/pdl.py)
KV_CACHE_DTYPES = ("auto", "fp8")  # EngineConfig.kv_cache_dtype (kernels/kv_fp8.py)
ATTENTION_DOTS = ("auto", "float32", "input")  # EngineConfig.decode_attention_dots (kernels/attention.py)
MAX_WEIGHT_PREFETCH = 16  # EngineConfig.weight_prefetch's largest (kernels/pdl.py)
TP_LAUNCHES = ("auto", "ray", "local")  # EngineConfig.tensor_parallel_launch
TP_ALL_REDUCES = ("auto", "nccl")  # EngineConfig.tensor_parallel_all_reduce


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and placement of one engine (one backbone on one device).

    max_loras:        adapter slots on the device (adapters resident at once)
    max_lora_rank:    largest LoRA rank accepted
    lora_pool_rows:   rank rows per projection pool; default max_loras * max_lora_rank
                      (when decode steps run the fused linear, rounded up to a multiple of 16).
                      An adapter of rank r takes r rows, so smaller ranks leave room
                      for more adapters when slots outnumber what rows allow.
    block_size:       tokens per KV-cache block
    num_kv_blocks:    KV-cache blocks (shared by all layers' caches)
    max_num_seqs:     requests running at once
    max_num_batched_tokens: tokens in one step (decodes plus prefill chunks; a longer prompt
                      runs in chunks over several steps)
    max_queued_requests: requests waiting to start; beyond it add_request sheds (Overloaded)
    max_model_len:    prompt plus generated tokens per request; default the backbone's
    max_virtual_tokens: longest prompt-tuning / prefix-tuning adapter accepted
    max_labels:       most labels a classification head may have
    max_head_layers:  1, or 2 for heads with a hidden layer (costs [slots, D, D] of memory)
    max_bottleneck_rank: widest bottleneck adapter accepted (hidden / reduction_factor)
    cuda_graphs:      replay decode steps as CUDA graphs (on CUDA devices)
    mixed_graph_tokens: with cuda_graphs, also replay steps with prefill tokens (prompts, chunks,
                      decodes beside them) as CUDA graphs, in token buckets up to this many tokens
                      (capped at max_num_batched_tokens; larger steps run eagerly); 0 = off. The
                      largest bucket's activations set the graphs' memory pool
    max_staged_adapters: adapters kept with ready-to-copy (pinned) host copies for fast loads
    max_staged_bytes: ... and at most this many bytes of such copies (the most recently added kept)
    lora_side_stream: run each LoRA shrink of a decode step on a second CUDA stream, beside the
                      base GEMM (CUDA only; measured in BENCHMARKS.md)
    warmup:           compile every kernel variant and capture every decode graph the
                      configuration can reach before the engine is built (CUDA only; False for
                      development, "force" runs it on any device: tests)
    lora_decode:      how batches of at most 256 tokens (decode) apply LoRA: "kernels" (base GEMM,
                      then the segmented shrink and expand), "stacked" (A rows stored under
                      the base weight: one GEMM yields base output and shrink, one launch the
                      expand; not with fp8 weights), "fused" (A rows kept apart from the
                      weight: a step of at most 64 tokens over at most 2 adapters whose rows span
                      at most stacked.FUSED_MAX_ROWS pool rows runs each linear's base product, shrink
                      and expand in one launch, kernels/stacked_fused.py; other steps run the
                      "kernels" path) or "auto"
                      ("fused" on CUDA devices of sm_90 on, where it measured faster in both
                      dtypes; "kernels" elsewhere: ``lora_decode_used``)
    decode_gemm:      the base product of decode batches (at most 64 tokens, bf16/fp16/fp32
                      weights, CUDA): "cublas" (torch's F.linear), "triton" (our split-K
                      decode GEMM, kernels/decode_gemm.py, which launches with PDL when that
                      is on) or "auto" (ours for wide outputs or deep inputs on sm_90+, where
                      it measured faster; cuBLAS for the rest)
    kv_cache_dtype:   "auto" (the activations' dtype) or "fp8": keys and values in float8 e4m3
                      with one float32 scale per token and KV head (kernels/kv_fp8.py); about
                      half the cache's bytes, so twice the tokens per block budget
    decode_attention_dots: the decode attention kernel's products (CUDA): "input" (bf16/fp16
                      tensor-core products, the softmax weights rounded to the queries' dtype, as
                      flash attention does), "float32" (keys, values and weights widened first), or
                      "auto" (the default): "input" for whole and split contexts alike, so a graph
                      step and the same eager step (which split differently) agree; float32 sums
    pdl:              programmatic dependent launch of the decode step's Triton kernels (sm_90+,
                      process-wide: the engine built last sets it; kernels/pdl.py): "off",
                      "early", "exit", or "auto": ADAPTERSERVE_PDL when that is set, else "early"
                      on CUDA where decode products run our Triton kernels: an FP8 backbone on our
                      decode GEMM (fp8_gemm auto, decode_w8a8, decode_weight_only), or decode LoRA
                      on the fused linear (lora_decode "fused", "auto" on Hopper), else "off"
    weight_prefetch:  K chunks of its weight rows each program of our decode GEMM and fused LoRA
                      linear asks L2 for before its PDL wait, so they stream while the kernel
                      before finishes (0 to 16; nothing where PDL is off), or None (the default):
                      ADAPTERSERVE_PREFETCH, else 0. Process-wide, as pdl
    enable_prefix_caching: reuse the KV blocks of a prompt's prefix computed before under the
                      same KV identity (docs/prefix_caching.md)
    tensor_parallel_size: ranks the backbone is split over, one device each (docs/tensor_parallel.md):
                      rank 0 is this engine on `device`, the others workers started by
                      tensor_parallel_launch
    tensor_parallel_launch: "ray" (actors in a placement group; Ray must be initialized), "local"
                      (spawned processes on cuda:index+1, ...), "auto": Ray when it is initialized
    tensor_parallel_all_reduce: "nccl" (the process group's own all-reduce for every sum) or
                      "auto" (opt-in: small sums over peer-to-peer symmetric memory on GPUs that
                      reach each other's memory, NCCL for the rest; docs/tensor_parallel.md)
    host_threads:     torch's CPU threads in each process of the engine (process-wide); None: on a
                      GPU, the process's share of the host's cores, at most 8, unless
                      OMP_NUM_THREADS is set; on CPU, torch's own (engine/host_threads.py)
    """

    device: str = "cpu"
    dtype: str = "float32"
    fp8_gemm: str = "auto"
    max_loras: int = 8
    max_lora_rank: int = 64
    lora_pool_rows: int | None = None
    block_size: int = 16
    num_kv_blocks: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_queued_requests: int = 1024
    max_model_len: int | None = None
    max_virtual_tokens: int = 64
    max_labels: int = 32
    max_head_layers: int = 1
    max_bottleneck_rank: int = 64
    cuda_graphs: bool = True
    mixed_graph_tokens: int = 2048
    max_staged_adapters: int = 32
    max_staged_bytes: int = 4 << 30
    lora_side_stream: bool = True
    warmup: bool | str = True
    lora_decode: str = "auto"
    decode_gemm: str = "cublas"
    pdl: str = "auto"
    weight_prefetch: int | None = None
    kv_cache_dtype: str = "auto"
    decode_attention_dots: str = "auto"
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_launch: str = "auto"
    tensor_parallel_all_reduce: str = "nccl"
    host_threads: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES and self.dtype != FP8:
            raise ValueError(f"dtype must be one of {sorted(DTYPES) + [FP8]}, got {self.dtype!r}")
        if self.fp8_gemm not in FP8_GEMMS:
            raise ValueError(f"fp8_gemm must be one of {list(FP8_GEMMS)}, got {self.fp8_gemm!r}")
        if self.lora_decode not in LORA_DECODES:
            raise ValueError(f"lora_decode must be one of {list(LORA_DECODES)}, got {self.lora_decode!r}")
        if self.lora_decode == "stacked" and self.dtype == FP8:
            raise ValueError('lora_decode="stacked" stores LoRA A rows in the base weight, so it needs '
                             'bf16/fp16/fp32 weights; with dtype="fp8" use "kernels" or "fused" (A rows kept '
                             'apart, a decode step with few adapters in one launch per linear)')
        if self.decode_gemm not in DECODE_GEMMS:
            raise ValueError(f"decode_gemm must be one of {list(DECODE_GEMMS)}, got {self.decode_gemm!r}")
        if self.pdl not in PDL_MODES:
            raise ValueError(f"pdl must be one of {list(PDL_MODES)}, got {self.pdl!r}")
        chunks = self.weight_prefetch
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or not 0 <= chunks <= MAX_WEIGHT_PREFETCH):
            raise ValueError(f"weight_prefetch must be an integer from 0 to {MAX_WEIGHT_PREFETCH}, or null "
                             f"(ADAPTERSERVE_PREFETCH), got {chunks!r}")
        if self.decode_attention_dots not in ATTENTION_DOTS:
            raise ValueError(f"decode_attention_dots must be one of {list(ATTENTION_DOTS)}, "
                             f"got {self.decode_attention_dots!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for name in ("max_loras", "max_lora_rank", "block_size", "num_kv_blocks", "max_num_seqs",
                     "max_num_batched_tokens", "max_queued_requests", "max_staged_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        tokens = self.mixed_graph_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"mixed_graph_tokens must be an integer of at least 0 (0: steps with prefills run "
                             f"eagerly), got {tokens!r}")
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer of at least 1 (ranks, one device each), "
                             f"got {size!r}")
        if self.tensor_parallel_launch not in TP_LAUNCHES:
            raise ValueError(f"tensor_parallel_launch must be one of {list(TP_LAUNCHES)}, "
                             f"got {self.tensor_parallel_launch!r}")
        if self.tensor_parallel_all_reduce not in TP_ALL_REDUCES:
            raise ValueError(f"tensor_parallel_all_reduce must be one of {list(TP_ALL_REDUCES)}, "
                             f"got {self.tensor_parallel_all_reduce!r}")
        threads = self.host_threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"host_threads must be an integer of at least 1, or null (automatic), got {threads!r}")
        if self.warmup not in (True, False, "force"):
            raise ValueError(f"warmup must be true, false or 'force', got {self.warmup!r}")
        if self.lora_pool_rows is not None and self.lora_pool_rows < self.max_lora_rank:
            raise ValueError(
                f"lora_pool_rows ({self.lora_pool_rows}) must hold at least one adapter of "
                f"max_lora_rank ({self.max_lora_rank})"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The activations' dtype (and that of everything but FP8 weights)."""
        import torch

        if self.dtype == FP8:
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV cache is in e4m3 (kv_cache_dtype="fp8")."""
        return self.kv_cache_dtype == FP8

    @property
    def lora_decode_used(self) -> str:
        """lora_decode with "auto" resolved for this config's device."""
        if self.lora_decode != "auto":
            return self.lora_decode
        import torch

        device = torch.device(self.device)
        if device.type == "cuda" and torch.cuda.is_available() and \
                torch.cuda.get_device_capability(device)[0] >= FUSED_MIN_CAPABILITY:
            return "fused"
        return "kernels"

    @property
    def pool_rows(self) -> int:
        """Rank rows per projection pool; where decode steps run the fused linear a multiple of
        FUSED_ROW_ALIGN (rounded up), so every row bucket it is launched with is one."""
        rows = self.lora_pool_rows or self.max_loras * self.max_lora_rank
        if self.lora_decode_used == "fused":
            return -(-rows // FUSED_ROW_ALIGN) * FUSED_ROW_ALIGN
        return rows
