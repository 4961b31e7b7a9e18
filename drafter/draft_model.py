"""Draft model drafting: a small causal LM that shares the target's tokenizer.

Any Hugging Face directory the model core loads (Llama, Mistral, Qwen2, Qwen3
layouts) serves as a draft model. Each sequence owns a slot in one paged KV
cache: the KV of its committed context (prompt + accepted tokens) and of the
drafts of its last proposal. A proposal for the whole batch is one ragged
forward that catches every sequence up on its committed tokens lacking KV
(chunked when large), then one batched forward per further draft position.

After each verifier step the KV stays valid for the longest prefix of what
the cache holds that the new context still starts with: the accepted drafts
(and any later draft that happens to equal the token the target chose), since
KV depends only on the tokens before it. Everything past that is truncated.

Greedy drafts (argmax) carry no probabilities: one-hot q, exact. With
`sample=True` a request with temperature > 0 samples from q = its draft logits
shaped by the request's temperature, min-p, top-k and top-p exactly as the
verifier shapes p, and the proposal carries the full q ([k, V]), which exact
rejection sampling needs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafter.method import Draft, DrafterInfo, DraftMethod
from drafter.registry import register
from specdec.models import LlamaForCausalLM, PagedKVCache, load_model
from specdec.models.cuda_graphs import CudaGraphRunner
from specdec.pb import common_pb2
from specdec.sampling import SamplingMetadata, SamplingParams, apply_sampling, inverse_cdf

# Files whose presence says a model directory carries its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class _Seq:
    slot: int  # sequence id in the KV cache
    tokens: list[int]  # committed context: prompt + accepted tokens
    max_num_speculative_tokens: int
    sampling: SamplingParams | None  # None: greedy drafts without probabilities
    generator: torch.Generator | None  # the request's own (seeded); None: the shared one
    num_cached: int = 0  # leading committed tokens whose KV is in the cache
    # Tokens past the committed ones whose KV is in the cache: the last proposal's drafts
    # (all but its final one, which was never fed). Cache length = num_cached + len(drafted).
    drafted: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Job:
    """One sequence's part in a propose call."""

    key: Hashable
    seq: _Seq
    num_speculative_tokens: int
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] float32 per sampled draft


def _has_tokenizer(model_dir: Path) -> bool:
    return any((model_dir / f).is_file() for f in _TOKENIZER_FILES)


def _fingerprint(model_dir: Path) -> tuple[int, str]:
    # Imported here: transformers is slow to import and in-memory models need none of it.
    from specdec.tokenizer import Tokenizer

    try:
        return Tokenizer.from_dir(model_dir).fingerprint()
    except (OSError, ValueError) as e:
        raise ValueError(f"{model_dir}: cannot load its tokenizer: {e}") from None


def _config_vocab_size(model_dir: Path) -> int:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    vocab = json.loads(path.read_text()).get("vocab_size")
    if not isinstance(vocab, int):
        raise ValueError(f"{path}: no integer vocab_size")
    return vocab


