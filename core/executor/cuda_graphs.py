"""CUDA graphs of the target forward (``engine.cuda_graphs``).

On a GPU a step is often host-bound: a transformers forward launches over a thousand
kernels from Python. A graph replays a captured forward's
launches in one call, but holds fixed shapes and addresses. So a step is padded into a
bucket, ``batch`` sequences of ``width`` new tokens each: its sequences up to the next
batch bucket, each sequence's new tokens up to the widest rounded up to a width bucket.
A padding token writes its K/V to the cache's scratch slot and sees only itself; no real
token sees it, and its logits and hidden states are dropped. Every graph reads its step
from static buffers that each replay overwrites (token ids, positions, K/V slots, block
tables, cached lengths, tree masks); the paged attention's launch is planned for the
model's longest context (:attr:`AttentionLayout.context_bound`) and splits each
sequence's keys evenly within it, so one launch serves every context.

A bucket's graph is captured the first time a step needs it (the forward run once
eagerly, then captured); all graphs share one memory pool and the static input buffers.
Steps that fit no bucket run eagerly: prompt chunks longer than the widest bucket, more
sequences than the largest, draft trees expanded level by level, the batch-invariant
mode, and any step where the paged attention is not the Triton kernel.
"""

from __future__ import annotations

import logging
import time

import attrs
import torch

from ..kernels import paged_attention_is_triton
from ..kvcache import PagedKVCache
from ..kvcache.layout import AttentionLayout, SequenceSlice
from ..model.target import ForwardMetadata, TargetModel

log = logging.getLogger(__name__)

#: new tokens per sequence a graph may hold (a step's widest, rounded up to one of these)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
#: the most tokens (batch x width) of one graph: its logits alone are ``tokens x vocab``
MAX_TOKENS = 512


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (and ``max_batch`` itself)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return buckets + [max_batch]


@attrs.define
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [batch * width, vocab], the model's dtype
    hidden: dict[int, torch.Tensor]  # captured hidden states, [batch * width, hidden]
    #: what the graph reads beside the static buffers (its layout's launch plan, the logits
    #: rows): held as long as the graph, whose kernels keep their addresses
    inputs: tuple


@attrs.define
class PaddedStep:
    """A step laid out for a graph of ``batch x width`` tokens (host tensors).

    ``index [T]``: the padded row of each of the step's packed tokens; ``slots [batch *
    width]`` where each row's K/V goes (the scratch slot for padding); ``tables [batch,
    longest]`` the block tables (zeros past a table's end and for padding sequences) and
    ``starts [batch]`` the cached tokens (0 for padding); ``tree [batch * width, width]``:
    which of its sequence's new tokens each row sees (padding: itself). A graph's table
    columns past ``longest`` keep older block numbers: only padding reads them, harmlessly."""

    index: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    starts: torch.Tensor
    tree: torch.Tensor


