"""A rank that sees only its own GPU (as a Ray actor does): started by
test_symm_allreduce_gpu.py with CUDA_VISIBLE_DEVICES set to one index. Kept apart from
the test module, which skips itself on import where fewer than 2 GPUs are visible."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from adapterserve.layers.parallel import TensorParallel
from adapterserve.layers.symm_allreduce import symmetric_all_reduce


class LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def one_gpu_rank(rank: int, root: Path) -> None:
    """Join a 2-rank NCCL group on this process's one GPU, build the symmetric all-reduce
    ("auto"), sum a decode-sized message; write what happened to root/<rank>.json."""
    messages, logger = LogLines(), logging.getLogger("adapterserve.layers")
    logger.addHandler(messages)
    logger.setLevel(logging.INFO)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{root / 'store'}", rank=rank, world_size=2,
                            device_id=device)
    symmetric = symmetric_all_reduce(dist.group.WORLD, device, 1 << 20)
    hidden = torch.full((64, 256), float(rank + 1), dtype=torch.bfloat16, device=device)
    TensorParallel(rank, 2, dist.group.WORLD, symmetric).all_reduce_(hidden)
    facts = {"symmetric": symmetric is not None, "log": messages.lines, "devices": torch.cuda.device_count(),
             "sum": sorted(set(hidden.float().flatten().tolist()))}
    (root / f"{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()
