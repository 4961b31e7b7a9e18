"""Train an EAGLE-3 head for a target model on CPU, from self-distillation data.

    python -m train.eagle3 --data ~/.cache/specdec/train/selfdistill.jsonl \\
        --out drafter/weights/smollm2-135m-eagle3 --minutes 30

Recipe:
  * data: the target's own greedy replies (train/data.py), so the
    data's next token is the target's greedy next token on every reply position;
  * draft vocabulary: the N most frequent tokens of the data, with EAGLE-3's
    d2t offsets (target id = draft id + d2t[draft id]); the head's lm_head has
    N rows instead of the target's 49k, initialised from the target's rows;
  * teacher forcing: the target's three feature layers, recorded by
    train/data.py while generating (DATA.features/) or computed here
    once per sequence and cached (float16, under the cache directory);
  * training-time test: S steps unrolled as drafting runs them
    (drafter/eagle.py). Step 1 is row i = (t_{i+1}, f_i) over the target's
    features; step j > 1 of chain i is the row at position i + j - 1 with
    token t_{i+j} and, as feature, the head's own pre-norm output of step
    j - 1 of the same chain. It attends to the step-1 rows 0..i and to its own
    chain's rows of steps 2..j, which is exactly the head cache during a
    draft. Step j predicts t_{i+j+1}; the loss is cross-entropy over the draft
    vocabulary on reply tokens (tokens outside it are ignored);
  * soft labels (--soft-labels W): that cross-entropy is mixed, W to 1 - W, with
    the one against the target's own distribution over the draft vocabulary at
    the same position (its final hidden state, recorded with the features).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import random
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter.heads.base import HeadConfig
from drafter.heads.eagle3 import Eagle3Head
from drafter.heads.load import load_head
from specdec.models import load_model
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.models.rope import apply_rotary

WEIGHTS_FILE = "model.safetensors"


@dataclasses.dataclass(slots=True)
class Example:
    tokens: torch.Tensor  # [T] int64: prompt + reply
    prompt_len: int
    hidden: torch.Tensor | None = None  # [T, len(layers), H_t] float16 target features


def load_examples(path: Path, max_len: int) -> list[Example]:
    out = []
    for line in path.open():
        row = json.loads(line)
        ids = (row["prompt"] + row["reply"])[:max_len]
        if len(ids) > len(row["prompt"]) + 2:
            out.append(Example(torch.tensor(ids), len(row["prompt"])))
    return out


# -- draft vocabulary ---------------------------------------------------------------------

def draft_vocabulary(examples: list[Example], size: int, vocab_size: int,
                     prompt_weight: float = 1.0) -> torch.Tensor:
    """[size] target ids of the `size` most frequent tokens, sorted, prompt tokens counted
    with `prompt_weight` against reply tokens; filled with the lowest unused ids when the
    data has fewer distinct tokens."""
    counts: Counter = Counter()
    for ex in examples:
        counts.update(ex.tokens[ex.prompt_len:].tolist())
        if prompt_weight:
            for t, c in Counter(ex.tokens[:ex.prompt_len].tolist()).items():
                counts[t] += prompt_weight * c
    ids = [t for t, _ in counts.most_common(size)]
    if len(ids) < size:
        have = set(ids)
        ids += [t for t in range(vocab_size) if t not in have][:size - len(ids)]
    return torch.tensor(sorted(ids), dtype=torch.int64)


def target_to_draft(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] draft id of each target id, -100 (ignored by the loss) outside it."""
    t2d = torch.full((vocab_size,), -100, dtype=torch.int64)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    return t2d


# -- teacher forcing ----------------------------------------------------------------------

