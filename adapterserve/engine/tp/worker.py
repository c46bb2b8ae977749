"""A tensor-parallel worker (rank 1..N-1): joins the group, loads its shard of the
backbone, builds its adapter pools and step state as rank 0 does, then runs rank 0's
commands in order until "close" or until rank 0's connection closes. It never sees a
request: a step arrives as its host inputs, a slot fill as the key of an adapter whose
part for this rank (an AdapterShard, engine/adapter_shard.py) arrived before. On an error
it sends the traceback to rank 0 and exits, so no collective of the other ranks waits on it
for long.
"""
from __future__ import annotations

import os
import pickle
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection

import torch

from adapterserve.adapters_store.formats.families import Adapter
from adapterserve.config import EngineConfig
from adapterserve.engine.adapter_shard import AdapterShard
from adapterserve.engine.host_copy import on_copy_stream
from adapterserve.engine.host_threads import apply_host_threads
from adapterserve.engine.pool_set import build_pools
from adapterserve.engine.staging import stage
from adapterserve.engine.step_device import StepDevice, StepInputs, attach_lora_side_stream, use_kernel_options
from adapterserve.engine.tp.adapter_post import send_at_once
from adapterserve.engine.tp.group import join_group, leave_group
from adapterserve.engine.tp.inbox import AdapterInbox
from adapterserve.engine.tp.stack_dump import dump_stacks_on_signal
from adapterserve.layers.ia3_places import WIDEST
from adapterserve.layers.parallel import TensorParallel
from adapterserve.models.decoder import DecoderModel
from adapterserve.models.loader import load_decoder


ModelBuilder = Callable[[TensorParallel, str], DecoderModel]  # (rank's place, device) -> its shard; picklable
# A directory: each local worker profiles its command loop (cProfile) and writes its busiest functions
# there when it closes (tp_worker<rank>.txt). For diagnosis: benchmarks/tp_decode.py --profile sets it.
PROFILE_ENV = "ADAPTERSERVE_TP_PROFILE"


def checkpoint_shard(model_dir: str, dtype: torch.dtype, fp8_gemm: str | None, tp: TensorParallel, device: str
                     ) -> DecoderModel:
    """This rank's shard of a Hugging Face checkpoint (a ModelBuilder, with functools.partial)."""
    return load_decoder(model_dir, dtype, device, fp8_gemm=fp8_gemm, tp=tp)[0]


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start: how to build its shard, rank 0's configuration, its rank,
    and where to meet rank 0 (the group's store and the command connection)."""

    build_model: ModelBuilder
    config: EngineConfig  # rank 0's; `device` replaced by this worker's
    rank: int
    world_size: int
    group_address: str  # tcp://host:port
    control_address: tuple[str, int]
    authkey: bytes
    all_reduce_bytes: int | None = None  # the largest all-reduce of a step (sizes the symmetric buffer)


class GivenBlocks:
    """KV blocks as rank 0 allocated them: a worker's prefix pool takes, for each placement,
    the block table rank 0's prefix pool chose (the worker allocates no blocks itself)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.next_table: list[int] = []

    def can_allocate(self, blocks: list[int], num_tokens: int) -> bool:
        return True

    def grow(self, blocks: list[int], num_tokens: int) -> None:
        blocks.extend(self.next_table)

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def release(self, blocks: list[int]) -> None:
        pass


class WorkerState:
    """A worker's shard: the model, its pools and its step state; one method per command."""

    def __init__(self, spec: WorkerSpec, tp: TensorParallel, inbox: AdapterInbox) -> None:
        self.inbox = inbox
        config = spec.config
        self.rank, self.world_size = spec.rank, spec.world_size
        self.model = spec.build_model(tp, config.device)
        self.blocks = GivenBlocks(config.block_size)
        self.pools = build_pools(config, self.model, self.blocks, with_head=False)
        self.device = StepDevice(self.model, config.num_kv_blocks * config.block_size + 1, config.block_size,
                                 config.max_loras, config.max_lora_rank, config.max_num_batched_tokens, tp,
                                 config.kv_fp8)
        on_gpu = torch.device(config.device).type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=config.device) if on_gpu else None
        self._landing: list[torch.cuda.Event] = []  # placements' copies the next step waits for
        if config.lora_side_stream and on_gpu:
            attach_lora_side_stream(self.model, config.device)
        use_kernel_options(self.model, config)
        self.pinning_device = torch.device(config.device)
        inbox.max_staged, inbox.max_staged_bytes = config.max_staged_adapters, config.max_staged_bytes
        inbox.prepare = self._prepare  # parts arriving from now on are staged as they arrive

    def _prepare(self, adapter: Adapter) -> None:
        """The pools' loading copies of a part (on the inbox's thread: placing it then only copies).
        That thread's current device is made this rank's, or pinning there would open a CUDA
        context on device 0."""
        device = self.pinning_device
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            stage(self.pools.all(), adapter)

    def step(self, inputs: StepInputs) -> None:
        for event in self._landing:
            torch.cuda.current_stream().wait_event(event)
        self._landing.clear()
        with self.pools.for_step(inputs.family_slots, inputs.mixed):  # the rows and scales rank 0's step covers
            self.device.forward(inputs)
        self.device.keep_sampled(None, len(inputs.generating))

    def place(self, slot: int, adapter: Adapter | int, prefix_pages: list[int]) -> None:
        """`adapter`: this rank's part of it (or the whole, which the pools cut), or the key it
        was shared under."""
        if isinstance(adapter, int):
            adapter = self.inbox.take(adapter)
        if isinstance(adapter, AdapterShard) and (adapter.rank, adapter.world_size) != (self.rank, self.world_size):
            raise RuntimeError(f"rank {self.rank} of {self.world_size} was sent the part of an adapter cut for rank "
                               f"{adapter.rank} of {adapter.world_size}")
        self.blocks.next_table = prefix_pages
        with on_copy_stream(self.copy_stream, self._landing):
            for pool in self.pools.all():
                if not pool.place(slot, adapter):
                    raise RuntimeError(f"rank {self.rank}: the {pool.family} pool has no room in slot {slot} for an "
                                       "adapter rank 0 placed there (the ranks' pools no longer agree)")
        adapter.staged.clear()  # the pools' pinned loading copies: freed once their copies have run

    def forget(self, key: int) -> None:
        self.inbox.forget(key)

    def clear(self, slot: int) -> None:
        for pool in self.pools.all():
            pool.clear(slot)

    def copy_blocks(self, sources: list[int], copies: list[int]) -> None:
        self.device.copy_blocks(sources, copies)

    def enable_cuda_graphs(self, max_batch: int, max_pages: int, mixed_tokens: int = 0, max_requests: int = 0
                           ) -> None:
        self.device.enable_cuda_graphs(max_batch, max_pages, mixed_tokens, max_requests)

    def capture(self, bucket: int, families: tuple[bool, ...], signature: tuple, stacked_rows: int,
                mixed: bool = False) -> None:
        graphs = self.device.mixed_graphs if mixed else self.device.graphs
        with self.pools.covering(stacked_rows, signature[1] if signature else WIDEST):
            graphs.capture(bucket, families, signature)



