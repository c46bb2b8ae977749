"""A row-parallel GEMM and its all-reduce, one after the other against pipelined in chunks of
the output columns: chunk c's all-reduce (on a second stream) runs while chunk c+1's GEMM
does, so only the last chunk's sum is left exposed. Each chunk reads its own rows of the
weight, so the weight is still read once. Decode shapes of the 70B's o_proj and down_proj at
TP=world (M=64 tokens), bf16, every variant captured in a CUDA graph of OPS_PER_GRAPH back-to-back
GEMM+sum pairs; a cell is the slowest rank's µs per pair. Outputs are checked against the
plain GEMM + NCCL sum before timing. The question it answers: is overlap worth building into
the decoder's row-parallel layers (issue 18, the 1.5x floor target)?

    python -m benchmarks.tp_overlap --world 4            # GPUs
    python -m benchmarks.tp_overlap --smoke              # CPU, gloo, 2 ranks: the logic runs
"""
from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adapterserve.layers.symm_allreduce import NCCL, ONE_SHOT, SymmetricAllReduce, choose_path
from benchmarks.allreduce_micro import sync, time_per_call

HIDDEN, INTERMEDIATE, LAYERS = 8192, 28672, 80  # Llama-3 70B
RTOL = 2 ** -6  # of the largest output: bf16 sums in another order differ by an ulp or two (2^-8 relative each)


@dataclass(frozen=True)
class Proj:
    name: str
    in_full: int  # split over the ranks (row-parallel)
    out: int


PROJS = (Proj("o_proj", HIDDEN, HIDDEN), Proj("down_proj", INTERMEDIATE, HIDDEN))
SMOKE_PROJS = (Proj("o_proj", 256, 256),)


class RowParallel:
    """One rank's x [M, K/world] and weight part [N, K/world], split into `chunks` column blocks of
    the output; `run_*` leave the summed output in self.out [M, N]."""

    def __init__(self, proj: Proj, tokens: int, world: int, chunks: int, device: torch.device, seed: int,
                 symmetric: bool) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        k = proj.in_full // world
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.x = torch.randn(tokens, k, generator=gen, device=device).to(dtype)
        self.weight = (torch.randn(proj.out, k, generator=gen, device=device) * k ** -0.5).to(dtype)
        width = proj.out // chunks
        self.weights = [self.weight[c * width:(c + 1) * width] for c in range(chunks)]  # contiguous row blocks
        self.parts = [torch.empty(tokens, width, dtype=dtype, device=device) for _ in range(chunks)]
        self.summed = [torch.empty_like(p) for p in self.parts]
        self.out = torch.empty(tokens, proj.out, dtype=dtype, device=device)
        capacity = tokens * width * self.out.element_size()
        self.sums = [SymmetricAllReduce.create(dist.group.WORLD, device, capacity) for _ in range(chunks)] \
            if symmetric else []
        self.world = world
        self.comm = torch.cuda.Stream(device) if device.type == "cuda" else None

    def gemm_only(self) -> None:
        for w, part in zip(self.weights, self.parts):
            torch.mm(self.x, w.t(), out=part)

    def run_serial(self, symmetric: bool) -> None:
        """All chunks' GEMMs, then the sums (with one chunk: the plain GEMM and one all-reduce)."""
        self.gemm_only()
        for c in range(len(self.parts)):
            self._sum(c, symmetric)
        self._gather()

    def run_pipelined(self, symmetric: bool) -> None:
        """Chunk c's sum on the second stream while chunk c+1's GEMM runs on this one."""
        if self.comm is None:  # CPU: the same order, one stream
            return self.run_serial(symmetric)
        main = torch.cuda.current_stream()
        self.comm.wait_stream(main)
        for c, (w, part) in enumerate(zip(self.weights, self.parts)):
            torch.mm(self.x, w.t(), out=part)
            done = torch.cuda.Event()
            done.record(main)
            self.comm.wait_event(done)
            with torch.cuda.stream(self.comm):
                self._sum(c, symmetric)
        main.wait_stream(self.comm)
        self._gather()

    def _sum(self, c: int, symmetric: bool) -> None:
        part, summed = self.parts[c], self.summed[c]
        path = choose_path(part.numel() * part.element_size(), part.dtype, True, self.world, 1 << 40) \
            if symmetric else NCCL
        if path == NCCL:
            dist.all_reduce(part)
            summed.copy_(part)
        elif path == ONE_SHOT:
            self.sums[c].one_shot(part, summed)
        else:
            self.sums[c].two_shot(part, summed)

    def _gather(self) -> None:
        torch.cat(self.summed, dim=1, out=self.out)


