"""Compatibility matrix: which speculative-decoding setups keep the target's output.

Every cell drives the real verifier engine in process (scheduler, paged KV cache,
one ragged forward, rejection sampler, rollback) with a real draft method behind
an in-process adapter, over tiny random Llama targets built here and saved as
Hugging Face directories (EAGLE heads in the checkpoint layout beside them):

    drafter    none (K = 0, the baseline row), ngram, draft_model, eagle, eagle3
    sampling   greedy: outputs equal plain greedy decoding (engine, K = 0) of the
               same dtype, batch, attention and graphs; "none" is checked against
               a full-context forward (no KV cache) instead.
               random: chi-square test of the joint law of the first 3 tokens
               against the target's own law (vocabulary of 8)
    K          static (K = 3), or dynamic (each sequence's K changes every step,
               cycling 0..3, through Engine.set_num_speculative_tokens as the
               service does on a PolicyUpdate)
    batch      1 or 8 requests at a time (mixed prompt lengths, chunked prefill)
    dtype      float64 (exact reference), float32, bfloat16; fp8 KV cache
    attention  every backend in specdec.models.attention.ATTENTION_BACKENDS
    graphs     CUDA graphs on / off (on only where a GPU exists)

Status: pass; warn when greedy output differs from plain only where the target's
top-2 logits are within the dtype's tolerance (TOLERANCE: docs/design.md section 4's
1e-4 for float32; 0 for float64) or when a random cell's first p-value was
<= 0.001 and a second seed passed; fail otherwise; n/a for what cannot run here.

    .venv/bin/python -m bench.matrix [--reduced] [--device cpu|cuda] [--out PATH]

--reduced (CI; seconds on CPU): every drafter greedy at batch 8, static K,
float32, and one random-sampling cell with fewer requests. The full CPU matrix
takes about 7 minutes on 2 cores (random cells: 3000 requests at batch 8, 1000
at batch 1). Writes JSON and Markdown (same stem) and prints the Markdown; exits
1 when a cell fails.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.matrix")

import argparse
import dataclasses
import itertools
import json
import math
import platform
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.stats import chi_square_p_value
from drafter import registry
from drafter.method import DraftMethod
from specdec.models import LlamaForCausalLM, ModelConfig, load_model, save_model
from specdec.models.attention import ATTENTION_BACKENDS
from specdec.sampling import SamplingParams
from train.inprocess import InProcessProposer
from verifier.engine import Engine, EngineConfig, Request
from verifier.engine.proposer import Proposer

RESULTS = Path(__file__).resolve().parent / "results"

DRAFTERS = ("none", "ngram", "suffix", "draft_model", "eagle", "eagle3")
SAMPLINGS = ("greedy", "random")
K_MODES = ("static", "dynamic")
BATCHES = (1, 8)
DTYPES = ("float64", "float32", "bfloat16", "fp8-kv")
K_STATIC = 3
K_MAX = 3  # dynamic K cycles 0..K_MAX
# Greedy divergences are accepted (warn) only where the target's top-2 logits are
# this close. float32: docs/design.md section 4. bfloat16 (8-bit mantissa): logits of
# these targets are O(10), where one bf16 ulp is 0.0625, and a verify pass and a
# one-token decode round activations differently in every layer. Seen: 1 ulp;
# 0.25 (4 ulps) leaves a margin.
TOLERANCE = {"float64": 0.0, "float32": 1e-4, "bfloat16": 0.25}
P_MIN = 1e-3

# Greedy target: vocabulary 128, peaked logits (greedy paths that are no single
# repeated token). Random target: vocabulary 8, flatter (every path is likely).
GREEDY_VOCAB, RANDOM_VOCAB = 128, 8
HIDDEN, HEADS, KV_HEADS, LAYERS = 64, 4, 2, 4
EAGLE3_LAYERS = [1, 2, 3]  # the default (2, L // 2, L - 3) needs L >= 7
GREEDY_TOKENS = 32
NUM_CHECKED = 3  # random cells: joint law of the first 3 tokens
TEMPERATURE = 0.8


@dataclass(frozen=True, slots=True)
class Dims:
    drafter: str
    sampling: str
    k: str  # "0" (no drafter), "static" or "dynamic"
    batch: int
    dtype: str
    attention: str
    cuda_graphs: bool


@dataclass(slots=True)
class Cell:
    dims: Dims
    status: str = "n/a"  # pass | warn | fail | n/a
    note: str = ""
    metrics: dict = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self.dims), "status": self.status, "note": self.note,
                "metrics": self.metrics, "seconds": round(self.seconds, 2)}


@dataclass(slots=True)
class Settings:
    device: str = "cpu"
    greedy_prompts: int = 8
    random_requests: int = 3000  # per random cell at batch 8
    random_requests_batch1: int = 1000  # at batch 1 (one at a time: ~3 engine steps each)
    seed: int = 0


# -- tiny models on disk ------------------------------------------------------------------

def tiny_config(vocab: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
                       head_dim=HIDDEN // HEADS, max_position_embeddings=512)


def hf_config(cfg: ModelConfig, **extra) -> dict:
    return cfg.to_hf_dict() | extra


@torch.no_grad()
def make_target_and_draft(vocab: int, seed: int, logit_scale: float, target_dir: Path,
                          draft_dir: Path, noise: float = 0.15) -> None:
    """A random float64 target, and a draft model that is the target plus noise: same
    vocabulary, and drafts that are right often but not always (partial acceptance)."""
    torch.manual_seed(seed)
    target = LlamaForCausalLM(tiny_config(vocab)).to(torch.float64).eval()
    target.lm_head.weight.mul_(logit_scale)
    save_model(target, target_dir)
    for p in target.parameters():
        p.add_(noise * p.std() * torch.randn_like(p))
    save_model(target, draft_dir)


def save_eagle_head(path: Path, kind: str, cfg: ModelConfig, seed: int) -> None:
    """Random head weights in the EAGLE repositories' naming and config layout."""
    g = torch.Generator().manual_seed(seed)
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def lin(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / math.sqrt(cols)

    def norm() -> torch.Tensor:
        return 1 + 0.1 * torch.randn(h, generator=g)

    layer = "midlayer." if kind == "eagle3" else "layers.0."
    attn_in = 2 * h if kind == "eagle3" else h
    t = {"fc.weight": lin(h, 3 * h if kind == "eagle3" else 2 * h),
         layer + "self_attn.q_proj.weight": lin(cfg.num_heads * d, attn_in),
         layer + "self_attn.k_proj.weight": lin(cfg.num_kv_heads * d, attn_in),
         layer + "self_attn.v_proj.weight": lin(cfg.num_kv_heads * d, attn_in),
         layer + "self_attn.o_proj.weight": lin(h, cfg.num_heads * d),
         layer + "mlp.gate_proj.weight": lin(inter, h), layer + "mlp.up_proj.weight": lin(inter, h),
         layer + "mlp.down_proj.weight": lin(h, inter),
         layer + "post_attention_layernorm.weight": norm()}
    extra: dict = dict(num_hidden_layers=1)
    if kind == "eagle3":
        draft_vocab = max(2, cfg.vocab_size * 3 // 4)
        ids = torch.randperm(cfg.vocab_size, generator=g)[:draft_vocab].sort().values
        t |= {layer + "input_layernorm.weight": norm(), layer + "hidden_norm.weight": norm(),
              "norm.weight": norm(), "lm_head.weight": 4 * lin(draft_vocab, h),
              "d2t": ids - torch.arange(draft_vocab)}
        extra |= dict(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                      eagle_aux_hidden_state_layer_ids=EAGLE3_LAYERS)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(cfg, **extra)))
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))


