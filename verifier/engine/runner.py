"""The target model's side of a step: one ragged forward over the whole batch.

Prefill chunks and verify blocks (last token + K_i drafts, K_i per sequence,
0 allowed) share one forward. A tree block (specdec/tree.py) runs under tree
attention. Logits are taken only where a token is sampled: every position of a
verify block, and the last position of a prefill chunk that completes its
sequence. Hidden states are taken, for drafters that read them (EAGLE), at
every fed position of their sequences; the engine keeps the rows it needs
after sampling. On a GPU, steps with no prefill and no tree replay a CUDA
graph (specdec/models/cuda_graphs.py); everything else runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec import tree as token_tree
from specdec.models import LlamaForCausalLM
from specdec.models.cuda_graphs import CudaGraphRunner
from verifier.engine.drafts import Drafts
from verifier.engine.proposer import Proposer
from verifier.engine.scheduler import Scheduled


@dataclass(slots=True)
class Hidden:
    """The step's hidden-state output and where each sequence's rows start in it."""

    states: torch.Tensor | None  # [len(layers), M, hidden]
    layers: tuple[int, ...]
    first_row: dict[int, int]  # seq_id -> first of its rows (one per fed token)

    def take(self, seq_id: int, proposer: Proposer, num_rows: int,
             rows: list[int] | None = None) -> torch.Tensor | None:
        """[num_rows, L_seq, hidden]: the sequence's first num_rows rows (or those of
        its fed tokens listed in `rows`: a tree's root and accepted path), layers in
        the order its drafter asked for."""
        if self.states is None or seq_id not in self.first_row:
            return None
        index = [self.layers.index(layer) for layer in proposer.hidden_layers(seq_id)]
        first = self.first_row[seq_id]
        if rows is None:
            out = self.states[index, first: first + num_rows]  # [L_seq, P, hidden]
        else:
            out = self.states[index][:, [first + r for r in rows]]
        return out.transpose(0, 1).contiguous()


@dataclass(slots=True)
class RunnerOutput:
    logits: torch.Tensor  # [sum(len(d) + 1 for d in drafts), V] raw target logits, in blocks
    # The sequences that sample this step, in batch order, and the drafts each fed:
    # its block is the len(drafts[i]) + 1 rows of its last token and drafts ([] and
    # one row for a prefill chunk that completes its sequence).
    sampled: list[Scheduled]
    drafts: list[list[int]]
    hidden: Hidden
    num_tokens: int  # rows fed in all: prefill chunks, and 1 + drafts per verify block
    # [len(logits)] int64 each row's argmax, where the step took it (inside a CUDA graph)
    argmax: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, num_kv_blocks: int, block_size: int,
                 max_num_seqs: int, max_query_len: int, max_model_len: int, cuda_graphs: bool,
                 enable_prefix_caching: bool = False):
        """The KV cache is made here: with CUDA graphs it holds one more block, the
        scratch block their padding writes to."""
        self.model = model
        use_graphs = cuda_graphs and model.device.type == "cuda"
        self.cache = model.make_kv_cache(num_kv_blocks + use_graphs, block_size,
                                         enable_prefix_caching=enable_prefix_caching)
        self.graphs = CudaGraphRunner(model, self.cache, max_num_seqs, max_query_len,
                                      max_model_len) if use_graphs else None

    def run(self, batch: list[Scheduled], drafts: Drafts,
            proposer: Proposer | None) -> RunnerOutput:
        """Plan the batch in the cache (its KV grows by every fed token) and run it."""
        feeds = [_feed(item, drafts.token_ids.get(item.seq.seq_id, [])) for item in batch]
        # No prefill and no tree: every row is sampled, which is what a graph computes.
        # Such a step is planned on the host, where the graph's inputs are staged.
        graphed = (self.graphs is not None and not drafts.trees
                   and not any(item.is_prefill for item in batch))
        meta = self.cache.plan(
            [(item.seq.seq_id, len(f)) for item, f in zip(batch, feeds, strict=True)],
            device="cpu" if graphed else None)
        starts = meta.query_start[:-1].tolist()  # [B] first row of each sequence's feed
        if drafts.trees:
            # The root of a tree block is the last token, at position num_computed.
            token_tree.plan_tree_attention(
                meta, [drafts.trees.get(item.seq.seq_id) for item in batch],
                [item.seq.num_computed for item in batch])
        sampled, sampled_drafts, logit_rows = _logit_rows(batch, feeds, starts)
        hidden_layers, hidden_rows, hidden_indices = _hidden_rows(batch, feeds, starts, proposer)

        dev = self.model.device
        ids = torch.tensor([t for f in feeds for t in f])  # [T]
        hidden_index = torch.tensor(hidden_indices, dtype=torch.int64).to(dev)  # [M]
        out = self.graphs.run(ids, meta, hidden_layers, hidden_index) if graphed else None
        if out is None:
            meta = meta.to(dev)
            out = self.model(ids.to(dev), meta, self.cache,
                             logits_indices=torch.tensor(logit_rows, dtype=torch.int64, device=dev),
                             hidden_layers=hidden_layers, hidden_indices=hidden_index)
        if self.cache.features is not None:
            _keep_features(self.cache, batch, feeds, meta.slot_mapping.to(dev), out.hidden_states,
                           hidden_layers, hidden_rows, hidden_index, proposer)
        return RunnerOutput(out.logits, sampled, sampled_drafts,
                            Hidden(out.hidden_states, hidden_layers, hidden_rows), len(ids),
                            out.argmax)


def _feed(item: Scheduled, draft: list[int]) -> list[int]:
    """The tokens a sequence feeds: its prefill chunk, or its last token and drafts."""
    seq = item.seq
    if item.is_prefill:
        return seq.tokens[seq.num_computed: seq.num_computed + item.num_tokens]
    return [seq.tokens[-1], *draft]


def _logit_rows(batch: list[Scheduled], feeds: list[list[int]], starts: list[int]) -> tuple[
        list[Scheduled], list[list[int]], list[int]]:
    """The sequences that sample, the drafts each fed, and the fed rows to take
    logits at: every position of a verify block; the last position of a prefill
    chunk that reaches the end of its sequence."""
    sampled: list[Scheduled] = []
    drafts: list[list[int]] = []
    rows: list[int] = []
    for item, feed, start in zip(batch, feeds, starts, strict=True):
        if item.is_prefill:
            if item.seq.num_computed + len(feed) == len(item.seq.tokens):
                sampled.append(item)
                drafts.append([])
                rows.append(start + len(feed) - 1)
        else:
            sampled.append(item)
            drafts.append(feed[1:])
            rows.extend(range(start, start + len(feed)))
    return sampled, drafts, rows


def _hidden_rows(batch: list[Scheduled], feeds: list[list[int]], starts: list[int],
                 proposer: Proposer | None) -> tuple[tuple[int, ...], dict[int, int], list[int]]:
    """The layers any drafter of the batch wants (in order of first request), where
    each wanting sequence's rows start in the hidden output (seq_id -> row), and the
    fed rows to take: every row of those sequences."""
    if proposer is None:
        return (), {}, []
    layers: list[int] = []
    for item in batch:
        for layer in proposer.hidden_layers(item.seq.seq_id):
            if layer not in layers:
                layers.append(layer)
    first_row: dict[int, int] = {}
    indices: list[int] = []
    for item, feed, start in zip(batch, feeds, starts, strict=True):
        if layers and proposer.hidden_layers(item.seq.seq_id):
            first_row[item.seq.seq_id] = len(indices)
            indices.extend(range(start, start + len(feed)))
    return tuple(layers), first_row, indices


def _keep_features(cache, batch: list[Scheduled], feeds: list[list[int]],
                   slot_mapping: torch.Tensor,
                   states: torch.Tensor | None, layers: tuple[int, ...],
                   first_row: dict[int, int], hidden_index: torch.Tensor,
                   proposer: Proposer | None) -> None:
    """Write the features of every sequence that keeps them (PagedKVCache.keep_features)
    beside its KV: states [len(layers), M, hidden] are the hidden rows of the fed
    positions hidden_index [M] (rows into the step's T tokens, slot_mapping [T]). A
    sequence that keeps features but got no rows this step (its drafter stopped
    reading them) loses them for the blocks it registers from now on."""
    wanted = cache.feature_layers
    rows: list[int] = []
    for item, feed in zip(batch, feeds, strict=True):
        seq_id = item.seq.seq_id
        if not cache.wants_features(seq_id):
            continue
        if seq_id not in first_row or proposer.hidden_layers(seq_id) != wanted:
            cache.lose_features(seq_id)
            continue
        start = first_row[seq_id]
        rows.extend(range(start, start + len(feed)))
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.int64, device=slot_mapping.device)  # [R]
    sel = states[[layers.index(layer) for layer in wanted]].index_select(1, index)  # [L, R, H]
    cache.write_features(slot_mapping.index_select(0, hidden_index.index_select(0, index)),
                         sel.transpose(0, 1).reshape(len(rows), -1))
