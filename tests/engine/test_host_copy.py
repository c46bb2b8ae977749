"""PinnedStaging: copies into fixed device buffers through reused pinned mirrors land exactly,
whatever slice of which buffer each step writes, and the host never reads a stale mirror."""
import numpy as np
import pytest
import torch

from adapterserve.engine.host_copy import PinnedStaging


def _steps(device: str, steps: int = 40) -> None:
    rng = np.random.default_rng()
    buffers = {"ids": torch.zeros(64, dtype=torch.long, device=device),
               "tables": torch.zeros(64, 9, dtype=torch.int32, device=device)}
    staging = PinnedStaging()
    for _ in range(steps):
        rows = int(rng.integers(1, 65))
        ids = rng.integers(-5, 1 << 40, size=rows)
        tables = rng.integers(0, 1 << 20, size=(rows, 9)).astype(np.int32)
        staging.copy_into(buffers["ids"][:rows], ids)
        staging.copy_into(buffers["tables"][:rows], tables)
        if device == "cuda":
            torch.cuda._sleep(200_000)  # the next step's host writes run while this step's copies wait
        assert torch.equal(buffers["ids"][:rows].cpu(), torch.from_numpy(ids))
        assert torch.equal(buffers["tables"][:rows].cpu(), torch.from_numpy(tables))


def test_copies_land_on_cpu():
    _steps("cpu")


def test_refuses_a_strided_buffer():
    family_slots = torch.full((3, 8), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous"):
        PinnedStaging().copy_into(family_slots[:, :4], np.zeros((3, 4), dtype=np.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copies_land_on_gpu():
    _steps("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mirror_is_not_rewritten_while_its_copy_waits():
    """More steps queued behind a long kernel than the ring has mirrors: every buffer still
    ends with its own step's values."""
    staging = PinnedStaging()
    outs = [torch.zeros(16, dtype=torch.long, device="cuda") for _ in range(3 * PinnedStaging.DEPTH)]
    torch.cuda._sleep(50_000_000)  # the stream is busy; the copies below queue behind it
    values = [np.arange(16) + 100 * i for i in range(len(outs))]
    shared = torch.zeros(16, dtype=torch.long, device="cuda")
    for out, v in zip(outs, values):
        staging.copy_into(shared, v)  # one buffer, rewritten each step (as graph inputs are)
        out.copy_(shared, non_blocking=True)
    for out, v in zip(outs, values):
        assert torch.equal(out.cpu(), torch.from_numpy(v))