@dataclass(slots=True)
class World:
    """One target, its draft model and heads on disk, and the prompts its cells run."""

    root: Path
    prompts: list[list[int]]
    _models: dict = field(default_factory=dict)

    def target(self, dtype: str, attention: str, device: str) -> LlamaForCausalLM:
        key = (dtype, attention, device)
        if key not in self._models:
            self._models[key] = load_model(self.root / "target", dtype, device, attention)
        return self._models[key]

    def method(self, drafter: str, dtype: str, device: str) -> DraftMethod:
        """A fresh draft method (methods hold per-sequence state), in the target's dtype."""
        files = dict(target_dir=str(self.root / "target"), dtype=dtype, device=device,
                     num_kv_blocks=256)
        options = {
            "ngram": {},
            "suffix": {},
            # sample=True: requests that sample get drafts sampled from q, with q sent along.
            "draft_model": files | dict(model_dir=str(self.root / "draft"), sample=True),
            "eagle": files | dict(model_dir=str(self.root / "eagle")),
            "eagle3": files | dict(model_dir=str(self.root / "eagle3")),
        }
        return registry.create(drafter, max_num_speculative_tokens=K_MAX, **options[drafter])


def make_world(root: Path, vocab: int, seed: int, logit_scale: float,
               prompts: list[list[int]]) -> World:
    make_target_and_draft(vocab, seed, logit_scale, root / "target", root / "draft")
    for i, kind in enumerate(("eagle", "eagle3")):
        save_eagle_head(root / kind, kind, tiny_config(vocab), seed + 10 + i)
    return World(root, prompts)


