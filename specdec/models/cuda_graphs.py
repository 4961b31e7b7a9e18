"""CUDA graphs for pure decode and verify steps: the verifier's engine replays
its decode and verify steps from them, the draft-model drafter its one-token
draft steps.

A step with no prefill in which every sequence feeds at most q tokens (1 for
decode, K + 1 for verify) has a shape fixed by three numbers once padded: the
batch size, q and the block-table width. Such a step is padded up to the next
captured bucket of batch size and width (and a sequence that feeds fewer
tokens, a smaller K, up to q) and replayed from a CUDA graph,
which removes the per-kernel launch cost that dominates small batches on a
GPU. Everything else (prefill chunks, shapes past the largest bucket) runs
eagerly.

Padding: extra sequences feed token 0 at position 0 and write their K/V to a
scratch block that no sequence owns; block-table columns past a sequence's
own blocks point at it too (masked by causality). Inputs are copied into
fixed buffers before each replay, and the graph copies its outputs into
fixed buffers, so all graphs share their inputs, outputs and one memory
pool. Graphs are captured lazily, the first time a shape is seen.

With capture=False (CPU, tests) the runner pads and copies exactly the same
way and calls the forward eagerly instead of replaying it: everything but the
capture itself runs without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.models import AttentionMetadata, ForwardOutput, LlamaForCausalLM, PagedKVCache

# The cache pseudo-sequence owning the scratch block; the engine's sequence ids and the
# draft model's slots start at 0.
SCRATCH_SEQ = -1


def batch_buckets(max_batch: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, then every multiple of 8, then max_batch."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    return small + list(range(8, max_batch, 8)) + [max_batch]


def width_buckets(max_model_len: int, block_size: int, min_context: int = 256) -> list[int]:
    """Captured block-table widths, in blocks: room for min_context tokens,
    doubling, up to max_model_len. Attention gathers every column, so a short
    context should not pay for the longest."""
    top = -(-max_model_len // block_size)
    widths, tokens = [], min_context
    while (w := -(-tokens // block_size)) < top:
        widths.append(w)
        tokens *= 2
    return widths + [top]


def bucket(buckets: list[int], n: int) -> int | None:
    """The smallest bucket >= n (buckets sorted), or None when n is past them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True, slots=True)
class GraphKey:
    batch: int  # padded batch size (a batch bucket)
    query_len: int  # q: tokens per sequence
    width: int  # padded block-table width (a width bucket)
    hidden_layers: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return self.batch * self.query_len


@dataclass(slots=True)
class _Graph:
    meta: AttentionMetadata  # views of the runner's input buffers at this shape
    rows: torch.Tensor  # [batch * q] arange: logits at every row
    replay: Callable[[], None]


