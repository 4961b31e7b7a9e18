"""EAGLE and EAGLE-3 heads: checkpoints in the layouts vLLM and SGLang load, drafts
equal to a plain-torch reference written from the checkpoint tensors, errors that
name what does not fit, and greedy output unchanged behind a real verifier."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter import registry
from drafter.__main__ import build_method, build_parser
from drafter.eagle import Eagle3Method, EagleMethod
from drafter.heads.load import load_head
from drafter.ngram import find_continuation
from specdec import tree
from specdec.generate import greedy_generate
from specdec.models import (
    LlamaForCausalLM,
    ModelConfig,
    PagedKVCache,
    load_model,
    save_model,
    small_rows,
)
from specdec.models import linear as linear_module
from specdec.models.linear import Linear
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from tests.verifier.test_service import Stack, generate, prompts, run_concurrently, start_msg

VOCAB, H, INTER, HEADS, KV_HEADS, EPS, THETA = 97, 64, 128, 4, 2, 1e-6, 10000.0
D = H // HEADS
DRAFT_VOCAB = 40
TARGET_LAYERS = 8  # EAGLE-3's default layers (2, L // 2, L - 3) = (2, 4, 5)
F64 = torch.float64


# -- checkpoints -----------------------------------------------------------------------

def hf_config(**extra) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
                hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, rms_norm_eps=EPS, rope_theta=THETA,
                max_position_embeddings=1024, tie_word_embeddings=False) | extra


def make_target(path, num_layers: int = TARGET_LAYERS, hidden: int = H, tie: bool = False,
                seed: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=INTER,
                      num_layers=num_layers, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      head_dim=hidden // HEADS, rms_norm_eps=EPS, rope_theta=THETA,
                      max_position_embeddings=1024, tie_word_embeddings=tie)
    model = LlamaForCausalLM(cfg).to(F64).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked logits: greedy ties are improbable
    path.mkdir(parents=True, exist_ok=True)
    save_model(model, path)
    return model


def head_tensors(kind: str, seed: int, *, fc_bias=False, embed=False,
                 prefix="") -> dict[str, torch.Tensor]:
    """Random head weights in the EAGLE repositories' naming."""
    g = torch.Generator().manual_seed(seed)

    def lin(rows, cols):
        return torch.randn(rows, cols, generator=g, dtype=F64) / math.sqrt(cols)

    def norm():
        return 1 + 0.1 * torch.randn(H, generator=g, dtype=F64)

    attn_in = 2 * H
    layer = "midlayer." if kind == "eagle3" else "layers.0."
    t = {"fc.weight": lin(H, (2 if kind == "eagle" else 3) * H),
         layer + "self_attn.q_proj.weight": lin(HEADS * D, attn_in if kind == "eagle3" else H),
         layer + "self_attn.k_proj.weight": lin(KV_HEADS * D, attn_in if kind == "eagle3" else H),
         layer + "self_attn.v_proj.weight": lin(KV_HEADS * D, attn_in if kind == "eagle3" else H),
         layer + "self_attn.o_proj.weight": lin(H, HEADS * D),
         layer + "mlp.gate_proj.weight": lin(INTER, H), layer + "mlp.up_proj.weight": lin(INTER, H),
         layer + "mlp.down_proj.weight": lin(H, INTER),
         layer + "post_attention_layernorm.weight": norm()}
    if fc_bias:
        t["fc.bias"] = 0.1 * torch.randn(H, generator=g, dtype=F64)
    if embed:
        t["embed_tokens.weight"] = torch.randn(VOCAB, H, generator=g, dtype=F64)
    if kind == "eagle3":
        t[layer + "input_layernorm.weight"] = norm()
        t[layer + "hidden_norm.weight"] = norm()
        t["norm.weight"] = norm()
        t["lm_head.weight"] = 4 * lin(DRAFT_VOCAB, H)
        ids = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
        t["d2t"] = ids - torch.arange(DRAFT_VOCAB)
        t["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    return {prefix + k if k not in ("d2t", "t2d") else k: v for k, v in t.items()}


def save_head(path, kind: str, tensors: dict, **config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    extra = dict(num_hidden_layers=1)
    if kind == "eagle3":
        extra.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB)
    cfg = hf_config(**extra) | config
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    make_target(path)
    return path


@pytest.fixture(scope="module")
def target(target_dir) -> LlamaForCausalLM:
    return load_model(target_dir, dtype=F64)


# -- the reference: plain torch over the whole context, from the checkpoint tensors ------

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, pos):  # x: [T, heads, D]
    inv = 1.0 / THETA ** (torch.arange(0, D, 2, dtype=F64) / D)
    ang = pos[:, None].to(F64) * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(t, p, x, pos):
    n = x.shape[0]
    q = rope((x @ t[p + "q_proj.weight"].T).view(n, HEADS, D), pos)
    k = rope((x @ t[p + "k_proj.weight"].T).view(n, KV_HEADS, D), pos)
    v = (x @ t[p + "v_proj.weight"].T).view(n, KV_HEADS, D)
    k, v = (z.repeat_interleave(HEADS // KV_HEADS, dim=1) for z in (k, v))
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(n, HEADS * D)
    return out @ t[p + "o_proj.weight"].T


def mlp(t, p, x):
    return (F.silu(x @ t[p + "gate_proj.weight"].T) * (x @ t[p + "up_proj.weight"].T)) \
        @ t[p + "down_proj.weight"].T


class Reference:
    """The head written out directly: every draft step recomputes all rows."""

    def __init__(self, kind, tensors, target: LlamaForCausalLM, norm_before_residual=False):
        self.kind = kind
        self.t = {k.removeprefix("model.").replace("midlayer.", "layers.0."): v
                  for k, v in tensors.items()}
        self.embed = self.t.get("embed_tokens.weight", target.embed_tokens.weight.detach())
        self.target_lm_head = target.lm_head.weight.detach()
        self.norm_before_residual = norm_before_residual

    def feature(self, raw):  # raw: [n, L, H] target states -> [n, H]
        if self.kind == "eagle":
            return raw[:, 0]
        return raw.flatten(1) @ self.t["fc.weight"].T

    def rows(self, next_ids, feats, pos):
        t, e = self.t, self.embed[next_ids]
        if self.kind == "eagle":
            x = torch.cat([e, feats], -1) @ t["fc.weight"].T
            if "fc.bias" in t:
                x = x + t["fc.bias"]
            x = x + attention(t, "layers.0.self_attn.", x, pos)
        else:
            normed = rms(feats, t["layers.0.hidden_norm.weight"])
            inp = torch.cat([rms(e, t["layers.0.input_layernorm.weight"]), normed], -1)
            x = (normed if self.norm_before_residual else feats) + \
                attention(t, "layers.0.self_attn.", inp, pos)
        return x + mlp(t, "layers.0.mlp.", rms(x, t["layers.0.post_attention_layernorm.weight"]))

    def token(self, h):
        if self.kind == "eagle":
            return int((h @ self.target_lm_head.T).argmax())
        d = int((rms(h, self.t["norm.weight"]) @ self.t["lm_head.weight"].T).argmax())
        return d + int(self.t["d2t"][d])

    def top(self, h, width):
        """The head's `width` most likely target tokens after row output h, and their
        probabilities (EAGLE-3 only)."""
        probs = torch.softmax(rms(h, self.t["norm.weight"]) @ self.t["lm_head.weight"].T, -1)
        p, d = probs.topk(width)
        return (d + self.t["d2t"][d]).tolist(), p.tolist()

    def draft_tops(self, tokens, raw, k, width):
        """Like `draft`, returning the top `width` tokens and probabilities of each step."""
        next_ids, feats = torch.tensor(tokens[1:]), self.feature(raw)
        pos = torch.arange(0, len(tokens) - 1)
        ids, probs = [], []
        for _ in range(k):
            h = self.rows(next_ids, feats, pos)[-1]
            i, p = self.top(h, width)
            ids.append(i)
            probs.append(p)
            next_ids = torch.cat([next_ids, torch.tensor(i[:1])])
            feats = torch.cat([feats, h[None]])
            pos = torch.cat([pos, pos[-1:] + 1])
        return ids, probs

    def draft(self, tokens, raw, k, begin=0):
        """tokens: the context t_0..t_{n-1}; raw: [n - 1 - begin, L, H] target states of
        positions begin..n-2. Returns k greedy drafts."""
        next_ids = torch.tensor(tokens[begin + 1:])
        feats = self.feature(raw)
        pos = torch.arange(begin, len(tokens) - 1)
        out = []
        for _ in range(k):
            h = self.rows(next_ids, feats, pos)[-1]
            out.append(self.token(h))
            next_ids = torch.cat([next_ids, torch.tensor([out[-1]])])
            feats = torch.cat([feats, h[None]])
            pos = torch.cat([pos, pos[-1:] + 1])
        return out


# -- driving a method as the verifier does ------------------------------------------------

class Driver:
    """Sends a method starts and outcomes with random target states, and remembers every
    state it sent, so a reference can draft from the same context."""

    def __init__(self, method, seed=0):
        self.m = method
        self.layers = len(method.info().hidden_state_layers)
        self.g = torch.Generator().manual_seed(seed)
        self.tokens: dict = {}
        self.states: dict = {}  # key -> {position: [L, H]}

    def rand_states(self, n):
        return torch.randn(n, self.layers, H, generator=self.g, dtype=F64)

    def start(self, key, prompt, output=()):
        self.m.start(key, list(prompt), list(output), SamplingParams(temperature=0.0), 8)
        self.tokens[key] = list(prompt) + list(output)
        self.states[key] = {}

    def advance(self, key, new, start, num_rows, rollback=0):
        rows = self.rand_states(num_rows)
        self.m.advance(key, 0, 0, list(new), rollback, rows if num_rows else None, start)
        del self.tokens[key][len(self.tokens[key]) - rollback:]
        self.tokens[key] += list(new)
        for i in range(num_rows):
            self.states[key][start + i] = rows[i]

    def prefill(self, key, chunks, first_token):
        pos = 0
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            self.advance(key, [first_token] if last else [], pos, c)
            pos += c

    def decode(self, key, new):
        """A step that kept len(new) rows: the previous last token and the accepted drafts."""
        self.advance(key, new, len(self.tokens[key]) - 1, len(new))

    def reference(self, ref: Reference, key, k, begin=0):
        n = len(self.tokens[key])
        raw = torch.stack([self.states[key][p] for p in range(begin, n - 1)])
        return ref.draft(self.tokens[key], raw, k, begin)


def eagle3_driven(tmp_path, target_dir, target, seed: int, **options
                  ) -> tuple[Eagle3Method, Reference, Driver]:
    """A float64 EAGLE-3 head of random weights (seed) saved under tmp_path, the method
    serving it with `options`, the reference its drafts must equal, and a driver."""
    tensors = head_tensors("eagle3", seed=seed)
    save_head(tmp_path / "head", "eagle3", tensors)
    method = Eagle3Method(tmp_path / "head", target_dir, dtype="float64", **options)
    return method, Reference("eagle3", tensors, target), Driver(method)


VARIANTS = {
    # kind, head_tensors options, config additions, target ties its embeddings
    "eagle": ("eagle", dict(fc_bias=True), {}, False),
    "eagle-own-embed-tied-target": ("eagle", dict(embed=True), {}, True),
    "eagle3": ("eagle3", {}, {}, False),
    "eagle3-prefixed-own-embed": ("eagle3", dict(embed=True, prefix="model."),
                                  dict(norm_before_residual=True), False),
}


ON_CUDA = [pytest.mark.gpu,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafts_equal_the_reference(variant, device, tmp_path):
    """The head on `device` (hidden states arrive on the CPU, as from the wire)
    drafts what the CPU reference computes."""
    kind, opts, config, tie = VARIANTS[variant]
    target = make_target(tmp_path / "target", tie=tie)
    tensors = head_tensors(kind, seed=3, **opts)
    save_head(tmp_path / "head", kind, tensors, **config)
    method = registry.create(kind, model_dir=str(tmp_path / "head"),
                             target_dir=str(tmp_path / "target"), dtype="float64",
                             device=device, num_kv_blocks=64, block_size=4)
    ref = Reference(kind, tensors, target, config.get("norm_before_residual", False))
    drv = Driver(method)
    g = torch.Generator().manual_seed(5)
    prompts_ = {key: torch.randint(VOCAB, (n,), generator=g).tolist()
                for key, n in (("a", 11), ("b", 3), ("c", 20))}
    for key, p in prompts_.items():
        drv.start(key, p)
    assert method.propose({"a": 4}) == {}  # no target states yet
    drv.prefill("a", [4, 7], 5)
    drv.prefill("b", [3], 9)
    drv.advance("c", [], 0, 8)  # partial chunks; the last one has not come yet
    drv.advance("c", [], 8, 8)
    wanted = {"a": 5, "b": 3, "c": 4}
    drafts = method.propose(wanted)
    assert set(drafts) == {"a", "b"}
    for key in drafts:
        assert drafts[key].token_ids == drv.reference(ref, key, wanted[key])
        assert drafts[key].probs is None
    drv.advance("c", [7], 16, 4)  # the last chunk
    drv.decode("a", drafts["a"].token_ids[:2] + [11])  # two accepted, then the bonus token
    drv.decode("b", [13])  # none accepted
    for _ in range(2):
        wanted = {"a": 2, "b": 8, "c": 1}
        drafts = method.propose(wanted)
        assert {k: d.token_ids for k, d in drafts.items()} == \
            {k: drv.reference(ref, k, wanted[k]) for k in wanted}
    drv.decode("a", [17])  # a step without a proposal (K = 0)
    drv.decode("a", [18])
    assert method.propose({"a": 3})["a"].token_ids == drv.reference(ref, "a", 3)


def test_restart_without_states_drafts_from_where_states_begin(tmp_path, target_dir, target):
    tensors = head_tensors("eagle", seed=4)
    save_head(tmp_path / "head", "eagle", tensors)
    method = EagleMethod(tmp_path / "head", target_dir, dtype="float64")
    ref = Reference("eagle", tensors, target)
    drv = Driver(method)
    drv.start("s", [1, 2, 3, 4, 5], output=[6, 7])  # a reconnect: no states for these
    assert method.propose({"s": 3}) == {}
    drv.decode("s", [8])  # states of position 6 only
    assert method.propose({"s": 3})["s"].token_ids == drv.reference(ref, "s", 3, begin=6)
    drv.decode("s", [9, 10])
    assert method.propose({"s": 2})["s"].token_ids == drv.reference(ref, "s", 2, begin=6)
    with pytest.raises(ValueError, match="past the context"):
        drv.advance("s", [], 10, 2)


def test_long_prefill_joins_the_head_cache_before_any_proposal(tmp_path, target_dir, target):
    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 8)
    drv.start("s", torch.randint(VOCAB, (300,), generator=drv.g).tolist())
    drv.prefill("s", [120, 120, 60], 3)  # more rows than a sequence holds back
    drv.decode("s", [4])
    assert method.propose({"s": 3})["s"].token_ids == drv.reference(ref, "s", 3)


def test_a_backlog_past_the_bound_is_folded_on_arrival_only_past_it(tmp_path, target_dir,
                                                                    target):
    # 300 rows arrive at once (a sequence that ran plain, whose held rows come with the
    # step that asks it for drafts): the 44 past the bound join the head cache at once,
    # the other 256 wait for a proposal's catch-up budget, and the draft is the same.
    from drafter.eagle import _MAX_PENDING_ROWS

    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 10)
    method.catch_up_budget_rows = 0
    drv.start("s", torch.randint(VOCAB, (300,), generator=drv.g).tolist())
    drv.prefill("s", [300], 3)
    seq = method._seqs["s"]
    assert (seq.kv_end, seq.num_pending) == (300 - _MAX_PENDING_ROWS, _MAX_PENDING_ROWS)
    assert method.propose({"s": 3}) == {}  # no budget: not caught up, no draft
    method.catch_up_budget_rows = _MAX_PENDING_ROWS
    assert method.propose({"s": 3})["s"].token_ids == drv.reference(ref, "s", 3)


def test_a_burst_of_contexts_is_taken_in_a_bounded_number_of_rows_a_proposal(
        tmp_path, target_dir, target):
    # Three prompts of 30 positions with a budget of 40 rows a proposal: the first is
    # taken in whole and drafts, the second's first 11 rows fill the budget, the third
    # waits; neither drafts. The next proposals finish them. A sequence bringing only
    # a step's rows (16 or fewer) is never held back. Every draft is the head's own.
    from drafter.eagle import _STEP_ROWS

    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 9)
    method.catch_up_budget_rows = 40
    for key in "abc":
        drv.start(key, torch.randint(VOCAB, (30,), generator=drv.g).tolist())
        drv.prefill(key, [30], 5)
    caught = []
    for _ in range(3):
        drafts = method.propose(dict.fromkeys("abc", 3))
        caught.append(sorted(drafts))
        for key, d in drafts.items():
            assert d.token_ids == drv.reference(ref, key, 3)
    assert caught == [["a"], ["a", "b"], ["a", "b", "c"]]
    # A step's own rows go in whatever the budget.
    method.catch_up_budget_rows = 0
    for key in "abc":
        drv.decode(key, [7] * _STEP_ROWS)
    drafts = method.propose(dict.fromkeys("abc", 2))
    assert {k: d.token_ids for k, d in drafts.items()} == \
        {k: drv.reference(ref, k, 2) for k in "abc"}