def greedy_prompts(n: int, seed: int) -> list[list[int]]:
    """Mixed lengths (2..40); every other prompt repeats a phrase (n-gram lookup hits)."""
    rng = random.Random(seed)
    lengths = [3, 17, 5, 40, 9, 26, 2, 33]
    out = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        if i % 2:
            phrase = [rng.randrange(GREEDY_VOCAB) for _ in range(4)]
            out.append((phrase * length)[:length])
        else:
            out.append([rng.randrange(GREEDY_VOCAB) for _ in range(length)])
    return out


# -- the engine with a draft method in process ----------------------------------------------

@dataclass(slots=True)
class Run:
    outputs: list[list[int]]  # per request, in request order
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # engine steps
    emissions: int = 0  # (sequence, step) pairs that emitted tokens

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def run_requests(model: LlamaForCausalLM, requests: list[Request], batch: int,
                 proposer: Proposer | None, dynamic_k: bool, graphs: bool, seed: int) -> Run:
    """Requests through one engine, at most `batch` at a time (a finished one makes
    room for the next). dynamic_k: before every step each running request gets
    K = (step + its index) mod (K_MAX + 1)."""
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    engine = Engine(model, EngineConfig(
        max_num_seqs=batch, max_model_len=longest + K_MAX + 1, block_size=16,
        num_kv_blocks=batch * (-(-(longest + K_MAX + 1) // 16)) + 2,
        max_num_batched_tokens=64, max_num_speculative_tokens=K_MAX, seed=seed,
        cuda_graphs=graphs), proposer)
    index = {r.request_id: i for i, r in enumerate(requests)}
    run = Run([[] for _ in requests])
    pending = iter(requests)
    active: list[str] = []
    while True:
        while len(active) < batch and (r := next(pending, None)) is not None:
            engine.add_request(r)
            active.append(r.request_id)
        if not active:
            return run
        if dynamic_k:
            for rid in active:
                engine.set_num_speculative_tokens(rid, (run.steps + index[rid]) % (K_MAX + 1))
        run.steps += 1
        for o in engine.step():
            run.outputs[index[o.request_id]] += o.new_token_ids
            run.drafted += o.num_drafted
            run.accepted += o.num_accepted
            run.emissions += bool(o.new_token_ids)
            if o.finish_reason is not None:
                active.remove(o.request_id)


def make_proposer(world: World, dims: Dims, device: str) -> Proposer | None:
    return None if dims.drafter == "none" else \
        InProcessProposer(world.method(dims.drafter, dims.dtype, device), K_MAX)


# -- greedy: identical to plain, or divergent only at near ties ------------------------------

@torch.inference_mode()
def full_context_logits(model: LlamaForCausalLM, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64: next-token logits after every prefix, from one forward
    over the whole context (no incremental decoding)."""
    cache = model.make_kv_cache(-(-len(tokens) // 16), 16)
    cache.add(0)
    meta = cache.plan([(0, len(tokens))])
    rows = torch.arange(len(tokens), device=model.device)
    ids = torch.tensor(tokens, device=model.device)
    return model(ids, meta, cache, logits_indices=rows).logits.double().cpu()


def check_greedy(model: LlamaForCausalLM, prompts: list[list[int]], outputs: list[list[int]],
                 reference: list[list[int]] | None, tol: float) -> tuple[str, str]:
    """Greedy outputs against `reference` (plain greedy; None: the full-context argmax).

    pass: identical (reference None: every token is the exact argmax of a forward over
    its whole context). warn: an output differs, but where it leaves the reference the
    two tokens' logits are within `tol`, and every token it emits is within `tol` of
    the argmax. fail otherwise; the note names the request, token and gap."""
    worst = (0.0, -1, -1)  # (gap, request, token)
    num_differing = 0
    for i, out in enumerate(outputs):
        want = reference[i] if reference is not None else None
        if want is not None and out == want:
            continue
        if want is not None and len(out) != len(want):
            return "fail", f"request {i}: {len(out)} tokens, plain greedy {len(want)}"
        # [n, V]: row j holds the logits that chose out[j] (one forward, no KV reuse).
        logits = full_context_logits(model, prompts[i] + out[:-1])[len(prompts[i]) - 1:]
        ids = torch.tensor(out)
        gaps = logits.max(dim=1).values - logits.gather(1, ids[:, None])[:, 0]  # [n]
        if want is not None:
            d = next(j for j, (a, b) in enumerate(zip(out, want, strict=True)) if a != b)
            gaps[d] = max(gaps[d], abs(logits[d, want[d]] - logits[d, out[d]]))
        num_differing += want is not None or bool(gaps.max() > 0)
        j = int(gaps.argmax())
        if gaps[j] >= worst[0]:
            worst = (float(gaps[j]), i, j)
    gap, req, token = worst
    if num_differing == 0:
        return "pass", ""
    if gap > tol:
        return "fail", (f"request {req} token {token}: logit {gap:.3g} below the "
                        f"{'plain token' if reference is not None else 'argmax'} "
                        f"(tolerance {tol:g})")
    what = "differ from plain greedy" if reference is not None else \
        "leave the full-context argmax"
    return "warn", (f"{num_differing}/{len(outputs)} outputs {what} only at near ties "
                    f"(top-2 logits {gap:.2g} apart <= {tol:g})")


# -- random: the joint law of the first tokens ----------------------------------------------

@torch.inference_mode()
def target_law(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """[V ** NUM_CHECKED] float64: the target's p(x1, x2, x3 | prompt) at TEMPERATURE."""
    v = model.config.vocab_size
    contexts: list[list[int]] = [[]]
    law = torch.ones(1, dtype=torch.float64)
    for _ in range(NUM_CHECKED):
        cache = model.make_kv_cache(sum(-(-(len(prompt) + len(c)) // 16) for c in contexts), 16)
        for i in range(len(contexts)):
            cache.add(i)
        meta = cache.plan([(i, len(prompt) + len(c)) for i, c in enumerate(contexts)])
        ids = torch.tensor([t for c in contexts for t in prompt + c], device=model.device)
        logits = model(ids, meta, cache).logits.double().cpu()  # [len(contexts), V]
        law = (law[:, None] * torch.softmax(logits / TEMPERATURE, dim=-1)).reshape(-1)
        contexts = [c + [t] for c in contexts for t in range(v)]
    return law


def random_requests(prompts: list[list[int]], n: int) -> list[Request]:
    """Half stop after 3 tokens (their first verify block has one draft, so the bonus
    token is among the checked ones), half after 4 (two drafts)."""
    params = SamplingParams(temperature=TEMPERATURE)
    return [Request(f"r{i}", prompts[i % len(prompts)], NUM_CHECKED + (i // len(prompts)) % 2,
                    params, ignore_eos=True, num_speculative_tokens=0)
            for i in range(n)]


def sample_p_value(model: LlamaForCausalLM, world: World, dims: Dims, settings: Settings,
                   seed: int, laws: torch.Tensor) -> tuple[float, Run]:
    requests = random_requests(world.prompts, settings.random_requests if dims.batch > 1
                               else settings.random_requests_batch1)
    for r in requests:
        r.num_speculative_tokens = 0 if dims.drafter == "none" else K_STATIC
    run = run_requests(model, requests, dims.batch, make_proposer(world, dims, settings.device),
                       dims.k == "dynamic", dims.cuda_graphs, seed)
    v, groups = model.config.vocab_size, len(world.prompts)
    cells = torch.tensor([_cell_index(out[:NUM_CHECKED], v) for out in run.outputs])
    group = torch.arange(len(requests)) % groups
    observed = torch.bincount(group * v ** NUM_CHECKED + cells,
                              minlength=groups * v ** NUM_CHECKED).view(groups, -1)
    expected = laws * observed.sum(dim=1, keepdim=True).double()
    return chi_square_p_value(observed, expected), run


def _cell_index(tokens: list[int], v: int) -> int:
    index = 0
    for t in tokens:
        index = index * v + t
    return index


# -- cells ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Matrix:
    """The worlds (built once) and the plain greedy runs cells compare against."""

    greedy: World
    random: World
    settings: Settings
    _plain: dict = field(default_factory=dict)
    _laws: dict = field(default_factory=dict)

    def plain_greedy(self, model: LlamaForCausalLM, dims: Dims) -> Run:
        key = (dims.dtype, dims.batch, dims.attention, dims.cuda_graphs)
        if key not in self._plain:
            self._plain[key] = run_requests(model, greedy_requests(self.greedy.prompts, 0),
                                            dims.batch, None, False, dims.cuda_graphs,
                                            self.settings.seed)
        return self._plain[key]

    def laws(self, model: LlamaForCausalLM, dims: Dims) -> torch.Tensor:
        key = (dims.dtype, dims.attention)
        if key not in self._laws:
            self._laws[key] = torch.stack([target_law(model, p) for p in self.random.prompts])
        return self._laws[key]


def greedy_requests(prompts: list[list[int]], k: int) -> list[Request]:
    return [Request(f"g{i}", p, GREEDY_TOKENS, SamplingParams(temperature=0.0), ignore_eos=True,
                    num_speculative_tokens=k) for i, p in enumerate(prompts)]


def not_applicable(dims: Dims, device: str) -> str | None:
    if dims.cuda_graphs and device != "cuda":
        return "n/a (no GPU)"
    if dims.dtype == "fp8-kv":
        return ("n/a (not supported: the paged KV cache stores K/V in the model dtype; "
                "EngineConfig has no KV-cache dtype)")
    return None


def run_cell(matrix: Matrix, dims: Dims) -> Cell:
    cell = Cell(dims)
    reason = not_applicable(dims, matrix.settings.device)
    if reason is not None:
        cell.note = reason
        return cell
    t0 = time.perf_counter()
    try:
        if dims.sampling == "greedy":
            greedy_cell(matrix, cell)
        else:
            random_cell(matrix, cell)
    except Exception as e:  # a crash is a failed cell, named
        cell.status, cell.note = "fail", f"{type(e).__name__}: {e}"
    cell.seconds = time.perf_counter() - t0
    return cell


def greedy_cell(matrix: Matrix, cell: Cell) -> None:
    dims, world, s = cell.dims, matrix.greedy, matrix.settings
    model = world.target(dims.dtype, dims.attention, s.device)
    plain = matrix.plain_greedy(model, dims)
    tol = TOLERANCE[dims.dtype]
    if dims.drafter == "none":
        cell.status, cell.note = check_greedy(model, world.prompts, plain.outputs, None, tol)
        cell.metrics = {"tokens_per_step": _per_step(plain)}
        return
    run = run_requests(model, greedy_requests(world.prompts, K_STATIC), dims.batch,
                       make_proposer(world, dims, s.device), dims.k == "dynamic",
                       dims.cuda_graphs, s.seed)
    cell.status, cell.note = check_greedy(model, world.prompts, run.outputs, plain.outputs, tol)
    cell.metrics = {"acceptance": round(run.acceptance, 3), "drafted": run.drafted,
                    "tokens_per_step": _per_step(run)}
    if run.drafted == 0:  # then the cell checked nothing of speculation
        cell.status = "fail"
        cell.note = (cell.note + "; " if cell.note else "") + "no draft was ever verified"


def random_cell(matrix: Matrix, cell: Cell) -> None:
    dims, world, s = cell.dims, matrix.random, matrix.settings
    model = world.target(dims.dtype, dims.attention, s.device)
    laws = matrix.laws(model, dims)
    p, run = sample_p_value(model, world, dims, s, s.seed, laws)
    cell.metrics = {"p_value": p, "requests": len(run.outputs),
                    "acceptance": round(run.acceptance, 3), "drafted": run.drafted}
    if p > P_MIN:
        cell.status = "pass"
    else:
        # One in a thousand exact cells fails by chance: a second seed tells which.
        p2, _ = sample_p_value(model, world, dims, s, s.seed + 1, laws)
        cell.metrics["p_value_second_seed"] = p2
        cell.status = "warn" if p2 > P_MIN else "fail"
        cell.note = (f"p = {p:.2g} <= {P_MIN:g}, then p = {p2:.2g} with a second seed"
                     + (" (chance)" if p2 > P_MIN else ": the law differs from the target's"))
    if dims.drafter != "none" and run.drafted == 0:
        cell.status = "fail"
        cell.note = (cell.note + "; " if cell.note else "") + "no draft was ever verified"


def _per_step(run: Run) -> float:
    """Tokens a sequence gains per step it emits in (prefill steps included)."""
    return round(sum(map(len, run.outputs)) / max(run.emissions, 1), 3)


def grid(reduced: bool) -> Iterator[Dims]:
    """Every cell, rows (drafter, sampling, K) first; n/a cells included."""
    for drafter, sampling in itertools.product(DRAFTERS, SAMPLINGS):
        for k in (("0",) if drafter == "none" else K_MODES):
            for dtype, batch, attention, graphs in itertools.product(
                    DTYPES, BATCHES, ATTENTION_BACKENDS, (False, True)):
                dims = Dims(drafter, sampling, k, batch, dtype, attention, graphs)
                if not reduced or in_reduced(dims):
                    yield dims


def in_reduced(dims: Dims) -> bool:
    """CI's subset: every drafter greedy at batch 8, static K, float32; one random cell."""
    if dims.dtype != "float32" or dims.batch != 8 or dims.k == "dynamic":
        return False
    return dims.sampling == "greedy" or dims.drafter == "draft_model"


def build_matrix(root: Path, settings: Settings) -> Matrix:
    greedy = make_world(root / "greedy", GREEDY_VOCAB, settings.seed + 1, 4.0,
                        greedy_prompts(settings.greedy_prompts, settings.seed))
    rng = random.Random(settings.seed + 5)
    prompts = [[rng.randrange(RANDOM_VOCAB) for _ in range(n)] for n in (4, 11)]
    rand = make_world(root / "random", RANDOM_VOCAB, settings.seed + 2, 2.0, prompts)
    return Matrix(greedy, rand, settings)


def run_matrix(settings: Settings, reduced: bool,
               progress: Callable[[Cell], None] | None = None) -> list[Cell]:
    cells = []
    with tempfile.TemporaryDirectory(prefix="specdec-matrix-") as tmp:
        matrix = build_matrix(Path(tmp), settings)
        for dims in grid(reduced):
            cell = run_cell(matrix, dims)
            cells.append(cell)
            if progress is not None:
                progress(cell)
    return cells


# -- report ---------------------------------------------------------------------------------

def summary(cells: list[Cell]) -> str:
    n = {s: sum(c.status == s for c in cells) for s in ("pass", "warn", "fail", "n/a")}
    return (f"{len(cells)} cells: {n['pass']} pass / {n['warn']} warn / {n['fail']} fail / "
            f"{n['n/a']} n/a")


def _label(d: Dims) -> str:
    return " ".join(filter(None, [
        d.drafter, d.sampling, "" if d.k == "0" else f"{d.k} K", f"b{d.batch}", d.dtype,
        d.attention, "graphs" if d.cuda_graphs else "eager"]))


def render(cells: list[Cell], meta: dict) -> str:
    ran = [c for c in cells if c.status != "n/a"]
    columns = sorted({(c.dims.dtype, c.dims.batch, c.dims.attention, c.dims.cuda_graphs)
                      for c in ran}, key=lambda col: (DTYPES.index(col[0]), col[1:]))
    rows = list(dict.fromkeys((c.dims.drafter, c.dims.sampling, c.dims.k) for c in cells))
    by = {(c.dims.drafter, c.dims.sampling, c.dims.k, c.dims.dtype, c.dims.batch,
           c.dims.attention, c.dims.cuda_graphs): c for c in cells}
    notes: list[str] = []
    lines = [f"# Compatibility matrix ({meta['mode']}, {meta['device']})", "",
             f"**{summary(cells)}**", "",
             f"`{meta['command']}` on {meta['machine']}, torch {meta['torch']}, "
             f"{meta['date']}, {meta['seconds']:.0f} s. Greedy: identical to plain greedy "
             f"(engine, K = 0; `none`: to a full-context forward), a divergence allowed only "
             f"at a top-2 logit gap within {', '.join(f'{k} {v:g}' for k, v in TOLERANCE.items())}"
             f" (warn). Random: chi-square of the joint law of the first {NUM_CHECKED} tokens "
             f"(vocab {RANDOM_VOCAB}, temperature {TEMPERATURE}), pass at p > {P_MIN:g}. "
             f"Static K = {K_STATIC}; dynamic K cycles 0..{K_MAX} per step. Cells show the "
             "status, then the acceptance rate (greedy) or the p-value (random). The draft "
             "model is the target plus noise; the EAGLE heads are random, so greedy steps "
             "reject nearly all their drafts (their accepted drafts run in the random "
             "cells).", ""]
    header = ["drafter", "sampling", "K"] + [
        f"{dt} b{b}" + (f" {a}" if len(ATTENTION_BACKENDS) > 1 else "")
        + (" graphs" if g else "") for dt, b, a, g in columns]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for drafter, sampling, k in rows:
        out = [drafter, sampling, "-" if k == "0" else k]
        for col in columns:
            c = by.get((drafter, sampling, k, *col))
            if c is None or c.status == "n/a":
                out.append("" if c is None else "n/a")
                continue
            text = c.status.upper() if c.status == "fail" else c.status
            m = c.metrics
            if "p_value" in m:
                text += f" p={m['p_value']:.2g}"
            elif "acceptance" in m:
                text += f" {m['acceptance']:.2f}"
            if c.note:
                notes.append(f"{len(notes) + 1}. {_label(c.dims)}: {c.note}")
                text += f" [{len(notes)}]"
            out.append(text)
        lines.append("| " + " | ".join(out) + " |")
    skipped = sorted({c.note for c in cells if c.status == "n/a"})
    if skipped:
        lines += ["", "Not run: " + "; ".join(
            f"{_na_what(cells, note)}: {note}" for note in skipped) + "."]
    if notes:
        lines += ["", "Notes:", "", *notes]
    fails = [c for c in cells if c.status == "fail"]
    lines += ["", f"Fails ({len(fails)}):" if fails else "Fails: none."]
    lines += [f"- {_label(c.dims)}: {c.note}" for c in fails]
    return "\n".join(lines) + "\n"


def _na_what(cells: list[Cell], note: str) -> str:
    dims = [c.dims for c in cells if c.status == "n/a" and c.note == note]
    if all(d.cuda_graphs for d in dims):
        return "CUDA graphs on"
    if all(d.dtype == "fp8-kv" for d in dims):
        return "fp8 KV cache"
    return f"{len(dims)} cells"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true", help="CI's quick CPU subset")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=Path, help="JSON path; the Markdown goes beside it "
                    "(default bench/results/matrix.json, matrix-reduced.json with --reduced)")
    ap.add_argument("--random-requests", type=int, help="requests per random-sampling cell at "
                    "batch 8, a third of them at batch 1 (default 3000; 1500 with --reduced)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny tensors: 1)")
    ap.add_argument("--quiet", action="store_true", help="no per-cell progress lines")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    torch.set_num_threads(args.threads)
    n = args.random_requests or (1500 if args.reduced else 3000)
    settings = Settings(device=args.device, random_requests=n, random_requests_batch1=n // 3)
    out = args.out or RESULTS / ("matrix-reduced.json" if args.reduced else "matrix.json")

    def progress(cell: Cell) -> None:
        if not args.quiet and cell.status != "n/a":
            print(f"{cell.status:4} {cell.seconds:6.1f}s  {_label(cell.dims)}"
                  + (f"  ({cell.note})" if cell.note else ""), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    cells = run_matrix(settings, args.reduced, progress)
    meta = {
        "mode": "reduced" if args.reduced else "full",
        "device": args.device,
        "command": "python -m bench.matrix"
        + (" --reduced" if args.reduced else "")
        + (" --device cuda" if args.device == "cuda" else ""),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "seconds": time.perf_counter() - t0,
        "summary": summary(cells),
        "tolerance": TOLERANCE,
        "p_min": P_MIN,
        "k_static": K_STATIC,
        "max_num_speculative_tokens": K_MAX,
        "random_requests": {
            "batch_8": settings.random_requests,
            "batch_1": settings.random_requests_batch1,
        },
        "greedy_prompts": settings.greedy_prompts,
        "greedy_tokens": GREEDY_TOKENS,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "cells": [c.to_json() for c in cells]}, indent=1)
                   + "\n")
    text = render(cells, meta)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 1 if any(c.status == "fail" for c in cells) else 0


if __name__ == "__main__":
    raise SystemExit(main())
