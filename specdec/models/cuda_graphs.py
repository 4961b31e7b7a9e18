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
own blocks point at it too (masked by causality). Each graph reads all its
inputs (ids, positions, slots, lengths, block table) from one int64 buffer of
its own, which a step fills with one asynchronous copy from a pinned host
buffer where the step was laid out, padding included: planned on the host, a
step costs no synchronous host-to-device copy and no padding kernels. Graphs
copy their outputs (logits, each row's argmax, hidden states) into fixed
buffers, so all graphs share their outputs and one memory pool. The argmax is
what a greedy step reads: its acceptance then needs one [T] int64 copy back and
no kernel outside the graph. Graphs are captured lazily, the first time a shape is seen.

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
    meta: AttentionMetadata  # views of `inputs` at this shape
    # [4 t + batch + batch * width] int64 on the model's device (t = batch * q), laid
    # out by _input_views: the graph's every input, filled by one copy a step.
    inputs: torch.Tensor
    rows: torch.Tensor  # [t] arange: logits at every row
    replay: Callable[[], None]


def _input_views(inputs: torch.Tensor, key: GraphKey) -> tuple[torch.Tensor, ...]:
    """A graph's input buffer [4 t + batch + batch * width] as its parts: ids, positions,
    slots, fed rows (each [t]), seq_lens [batch] and block_tables [batch, width]. Fed
    rows are where each token fed sits in the graph's [batch * q] layout (its first T
    entries); the graph does not read them, the outputs' gather after it does."""
    t, b = key.num_tokens, key.batch
    ids, positions, slots, rows, seq_lens, tables = inputs.split(
        [t, t, t, t, b, b * key.width])
    return ids, positions, slots, rows, seq_lens, tables.view(b, key.width)


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

        dev = model.device
        cfg = model.config
        max_tokens = max_batch * max_query_len
        self.logits = torch.zeros(max_tokens, cfg.vocab_size, dtype=model.dtype, device=dev)
        # Each row's argmax, taken inside the graph: a greedy step reads these alone, one
        # small copy back ([T] int64) and no kernel after the replay.
        self.argmax = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.hidden: dict[tuple[int, ...], torch.Tensor] = {}  # layers -> [L, max_tokens, hidden]
        self.graphs: dict[GraphKey, _Graph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # Host buffers the inputs are staged in, two so that a step may fill one while
        # the other's copy is in flight (pinned on CUDA: the copy runs asynchronously),
        # each with the event its last copy recorded.
        size = 4 * max_tokens + max_batch * (1 + self.widths[-1])
        pinned = dev.type == "cuda"
        self._staging = [torch.zeros(size, dtype=torch.int64, pin_memory=pinned)
                         for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
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
        out as in `meta`, already planned in the cache; both best on the host
        (`PagedKVCache.plan(..., device="cpu")`): they are staged there and reach the
        device in one asynchronous copy (device tensors are read back first, a sync).
        Logits and their argmax come at every row; hidden states of hidden_layers at
        hidden_indices (default all; a device tensor). The outputs are views of the
        runner's buffers: read them before the next run."""
        key = self.key(meta, hidden_layers)
        if key is None:
            return None
        graph = self.graphs.get(key) or self._capture(key)
        t = meta.num_tokens
        host = self._stage(key, input_ids.cpu(), meta.to("cpu"))
        graph.inputs.copy_(host, non_blocking=True)
        if graph.inputs.device.type == "cuda":
            event = self._copied[self._turn] = torch.cuda.Event()
            event.record()
        self._turn ^= 1
        graph.replay()
        self.num_runs += 1
        # rows: [T] where each fed token sits in the graph's layout; None when every
        # sequence feeds q tokens (the layouts agree).
        rows = None if t == key.num_tokens else _input_views(graph.inputs, key)[3][:t]
        hidden = None
        if hidden_layers:
            out = self.hidden[key.hidden_layers]  # [L, max_tokens, hidden]
            # Rows of the fed layout -> rows of the graph's.
            index = rows if hidden_indices is None else (
                hidden_indices if rows is None else rows[hidden_indices])
            hidden = out[:, :t] if index is None else out.index_select(1, index)
        if rows is None:
            return ForwardOutput(self.logits[:t], hidden, self.argmax[:t])
        return ForwardOutput(self.logits.index_select(0, rows), hidden,
                             self.argmax.index_select(0, rows))

    def _stage(self, key: GraphKey, input_ids: torch.Tensor,
               meta: AttentionMetadata | None) -> torch.Tensor:
        """The graph's inputs for a step (all padding for meta None) in the next host
        buffer, once its previous copy has left: [4 t + batch + batch * width] int64.

        Padding: sequences past the batch, and a sequence's rows past its own tokens
        (it feeds fewer than q), feed token 0 at position 0 and write their K/V to the
        scratch block; block-table columns past a sequence's own blocks point at the
        scratch block too (masked by causality). Position 0 attends to its first key
        only, and no real sequence's table holds the scratch block at a column its
        positions reach."""
        turn = self._turn
        if (event := self._copied[turn]) is not None:
            event.synchronize()
        size = 4 * key.num_tokens + key.batch * (1 + key.width)
        host = self._staging[turn][:size]
        ids, positions, slots, rows, seq_lens, tables = _input_views(host, key)
        host.zero_()
        slots.fill_(self.scratch_block * self.cache.block_size)
        seq_lens.fill_(1)
        tables.fill_(self.scratch_block)
        if meta is None:
            return host
        t, q = meta.num_tokens, key.query_len
        if t == key.num_tokens:
            fed = slice(0, t)
        else:
            fed = torch.tensor([s * q + j for s, n in enumerate(meta.query_lens)
                                for j in range(n)], dtype=torch.int64)
            rows[:t] = fed
        ids[fed] = input_ids
        positions[fed] = meta.positions
        slots[fed] = meta.slot_mapping
        b, w = meta.batch_size, meta.block_tables.shape[1]
        seq_lens[:b] = meta.seq_lens
        tables[:b, :w] = meta.block_tables
        return host

    def _capture(self, key: GraphKey) -> _Graph:
        dev, q, t = self.model.device, key.query_len, key.num_tokens
        inputs = torch.zeros(4 * t + key.batch * (1 + key.width), dtype=torch.int64, device=dev)
        ids, positions, slots, _, seq_lens, tables = _input_views(inputs, key)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots,
            query_start=torch.arange(0, t + 1, q, device=dev),
            seq_lens=seq_lens, block_tables=tables,
            query_lens=[q] * key.batch, max_seq_len=key.width * self.cache.block_size,
            block_size=self.cache.block_size)
        rows = torch.arange(t, device=dev)
        layers = key.hidden_layers
        if layers and layers not in self.hidden:
            self.hidden[layers] = torch.zeros(len(layers), self.logits.shape[0],
                                              self.model.config.hidden_size,
                                              dtype=self.model.dtype, device=dev)

        def forward() -> None:
            out = self.model(ids, meta, self.cache, logits_indices=rows,
                             hidden_layers=layers, static_shapes=True)
            self.logits[:t].copy_(out.logits)
            torch.argmax(out.logits, dim=-1, out=self.argmax[:t])
            if layers:
                self.hidden[layers][:, :t].copy_(out.hidden_states)

        graph = _Graph(meta, inputs, rows, forward)
        if self.capture:
            # Padding only while warming up: those runs execute, and must write
            # nothing but the scratch block.
            inputs.copy_(self._stage(key, ids, None))
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