def variants(world: int, device: torch.device, chunk_counts: tuple[int, ...]) -> list[tuple[str, int, str, bool]]:
    """(label, chunks, how, symmetric) of every variant; symmetric ones only on GPUs."""
    found = [("gemm only", 1, "gemm", False), ("serial nccl", 1, "serial", False)]
    if device.type == "cuda":
        found.append(("serial symm", 1, "serial", True))
    for chunks in chunk_counts:
        found.append((f"{chunks} chunks nccl", chunks, "pipelined", False))
        if device.type == "cuda":
            found.append((f"{chunks} chunks symm", chunks, "pipelined", True))
    return found


def _rank_main(rank: int, world: int, root: Path, smoke: bool, tokens: int, chunk_counts: tuple[int, ...]) -> None:
    device = torch.device("cpu") if smoke else torch.device("cuda", rank)
    if not smoke:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if smoke else "nccl", init_method=f"file://{root / 'store'}", rank=rank,
                            world_size=world)
    found: dict[str, dict[str, float]] = {}
    for proj in SMOKE_PROJS if smoke else PROJS:
        found[proj.name] = {}
        reference = None
        for label, chunks, how, symmetric in variants(world, device, chunk_counts):
            layer = RowParallel(proj, tokens, world, chunks, device, seed=rank, symmetric=symmetric)
            run = layer.gemm_only if how == "gemm" else partial(getattr(layer, f"run_{how}"), symmetric)
            run()
            sync(device)
            if how != "gemm":
                reference = layer.out.clone() if reference is None else reference
                error = (layer.out.float() - reference.float()).abs().max().item()
                if error > RTOL * reference.float().abs().max().item():
                    raise AssertionError(f"rank {rank} {proj.name} {label}: differs from serial NCCL by {error:.3g}")
            found[proj.name][label] = time_per_call(run, graph=device.type == "cuda", device=device)
            del run, layer  # its symmetric buffers' peer mappings released while the group still stands
    (root / f"{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def measure(world: int, smoke: bool, tokens: int, chunk_counts: tuple[int, ...]) -> dict[str, dict[str, float]]:
    """{proj: {variant: µs per GEMM+sum, slowest rank}}."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world, Path(tmp), smoke, tokens, chunk_counts), nprocs=world,
                           start_method="spawn")
        per_rank = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]
    return {proj: {v: max(rank[proj][v] for rank in per_rank) for v in per_rank[0][proj]} for proj in per_rank[0]}


def table(found: dict[str, dict[str, float]], world: int, tokens: int, device_name: str) -> str:
    lines = [f"row-parallel GEMM + all-reduce, M={tokens}, TP={world}, µs per pair (slowest rank); {device_name}",
             f"{'variant':>16} " + " ".join(f"{p:>10}" for p in found) + f" {'per step ms':>12} {'vs serial':>10}"]
    labels = list(next(iter(found.values())))
    step = {v: LAYERS * sum(found[p][v] for p in found) / 1e3 for v in labels}
    serial = step.get("serial symm", step["serial nccl"])
    for v in labels:
        cells = " ".join(f"{found[p][v]:>10.1f}" for p in found)
        lines.append(f"{v:>16} {cells} {step[v]:>12.2f} {serial / step[v]:>9.2f}x")
    lines.append(f"per step: {LAYERS} layers x ({' + '.join(found)}); 'vs serial': the serial symmetric sum "
                 "(the engine's \"auto\" today), or NCCL where there is none")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="GPUs (ranks)")
    p.add_argument("--tokens", type=int, default=64, help="rows of the decode batch (M)")
    p.add_argument("--chunks", default="2,4,8", help="chunk counts of the output columns, comma-separated")
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, 2 ranks, a small shape")
    args = p.parse_args(argv)
    world = 2 if args.smoke else args.world
    chunk_counts = tuple(int(c) for c in args.chunks.split(","))
    found = measure(world, args.smoke, args.tokens, chunk_counts)
    name = "CPU (gloo)" if args.smoke else f"{world} x {torch.cuda.get_device_name(0)}"
    print(json.dumps(found))
    print(table(found, world, args.tokens, name))


if __name__ == "__main__":
    main()
