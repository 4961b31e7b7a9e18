"""EAGLE and EAGLE-3 drafting: a small head reads the target's hidden states.

Position i of a sequence becomes one row of the head, (t_{i+1}, f_i), once
both the token after it and the target's feature f_i have arrived (the
verifier sends f for the positions it computed and kept: a prefill chunk,
or the previous last token plus the accepted drafts). Those committed rows
live in the head's KV cache. A proposal runs, batched over the sequences:

    step 1   the rows not yet in the cache, up to position n - 2 (t_{n-1} is
             the newest token), in one ragged forward; the output at n - 2
             drafts d_1 (the token at position n)
    step j   one row per sequence, (d_{j-1}, the previous step's output), at
             position n - 3 + j; drafts d_j

as vLLM's EAGLE proposer does, and then drops the draft rows from the cache
again: the next outcome brings the target's own features for whatever was
accepted. Drafts are greedy and carry no probabilities (one-hot q, exact).
Step 1 takes in at most CATCH_UP_BUDGET_ROWS rows beyond each sequence's own
step: a burst's prompts join over several proposals, each sequence drafting
once its whole context is in.

With tree_width > 1, a greedy request's proposal is a token tree (EAGLE-2's
idea at no extra head cost): the chain above plus, at each depth, the head's
next tree_width - 1 choices as leaves, of which the K tokens with the highest
path probability are proposed (specdec/tree.py, chain_with_siblings). The
verifier scores them all in the one forward a chain of K would take.

With lookup on (`lookup_min_n` > 0), a sequence whose context ends in an
n-gram of at least that many tokens seen earlier in it gets the prompt-lookup
draft (drafter/ngram.py) instead, and a head chain whose context plus drafts
runs into such an n-gram takes the lookup continuation from there: the head
copies badly (it drafts a quoted passage or the code being edited far worse
than lookup does), and lookup costs no forward. The features of steps drafted
by lookup still join the head cache at the next step the head drafts, so the
head context never goes stale.

A sequence started without features (a reconnect re-starts it with its
output so far) has none for its old positions and never will: its head
context begins at the first position whose feature arrives, and drafting
resumes from there with a shorter context rather than not at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from drafter.heads.base import DraftHead
from drafter.heads.load import load_head
from drafter.method import Draft, DrafterInfo, DraftMethod
from drafter.ngram import TokenBuffer, find_continuation
from drafter.registry import register
from specdec.models.linear import pack_linear_weights
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from specdec.tree import chain_with_siblings

# Feature rows a sequence may hold back before advance folds those past them into its
# head cache on its own: bounds the memory of sequences that run long without drafting.
_MAX_PENDING_ROWS = 256
# Context rows a proposal takes in beyond what each sequence brings every step (up to
# _STEP_ROWS of its own), for all its sequences together. A sequence whose context does
# not fit takes in what is left of the budget and gets no draft this step (its rows
# join at the next ones). After a burst of prompts, taking every context in at once
# stalled the whole batch's step: 16 prompts on two CPU cores, 1819 rows, 259 ms where
# a step took 35 ms, and dynamic K, finding drafting near even at that batch, then ran
# 65 plain steps after it. A bounded catch-up never stalls a step far, and what a batch
# that turns to plain decoding has not taken in yet costs nothing.
CATCH_UP_BUDGET_ROWS = 256
_STEP_ROWS = 16
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(slots=True)
class _Seq:
    cache_id: int
    tokens: TokenBuffer  # committed context t_0 .. t_{n-1}
    kv_begin: int = 0  # first position in the head cache (> 0 only after features went missing)
    kv_end: int = 0  # positions kv_begin .. kv_end - 1 are committed rows of the head cache
    greedy: bool = True  # the request samples greedily: its drafts may form a tree
    pending: list[torch.Tensor] = field(default_factory=list)  # [p, H] features of kv_end ..
    num_pending: int = 0
    last_out: torch.Tensor | None = None  # [H] head output at position kv_end - 1

    @property
    def feature_end(self) -> int:
        return self.kv_end + self.num_pending

    def pending_features(self) -> torch.Tensor:
        if len(self.pending) > 1:
            self.pending = [torch.cat(self.pending)]
        return self.pending[0]

    def keep_pending(self, start: int, stop: int) -> None:
        """Keep pending rows start..stop - 1 (counted from kv_end)."""
        if stop - start == self.num_pending:
            return
        rows = self.pending_features()[start:stop] if stop > start else None
        self.pending = [] if rows is None else [rows]
        self.num_pending = stop - start


class _EagleMethod(DraftMethod):
    """Shared by both heads; they differ only in the head (drafter/heads/)."""

    _spec_method: int

    def __init__(self, model_dir: str | Path | None = None, target_dir: str | Path | None = None,
                 dtype: str = "float32", device: str = "cpu", max_num_speculative_tokens: int = 8,
                 num_kv_blocks: int = 2048, block_size: int = 16, lookup_min_n: int = 0,
                 lookup_max_n: int = 4, min_confidence: float = 0.0, tree_width: int = 1):
        """model_dir: the head (config.json + safetensors); target_dir: the target model
        it drafts for (its config, embedding / lm_head where the head has none, and
        its tokenizer for the fingerprint). num_kv_blocks x block_size positions of head
        KV cache are shared by all sequences; one that does not fit gets no draft.
        lookup_min_n > 0: prompt lookup (n-grams of lookup_min_n..lookup_max_n tokens)
        drafts where it finds a match, the head elsewhere; 0 = the head alone.
        min_confidence: a head chain stops before a draft the head gives a lower
        probability (after the first); 0 = always K drafts.
        tree_width > 1: greedy requests get token trees of K tokens, the chain and up to
        tree_width - 1 alternatives at each depth (sampled requests keep chains)."""
        if model_dir is None or target_dir is None:
            raise ValueError(f"{self.name} needs its head (model_dir, --model) and the target "
                             f"model directory (target_dir, --target)")
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"num_kv_blocks and block_size must be >= 1, got {num_kv_blocks}, "
                             f"{block_size}")
        if not Path(target_dir).is_dir():
            raise ValueError(f"target_dir {target_dir}: not a directory")
        if lookup_min_n < 0 or (lookup_min_n and lookup_max_n < lookup_min_n):
            raise ValueError(f"lookup n-gram sizes need 0 <= lookup_min_n <= lookup_max_n, got "
                             f"lookup_min_n={lookup_min_n}, lookup_max_n={lookup_max_n}")
        self.lookup_min_n, self.lookup_max_n = lookup_min_n, lookup_max_n
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = min_confidence
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.tree_width = tree_width
        self.head: DraftHead = load_head(self.name, model_dir, target_dir, dtype, device)
        # As the target's projections: few rows (a drafting step of a few sequences) on
        # the small-rows kernel, more (a batch's step, a context taken in) on oneDNN's
        # packed weights, where F.linear took 2.2-2.6x as long (16-32 rows of the
        # default head, one thread). Inference only: a head loaded for training keeps
        # F.linear.
        pack_linear_weights(self.head)
        cfg = self.head.config
        vocab_size, tokenizer_hash = _fingerprint(Path(target_dir), cfg.vocab_size)
        self._info = DrafterInfo(
            method=self._spec_method,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_hash,
            model_name=Path(model_dir).name,
            max_num_speculative_tokens=max_num_speculative_tokens,
            needs_hidden_states=True,
            hidden_state_layers=list(cfg.target_layers),
            hidden_size=cfg.target_hidden_size,
            hidden_state_dtype=self.head.dtype,
        )
        self._cache = self.head.make_kv_cache(num_kv_blocks, block_size)
        self.catch_up_budget_rows = CATCH_UP_BUDGET_ROWS
        self._seqs: dict[Hashable, _Seq] = {}
        self._cache_ids = itertools.count()

    def info(self) -> DrafterInfo:
        return self._info

    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: SamplingParams, max_num_speculative_tokens: int) -> None:
        # Greedy whatever the sampling: one-hot drafts stay exact under rejection sampling.
        self.free(key)
        seq = _Seq(next(self._cache_ids), TokenBuffer(list(prompt_ids) + list(output_ids)),
                   greedy=sampling.temperature == 0.0)
        self._cache.add(seq.cache_id)
        self._seqs[key] = seq

    @torch.inference_mode()
    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        seq = self._seqs[key]
        if num_rollback_tokens:
            self._rollback(seq, num_rollback_tokens)
        seq.tokens.extend(new_token_ids)
        if hidden_states is not None and hidden_states.shape[0]:
            self._add_features(seq, hidden_states, hidden_start_position)
        # Only the rows past the bound; the rest wait for a proposal's catch-up budget.
        # The verifier holds a plain-decoding sequence's rows until it drafts again, so
        # they come with the step that asks for drafts, and folded whole here they would
        # stall that step as an unbudgeted catch-up does.
        take = min(self._rows_ready(seq), seq.num_pending - _MAX_PENDING_ROWS)
        if take > 0 and self._cache.can_append(seq.cache_id, take):
            self._catch_up([(seq, take)])

    @torch.inference_mode()
    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        cap = self._info.max_num_speculative_tokens
        plan: list[tuple[Hashable, _Seq, int]] = []  # (key, seq, K)
        looked_up: dict[Hashable, Draft] = {}
        free_blocks = self._cache.num_free_blocks
        work: list[tuple[_Seq, int]] = []  # (seq, context rows it takes in now)
        budget = self.catch_up_budget_rows
        for key, k in wanted.items():
            seq, k = self._seqs.get(key), min(k, cap)
            if seq is None or k < 1:
                continue
            if self.lookup_min_n:
                copy = find_continuation(seq.tokens.view(), self.lookup_min_n,
                                         self.lookup_max_n, k)
                if copy.size:
                    looked_up[key] = Draft(copy.tolist())
                    continue
            if not self._can_draft(seq):
                continue
            rows = self._rows_ready(seq)
            need = self._cache.blocks_needed(seq.cache_id, rows + k - 1)
            if need > free_blocks:
                continue  # head cache full: this sequence runs without a draft this round
            free_blocks -= need
            # A context past the budget: what is left of it now, the draft later.
            take = rows if rows <= _STEP_ROWS or rows <= budget else budget
            budget = max(budget - take, 0)
            if take:
                work.append((seq, take))
            if take == rows:
                plan.append((key, seq, k))
        self._catch_up(work)
        if not plan:
            return looked_up
        try:
            drafts = self._draft([seq for _, seq, _ in plan], [k for _, _, k in plan])
        finally:
            for _, seq, _ in plan:
                self._cache.truncate(seq.cache_id, seq.kv_end - seq.kv_begin)
        return looked_up | {key: d for (key, _, _), d in zip(plan, drafts, strict=True)}

    def free(self, key: Hashable) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self._cache.free(seq.cache_id)

    def has(self, key: Hashable) -> bool:
        return key in self._seqs

    # -- features and the head cache -------------------------------------------------------

    @staticmethod
    def _rows_ready(seq: _Seq) -> int:
        """Rows that can join the cache: position i needs f_i and t_{i+1}."""
        return max(0, min(seq.feature_end, len(seq.tokens) - 1) - seq.kv_end)

    def _can_draft(self, seq: _Seq) -> bool:
        """Whether the head has (or is about to have) the row of position n - 2."""
        n = len(seq.tokens)
        if seq.feature_end < n - 1:
            return False  # the newest positions' features have not arrived
        return self._rows_ready(seq) > 0 or (seq.last_out is not None and seq.kv_end == n - 1)

    def _add_features(self, seq: _Seq, hidden: torch.Tensor, start: int) -> None:
        """hidden: [P, len(layers), H_t], the target's states of positions start..start+P-1."""
        num = hidden.shape[0]
        if start + num > len(seq.tokens):
            raise ValueError(f"hidden_states: positions {start}..{start + num - 1} are past the "
                             f"context's {len(seq.tokens)} tokens")
        features = self.head.features(hidden.to(self.head.device, self.head.dtype))  # [P, H]
        if start < seq.kv_begin or start > seq.feature_end:
            # No features join these to the cached rows: the head context starts over here.
            self._cut(seq, seq.kv_begin)
            seq.kv_begin = seq.kv_end = start
        elif start < seq.kv_end:
            self._cut(seq, start)  # the target recomputed committed positions
        else:
            seq.keep_pending(0, start - seq.kv_end)
        seq.pending.append(features)
        seq.num_pending += num

    def _rollback(self, seq: _Seq, num: int) -> None:
        n = len(seq.tokens) - num
        if n < 0:
            raise ValueError(f"num_rollback_tokens {num} exceeds the context's "
                             f"{len(seq.tokens)} tokens")
        seq.tokens.drop(num)
        # Row i used t_{i+1}; feature f_i used t_0..t_i.
        if seq.kv_end > max(n - 1, seq.kv_begin):
            self._cut(seq, max(n - 1, seq.kv_begin))
        else:
            seq.keep_pending(0, max(0, min(seq.num_pending, n - seq.kv_end)))

    def _cut(self, seq: _Seq, position: int) -> None:
        """Drop the cached rows from `position` on, and every pending feature."""
        seq.kv_end = position
        self._cache.truncate(seq.cache_id, position - seq.kv_begin)
        seq.pending, seq.num_pending, seq.last_out = [], 0, None

    def _catch_up(self, work: list[tuple[_Seq, int]]) -> None:
        """One forward over the ready rows of several sequences; they become committed."""
        if not work:
            return
        dev = self.head.device
        meta = self._cache.plan([(seq.cache_id, rows) for seq, rows in work])
        ids = torch.from_numpy(np.concatenate(
            [seq.tokens.view()[seq.kv_end + 1: seq.kv_end + 1 + rows] for seq, rows in work]
        )).to(dev, torch.int64)  # [T]
        features = torch.cat([seq.pending_features()[:rows] for seq, rows in work])
        positions = torch.cat([torch.arange(seq.kv_end, seq.kv_end + rows) for seq, rows in work])
        out = self.head(ids, features, positions.to(dev), meta, self._cache)  # [T, H]
        last = out.index_select(0, meta.last_token_indices())  # [B, H]
        for i, (seq, rows) in enumerate(work):
            seq.keep_pending(rows, seq.num_pending)
            seq.kv_end += rows
            seq.last_out = last[i]

    def _draft(self, seqs: list[_Seq], ks: list[int]) -> list[Draft]:
        """Greedy drafts of each sequence, up to K_i of them, one batched head step per
        position. A chain stops early where the head's probability of its next draft is
        below min_confidence (the first draft always stays). With lookup on, a chain whose
        context plus drafts so far ends in a repeated n-gram takes the lookup
        continuation for the rest of its K and leaves the batch. With tree_width > 1, the
        head's top choices at each step make greedy sequences' chains into trees."""
        dev = self.head.device
        gate = self.min_confidence > 0
        width = self.tree_width
        drafts: list[list[int]] = [[] for _ in seqs]
        # Per sequence, the head's top `width` tokens and probabilities at each chain step.
        tops: list[list[tuple[list[int], list[float]]]] = [[] for _ in seqs]

        def head_step(hidden: torch.Tensor):
            """[B, H] -> ([B] chain tokens, [B] their probabilities or None, top or None)."""
            if width == 1:
                return (*self.head.draft_token_ids(hidden, gate), None)
            top_ids, top_probs = self.head.draft_top(hidden, width)  # [B, width] each
            return top_ids[:, 0], top_probs[:, 0], (top_ids.tolist(), top_probs.tolist())

        hidden = torch.stack([seq.last_out for seq in seqs])  # [B, H]
        ids, confidence, top = head_step(hidden)  # [B], [B] or None
        active = list(range(len(seqs)))
        step = 1
        while True:
            keep = []
            sure = [True] * len(active) if not gate or step == 1 else \
                (confidence >= self.min_confidence).tolist()
            for j, (i, tok) in enumerate(zip(active, ids.tolist(), strict=True)):
                if not sure[j]:
                    continue
                drafts[i].append(tok)
                if top is not None:
                    tops[i].append((top[0][j], top[1][j]))
                left = ks[i] - len(drafts[i])
                if left and self.lookup_min_n:
                    context = np.concatenate((seqs[i].tokens.view(),
                                              np.asarray(drafts[i], dtype=np.int32)))
                    copy = find_continuation(context, self.lookup_min_n, self.lookup_max_n,
                                             left)
                    if copy.size:
                        drafts[i] += copy.tolist()
                        continue
                if left:
                    keep.append(j)
            if not keep:
                return [self._proposal(seq, d, t, k)
                        for seq, d, t, k in zip(seqs, drafts, tops, ks, strict=True)]
            if len(keep) < len(active):
                index = torch.tensor(keep, device=dev)
                hidden, ids = hidden.index_select(0, index), ids.index_select(0, index)
                active = [active[j] for j in keep]
            meta = self._cache.plan([(seqs[i].cache_id, 1) for i in active])
            positions = torch.tensor([seqs[i].kv_end + step - 1 for i in active], device=dev)
            hidden = self.head(ids, hidden, positions, meta, self._cache)
            ids, confidence, top = head_step(hidden)
            step += 1

    @staticmethod
    def _proposal(seq: _Seq, chain: list[int], tops: list[tuple[list[int], list[float]]],
                  k: int) -> Draft:
        """The chain, or for a greedy sequence whose chain the head drafted alone (no
        lookup continuation) the best tree of k tokens around it."""
        if not seq.greedy or not tops or len(tops) != len(chain):
            return Draft(chain)
        token_ids, parents = chain_with_siblings([t[0] for t in tops], [t[1] for t in tops], k)
        return Draft(token_ids, parents=parents)


def _fingerprint(target_dir: Path, vocab_size: int) -> tuple[int, str]:
    """(vocab_size, hash) as the verifier reports them for this target: the tokenizer's
    hash when it covers the model's whole vocabulary, else "" (vocab_size alone)."""
    if not any((target_dir / name).is_file() for name in _TOKENIZER_FILES):
        return vocab_size, ""
    # Imported here: transformers is slow to import and only a real target needs it.
    from specdec.tokenizer import Tokenizer

    try:
        vocab, digest = Tokenizer.from_dir(target_dir).fingerprint()
    except (OSError, ValueError) as e:
        raise ValueError(f"target_dir {target_dir}: cannot load its tokenizer: {e}") from None
    return vocab_size, digest if vocab == vocab_size else ""


@register
class EagleMethod(_EagleMethod):
    name = "eagle"
    _spec_method = common_pb2.SPEC_METHOD_EAGLE


@register
class Eagle3Method(_EagleMethod):
    name = "eagle3"
    _spec_method = common_pb2.SPEC_METHOD_EAGLE3

