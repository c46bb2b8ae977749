"""What decode graphs (engine/graphs.py) and mixed-step graphs (engine/mixed_graphs.py)
share: graphs keyed by (bucket, families, signature, stacked expand), captured over a
subclass's fixed buffers into one memory pool, and the adapter metadata a captured
forward builds from the bucket's fixed family-slot buffer.

A subclass names its buckets and implements ``_forward(bucket, families, expand)``:
the step over the buffers of that bucket (ids, sources, positions, family_slots, and
its attention metadata), returning its logits in a fixed buffer (``_logits``). On a
device that cannot capture (CPU), ``replay`` runs that same forward eagerly, so tests
exercise the path the capture records.
"""
from __future__ import annotations

import numpy as np
import torch

from adapterserve.engine.host_copy import PinnedStaging
from adapterserve.engine.step_device import with_sampled_ids
from adapterserve.kernels import build_adapter_meta
from adapterserve.kernels.metadata import AdapterBatchMeta
from adapterserve.kernels.stacked import expand_for_slots, reachable_expands, reads_row_bucket
from adapterserve.layers.context import AttentionMeta, BatchContext, set_context


class GraphPool:
    """One CUDA-graph memory pool for every graph of a rank: graphs replay one at a time,
    so their intermediate buffers can share memory."""

    def __init__(self) -> None:
        self.handle = None