class CudaGraphRunner:
    def __init__(self, model: LlamaForCausalLM, cache: PagedKVCache, max_batch: int,
                 max_query_len: int, max_model_len: int, *, capture: bool | None = None,
                 min_context: int = 256):
        """cache: the engine's; one of its blocks becomes the scratch block.
        capture: record and replay CUDA graphs (default: on a CUDA model)."""
        self.model = model
        self.cache = cache
        self.capture = model.device.type == "cuda" if capture is None else capture
        self.max_query_len = max_query_len
        self.batch_sizes = batch_buckets(max_batch)
        self.widths = width_buckets(max_model_len, cache.block_size, min_context)
        cache.add(SCRATCH_SEQ)
        self.scratch_block = int(cache.plan([(SCRATCH_SEQ, cache.block_size)]).block_tables[0, 0])

        dev, i64 = model.device, torch.int64
        cfg = model.config
        max_tokens = max_batch * max_query_len
        self.ids = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.slots = torch.zeros(max_tokens, dtype=i64, device=dev)
        self.block_tables = torch.zeros(max_batch, self.widths[-1], dtype=i64, device=dev)
        self.seq_lens = torch.zeros(max_batch, dtype=i64, device=dev)
        self.logits = torch.zeros(max_tokens, cfg.vocab_size, dtype=model.dtype, device=dev)
        self.hidden: dict[tuple[int, ...], torch.Tensor] = {}  # layers -> [L, max_tokens, hidden]
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.num_runs = 0  # steps served by the runner

    def key(self, meta: AttentionMetadata, hidden_layers: tuple[int, ...] = ()) -> GraphKey | None:
        """The graph a step planned as `meta` runs in, or None when it runs eagerly.
        Sequences may feed different numbers of tokens (a verify step with a K per
        sequence): each is padded to the longest."""
        q = max(meta.query_lens)
        if q > self.max_query_len:
            return None
        batch = bucket(self.batch_sizes, meta.batch_size)
        width = bucket(self.widths, meta.block_tables.shape[1])
        if batch is None or width is None:
            return None
        return GraphKey(batch, q, width, tuple(hidden_layers))

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata,
            hidden_layers: tuple[int, ...] = (),
            hidden_indices: torch.Tensor | None = None) -> ForwardOutput | None:
        """The forward of a step with no prefill, from a graph; None when the
        step's shape has none (run the model eagerly then). input_ids: [T] laid
        out as in `meta`, already planned in the cache. Logits come at every
        row; hidden states of hidden_layers at hidden_indices (default all).
        The outputs are views of the runner's buffers: read them before the
        next run."""
        key = self.key(meta, hidden_layers)
        if key is None:
            return None
        graph = self.graphs.get(key) or self._capture(key)
        t, q = meta.num_tokens, key.query_len
        w = meta.block_tables.shape[1]
        # rows: [T] where each fed token sits in the graph's [batch * q] layout; None
        # when every sequence feeds q tokens (the layouts agree).
        rows = None
        if t != meta.batch_size * q:
            rows = torch.tensor([s * q + j for s, n in enumerate(meta.query_lens) for j in range(n)],
                                dtype=torch.int64, device=self.ids.device)
            self._pad_rows(0, meta.batch_size * q)  # padding first, the real rows over it
            self.ids.index_copy_(0, rows, input_ids)
            self.positions.index_copy_(0, rows, meta.positions)
            self.slots.index_copy_(0, rows, meta.slot_mapping)
        else:
            self.ids[:t].copy_(input_ids)
            self.positions[:t].copy_(meta.positions)
            self.slots[:t].copy_(meta.slot_mapping)
        self.block_tables[: meta.batch_size, :w].copy_(meta.block_tables)
        self.seq_lens[: meta.batch_size].copy_(meta.seq_lens)
        self._pad(key, meta.batch_size, w)
        graph.replay()
        self.num_runs += 1
        hidden = None
        if hidden_layers:
            out = self.hidden[key.hidden_layers]  # [L, max_tokens, hidden]
            # Rows of the fed layout -> rows of the graph's.
            index = rows if hidden_indices is None else (
                hidden_indices if rows is None else rows[hidden_indices])
            hidden = out[:, :t] if index is None else out.index_select(1, index)
        logits = self.logits[:t] if rows is None else self.logits.index_select(0, rows)
        return ForwardOutput(logits, hidden)

    def _pad(self, key: GraphKey, batch: int, width: int) -> None:
        """Sequences batch..key.batch become padding: token 0 at position 0,
        writing to and reading from the scratch block only. Block-table columns
        width..key.width of real sequences point at the scratch block (masked).
        A real sequence's own padding rows (it feeds fewer than q tokens) are set
        the same way before its tokens are copied in: position 0 attends to its
        first key only, and their K/V go to the scratch block, which no real
        sequence's table holds at a column its positions reach."""
        self._pad_rows(batch * key.query_len, key.num_tokens)
        self.block_tables[:batch, width: key.width].fill_(self.scratch_block)
        self.block_tables[batch: key.batch, : key.width].fill_(self.scratch_block)
        self.seq_lens[batch: key.batch].fill_(1)

    def _pad_rows(self, first: int, last: int) -> None:
        """Rows first..last-1 feed token 0 at position 0 into the scratch block."""
        self.ids[first:last].zero_()
        self.positions[first:last].zero_()
        self.slots[first:last].fill_(self.scratch_block * self.cache.block_size)

    def _capture(self, key: GraphKey) -> _Graph:
        dev, q, t = self.model.device, key.query_len, key.num_tokens
        meta = AttentionMetadata(
            positions=self.positions[:t], slot_mapping=self.slots[:t],
            query_start=torch.arange(0, t + 1, q, device=dev),
            seq_lens=self.seq_lens[: key.batch], block_tables=self.block_tables[: key.batch, : key.width],
            query_lens=[q] * key.batch, max_seq_len=key.width * self.cache.block_size,
            block_size=self.cache.block_size)
        rows = torch.arange(t, device=dev)
        layers = key.hidden_layers
        if layers and layers not in self.hidden:
            self.hidden[layers] = torch.zeros(len(layers), self.ids.shape[0],
                                              self.model.config.hidden_size,
                                              dtype=self.model.dtype, device=dev)

        def forward() -> None:
            out = self.model(self.ids[:t], meta, self.cache, logits_indices=rows,
                             hidden_layers=layers, static_shapes=True)
            self.logits[:t].copy_(out.logits)
            if layers:
                self.hidden[layers][:, :t].copy_(out.hidden_states)

        graph = _Graph(meta, rows, forward)
        if self.capture:
            # Padding only while warming up: those runs execute, and must write
            # nothing but the scratch block.
            self._pad(key, 0, 0)
            graph.replay = self._record(forward)
        self.graphs[key] = graph
        return graph

    def _record(self, forward: Callable[[], None]) -> Callable[[], None]:
        # A warm-up run on a side stream first keeps lazy initialisation
        # (cuBLAS workspaces, kernel selection) out of the graph.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        cuda_graph = torch.cuda.CUDAGraph()
        # thread_local: a drafter running on the same GPU from another thread
        # may keep allocating while this thread captures.
        with torch.cuda.graph(cuda_graph, pool=self.pool, capture_error_mode="thread_local"):
            forward()
        return cuda_graph.replay
