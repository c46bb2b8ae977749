"""What pinning host memory costs on this machine, and what the engine's staged copies cost.

The engine copies step inputs and adapters to the GPU from pinned (page-locked) host memory,
so the copies run without a host sync. On some hosts a fresh pinned allocation is slow (its
cudaHostAlloc, or the caching host allocator waiting for events), and a step that pins per
copy then pays it every step. One table, per size: a fresh CPU tensor's ``pin_memory()``
(freed at once, so the caching host allocator may hand the block back), ``torch.empty(...,
pin_memory=True)`` kept alive (a new block each time: the allocation itself), and
``cudaHostRegister`` of ordinary memory. Then the step-input copy both ways: pin per copy
against ``PinnedStaging`` (engine/host_copy.py). With ``--all-devices``, a CUDA context is
made on every visible GPU first, and every pair's peer access enabled (as a tensor-parallel
worker's process has them).

    python benchmarks/host_pinning.py                 # GPU 0 only
    python benchmarks/host_pinning.py --all-devices   # as under tensor parallelism
    python benchmarks/host_pinning.py --smoke         # CPU: the script runs (no pinning there)
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from adapterserve.engine.host_copy import PinnedStaging, pinned_copy

SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20, 128 << 20)
REPEATS = 10


def _us(calls: list[float]) -> str:
    return f"{1e6 * statistics.median(calls):,.1f}"


def _timed(fn, repeats: int = REPEATS) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def pin_costs(size: int) -> tuple[str, str, str, str]:
    """us per call: pin_memory(), pinned_copy (both freed), a held new pinned block, cudaHostRegister + unregister."""
    source = torch.empty(size, dtype=torch.uint8)
    fresh = _timed(lambda: source.pin_memory())
    copied = _timed(lambda: pinned_copy(source))
    held: list[torch.Tensor] = []
    allocated = _timed(lambda: held.append(torch.empty(size, dtype=torch.uint8, pin_memory=True)))
    cudart = torch.cuda.cudart()
    plain = torch.empty(size, dtype=torch.uint8)

    def register() -> None:
        assert cudart.cudaHostRegister(plain.data_ptr(), size, 0) == 0
        assert cudart.cudaHostUnregister(plain.data_ptr()) == 0

    return _us(fresh), _us(copied), _us(allocated), _us(_timed(register))


def step_copy_costs(device: str, steps: int = 200) -> tuple[str, str]:
    """us per step of 9 input copies (a decode graph's, 64 rows): pinned per copy, and staged."""
    buffers = [torch.zeros(64, dtype=torch.long, device=device) for _ in range(9)]
    values = [np.arange(64, dtype=np.int64) + i for i in range(9)]
    staging = PinnedStaging()

    def per_copy() -> None:
        for buffer, v in zip(buffers, values):
            host = torch.from_numpy(v)
            buffer.copy_(host.pin_memory() if buffer.is_cuda else host, non_blocking=True)

    def staged() -> None:
        for buffer, v in zip(buffers, values):
            staging.copy_into(buffer, v)

    for fn in (per_copy, staged):  # warm: first blocks, first mirrors
        fn()
    return _us(_timed(per_copy, steps)), _us(_timed(staged, steps))


def touch_all_devices() -> int:
    """A context on every visible GPU and peer access between every pair; how many GPUs."""
    count = torch.cuda.device_count()
    tensors = [torch.ones(1, device=f"cuda:{i}") for i in range(count)]
    for i in range(count):
        for j in range(count):
            if i != j and torch.cuda.can_device_access_peer(i, j):
                tensors[j].copy_(tensors[i])  # enables peer access i -> j
    torch.cuda.synchronize()
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--all-devices", action="store_true", help="contexts and peer access on every visible GPU first")
    p.add_argument("--smoke", action="store_true", help="CPU: the step copies only")
    args = p.parse_args()
    if args.smoke or not torch.cuda.is_available():
        per_copy, staged = step_copy_costs("cpu", steps=20)
        print(f"host pinning, CPU (no pinning): step copies {per_copy} us per copy, {staged} us staged")
        return
    devices = touch_all_devices() if args.all_devices else 1
    torch.cuda.init()
    print(f"host pinning, {torch.cuda.get_device_name(0)}, {devices} GPU context(s), median of {REPEATS} calls")
    print(f"{'size':>10} {'pin_memory() us':>16} {'pinned_copy us':>15} {'new pinned block us':>20} "
          f"{'cudaHostRegister us':>20}")
    for size in SIZES:
        fresh, copied, allocated, registered = pin_costs(size)
        print(f"{size >> 10:>8} K {fresh:>16} {copied:>15} {allocated:>20} {registered:>20}")
    per_copy, staged = step_copy_costs("cuda")
    print(f"a decode step's 9 input copies: {per_copy} us pinning per copy, {staged} us staged "
          "(PinnedStaging), per step")


if __name__ == "__main__":
    main()