def test_rollback_and_a_full_head_cache(tmp_path, target_dir, target):
    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 6, num_kv_blocks=6, block_size=4)
    drv.start("s", list(range(10)))
    drv.prefill("s", [10], 42)
    drv.decode("s", [43, 44])
    assert method.propose({"s": 3})["s"].token_ids == drv.reference(ref, "s", 3)
    drv.advance("s", [50], 9, 1, rollback=3)  # back to 10 tokens, position 9 recomputed
    assert drv.tokens["s"] == list(range(10)) + [50]
    assert method.propose({"s": 4})["s"].token_ids == drv.reference(ref, "s", 4)
    # 24 cached positions in all: a second sequence of 20 rows does not fit beside it.
    drv.start("t", list(range(20)))
    drv.prefill("t", [20], 1)
    assert set(method.propose({"s": 2, "t": 2})) == {"s"}
    method.free("s")
    assert method.propose({"t": 2})["t"].token_ids == drv.reference(ref, "t", 2)


def test_lookup_drafts_where_the_context_repeats_and_the_head_elsewhere(tmp_path, target_dir,
                                                                        target):
    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 9, lookup_min_n=2)
    # "copy" ends in 5, 6 (the first token), seen before and followed by 7, 8, 9;
    # "fresh" repeats no 2-gram.
    drv.start("copy", [20, 5, 6, 7, 8, 9, 21, 22, 5])
    drv.prefill("copy", [9], 6)
    drv.start("fresh", [30, 31, 32, 33])
    drv.prefill("fresh", [4], 34)
    drafts = method.propose({"copy": 3, "fresh": 3})
    assert drafts["copy"].token_ids == [7, 8, 9]
    assert drafts["fresh"].token_ids == drv.reference(ref, "fresh", 3)
    # Two accepted, then a bonus token that ends the match: the head drafts again, from
    # a cache that took in the states sent while lookup drafted.
    drv.decode("copy", [7, 8, 40])
    assert method.propose({"copy": 2})["copy"].token_ids == drv.reference(ref, "copy", 2)
    # A 1-token match is below lookup_min_n: still the head.
    drv.decode("copy", [9])
    assert method.propose({"copy": 2})["copy"].token_ids == drv.reference(ref, "copy", 2)
    assert drv.tokens["copy"][-2:] == [40, 9]
    for bad in (dict(lookup_min_n=-1), dict(lookup_min_n=3, lookup_max_n=2)):
        with pytest.raises(ValueError, match="0 <= lookup_min_n <= lookup_max_n"):
            Eagle3Method(tmp_path / "head", target_dir, **bad)