def run_worker(spec: WorkerSpec, device: str) -> None:
    """A worker's life: connect to rank 0, join the group on `device`, load, serve commands.
    Exits the process on an error (after sending it to rank 0). ``kill -USR1`` prints its
    threads' stacks (stack_dump.py)."""
    dump_stacks_on_signal()
    apply_host_threads(spec.config, spec.world_size)
    conn = Client(spec.control_address, authkey=spec.authkey)
    send_at_once(conn)  # its error reports and replies leave at once
    conn.send((spec.rank, "commands"))
    inbox = AdapterInbox(Client(spec.control_address, authkey=spec.authkey), spec.rank)
    try:
        tp = join_group(spec.group_address, spec.rank, spec.world_size, device,
                        spec.config.tensor_parallel_all_reduce, spec.all_reduce_bytes)
        state = WorkerState(replace(spec, config=replace(spec.config, device=device)), tp, inbox)
        conn.send_bytes(pickle.dumps(("ready",)))
        profile_dir = os.environ.get(PROFILE_ENV)
        if profile_dir:
            _serve_profiled(conn, state, profile_dir)
        else:
            _serve(conn, state)
    except BaseException:
        try:
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        except OSError:
            pass
        os._exit(1)
    state.device.release_graphs(wait=True)  # NCCL leaves no group whose graphs live (a stuck wait: rank 0 kills it)
    leave_group()  # beside rank 0, which leaves as it sends "close"
    conn.close()


def _serve(conn: Connection, state: WorkerState) -> None:
    while True:
        try:
            op, *args = pickle.loads(conn.recv_bytes())
        except EOFError:  # rank 0 is gone
            return
        if op == "close":
            return
        getattr(state, op)(*args)


def _serve_profiled(conn: Connection, state: WorkerState, out_dir: str) -> None:
    """_serve under cProfile; the functions by their own time go to out_dir/tp_worker<rank>.txt."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    profile.enable()
    try:
        _serve(conn, state)
    finally:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        with open(os.path.join(out_dir, f"tp_worker{state.rank}.txt"), "w") as out:
            out.write(text.getvalue())
