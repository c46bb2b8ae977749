"""The kernel variants and decode graphs an engine's configuration can reach.

A variant is what makes Triton compile (constexpr block shapes, launch kinds, the
integer specialisation of a block table's row stride) or a CUDA graph capture. Every
variant is named by the same choosers the kernels call at run time, from host ints
only, so warm-up (engine/warmup.py) and the real path cannot disagree:

    ("segment", family, "gemv" | "dot16" | "dot32")      LoRA / bottleneck shrink+expand
    ("stacked", "tiled" | "grouped" | "fused", tiles)    the stacked layout's expands (lora_decode="stacked"),
                                                         the fused linear (lora_decode="fused")
    ("ia3",)                                             the (IA)^3 scale
    ("decode_attention", splits, block_n, width)         paged decode (split-KV choice)
    ("prefill_attention", "single" | "multi", width)     paged prefill, its two launches
    ("graph", bucket, families, rows, expand, tier)      a captured decode step (rows: the stacked
                                                         GEMM's row bucket, 0 unless stacked LoRA or
                                                         the fused linear's steps; expand: its
                                                         stacked expand, else None; tier: the (IA)^3
                                                         scales it launches, layers/ia3_places.py,
                                                         None without (IA)^3 rows)
    ("penalties", (repetition, frequency, presence))     the sampler's penalty pass

``width`` is the class Triton specialises a block table's row stride on ("1", "16k":
a multiple of 16, "n": any other). Variants fixed by the model's shapes (norms, RoPE,
the projections' own sizes) are reached by any step and are not listed apart.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations, product

from adapterserve.kernels.attention import decode_blocks
from adapterserve.kernels.decode_gemm import row_tile
from adapterserve.kernels.metadata import default_block_m
from adapterserve.kernels.segment_ops import use_gemv
from adapterserve.kernels.stacked import (
    EXPANDS,
    STACKED_MAX_TOKENS,
    expand_tiles,
    grouped_tiles,
    reachable_expands,
    reads_row_bucket,
)
from adapterserve.layers.context import BatchContext

Variant = tuple
SEGMENT_FAMILIES = ("lora", "bottleneck")  # families whose update runs the segment kernels
PENALTY_USES = tuple(u for u in product((False, True), repeat=3) if any(u))


@dataclass(frozen=True)
class EngineShape:
    """What of an engine's configuration decides its variants (host ints only)."""

    kv_heads: int
    page: int
    max_num_seqs: int
    max_tokens: int  # max_num_batched_tokens
    max_pages: int  # widest block table a request can have (prefix pages included)
    lora_rank: int
    bottleneck_rank: int
    families: tuple[str, ...]  # token families the engine has pools for: lora, ia3, bottleneck
    buckets: tuple[int, ...] | None  # decode graph buckets; None: decode steps run eagerly
    graph_pages: int = 0  # the decode graphs' block-table width
    row_buckets: tuple[int, ...] = ()  # stacked LoRA: the GEMM row buckets adapters can make
    stacked_widths: tuple[int, ...] = ()  # stacked LoRA: output widths of the stacked linears
    lora_slots: int = 0  # adapter slots (max_loras): a step's distinct adapters are at most these
    fused_rows: int = 0  # lora_decode="fused": A rows kept apart; steps with few adapters in a row bucket of
    # at most this many rows run the fused linear, the others the segment kernels (0: no fused linear)
    ia3_tiers: tuple[str, ...] = ()  # the (IA)^3 tiers a step can take (a decode graph each)

    @classmethod
    def of(cls, engine) -> "EngineShape":
        cfg, graphs = engine.config, engine.runner.graphs
        page = cfg.block_size
        max_pages = -(-engine.max_model_len // page) + -(-cfg.max_virtual_tokens // page)
        families = tuple(f for f in ("lora", "ia3", "bottleneck") if any(p.family == f for p in engine.slots.pools))
        widths = sorted({linear.stacked.n_out for _, linear in engine.model.adapter_linears()
                         if linear.stacked is not None})
        return cls(engine.model_config.num_kv_heads, page, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_pages,
                   cfg.max_lora_rank, cfg.max_bottleneck_rank, families,
                   tuple(graphs.buckets) if graphs is not None else None,
                   graphs.max_pages if graphs is not None else 0,
                   tuple(engine.lora_pool.row_buckets()), tuple(widths), cfg.max_loras,
                   engine.lora_pool.fused_rows, engine.pools.ia3.tiers() if "ia3" in families else ())

    def rank(self, family: str) -> int:
        return self.lora_rank if family == "lora" else self.bottleneck_rank

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def graph_rows(self, families: frozenset[str]) -> tuple[int, ...]:
        """The stacked row buckets a decode graph of these families can be replayed with."""
        return self.row_buckets if "lora" in families and self.row_buckets else (0,)

    def graph_tiers(self, families: frozenset[str]) -> tuple[str | None, ...]:
        """The (IA)^3 tiers a decode graph of these families can be replayed with (None: no such rows)."""
        return self.ia3_tiers if "ia3" in families and self.ia3_tiers else (None,)

    def expands(self, num_tokens: int, rows: int | None = None) -> tuple[str, ...]:
        """The stacked expands a step of num_tokens rows can choose (its distinct adapters:
        at most one per request, so at most max_num_seqs) in row bucket ``rows`` (None: in any)."""
        chosen = {e for r in ((self.row_buckets or (0,)) if rows is None else (rows,))
                  for e in reachable_expands(num_tokens, self.lora_slots, self.fused_rows, self.max_num_seqs, r)}
        return tuple(e for e in EXPANDS if e in chosen)


def width_class(width: int) -> str:
    """How Triton specialises an integer argument (here a block table's row stride)."""
    return "1" if width == 1 else "16k" if width % 16 == 0 else "n"


def segment_class(num_tokens: int, max_rank: int) -> str:
    """Which segment kernels and tile height a step of num_tokens runs (segment_ops' choice)."""
    return "gemv" if use_gemv(num_tokens, max_rank) else f"dot{default_block_m(num_tokens)}"


def runs_stacked(shape: EngineShape, num_tokens: int) -> bool:
    """Whether a step of num_tokens runs LoRA's stacked layout (else the segment kernels)."""
    return bool(shape.stacked_widths) and num_tokens <= STACKED_MAX_TOKENS


def stacked_class(shape: EngineShape, num_tokens: int, expand: str) -> tuple:
    """The stacked expand's variant for a step of num_tokens: its tiles per linear width."""
    if expand == "grouped":
        return ("stacked", expand, grouped_tiles(shape.lora_rank))
    if expand == "fused":  # its row tile, and per linear width the tiles decode_config / fp8_fused_config pick
        return ("stacked", expand, row_tile(num_tokens), tuple(sorted(shape.stacked_widths)))
    return ("stacked", expand, tuple(sorted({expand_tiles(num_tokens, n) for n in shape.stacked_widths}, key=repr)))


def segment_variants(shape: EngineShape, num_tokens: int, families: Iterable[str],
                     expands: tuple[str, ...] | None = None) -> set[Variant]:
    """The adapter kernels' variants of a step; expands: the stacked expands it may run
    (None: every one num_tokens rows can choose)."""
    families = tuple(families)
    stacked = "lora" in families and runs_stacked(shape, num_tokens)
    chosen = (shape.expands(num_tokens) if expands is None else expands) if stacked else ()
    lora_segment = not stacked
    if shape.fused_rows:  # A rows apart: the fused linear's steps; the others take the segment kernels
        lora_segment = not stacked or any(e != "fused" for e in chosen)
        chosen = tuple(e for e in chosen if e == "fused")
    out: set[Variant] = {("segment", f, segment_class(num_tokens, shape.rank(f)))
                         for f in families if f in SEGMENT_FAMILIES and (f != "lora" or lora_segment)}
    out |= {stacked_class(shape, num_tokens, e) for e in chosen}
    if "ia3" in families:
        out.add(("ia3",))
    return out


def decode_attention(shape: EngineShape, batch: int, width: int) -> Variant:
    splits, block_n = decode_blocks(batch, shape.kv_heads, width * shape.page)
    return ("decode_attention", splits, block_n, width_class(width))


def decode_variants(shape: EngineShape, batch: int, width: int, families: frozenset[str], rows: int = 0,
                    expands: tuple[str, ...] | None = None, tier: str | None = None) -> set[Variant]:
    """A step of `batch` one-token rows: a graph replay of its bucket, or an eager launch.
    rows: the stacked GEMM's row bucket at the step (0 unless stacked LoRA); expands: the
    stacked expands it may run (None: every one it can choose); tier: its (IA)^3 tier."""
    if shape.buckets is not None:
        bucket = shape.bucket(batch)
        stacked = "lora" in families and bool(shape.row_buckets)
        graph_rows = rows if stacked else 0
        graph_expands = (expands or shape.expands(bucket, graph_rows)) if stacked else (None,)
        tier = tier if "ia3" in families and shape.ia3_tiers else None
        return {*(("graph", bucket, families, _keyed_rows(shape, graph_rows, e), e, tier) for e in graph_expands),
                decode_attention(shape, bucket, shape.graph_pages),
                *segment_variants(shape, bucket, families, graph_expands if stacked else expands)}
    return {decode_attention(shape, batch, width), *segment_variants(shape, batch, families, expands)}


def _keyed_rows(shape: EngineShape, rows: int, expand: str | None) -> int:
    """The row bucket a decode graph is keyed by: none for a step the fused linear does not take
    (the separate LoRA kernels read no row bucket: engine/graph_capture.py keys it so)."""
    return rows if reads_row_bucket(expand, shape.fused_rows) else 0


def prefill_variants(shape: EngineShape, num_tokens: int, width: int, single: bool, multi: bool,
                     families: frozenset[str], expands: tuple[str, ...] | None = None) -> set[Variant]:
    launches = [name for name, used in (("single", single), ("multi", multi)) if used]
    return {*(("prefill_attention", name, width_class(width)) for name in launches),
            *segment_variants(shape, num_tokens, families, expands)}


def context_variants(shape: EngineShape, ctx: BatchContext, num_tokens: int, rows: int = 0,
                     tier: str | None = None) -> set[Variant]:
    """The variants a forward pass over this step's context launches (as on a GPU);
    rows: the stacked GEMM's row bucket at the step; tier: its (IA)^3 tier."""
    families = frozenset(f for f in ("lora", "ia3", "bottleneck") if getattr(ctx, f) is not None)
    expands = (ctx.lora.stacked_expand,) if ctx.lora is not None else ()
    meta = ctx.attention
    width = int(meta.block_tables.shape[1])
    if meta.decode:
        return decode_variants(shape, num_tokens, width, families, rows, expands, tier)
    tiles = meta.tiles
    return prefill_variants(shape, num_tokens, width, tiles.single.shape[0] > 0, tiles.multi.shape[0] > 0, families,
                            expands)


def family_sets(families: Iterable[str]) -> list[frozenset[str]]:
    families = tuple(families)
    return [frozenset(c) for n in range(len(families) + 1) for c in combinations(families, n)]


def graph_plan(shape: EngineShape) -> list[tuple[int, frozenset[str], int, str | None]]:
    """Every decode graph (bucket, families, stacked rows, (IA)^3 tier) the engine can replay:
    the buckets are the DecodeGraphs' own (EngineShape.buckets)."""
    return [(bucket, families, rows, tier) for families in family_sets(shape.families)
            for rows in shape.graph_rows(families) for tier in shape.graph_tiers(families)
            for bucket in shape.buckets or ()]


def reachable(shape: EngineShape) -> set[Variant]:
    """Every variant this configuration can launch."""
    out: set[Variant] = {("penalties", use) for use in PENALTY_USES}
    every = frozenset(shape.families)
    if shape.buckets is not None:
        for bucket, families, rows, tier in graph_plan(shape):
            out |= decode_variants(shape, bucket, shape.graph_pages, families, rows, tier=tier)
    else:
        for batch, width in product(range(1, shape.max_num_seqs + 1), range(1, shape.max_pages + 1)):
            out |= decode_variants(shape, batch, width, every)
    for num_tokens in range(2, shape.max_tokens + 1):
        out |= segment_variants(shape, num_tokens, every)
    widths = {width_class(w) for w in range(1, shape.max_pages + 1)}
    out |= {("prefill_attention", "multi", w) for w in widths}
    if shape.max_tokens >= 3 and shape.max_num_seqs >= 2:  # a decode row beside a prompt
        out |= {("prefill_attention", "single", w) for w in widths}
    return out