def test_lookup_takes_over_a_head_chain_that_runs_into_a_repeat(tmp_path, target_dir):
    tensors = head_tensors("eagle3", seed=9)
    tensors["lm_head.weight"].zero_()  # all logits tie: the head always drafts draft id 0
    t0 = int(tensors["d2t"][0])
    save_head(tmp_path / "head", "eagle3", tensors)
    x, a, b, c, d, e, f = [v for v in range(50, 60) if v != t0][:7]
    # The context ends in (b, x): x occurred before but after another token, so lookup
    # has no 2-gram to start from; once the head has drafted t0, (x, t0) has occurred,
    # followed by c, d, e.
    prompt = [a, x, t0, c, d, e, f, b]
    drafts = {}
    for lookup in (0, 2):
        method = Eagle3Method(tmp_path / "head", target_dir, dtype="float64",
                              lookup_min_n=lookup)
        drv = Driver(method)
        drv.start("s", prompt)
        drv.prefill("s", [len(prompt)], x)
        drafts[lookup] = method.propose({"s": 4})["s"].token_ids
    assert drafts == {0: [t0] * 4, 2: [t0, c, d, e]}


def test_min_confidence_ends_head_chains_and_leaves_lookup_alone(tmp_path, target_dir):
    tensors = head_tensors("eagle3", seed=9)
    tensors["lm_head.weight"].zero_()  # every draft: draft id 0, probability 1 / DRAFT_VOCAB
    t0 = int(tensors["d2t"][0])
    save_head(tmp_path / "head", "eagle3", tensors)
    x, a, b, c, d, e, f = [v for v in range(50, 60) if v != t0][:7]
    got = {}
    for conf in (0.0, 0.02, 0.5):  # 1 / DRAFT_VOCAB = 0.025
        method = Eagle3Method(tmp_path / "head", target_dir, dtype="float64", lookup_min_n=2,
                              min_confidence=conf)
        drv = Driver(method)
        drv.start("copy", [a, x, t0, c, d, e, f, b])  # lookup after the head's t0
        drv.prefill("copy", [8], x)
        drv.start("fresh", [a, b, c])
        drv.prefill("fresh", [3], d)
        out = method.propose({"copy": 4, "fresh": 4})
        got[conf] = (out["copy"].token_ids, out["fresh"].token_ids)
    assert got == {0.0: ([t0, c, d, e], [t0] * 4), 0.02: ([t0, c, d, e], [t0] * 4),
                   0.5: ([t0, c, d, e], [t0])}
    with pytest.raises(ValueError, match=r"min_confidence must be in \[0, 1\], got 1.5"):
        Eagle3Method(tmp_path / "head", target_dir, min_confidence=1.5)