def pad_step(seqs: list[SequenceSlice], batch: int, width: int, block_size: int, scratch_slot: int) -> PaddedStep:
    """:class:`PaddedStep` of ``seqs`` (at most ``batch`` of them, at most ``width`` new
    tokens each; none: all padding), in a few tensor operations whatever the batch (a graphed step's host
    work is most of what it costs beyond the GPU's)."""
    counts = torch.tensor([len(s.positions) for s in seqs], dtype=torch.long)
    longest = max((len(s.block_table) for s in seqs), default=0)
    tables = torch.zeros(batch, longest, dtype=torch.long)
    starts = torch.zeros(batch, dtype=torch.long)
    if seqs:
        tables[:len(seqs)] = torch.tensor([s.block_table + [0] * (longest - len(s.block_table)) for s in seqs])
        starts[:len(seqs)] = torch.tensor([s.start for s in seqs])
    seq = torch.repeat_interleave(torch.arange(len(seqs)), counts)
    local = torch.arange(len(seq)) - (torch.cumsum(counts, 0) - counts)[seq]  # each token's index in its sequence
    index = seq * width + local
    cache_index = starts[seq] + local
    slots = torch.full((batch * width,), scratch_slot, dtype=torch.long)
    slots[index] = tables[seq, cache_index // block_size] * block_size + cache_index % block_size
    tree = torch.eye(width, dtype=torch.int8).repeat(batch, 1)
    columns = torch.arange(width)
    tree[index] = ((columns <= local[:, None]) & (columns < counts[seq][:, None])).to(torch.int8)  # causal
    for b, s in enumerate(seqs):
        if s.tree_mask is not None:
            n = len(s.positions)
            tree[b * width:b * width + n, :n] = s.tree_mask.cpu().to(torch.int8)
    return PaddedStep(index, slots, tables.to(torch.int32), starts.to(torch.int32), tree)


class CudaGraphs:
    """The target's forward through captured CUDA graphs where a step fits a bucket
    (:meth:`forward`, same contract as :meth:`TargetModel.forward`), eagerly elsewhere."""

    def __init__(self, target: TargetModel, cache: PagedKVCache, block_size: int, max_model_len: int,
                 max_batch: int, hidden_layers: frozenset[int] = frozenset()):
        self.target = target
        self.cache = cache
        self.hidden_layers = hidden_layers
        self.block_size = block_size
        self.batches = batch_buckets(max_batch)
        self.table_width = -(-(max_model_len + WIDTHS[-1]) // block_size)
        #: target forwards replayed from a graph, and run eagerly (no bucket held the step)
        self.replays = 0
        self.eager_steps = 0
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._disabled = False
        device, batch = target.device, self.batches[-1]
        with torch.inference_mode():  # the buffers are written in inference mode, as the forward is
            self._ids = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
            self._positions = torch.zeros(MAX_TOKENS, dtype=torch.long, device=device)
            self._slots = torch.full((MAX_TOKENS,), cache.scratch_slot, dtype=torch.long, device=device)
            self._tables = torch.zeros(batch, self.table_width, dtype=torch.int32, device=device)
            self._starts = torch.zeros(batch, dtype=torch.int32, device=device)
            self._tree = torch.zeros(MAX_TOKENS * WIDTHS[-1], dtype=torch.int8, device=device)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def bucket(self, meta: ForwardMetadata) -> tuple[int, int] | None:
        """The (batch, width) graph that holds ``meta``'s step, or None (it runs eagerly)."""
        layout = meta.layout
        if (self._disabled or layout is None or meta.probe is not None or meta.batch_invariant
                or meta.cache is not self.cache or layout.has_pending
                or not paged_attention_is_triton(self.target.device)):
            return None
        seqs = layout.seqs
        widest = max(len(s.positions) for s in seqs)
        batch = next((b for b in self.batches if b >= len(seqs)), None)
        width = next((w for w in WIDTHS if w >= widest), None)
        if batch is None or width is None or batch * width > MAX_TOKENS:
            return None
        limit = self.table_width * self.block_size
        if any(len(s.block_table) > self.table_width or s.start + width > limit for s in seqs):
            return None
        return batch, width

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        key = self.bucket(meta)
        graph = None if key is None else self._graphs.get(key) or self._capture(*key)
        if graph is None:
            self.eager_steps += 1
            return self.target.forward(input_ids, positions, meta, logits_rows)
        index = self._load(meta.layout.seqs, *key).to(self.target.device)
        self._ids.index_copy_(0, index, input_ids)
        self._positions.index_copy_(0, index, positions)
        graph.graph.replay()
        self.replays += 1
        logits = graph.logits.index_select(0, index.index_select(0, logits_rows)).float()
        return logits, {layer: h.index_select(0, index) for layer, h in graph.hidden.items()}

    def _load(self, seqs: list[SequenceSlice], batch: int, width: int) -> torch.Tensor:
        """Write ``seqs`` padded to ``batch x width`` (:func:`pad_step`) into the static
        buffers; the padded row of each of their tokens (host)."""
        tokens = batch * width
        step = pad_step(seqs, batch, width, self.block_size, self.cache.scratch_slot)
        self._slots[:tokens].copy_(step.slots)
        self._tables[:batch, :step.tables.shape[1]].copy_(step.tables)
        self._starts[:batch].copy_(step.starts)
        self._tree[:tokens * width].copy_(step.tree.flatten())
        return step.index

    def _static_step(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor, ForwardMetadata, torch.Tensor]:
        """The forward arguments of a ``batch x width`` graph: token ids, positions, and a
        layout whose views are the static buffers, set to padding (every sequence empty)."""
        tokens = batch * width
        device = self.target.device
        layout = AttentionLayout([SequenceSlice(block_table=[0], start=0, positions=torch.arange(width))
                                  for _ in range(batch)], self.block_size, device,
                                 context_bound=self.table_width * self.block_size)
        tree = self._tree[:tokens * width].view(tokens, width)
        layout.__dict__.update(  # the views the attention reads lazily, on the static buffers
            has_pending=False, slot_mapping=self._slots[:tokens], query_positions=self._positions[:tokens],
            kernel_tensors={"block_tables": self._tables[:batch], "tree_mask": tree,
                            "first_token": torch.arange(0, tokens, width, dtype=torch.int32, device=device),
                            "starts": self._starts[:batch],
                            "num_new": torch.full((batch,), width, dtype=torch.int32, device=device)})
        self._load([], batch, width)
        meta = ForwardMetadata(cache=self.cache, layout=layout, hidden_layers=self.hidden_layers)
        return self._ids[:tokens], self._positions[:tokens], meta, torch.arange(tokens, device=device)

    def _capture(self, batch: int, width: int) -> _Graph | None:
        """Run the bucket's forward once eagerly on padding (compiling the Triton kernels,
        planning the attention), then capture it. A capture that fails turns the graphs
        off for this engine, with a warning; the step runs eagerly."""
        started = time.perf_counter()
        ids, positions, meta, rows = self._static_step(batch, width)
        device = self.target.device
        try:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self.target.forward_raw(ids, positions, meta, rows)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits, hidden = self.target.forward_raw(ids, positions, meta, rows)
        except RuntimeError as exc:
            self._disabled = True
            log.warning("engine.cuda_graphs: capturing %d x %d tokens failed (%s); the target runs eagerly from "
                        "now on", batch, width, str(exc).splitlines()[0][:200])
            return None
        self._pool = graph.pool()
        self._graphs[batch, width] = captured = _Graph(graph, logits, dict(hidden), (meta, rows))
        log.info("engine.cuda_graphs: captured %d sequences x %d tokens in %.2f s", batch, width,
                 time.perf_counter() - started)
        return captured