class CapturedSteps:
    def __init__(self, runner, pool: GraphPool | None = None) -> None:
        self.runner = runner
        self.pool = pool or GraphPool()
        self.capturable = torch.device(runner.device).type == "cuda"
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self.replays = 0  # steps served by a captured graph (or, off CUDA, by its eager twin)
        self.staging = PinnedStaging()  # the host side of every copy into the graphs' input buffers

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def capture(self, bucket: int, families: tuple[bool, bool, bool], signature: tuple = (),
                expand: str | None = None) -> bool:
        """Capture the graph of this key unless it exists (engine warm-up calls it ahead,
        expand None: the graph of every stacked expand the bucket can choose); True if one
        was captured now."""
        signature = self._signature(bucket, signature)
        stacked = _stacked(families, signature)
        expands = ([expand or "tiled"] if expand or not stacked
                   else reachable_expands(bucket, self.runner.num_slots, self.runner.fused_rows,
                                          self.max_requests(bucket), _rows(signature)))
        captured = False
        for choice in expands:
            key = self._key(bucket, families, signature, choice)
            if key not in self._graphs:
                self._graphs[key] = self._capture(bucket, families, choice)
                captured = True
        return captured

    def max_requests(self, bucket: int) -> int:
        """The most requests (distinct adapters) a step of this bucket holds."""
        return bucket

    def runs_stacked(self, bucket: int) -> bool:
        """Whether this bucket's LoRA rows may run the stacked layout (its GEMM's row
        bucket and expand then shape the graph)."""
        return True

    def _key(self, bucket: int, families: tuple[bool, bool, bool], signature: tuple, expand: str | None) -> tuple:
        """The graph's key (_key), without the LoRA row bucket where it shapes nothing: with the
        fused linear's pool (A rows kept apart) a step the fused linear does not take runs the
        separate LoRA kernels, which read no row bucket, so one graph serves every bucket."""
        if signature and not reads_row_bucket(expand, self.runner.fused_rows):
            signature = ((), *signature[1:])
        return _key(bucket, families, signature, expand)

    def _signature(self, bucket: int, signature: tuple) -> tuple:
        """The signature that shapes this bucket's graphs: without the stacked LoRA part
        where the bucket never runs the stacked layout."""
        return signature if not signature or self.runs_stacked(bucket) else ((), *signature[1:])

    def replay(self, bucket: int, family_slots: np.ndarray, families: tuple[bool, bool, bool],
               signature: tuple) -> torch.Tensor:
        """Replay the graph of the bucket (the buffers already filled), capturing it first
        if warm-up did not; off CUDA, run its forward eagerly. The logits buffer it wrote."""
        signature = self._signature(bucket, signature)
        expand = (expand_for_slots(family_slots[0], self.runner.fused_rows, bucket, _rows(signature))
                  if _stacked(families, signature) else None)
        self.replays += 1
        self.capture(bucket, families, signature, expand)  # lazily, where warm-up did not
        if not self.capturable:
            return self._forward(bucket, families, expand or "tiled")
        graph, logits = self._graphs[self._key(bucket, families, signature, expand)]
        graph.replay()
        return logits

    def _capture(self, bucket: int, families: tuple[bool, bool, bool], expand: str
                 ) -> tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]:
        if not self.capturable:  # the key is recorded (warm-up's plan), its forward run once
            self._forward(bucket, families, expand)
            return None, None
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # compile and warm every kernel outside the capture
                self._forward(bucket, families, expand)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle):
            logits = self._forward(bucket, families, expand)
        self.pool.handle = graph.pool()
        return graph, logits

    def _forward(self, bucket: int, families: tuple[bool, bool, bool], expand: str) -> torch.Tensor:
        raise NotImplementedError

    def _copy_family_slots(self, family_slots: np.ndarray) -> None:
        """Each family's slot per token [3, T] into the whole family_slots buffer, padded with -1
        (the whole buffer: a staged copy needs it contiguous)."""
        slots = np.full(self.family_slots.shape, -1, dtype=np.int32)
        slots[:, : family_slots.shape[1]] = family_slots
        self.staging.copy_into(self.family_slots, slots)

    def _logits(self, bucket: int, attention: AttentionMeta, families: tuple[bool, bool, bool], expand: str,
                rows: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """The backbone over the bucket's token buffers, then the logits of ``rows`` (None:
        every token row) into ``out``."""
        runner = self.runner
        metas = self._adapter_metas(self.family_slots[:, :bucket], families, expand)
        set_context(BatchContext(attention=attention, lora=metas[0], ia3=metas[1], bottleneck=metas[2],
                                 lora_workspace=runner.lora_workspace, logits_rows=rows))
        try:
            ids = with_sampled_ids(self.ids[:bucket], self.sources[:bucket], runner.sampled)
            hidden = runner.model(ids, self.positions[:bucket])
            return runner.model.compute_logits(hidden if rows is None else hidden[rows], out=out)
        finally:
            set_context(None)

    def _adapter_metas(self, family_slots: torch.Tensor, families: tuple[bool, bool, bool], expand: str
                       ) -> list[AdapterBatchMeta | None]:
        """Per family (lora, ia3, bottleneck): its metadata over the bucket's slots [3, T]
        (built on the device, no host sync), None where the graph has no such rows."""
        return [build_adapter_meta(family_slots[i], self.runner.num_slots, stacked_expand=expand) if on else None
                for i, on in enumerate(families)]


def _stacked(families: tuple[bool, ...], signature: tuple) -> bool:
    """Whether a graph's LoRA rows run the stacked layout (its signature part, the row bucket, is set)."""
    return bool(families[0] and signature and signature[0])


def _rows(signature: tuple) -> int:
    """The stacked GEMMs' row bucket a signature holds (LoraPool.graph_part), 0 where none."""
    return signature[0][1] if signature and signature[0] else 0


def _key(bucket: int, families: tuple[bool, bool, bool], signature: tuple, expand: str = "tiled") -> tuple:
    """A graph's key. The signature holds one part per family (lora, ia3, bottleneck): the
    host state its captured ops read (the stacked GEMM's row bucket, the bottleneck
    activations resident); a part counts only in graphs with that family's rows. The
    stacked expand counts only in graphs whose LoRA rows run the stacked layout."""
    parts = tuple(part if on else () for part, on in zip(signature, families))
    return bucket, families, parts if any(parts) else (), expand if _stacked(families, signature) else None
