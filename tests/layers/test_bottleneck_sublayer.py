"""The decoders' bottleneck updates added into the sublayer's output (add_bottlenecks, the
residual added after) against the out-of-place form they replace (residual_sublayer without a
norm): Houlsby and Pfeiffer slots of mixed widths and activations, slots without an adapter at
this place, and base rows, in float32: the same sums in the same order, so the same bits."""
import pytest
import torch

from adapterserve.adapters_store.formats.types import BottleneckModule
from adapterserve.kernels import build_adapter_meta
from adapterserve.kernels.segment_ops import GEMV_TOKENS
from adapterserve.layers.bottleneck import BOTTLENECK_ACTIVATIONS, BottleneckPool, add_bottlenecks, residual_sublayer
from adapterserve.layers.context import BatchContext, set_context

DIM, SLOTS, WIDTH = 48, 5, 8


def _pool(gen: torch.Generator, tokens: int = 32) -> BottleneckPool:
    pool = BottleneckPool.empty(SLOTS, WIDTH, DIM, torch.zeros(tokens, WIDTH))
    for slot, (rank, ln_before) in enumerate([(8, False), (3, True), (0, False), (5, True)]):  # slot 4 stays empty
        if rank:
            randn = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
            module = BottleneckModule(randn(rank, DIM) / DIM ** 0.5, randn(rank) * 0.1, randn(rank, DIM) * 0.1,
                                      randn(DIM) * 0.1, BOTTLENECK_ACTIVATIONS[slot % len(BOTTLENECK_ACTIVATIONS)])
            pool.load(slot, module, ln_before)
    return pool


@pytest.mark.parametrize("seed", [0, 1])
def test_updates_added_into_the_output_give_the_out_of_place_form_s_sum(seed):
    gen = torch.Generator().manual_seed(seed)
    pool = _pool(gen)
    slots = torch.randint(-1, SLOTS, (23,), generator=gen, dtype=torch.int32)
    slots[:SLOTS + 1] = torch.arange(-1, SLOTS, dtype=torch.int32)  # every slot and a base row
    x, residual = torch.randn(23, DIM, generator=gen), torch.randn(23, DIM, generator=gen)
    set_context(BatchContext(attention=None, lora=None, ia3=None, bottleneck=build_adapter_meta(slots, SLOTS),
                             lora_workspace=None, logits_rows=None))
    try:
        want = residual_sublayer(x, residual, None, pool)
        out = x.clone()
        add_bottlenecks(out, residual, pool)
        got = out + residual
    finally:
        set_context(None)
    assert torch.equal(got, want)
    unchanged = (slots < 0) | (slots == 2) | (slots == 4)  # base rows and slots with no adapter here
    assert torch.equal(got[unchanged], (x + residual)[unchanged])
    assert not torch.allclose(got[~unchanged], (x + residual)[~unchanged])


@pytest.mark.parametrize("repeats", [3, GEMV_TOKENS // (SLOTS + 1) + 1], ids=["decode", "wide"])
def test_pools_sharing_ln_mix_gather_the_step_s_mixes_once(repeats):
    """Two places' pools sharing one ln_mix (as add_bottleneck_pools makes them), the second without
    the Pfeiffer adapter's module: the shared mix stays the adapter's after both loads, and each
    place's result is its unshared twin's. A decode-sized step's shrink forms its input as it reads
    (no gather); a wider one gathers its rows' mixes once for both places."""
    gen = torch.Generator().manual_seed(3)
    slots = torch.arange(-1, SLOTS, dtype=torch.int32).repeat(repeats)
    alone = _pool(gen, len(slots))
    shared = BottleneckPool.empty(SLOTS, WIDTH, DIM, alone.workspace)
    for name in ("down", "down_bias", "up", "up_bias", "rank", "activation", "ln_mix"):
        getattr(shared, name).copy_(getattr(alone, name))
    other = BottleneckPool.empty(SLOTS, WIDTH, DIM, alone.workspace, shared.ln_mix)
    other.load(1, None, True)  # slot 1 (Pfeiffer) has no module at this place
    assert shared.ln_mix[1] == 1.0 and other.rank[1] == 0
    x, residual = torch.randn(len(slots), DIM, generator=gen), torch.randn(len(slots), DIM, generator=gen)
    ctx = BatchContext(attention=None, lora=None, ia3=None, bottleneck=build_adapter_meta(slots, SLOTS),
                       lora_workspace=None, logits_rows=None)
    set_context(ctx)
    try:
        want = residual_sublayer(x, residual, None, alone)
        out = x.clone()
        add_bottlenecks(out, residual, shared)
        mixes = ctx.bottleneck_mix
        untouched = x.clone()
        add_bottlenecks(untouched, residual, other)  # no module in any slot: nothing added
        assert ctx.bottleneck_mix is mixes  # gathered once for both places, or (decode) never
    finally:
        set_context(None)
    assert (mixes is None) == (len(slots) <= GEMV_TOKENS)
    assert torch.equal(out + residual, want)
    assert torch.equal(untouched, x)