def test_tree_width_proposes_the_most_probable_tree(tmp_path, target_dir, target):
    method, ref, drv = eagle3_driven(tmp_path, target_dir, target, 9, tree_width=3)
    drv.start("greedy", [20, 21, 22, 23, 24])
    drv.prefill("greedy", [5], 25)
    method.start("sampled", [30, 31, 32], [], SamplingParams(temperature=0.7), 8)
    drv.tokens["sampled"], drv.states["sampled"] = [30, 31, 32], {}
    drv.prefill("sampled", [3], 33)
    for k in (1, 4, 6):
        drafts = method.propose({"greedy": k, "sampled": k})
        ids, probs = ref.draft_tops(drv.tokens["greedy"], torch.stack(
            [drv.states["greedy"][p] for p in range(len(drv.tokens["greedy"]) - 1)]), k, 3)
        want = tree.chain_with_siblings(ids, probs, k)
        got = drafts["greedy"]
        assert (got.token_ids, got.parents) == want
        assert got.probs is None
        # The sampled request keeps the plain chain, the head's argmax at each step.
        assert drafts["sampled"].parents is None
        assert drafts["sampled"].token_ids == drv.reference(ref, "sampled", k)
    assert not tree.is_chain(drafts["greedy"].parents)  # random weights: unsure, so a tree
    with pytest.raises(ValueError, match="tree_width must be >= 1, got 0"):
        Eagle3Method(tmp_path / "head", target_dir, tree_width=0)