@torch.inference_mode()
def target_features(model: LlamaForCausalLM, tokens: torch.Tensor,
                    layers: tuple[int, ...]) -> torch.Tensor:
    """tokens: [T] -> [T, len(layers), H] float16 hidden states (HF numbering), as the
    verifier hands them to a drafter."""
    cache = model.make_kv_cache(-(-len(tokens) // 16), 16)
    cache.add(0)
    meta = cache.plan([(0, len(tokens))])
    out = model(tokens, meta, cache, logits_indices=torch.empty(0, dtype=torch.int64),
                hidden_layers=layers)
    return out.hidden_states.transpose(0, 1).to(torch.float16).contiguous()


def default_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's three target layers (HF numbering): low, middle, high."""
    return (2, num_layers // 2, num_layers - 3)


def feature_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """The target layers recorded for training: the head's three, then the target's
    final normed hidden state (layer num_layers), whose product with the target's
    lm_head rows of the draft vocabulary gives the soft labels (--soft-labels)."""
    return (*layers, num_layers)


def feature_key(tokens: list[int], layers: tuple[int, ...]) -> str:
    return hashlib.sha1(f"{tuple(layers)}{list(tokens)}".encode()).hexdigest()


def attach_features(model: LlamaForCausalLM, examples: list[Example], layers: tuple[int, ...],
                    store: Path | None, shards: list[Path] = (), compute: bool = True) -> float:
    """Fill each example's hidden states, from `store` or the `shards` directories
    (features recorded by train/data.py) where they have them, keyed by the
    token ids and layers, and by running the target otherwise (unless `compute` is
    False: those examples keep hidden None). Returns seconds spent."""
    t0 = time.perf_counter()
    cached: dict[str, torch.Tensor] = {}
    if store is not None and store.exists():
        cached = torch.load(store)
    recorded: dict[str, torch.Tensor] = {}
    for d in shards:
        for f in sorted(d.glob("*.pt")) if d.is_dir() else ():
            recorded.update(torch.load(f))
    fresh = 0
    for ex in examples:
        key = feature_key(ex.tokens.tolist(), layers)
        if key not in cached and key in recorded:
            ex.hidden = recorded[key]
            continue
        if key not in cached:
            if not compute:
                continue
            cached[key] = target_features(model, ex.tokens, layers)
            fresh += 1
        ex.hidden = cached[key]
    if store is not None and fresh:
        store.parent.mkdir(parents=True, exist_ok=True)
        torch.save(cached, store)
    return time.perf_counter() - t0


# -- the head -----------------------------------------------------------------------------

def build_head(target: LlamaForCausalLM, draft_ids: torch.Tensor, intermediate_size: int,
               layers: tuple[int, ...], seed: int) -> Eagle3Head:
    """A fresh float32 EAGLE-3 head: the target's (frozen) embedding, lm_head rows of the
    draft vocabulary from the target's lm_head, the rest randomly initialised."""
    torch.manual_seed(seed)
    tcfg = target.config
    dec = dataclasses.replace(tcfg, num_layers=1, intermediate_size=intermediate_size,
                              tie_word_embeddings=False, attention_bias=False)
    cfg = HeadConfig(decoder=dec, target_hidden_size=tcfg.hidden_size,
                     vocab_size=tcfg.vocab_size, draft_vocab_size=len(draft_ids),
                     target_layers=layers)
    head = Eagle3Head(cfg)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids] * target.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    head.embed_tokens.weight.requires_grad_(False)
    return head


@torch.no_grad()
def revocab(head: Eagle3Head, target_rows: torch.Tensor, new_ids: torch.Tensor) -> int:
    """Give a trained head another draft vocabulary of the same size, in place: tokens in
    both keep their trained lm_head rows; a new token's row is its target row through the
    linear map that best takes the target's rows of the old vocabulary to the head's
    (least squares), so it starts where training would have put a row like it.
    target_rows: [V, H] the target's lm_head rows scaled by its final norm (build_head's
    initialisation); new_ids: [dv] sorted target ids. Returns how many tokens are new."""
    dv = len(head.d2t)
    assert new_ids.shape == (dv,), f"the new vocabulary has {len(new_ids)} tokens, not {dv}"
    old_ids = head.d2t + torch.arange(dv)  # [dv] target ids
    weight = head.lm_head.weight  # [dv, H]
    fit = torch.linalg.lstsq(target_rows[old_ids].double(), weight.double()).solution  # [H, H]
    rows = (target_rows[new_ids].double() @ fit).to(weight.dtype)  # [dv, H]
    old_row = {int(t): i for i, t in enumerate(old_ids)}
    kept = [(j, old_row[int(t)]) for j, t in enumerate(new_ids) if int(t) in old_row]
    if kept:
        new_at, old_at = map(torch.tensor, zip(*kept, strict=True))
        rows[new_at] = weight[old_at]
    weight.copy_(rows)
    head.d2t.copy_(new_ids - torch.arange(dv))
    return dv - len(kept)


def _attention(q: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor,
               chain_k: list[torch.Tensor], chain_v: list[torch.Tensor]) -> torch.Tensor:
    """q: [n, h, D] queries of one step; k1, v1: [n, hkv, D] step-1 rows (causal: chain i
    sees rows 0..i); chain_k, chain_v: [n, hkv, D] each, chain i's own rows of steps
    2..j (the diagonal). Returns [n, h * D]."""
    n, h, d = q.shape
    rep = h // k1.shape[1]
    qh = q.transpose(0, 1)  # [h, n, D]
    k1 = k1.repeat_interleave(rep, 1).transpose(0, 1)
    v1 = v1.repeat_interleave(rep, 1).transpose(0, 1)
    scale = 1.0 / math.sqrt(d)
    scores = qh @ k1.transpose(1, 2) * scale  # [h, n, n]
    causal = torch.ones(n, n, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    vs = [v.repeat_interleave(rep, 1).transpose(0, 1) for v in chain_v]  # [h, n, D] each
    diag = [(qh * k.repeat_interleave(rep, 1).transpose(0, 1)).sum(-1, keepdim=True) * scale
            for k in chain_k]  # [h, n, 1] each
    p = torch.cat([scores, *diag], dim=-1).softmax(-1)  # [h, n, n + j - 1]
    out = p[..., :n] @ v1  # [h, n, D]
    for m, v in enumerate(vs):
        out = out + p[..., n + m, None] * v
    out = out.transpose(0, 1)  # [n, h, D]
    return out.reshape(n, h * d)


def unrolled_forward(head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor,
                     steps: int) -> list[torch.Tensor]:
    """Training forward of `steps` draft steps over one sequence, differentiable.

    tokens: [T]; hidden: [T, len(layers), H_t] target features. Returns per step j
    (1-based) the head outputs [T - 1, H] of chains i = 0..T-2 (row at position
    i + j - 1); chains whose token t_{i+j} is past the end hold padding."""
    layer = head.layers[0]
    attn = layer.self_attn
    nh, nkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    n = len(tokens) - 1
    feats = head.features(hidden[:n].to(head.dtype))  # [n, H]
    k1 = v1 = None
    chain_k: list[torch.Tensor] = []
    chain_v: list[torch.Tensor] = []
    outs = []
    for j in range(1, steps + 1):
        # Chain i's step-j token is t_{i+j}; past the end it is padded with the last token.
        idx = torch.clamp(torch.arange(n) + j, max=n)
        embeds = head.embed_tokens(tokens[idx])
        normed = layer.hidden_norm(feats)
        residual = normed if layer.norm_before_residual else feats
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [n, 2H]
        qkv = F.linear(x, attn.qkv_proj.weight).view(n, nh + 2 * nkv, d)
        cos, sin = head.rotary.cos_sin(torch.arange(n) + j - 1, head.dtype)
        qk = apply_rotary(qkv[:, :nh + nkv], cos, sin)
        q, k, v = qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv:]
        if j == 1:
            k1, v1 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        a = F.linear(_attention(q, k1, v1, chain_k, chain_v), attn.o_proj.weight)
        y = residual + a
        y = y + layer.mlp.apply_mlp(layer.post_attention_layernorm(y))
        outs.append(y)
        feats = y
    return outs


def sequence_loss(head: Eagle3Head, ex: Example, t2d: torch.Tensor, steps: int,
                  step_weights: list[float], prompt_weight: float = 0.0,
                  feature_noise: float = 0.0, soft_rows: torch.Tensor | None = None,
                  soft_weight: float = 0.0) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Weighted cross-entropy summed over steps (a weighted mean over each step's labelled
    rows), and per step (correct, counted) on reply tokens for accuracy.

    prompt_weight > 0 also labels prompt tokens (the data's next token, which is text
    rather than the target's greedy choice), weighted so; feature_noise adds Gaussian
    noise of that relative size to the target features (EAGLE's augmentation).

    soft_weight > 0 mixes in the cross-entropy against the target's own distribution
    over the draft vocabulary (softmax of its final normed hidden state, the last
    feature layer of `ex.hidden`, times `soft_rows`: [dv, H_t] the target's lm_head rows
    of the draft vocabulary), as (1 - w) hard + w soft: the target's second choices
    and their odds, which a tree drafts, rather than its argmax alone."""
    tokens = ex.tokens
    n = len(tokens) - 1
    num_layers = len(head.config.target_layers)
    hidden = ex.hidden[:, :num_layers].float()
    final = None
    if soft_weight > 0:
        assert soft_rows is not None and ex.hidden.shape[1] > num_layers, \
            "soft labels need the target's final hidden state recorded (feature_layers)"
        final = ex.hidden[:, num_layers]  # [T, H_t] float16
    if feature_noise:
        hidden = hidden + feature_noise * hidden.std(-1, keepdim=True) * torch.randn_like(hidden)
    outs = unrolled_forward(head, tokens, hidden, steps)
    total = torch.zeros(())
    stats = []
    for j, y in enumerate(outs, start=1):
        # Chain i at step j predicts t_{i+j+1}; a reply token when its index >= prompt_len.
        label_pos = torch.arange(n) + j + 1
        inside = label_pos < len(tokens)
        reply = inside & (label_pos >= ex.prompt_len)
        valid = inside if prompt_weight > 0 else reply
        labels = torch.full((n,), -100, dtype=torch.int64)
        labels[valid] = t2d[tokens[label_pos[valid]]]
        keep = labels != -100
        if not keep.any():
            stats.append((0, 0))
            continue
        logits = head.lm_head(head.norm(y[keep]))  # [m, dv]
        ce = F.cross_entropy(logits, labels[keep], reduction="none")  # [m]
        if final is not None:
            # The target's prediction of the label comes from the position before it. The
            # recorded features end in two zero rows (never computed): hard labels there.
            before = final[label_pos[keep] - 1].to(soft_rows.dtype)  # [m, H_t]
            recorded = before.abs().sum(-1) > 0  # [m]
            target_p = F.linear(before, soft_rows).softmax(-1)  # [m, dv]
            soft = -(target_p * logits.log_softmax(-1)).sum(-1)  # [m]
            ce = torch.where(recorded, (1 - soft_weight) * ce + soft_weight * soft, ce)
        w = torch.where(reply[keep], 1.0, prompt_weight)
        total = total + step_weights[j - 1] * (w * ce).sum() / w.sum().clamp(min=1e-6)
        # Accuracy counts every reply token, out-of-vocabulary ones as misses.
        hit = (logits.argmax(-1) == labels[keep]) & reply[keep]
        stats.append((int(hit.sum()), int(reply.sum())))
    return total, stats


# -- checkpoint ---------------------------------------------------------------------------

def checkpoint_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The head in the EAGLE-3 repositories' layout (what drafter/heads/load.py loads)."""
    layer, attn = head.layers[0], head.layers[0].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
    t = {"fc.weight": head.fc.weight,
         "midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
         "midlayer.self_attn.v_proj.weight": v, "midlayer.self_attn.o_proj.weight": attn.o_proj.weight,
         "midlayer.mlp.gate_proj.weight": gate, "midlayer.mlp.up_proj.weight": up,
         "midlayer.mlp.down_proj.weight": layer.mlp.down_proj.weight,
         "midlayer.input_layernorm.weight": layer.input_layernorm.weight,
         "midlayer.hidden_norm.weight": layer.hidden_norm.weight,
         "midlayer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
         "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight}
    out = {name: w.detach().to(dtype).contiguous() for name, w in t.items()}
    out["d2t"] = head.d2t.detach().clone()
    return out


def head_config_json(target_dir: Path, head: Eagle3Head, layers: tuple[int, ...]) -> dict:
    raw = json.loads((target_dir / "config.json").read_text())
    cfg = head.config
    L = cfg.decoder  # the target's fields, with the head's own sizes
    raw.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
               intermediate_size=L.intermediate_size, tie_word_embeddings=False,
               draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
               eagle_aux_hidden_state_layer_ids=list(layers), dtype="bfloat16")
    raw.pop("_model_name_or_path", None)
    return raw


def save_head(head: Eagle3Head, out: Path, target_dir: Path, layers: tuple[int, ...],
              dtype: torch.dtype = torch.bfloat16) -> int:
    """Write config.json + model.safetensors; returns the weights file's size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(head, dtype), str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(head_config_json(target_dir, head, layers),
                                                indent=2) + "\n")
    return (out / WEIGHTS_FILE).stat().st_size


# -- the loop -----------------------------------------------------------------------------

@torch.no_grad()
def evaluate(head: Eagle3Head, examples: list[Example], t2d: torch.Tensor, steps: int) -> dict:
    """Per-step accuracy on reply tokens given the previous ones were right (teacher
    forcing) and the chain's conditional accuracy, on held-out sequences."""
    correct, counted, loss = [0] * steps, [0] * steps, 0.0
    for ex in examples:
        total, stats = sequence_loss(head, ex, t2d, steps, [1.0] * steps)
        loss += float(total) / steps
        for j, (c, m) in enumerate(stats):
            correct[j] += c
            counted[j] += m
    acc = [c / max(m, 1) for c, m in zip(correct, counted, strict=True)]
    return {"loss": loss / max(len(examples), 1), "accuracy": acc}


def _score(ev: dict) -> float:
    return sum(ev["accuracy"]) / len(ev["accuracy"])


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    target_dir = Path(args.target) if args.target else prepare_default_model()
    target = load_model(target_dir, dtype="float32")
    tcfg: ModelConfig = target.config
    L = tcfg.num_layers
    layers = tuple(args.layers) if args.layers else default_layers(L)
    init = None
    if args.init:
        # Training goes on from a saved head: its draft vocabulary and target layers
        # stay, since its lm_head rows and fc columns are tied to them.
        init = load_head("eagle3", args.init, target_dir, dtype="float32")
        if args.layers and tuple(args.layers) != init.config.target_layers:
            raise SystemExit(f"--layers {args.layers}: --init {args.init} was trained on "
                             f"target layers {list(init.config.target_layers)}")
        layers = init.config.target_layers
    examples = [ex for path in args.data for ex in load_examples(path, args.max_len)]
    rng = random.Random(args.seed)
    rng.shuffle(examples)
    if args.eval_data:  # a held-out split of its own (other prompts by construction)
        held_out = [ex for path in args.eval_data for ex in load_examples(path, args.max_len)]
        train_set = examples
    else:
        num_eval = max(1, int(len(examples) * args.eval_fraction))
        held_out, train_set = examples[:num_eval], examples[num_eval:]
    store = None if args.no_cache else (args.feature_cache or
                                        cache_dir() / "train" / "eagle3_features.pt")
    shards = [path.with_suffix(".features") for path in [*args.data, *(args.eval_data or [])]]
    tf_seconds = attach_features(target, train_set + held_out, feature_layers(layers, L), store,
                                 shards, compute=not args.stored_features_only)
    train_set = [ex for ex in train_set if ex.hidden is not None]
    held_out = [ex for ex in held_out if ex.hidden is not None]
    if init is None:
        draft_ids = draft_vocabulary(train_set, args.draft_vocab, tcfg.vocab_size,
                                     args.vocab_prompt_weight)
        head = build_head(target, draft_ids, args.intermediate_size, layers, args.seed)
    else:
        head = init.train()
        head.embed_tokens.weight.requires_grad_(False)
        if args.new_vocab:
            new_ids = draft_vocabulary(train_set, len(head.d2t), tcfg.vocab_size,
                                       args.vocab_prompt_weight)
            scaled = target.lm_head.weight.detach() * target.norm.weight.detach()  # [V, H]
            args.new_tokens = revocab(head, scaled, new_ids)
            print(f"--new-vocab: {args.new_tokens} of {len(new_ids)} draft tokens are new",
                  flush=True)
        draft_ids = head.d2t + torch.arange(len(head.d2t))
        args.draft_vocab = len(draft_ids)
        args.intermediate_size = head.config.decoder.intermediate_size
    t2d = target_to_draft(draft_ids, tcfg.vocab_size)
    soft_rows = target.lm_head.weight[draft_ids].detach().float()  # [dv, H_t]
    del target
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    weights = [args.step_decay ** j for j in range(args.ttt_steps)]
    n_tokens = sum(len(ex.tokens) for ex in train_set)
    print(f"{len(train_set)} training sequences ({n_tokens} tokens), {len(held_out)} held out; "
          f"features in {tf_seconds:.0f} s; draft vocab {len(draft_ids)}; "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters", flush=True)

    budget = args.minutes * 60
    history = []
    best = -1.0  # held-out accuracy of the saved head, mean over steps
    if init is not None:
        # The starting point is a candidate too: a worse head is never written over it.
        ev = evaluate(head, held_out, t2d, args.ttt_steps)
        history.append({"minutes": 0.0, "step": 0, "epoch": 0, "train_loss": float("nan"), **ev})
        best = _score(ev)
        print(f"--init {args.init}: held-out {ev['loss']:.3f} acc "
              + " ".join(f"{a:.3f}" for a in ev["accuracy"]), flush=True)
        save_head(head, args.out, target_dir, layers)
    t0 = last_report = last_save = time.perf_counter()
    step = epoch = 0
    done = False
    while not done:
        epoch += 1
        order = list(range(len(train_set)))
        rng.shuffle(order)
        for b in range(0, len(order), args.batch):
            elapsed = time.perf_counter() - t0
            if elapsed >= budget or (args.max_steps and step >= args.max_steps):
                done = True
                break
            # Linear warmup, then cosine to 10% over the time budget.
            frac = min(elapsed / budget, 1.0)
            lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 *
                                                                  (1 + math.cos(math.pi * frac)))
            for group in opt.param_groups:
                group["lr"] = lr
            opt.zero_grad(set_to_none=True)
            batch = [train_set[i] for i in order[b:b + args.batch]]
            loss_sum = 0.0
            for ex in batch:
                loss, _ = sequence_loss(head, ex, t2d, args.ttt_steps, weights,
                                        args.prompt_weight, args.feature_noise, soft_rows,
                                        args.soft_labels)
                (loss / len(batch)).backward()
                loss_sum += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            now = time.perf_counter()
            if now - last_report >= args.report_every:
                last_report = now
                ev = evaluate(head, held_out, t2d, args.ttt_steps)
                history.append({"minutes": (now - t0) / 60, "step": step, "epoch": epoch,
                                "train_loss": loss_sum / len(batch), **ev})
                print(f"{(now - t0) / 60:5.1f} min step {step} epoch {epoch} lr {lr:.2e} "
                      f"train {loss_sum / len(batch):.3f} held-out {ev['loss']:.3f} acc "
                      + " ".join(f"{a:.3f}" for a in ev["accuracy"]), flush=True)
                # Small data overfits: the head kept is the best one on held-out replies.
                if now - last_save >= args.save_every and _score(ev) > best:
                    last_save, best = now, _score(ev)
                    save_head(head, args.out, target_dir, layers)
    train_seconds = time.perf_counter() - t0
    final = evaluate(head, held_out, t2d, args.ttt_steps)
    if _score(final) >= best:
        save_head(head, args.out, target_dir, layers)
    else:
        final = max(history, key=_score)
        final = {"loss": final["loss"], "accuracy": final["accuracy"],
                 "kept_from_minute": final["minutes"]}
    size = (args.out / WEIGHTS_FILE).stat().st_size
    result = {"sequences": len(train_set), "tokens": n_tokens, "held_out": len(held_out),
              "draft_vocab": len(draft_ids), "layers": list(layers), "steps": step,
              "epochs": epoch, "feature_seconds": tf_seconds, "train_seconds": train_seconds,
              "final": final, "weights_bytes": size, "history": history}
    print(f"done: {step} steps, {epoch} epochs, {train_seconds / 60:.1f} min; held-out loss "
          f"{final['loss']:.3f}, accuracy " + " ".join(f"{a:.3f}" for a in final["accuracy"])
          + f"; {args.out / WEIGHTS_FILE}: {size} bytes", flush=True)
    (args.out / "training_log.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "TRAINING.md").write_text(training_card(args, result))
    return result


def shell_arg(arg: str) -> str:
    """`arg` quoted for a shell, a path under the home directory written from ~, so that
    the command on a card runs for anyone who keeps the data in their own cache."""
    home = str(Path.home()).rstrip("/") + "/"
    if arg.startswith(home):
        return "~/" + shlex.quote(arg[len(home):])
    return shlex.quote(arg)


def training_card(args: argparse.Namespace, r: dict) -> str:
    """TRAINING.md: how the head in this directory was made, and how well it did."""
    command = "python -m train.eagle3 " + " ".join(
        shell_arg(a) for a in (getattr(args, "argv", None) or sys.argv[1:]))
    acc = " / ".join(f"{a:.3f}" for a in r["final"]["accuracy"])
    lines = [
        "# EAGLE-3 head: how it was trained", "",
        "Produced by `train/eagle3.py` (its docstring has the recipe):", "",
        f"    {command}", "",
        *([f"- went on from the head in `{args.init}` (its "
           + ("MLP width and target layers; a new draft vocabulary of the most frequent "
              f"tokens of the data, {getattr(args, 'new_tokens', 0)} of them new, their "
              "lm_head rows mapped from the target's (revocab)"
              if getattr(args, "new_vocab", False) else
              "draft vocabulary, MLP width and target layers")
           + "; minute 0 below is that head)"] if args.init else []),
        f"- data: {', '.join(f'`{d.name}`' for d in args.data)}, {r['sequences']} prompt + "
        f"reply sequences ({r['tokens']} tokens) for training, {r['held_out']} held out"
        + (f" ({', '.join(f'`{d.name}`' for d in args.eval_data)})" if args.eval_data else "")
        + "; the target's own greedy replies (train/data.py)",
        f"- target layers (HF numbering): {r['layers']}; draft vocabulary {r['draft_vocab']}; "
        f"MLP width {args.intermediate_size}; training-time-test steps {args.ttt_steps} "
        f"(loss weight {args.step_decay}^(j-1)); prompt-token weight {args.prompt_weight}; "
        f"feature noise {args.feature_noise}; soft labels {args.soft_labels}; AdamW lr "
        f"{args.lr} (weight decay "
        f"{args.weight_decay}) cosine to 10%, "
        f"{args.batch} sequences per step; seed {args.seed}",
        f"- teacher forcing (target features): {r['feature_seconds'] / 60:.1f} min; training: "
        f"{r['train_seconds'] / 60:.1f} min, {r['steps']} steps, {r['epochs']} epochs "
        f"({torch.get_num_threads()} CPU threads)",
        f"- held-out loss {r['final']['loss']:.3f}; accuracy of draft steps 1..{args.ttt_steps} "
        f"(previous steps right, reply tokens): {acc}",
        f"- {WEIGHTS_FILE}: {r['weights_bytes']} bytes (bfloat16; the embedding is the "
        "target's)", "",
        "| minutes | step | train loss | held-out loss | held-out accuracy by step |",
        "|---|---|---|---|---|"]
    for h in r["history"]:
        lines.append(f"| {h['minutes']:.1f} | {h['step']} | {h['train_loss']:.3f} | "
                     f"{h['loss']:.3f} | " + " / ".join(f"{a:.3f}" for a in h["accuracy"]) + " |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="JSON lines {prompt, reply} of ids (one file or more)")
    p.add_argument("--eval-data", type=Path, nargs="+",
                   help="held-out JSON lines, one file or more (default: --eval-fraction of "
                        "--data)")
    p.add_argument("--feature-cache", type=Path,
                   help="target features on disk (default: eagle3_features.pt in the cache)")
    p.add_argument("--out", type=Path, required=True, help="head directory to write")
    p.add_argument("--target", help="target model dir (default: the prepared default model)")
    p.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps too")
    p.add_argument("--init", type=Path,
                   help="head directory to go on training from (keeps its draft vocabulary, "
                        "MLP width and target layers)")
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("--new-vocab", action="store_true",
                   help="with --init: choose the draft vocabulary afresh from --data, of the "
                        "same size (the tokens kept keep their rows; see revocab)")
    p.add_argument("--vocab-prompt-weight", type=float, default=1.0,
                   help="weight of prompt tokens against reply tokens in the draft vocabulary")
    p.add_argument("--intermediate-size", type=int, default=768, help="the head's MLP width")
    p.add_argument("--layers", type=int, nargs="*", help="target layers (HF numbering)")
    p.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    p.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step j: decay^(j-1)")
    p.add_argument("--prompt-weight", type=float, default=0.0,
                   help="loss weight of prompt tokens (0: replies only)")
    p.add_argument("--soft-labels", type=float, default=0.0, metavar="W",
                   help="weight of the cross-entropy against the target's distribution over "
                        "the draft vocabulary (the rest on its greedy token)")
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="relative std of Gaussian noise on the target features in training")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20, help="optimizer steps of linear warmup")
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--max-len", type=int, default=640, help="tokens per sequence at most")
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--report-every", type=float, default=120.0, help="seconds")
    p.add_argument("--save-every", type=float, default=0.0,
                   help="seconds between checkpoints at least (taken at reports that improve "
                        "on the held-out accuracy)")
    p.add_argument("--no-cache", action="store_true", help="do not keep target features on disk")
    p.add_argument("--stored-features-only", action="store_true",
                   help="train on the sequences whose features are stored or were recorded by "
                        "train/data.py only (no target pass)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    if args.threads:
        torch.set_num_threads(args.threads)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