@register
class DraftModelMethod(DraftMethod):
    name = "draft_model"

    def __init__(self, model_dir: str | Path | None = None, model: LlamaForCausalLM | None = None,
                 target_dir: str | Path | None = None, dtype: str = "float32",
                 device: str = "cpu", max_num_speculative_tokens: int = 8,
                 num_kv_blocks: int = 1024, block_size: int = 16,
                 max_model_len: int | None = None, max_num_batched_tokens: int = 2048,
                 sample: bool = False, pipeline: bool = True, cuda_graphs: bool = True,
                 cuda_graph_max_batch: int = 64):
        """model_dir loads the draft model in `dtype` on `device`; `model` passes one
        already built (tests), used as it is. target_dir: the target model directory;
        its tokenizer and vocabulary must match the draft model's. max_model_len
        defaults to the draft model's max_position_embeddings. On a GPU the one-token
        draft steps of up to cuda_graph_max_batch sequences replay CUDA graphs (the
        runner the verifier uses too) unless cuda_graphs is False; catch-up steps run
        eagerly."""
        if (model_dir is None) == (model is None):
            raise ValueError("give exactly one of model_dir (a directory) and model")
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"num_kv_blocks and block_size must be >= 1, got {num_kv_blocks} "
                             f"and {block_size}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        if model is None:
            model_dir = Path(model_dir)
            if not model_dir.is_dir():
                raise ValueError(f"draft model {model_dir}: not a directory")
            try:
                model = load_model(model_dir, dtype=dtype, device=device)
            except OSError as e:  # no config.json or weights
                raise ValueError(f"draft model {model_dir}: {e}") from None
        self.model = model.eval()
        self.device = model.device
        vocab_size = model.config.vocab_size
        vocab_size, tokenizer_hash = self._check_vocab(
            vocab_size, None if model_dir is None else Path(model_dir),
            None if target_dir is None else Path(target_dir))
        if max_model_len is None:
            max_model_len = model.config.max_position_embeddings
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.sample = sample
        self._info = DrafterInfo(
            method=common_pb2.SPEC_METHOD_DRAFT_MODEL,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_hash,
            model_name="" if model_dir is None else Path(model_dir).name,
            max_num_speculative_tokens=max_num_speculative_tokens,
            returns_probs=sample,
            # Greedy blocks are drafted ahead while the verifier verifies (drafter/pipeline.py).
            supports_pipelining=pipeline,
            max_model_len=max_model_len,
        )
        use_graphs = cuda_graphs and self.device.type == "cuda"
        # With graphs, one more block: the scratch block their padding writes to.
        self.cache: PagedKVCache = model.make_kv_cache(num_kv_blocks + use_graphs, block_size)
        self.graphs = CudaGraphRunner(model, self.cache, cuda_graph_max_batch, 1,
                                      max_model_len) if use_graphs else None
        self._seqs: dict[Hashable, _Seq] = {}
        self._slots = itertools.count()
        # Unseeded sampled requests draw from one generator, as in the verifier.
        self._shared_generator = torch.Generator(device=self.device)
        self._shared_generator.seed()

    @staticmethod
    def _check_vocab(vocab_size: int, model_dir: Path | None,
                     target_dir: Path | None) -> tuple[int, str]:
        """(vocab_size, tokenizer_hash) to report; ValueError on any mismatch.

        The verifier's vocabulary is its model's logit count, and it compares hashes only
        when its tokenizer covers exactly that many ids; the same rule applies here, so a
        padded embedding (more logits than tokens) still connects, on vocab_size alone."""
        own = model_dir is not None and _has_tokenizer(model_dir)
        fingerprint = _fingerprint(model_dir) if own else None
        if fingerprint is not None and fingerprint[0] > vocab_size:
            raise ValueError(f"draft model {model_dir}: its tokenizer has {fingerprint[0]} tokens "
                             f"but the model only {vocab_size} logits (config.json vocab_size)")
        if target_dir is not None:
            draft_name = model_dir or "(in-memory model)"
            target_vocab = _config_vocab_size(target_dir)
            target_fp = _fingerprint(target_dir) if _has_tokenizer(target_dir) else None
            if fingerprint is not None and target_fp is not None and fingerprint != target_fp:
                raise ValueError(
                    f"tokenizer mismatch: draft model {draft_name} has vocab {fingerprint[0]} "
                    f"hash {fingerprint[1][:16]}..., target {target_dir} has vocab "
                    f"{target_fp[0]} hash {target_fp[1][:16]}...")
            if target_vocab != vocab_size:
                raise ValueError(
                    f"vocab size mismatch: draft model {draft_name} has {vocab_size} logits, "
                    f"target {target_dir} has {target_vocab} (config.json vocab_size)")
            if fingerprint is None:  # a draft directory without tokenizer files: the target's
                fingerprint = target_fp
        if fingerprint is None or fingerprint[0] != vocab_size:
            return vocab_size, ""
        return fingerprint

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def info(self) -> DrafterInfo:
        return self._info

    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: SamplingParams, max_num_speculative_tokens: int) -> None:
        self.free(key)
        params = sampling if self.sample and not sampling.is_greedy else None
        seq = _Seq(slot=next(self._slots), tokens=list(prompt_ids) + list(output_ids),
                   max_num_speculative_tokens=max_num_speculative_tokens, sampling=params,
                   generator=params.make_generator(self.device) if params else None)
        self.cache.add(seq.slot)
        self._seqs[key] = seq

    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        seq = self._seqs[key]
        if num_rollback_tokens > len(seq.tokens):
            raise ValueError(f"num_rollback_tokens {num_rollback_tokens} exceeds the context's "
                             f"{len(seq.tokens)} tokens")
        del seq.tokens[len(seq.tokens) - num_rollback_tokens:]
        keep = min(seq.num_cached, len(seq.tokens))
        if keep == seq.num_cached:
            # Drafts sit right after the committed tokens (a proposal caught every
            # committed token up); their KV holds as far as the new tokens repeat them.
            for drafted, new in zip(seq.drafted, new_token_ids, strict=False):
                if drafted != new:
                    break
                keep += 1
        seq.tokens.extend(new_token_ids)
        seq.num_cached = keep
        seq.drafted = []
        self.cache.truncate(seq.slot, keep)

    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        jobs = self._admit(wanted)
        if not jobs:
            return {}
        logits = self._catch_up(jobs)  # [n, V]: each job's first draft position
        argmax = None  # [n] the logits' argmax where a graph took it
        active = jobs
        while True:
            self._choose(active, logits, argmax)
            active = [job for job in active if len(job.token_ids) < job.num_speculative_tokens]
            if not active:
                break
            # Feed each still-drafting sequence its last draft: logits of the next position.
            # Planned on the host where a graph will stage it (cuda_graphs.py).
            meta = self.cache.plan([(job.seq.slot, 1) for job in active],
                                   device=None if self.graphs is None else "cpu")
            ids = torch.tensor([job.token_ids[-1] for job in active])
            # One token per sequence: a graph's shape (its logits are read before the next run).
            out = self.graphs.run(ids, meta) if self.graphs is not None else None
            if out is None:
                out = self.model(ids.to(self.device), meta.to(self.device), self.cache)
            logits, argmax = out.logits, out.argmax
            for job in active:
                job.seq.drafted.append(job.token_ids[-1])
        return {job.key: Draft(job.token_ids, torch.stack(job.probs) if job.probs else None)
                for job in jobs}

    def free(self, key: Hashable) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self.cache.free(seq.slot)

    def has(self, key: Hashable) -> bool:
        return key in self._seqs

    # -- propose, step by step ---------------------------------------------------

    def _admit(self, wanted: dict[Hashable, int]) -> list[_Job]:
        """The sequences that get a proposal, with their K; reserves nothing yet, but
        the chosen ones fit in the free blocks together, so no plan of this call fails."""
        candidates: list[_Job] = []
        for key, k in wanted.items():
            seq = self._seqs.get(key)
            if seq is None or not seq.tokens:
                continue
            # The context after the drafts stays within max_model_len.
            k = min(k, seq.max_num_speculative_tokens, self._info.max_num_speculative_tokens,
                    self.max_model_len - len(seq.tokens))
            if k < 1:
                continue
            # KV of drafts no advance confirmed (a second proposal for the same context).
            keep = seq.num_cached
            if keep == len(seq.tokens):
                keep -= 1  # the first draft's logits need one committed token fed
            if keep != self.cache.length(seq.slot):
                self.cache.truncate(seq.slot, keep)
                seq.num_cached, seq.drafted = keep, []
            candidates.append(_Job(key, seq, k))
        jobs: list[_Job] = []
        free = self.cache.num_free_blocks
        for job in candidates:
            # Catch-up tokens, then every draft but the last (never fed).
            n_new = len(job.seq.tokens) - job.seq.num_cached + job.num_speculative_tokens - 1
            need = self.cache.blocks_needed(job.seq.slot, n_new)
            if need <= free:  # otherwise no room: propose nothing for it this round
                free -= need
                jobs.append(job)
        return jobs

    def _catch_up(self, jobs: list[_Job]) -> torch.Tensor:
        """Feed every job's committed tokens that lack KV, at most max_num_batched_tokens
        per forward; returns [len(jobs), V] logits at each job's last committed token."""
        pending = [(i, job.seq.tokens[job.seq.num_cached:]) for i, job in enumerate(jobs)]
        last: list[torch.Tensor | None] = [None] * len(jobs)
        while pending:
            budget = self.max_num_batched_tokens
            chunk: list[tuple[int, list[int]]] = []
            rest: list[tuple[int, list[int]]] = []
            for i, tokens in pending:
                take = min(len(tokens), budget)
                if take:
                    chunk.append((i, tokens[:take]))
                    budget -= take
                if take < len(tokens):
                    rest.append((i, tokens[take:]))
            finished = {i for i, _ in chunk} - {i for i, _ in rest}
            meta = self.cache.plan([(jobs[i].seq.slot, len(t)) for i, t in chunk])
            ids = torch.tensor([t for _, tokens in chunk for t in tokens], device=self.device)
            ends = meta.last_token_indices()  # [len(chunk)]
            rows = [n for n, (i, _) in enumerate(chunk) if i in finished]
            out = self.model(ids, meta, self.cache,
                             logits_indices=ends[torch.tensor(rows, device=ends.device)]
                             if rows else ends[:0])
            for row, n in enumerate(rows):
                last[chunk[n][0]] = out.logits[row]
            for i, tokens in chunk:
                jobs[i].seq.num_cached += len(tokens)
            pending = rest
        return torch.stack(last)  # type: ignore[arg-type]

    def _choose(self, jobs: list[_Job], logits: torch.Tensor,
                argmax: torch.Tensor | None = None) -> None:
        """Append each job's next draft. logits: [len(jobs), V] for its next position;
        argmax: [len(jobs)] theirs, where a CUDA graph took it (one small copy back)."""
        greedy = (logits.argmax(-1) if argmax is None else argmax).tolist()
        sampled = [n for n, job in enumerate(jobs) if job.seq.sampling is not None]
        if sampled:
            params = [jobs[n].seq.sampling for n in sampled]
            metadata = SamplingMetadata.from_params(
                params, [jobs[n].seq.generator for n in sampled], self._shared_generator,
                self.device)
            rows = torch.tensor(sampled, device=logits.device)
            q = apply_sampling(logits.index_select(0, rows), metadata,
                               torch.ones(len(sampled), dtype=torch.int64,
                                          device=logits.device))  # [S, V] float32
            # One uniform per row from its request's generator, then the inverse CDF for
            # all rows at once: torch.multinomial walks the vocabulary row by row
            # (0.8 ms a row of 49152 tokens on a CPU core).
            u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=g.device)
                           for g in metadata.generators]).to(q.device)  # [S]
            for row, (n, token) in enumerate(zip(sampled, inverse_cdf(q, u).tolist(), strict=True)):
                greedy[n] = token
                jobs[n].probs.append(q[row])
        for job, token in zip(jobs, greedy, strict=True):
            job.token_ids.append(token)