@pytest.mark.parametrize(("kind", "config", "layers"), [
    ("eagle", {}, [TARGET_LAYERS]),
    ("eagle3", {}, [2, 4, 5]),
    ("eagle3", dict(eagle_aux_hidden_state_layer_ids=[6, 1, 3]), [1, 3, 6]),
    ("eagle3", dict(eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 2, 7])), [0, 2, 7]),
])
def test_info(kind, config, layers, tmp_path, target_dir):
    save_head(tmp_path / "head", kind, head_tensors(kind, seed=1), **config)
    info = registry.create(kind, model_dir=str(tmp_path / "head"),
                           target_dir=str(target_dir)).info()
    assert info.method == (common_pb2.SPEC_METHOD_EAGLE if kind == "eagle"
                           else common_pb2.SPEC_METHOD_EAGLE3)
    assert info.needs_hidden_states and info.hidden_state_layers == layers
    assert (info.hidden_size, info.hidden_state_dtype) == (H, torch.float32)
    assert (info.vocab_size, info.tokenizer_hash) == (VOCAB, "")  # the target has no tokenizer
    assert not info.returns_probs


def _drop(name):
    return lambda t: t.pop(name)


def _set(name, value):
    return lambda t: t.__setitem__(name, value)


@pytest.mark.parametrize(("kind", "edit", "config", "message"), [
    ("eagle", _drop("layers.0.mlp.down_proj.weight"), {},
     "missing tensor layers.0.mlp.down_proj.weight"),
    ("eagle3", _drop("midlayer.hidden_norm.weight"), {}, "missing tensor layers.0.hidden_norm"),
    ("eagle", _set("fc.weight", torch.zeros(H, 3 * H)), {},
     r"tensor fc.weight has shape \(64, 192\), expected \(64, 128\)"),
    ("eagle3", _set("midlayer.self_attn.q_proj.weight", torch.zeros(H, H)), {},
     r"tensor layers.0.self_attn.q_proj.weight has shape \(64, 64\), expected \(64, 128\)"),
    ("eagle3", _set("lm_head.weight", torch.zeros(VOCAB, H)), {},
     r"tensor lm_head.weight has shape \(97, 64\), expected \(40, 64\)"),
    ("eagle", None, dict(hidden_size=32), "hidden size mismatch: head built for hidden_size 32"),
    ("eagle3", None, dict(target_hidden_size=48), "hidden size mismatch"),
    ("eagle", None, dict(vocab_size=50), "vocab mismatch: head vocab_size 50"),
    ("eagle3", None, dict(draft_vocab_size=200), "vocab mismatch: draft_vocab_size 200"),
    ("eagle3", _set("d2t", torch.full((DRAFT_VOCAB,), 90)), {},
     "vocab mismatch: d2t maps draft id 7 to target id 97"),
    ("eagle3", _drop("d2t"), {}, "missing tensor d2t"),
    ("eagle3", None, dict(eagle_aux_hidden_state_layer_ids=[1, 2, 8]),
     r"target layers \[1, 2, 8\] from eagle_aux_hidden_state_layer_ids must be distinct and "
     r"in 0..7"),
    ("eagle3", None, dict(eagle_aux_hidden_state_layer_ids=[1, 2]),
     r"tensor fc.weight has shape \(64, 192\), expected \(64, 128\) from 2 target layers"),
])
def test_mismatch_is_named(kind, edit, config, message, tmp_path, target_dir):
    tensors = head_tensors(kind, seed=2)
    if edit is not None:
        edit(tensors)
    save_head(tmp_path / "head", kind, tensors, **config)
    with pytest.raises(ValueError, match=message):
        registry.create(kind, model_dir=str(tmp_path / "head"), target_dir=str(target_dir))


def test_target_mismatch_is_named(tmp_path):
    save_head(tmp_path / "head", "eagle", head_tensors("eagle", seed=2))
    save_head(tmp_path / "head3", "eagle3", head_tensors("eagle3", seed=2))
    make_target(tmp_path / "small", num_layers=4)
    with pytest.raises(ValueError, match=r"target layers \[2, 2, 1\] from the default .* L = 4"):
        Eagle3Method(tmp_path / "head3", tmp_path / "small")
    make_target(tmp_path / "wide", hidden=128)
    with pytest.raises(ValueError, match="hidden size mismatch: .* target hidden_size 128"):
        EagleMethod(tmp_path / "head", tmp_path / "wide")
    (tmp_path / "small" / "model.safetensors").unlink()
    save_file({"model.embed_tokens.weight": torch.zeros(VOCAB, H)},
              str(tmp_path / "small" / "model.safetensors"))
    with pytest.raises(ValueError, match="small: missing tensor lm_head.weight"):
        EagleMethod(tmp_path / "head", tmp_path / "small")
    (tmp_path / "head" / "model.safetensors").rename(tmp_path / "head" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="no safetensors weights .*pytorch_model.bin"):
        EagleMethod(tmp_path / "head", tmp_path / "small")


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_command_line_builds_the_method(kind, tmp_path, target_dir):
    save_head(tmp_path / "head", kind, head_tensors(kind, seed=1))
    args = build_parser().parse_args([
        "--method", kind, "--model", str(tmp_path / "head"), "--target", str(target_dir),
        "--dtype", "float64", "--max-num-speculative-tokens", "5", "--port", "0"])
    method = build_method(args)
    assert isinstance(method, EagleMethod if kind == "eagle" else Eagle3Method)
    info = method.info()
    assert (info.max_num_speculative_tokens, info.hidden_state_dtype) == (5, F64)
    assert info.model_name == "head"
    assert method.lookup_min_n == 0
    args = build_parser().parse_args([
        "--method", kind, "--model", str(tmp_path / "head"), "--target", str(target_dir),
        "--lookup-min", "2", "--lookup-max", "6", "--min-confidence", "0.3"])
    method = build_method(args)
    assert (method.lookup_min_n, method.lookup_max_n, method.min_confidence) == (2, 6, 0.3)


# -- end to end: a real verifier, greedy output unchanged --------------------------------

class RecordingMixin:
    """Mirrors each context so the test can re-draft every proposal with the reference."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ctx: dict = {}
        self.proposals: list = []
        self.rows: list[int] = []  # hidden-state rows of each Advance

    def start(self, key, prompt_ids, output_ids, sampling, max_num_speculative_tokens):
        super().start(key, prompt_ids, output_ids, sampling, max_num_speculative_tokens)
        self.ctx[key] = list(prompt_ids) + list(output_ids)

    def advance(self, key, num_drafted, num_accepted, new_token_ids, num_rollback_tokens,
                hidden_states, hidden_start_position):
        super().advance(key, num_drafted, num_accepted, new_token_ids, num_rollback_tokens,
                        hidden_states, hidden_start_position)
        self.rows.append(0 if hidden_states is None else hidden_states.shape[0])
        ctx = self.ctx[key]
        del ctx[len(ctx) - num_rollback_tokens:]
        ctx.extend(new_token_ids)

    def propose(self, wanted):
        drafts = super().propose(wanted)
        self.proposals += [(list(self.ctx[key]), d.token_ids) for key, d in drafts.items()]
        return drafts


class RecordingEagle(RecordingMixin, EagleMethod):
    pass


class RecordingEagle3(RecordingMixin, Eagle3Method):
    pass


def target_states(model: LlamaForCausalLM, tokens: list[int], layers) -> torch.Tensor:
    """[n, len(layers), H]: the target's hidden states of every position, in one forward."""
    cache = PagedKVCache.for_model(model.config, -(-len(tokens) // 16), 16, F64)
    cache.add(0)
    meta = cache.plan([(0, len(tokens))])
    no_logits = torch.tensor([], dtype=torch.int64)
    out = model(torch.tensor(tokens), meta, cache, logits_indices=no_logits,
                hidden_layers=tuple(layers))
    return out.hidden_states.transpose(0, 1)


@pytest.mark.parametrize(("kind", "batch", "rows_a_message"), [
    ("eagle", 1, None), ("eagle", 8, None), ("eagle3", 1, None), ("eagle3", 8, None),
    ("eagle3", 8, 2)])
def test_output_equals_plain_greedy(kind, batch, rows_a_message, loop, target, target_dir,
                                    tmp_path):
    """rows_a_message: drafter stream messages that hold this many hidden-state rows,
    so that every step's request and answer are split (DraftRequest.continued)."""
    tensors = head_tensors(kind, seed=7)
    save_head(tmp_path / "head", kind, tensors)
    cls = RecordingEagle if kind == "eagle" else RecordingEagle3
    method = cls(tmp_path / "head", target_dir, dtype="float64")
    limits = {}
    if rows_a_message is not None:
        info = method.info()
        row = len(info.hidden_state_layers) * info.hidden_size * info.hidden_state_dtype.itemsize
        limits["part_bytes"] = 256 + rows_a_message * (row + 5)
    stack = Stack(loop, target, {kind: method}, **limits)
    try:
        ps = prompts(batch, seed=10 + batch)
        expected = greedy_generate(target, ps, 40)
        msgs = [start_msg(p, 40, k=1 + i % 8, drafter=kind) for i, p in enumerate(ps)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        for (tokens, responses), want in zip(results, expected, strict=True):
            assert tokens == want
            spec = responses[-1].spec_decode
            assert spec.num_draft_tokens > 0
    finally:
        stack.close()
    if rows_a_message is not None:  # prefills split into Advances of rows_a_message rows
        assert max(method.rows) == rows_a_message
    # Every proposal is what the reference drafts from the target's own hidden states.
    ref = Reference(kind, tensors, target)
    layers = method.info().hidden_state_layers
    assert method.proposals
    for ctx, draft in method.proposals[:24]:
        raw = target_states(target, ctx[:-1], layers)
        assert draft == ref.draft(ctx, raw, len(draft))


def test_output_with_lookup_and_confidence_stop_equals_plain_greedy(loop, target, target_dir,
                                                                    tmp_path):
    save_head(tmp_path / "head", "eagle3", head_tensors("eagle3", seed=7))
    method = RecordingEagle3(tmp_path / "head", target_dir, dtype="float64", lookup_min_n=2,
                             min_confidence=0.3)
    stack = Stack(loop, target, {"eagle3": method})
    try:
        ps = prompts(8, seed=18)
        expected = greedy_generate(target, ps, 40)
        msgs = [start_msg(p, 40, k=1 + i % 8, drafter="eagle3") for i, p in enumerate(ps)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        assert [tokens for tokens, _ in results] == expected
    finally:
        stack.close()
    # Both kinds of draft went through the verifier: lookup's where the context repeated a
    # 2-gram, the head's elsewhere.
    looked_up = 0
    for ctx, draft in method.proposals:
        copy = find_continuation(np.asarray(ctx), 2, 4, len(draft))
        if copy.size:
            assert draft == copy.tolist()
            looked_up += 1
    assert 0 < looked_up < len(method.proposals)


def test_tree_drafts_over_the_wire_keep_greedy_output(loop, target, target_dir, tmp_path):
    """Token trees travel in DraftProposal.parents and the verifier accepts paths off
    the first-child chain; outputs stay plain greedy at batch 8 with mixed K."""
    save_head(tmp_path / "head", "eagle3", head_tensors("eagle3", seed=7))
    method = RecordingEagle3(tmp_path / "head", target_dir, dtype="float64", tree_width=3)
    trees = []
    propose = method.propose

    def recording(wanted):
        drafts = propose(wanted)
        trees.extend(d.parents for d in drafts.values() if d.parents is not None)
        return drafts

    method.propose = recording
    stack = Stack(loop, target, {"eagle3": method})
    try:
        ps = prompts(8, seed=21)
        expected = greedy_generate(target, ps, 40)
        msgs = [start_msg(p, 40, k=2 + i % 6, drafter="eagle3") for i, p in enumerate(ps)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        assert [tokens for tokens, _ in results] == expected
        assert sum(r[-1].spec_decode.num_accepted_tokens for _, r in results) > 0
    finally:
        stack.close()
    assert any(not tree.is_chain(p) for p in trees)


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_float32_head_runs_its_projections_on_the_targets_kernels(tmp_path, target_dir,
                                                                   invariant, monkeypatch):
    """The drafter's head takes the target's CPU paths: few rows on the small-rows
    kernel where the machine has it, more (a batch's step, a context taken in) on
    oneDNN's packed weights (every row on the kernel under SPECDEC_BATCH_INVARIANT);
    a head loaded for training (load_head alone) keeps F.linear, which has autograd.
    All give F.linear's values."""
    monkeypatch.setattr(linear_module, "BATCH_INVARIANT", invariant)
    save_head(tmp_path / "head", "eagle3", head_tensors("eagle3", seed=9))
    method = Eagle3Method(tmp_path / "head", target_dir, dtype="float32")
    head = method.head
    projections = [m for m in head.modules() if isinstance(m, Linear)]
    assert len(projections) == 6  # fc, qkv, o, gate_up, down, lm_head
    assert all(m.small_rows == small_rows.available() for m in projections)
    packs = torch.backends.mkldnn.is_available() and not (invariant and small_rows.available())
    assert all((m.packed is not None) == packs for m in projections)
    trained = [m for m in load_head("eagle3", tmp_path / "head", target_dir).modules()
               if isinstance(m, Linear)]
    assert not any(m.small_rows or m.packed is not None for m in trained)
    gen = torch.Generator().manual_seed(0)
    results = []
    for rows in (5, 20):  # each side of the small-rows kernel's limit
        hidden = torch.randn(rows, H, generator=gen)
        raw = torch.randn(rows, 3, H, generator=gen)
        with torch.inference_mode():
            results.append((head.draft_logits(hidden), head.features(raw)))
    for m in projections:
        m.small_rows, m.packed = False, None
    for rows, fast in zip((5, 20), results, strict=True):
        gen = torch.Generator().manual_seed(0)
        if rows == 20:  # the same draws as above
            torch.randn(5, H, generator=gen), torch.randn(5, 3, H, generator=gen)
        hidden = torch.randn(rows, H, generator=gen)
        raw = torch.randn(rows, 3, H, generator=gen)
        with torch.inference_mode():
            plain = head.draft_logits(hidden), head.features(raw)
        for a, b in zip(fast, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
