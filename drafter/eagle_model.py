"""EAGLE and EAGLE-3 draft heads, and their loader.

Both heads read the target's hidden states. Row i of a head's input is the
feature f_i of position i together with the embedding of the token that
follows it, t_{i+1}; its output h_i is the next feature, and the logits of
h_i draft the token at position i + 2. The head runs at position i (RoPE)
with its own KV cache.

EAGLE (v1/v2, SafeAILab/EAGLE cnets.py; vLLM llama_eagle.py):
    f_i = the target's last hidden state after its final norm (HF layer L)
    x   = fc([embed(t_{i+1}); f_i])            fc: [H, 2H], bias optional
    h   = decoder layers(x)                    layer 0 has no input_layernorm
    logits = target lm_head(h)                 no norm in between
    the next step's feature is h itself.
EAGLE-3 (vLLM / SGLang llama_eagle3.py):
    f_i = fc([a_i; b_i; c_i])                  target layers (2, L//2, L-3), fc: [H, 3H_t]
    x   = f_i (or hidden_norm(f_i)) + attn([input_layernorm(embed); hidden_norm(f_i)])
    h   = x + mlp(post_attention_layernorm(x)) (then any further plain decoder layers)
    logits = lm_head(norm(h)) over a draft vocabulary; target id = d + d2t[d]
    the next step's feature is h (pre-norm), fc is not applied again.

Checkpoint tensor names are those of the EAGLE repositories (`fc.*`,
`layers.N.*` / `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`,
optional `embed_tokens.weight`); a `model.` prefix is accepted. What a head
lacks (embed_tokens; EAGLE's lm_head) comes from the target directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from specdec.models.attention import ATTENTION_BACKENDS
from specdec.models.config import ModelConfig
from specdec.models.kv_cache import AttentionMetadata, PagedKVCache
from specdec.models.linear import Linear, linear
from specdec.models.llama import MLP, Attention, DecoderLayer, RMSNorm, StepContext
from specdec.models.loader import parse_dtype, safetensors_files
from specdec.models.rope import RotaryEmbedding, inv_frequencies

log = logging.getLogger(__name__)

HEAD_KINDS = ("eagle", "eagle3")


@dataclasses.dataclass(frozen=True, slots=True)
class HeadConfig:
    kind: str  # one of HEAD_KINDS
    decoder: ModelConfig  # the head's own layers (num_layers = the head's decoder layers)
    target_hidden_size: int
    vocab_size: int  # the target's: drafts are its token ids
    draft_vocab_size: int  # rows of the head's logits (EAGLE-3 may use fewer)
    target_layers: tuple[int, ...]  # HF numbering, in the order fc reads them
    fc_bias: bool = False
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(f), not f

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"head kind must be one of {HEAD_KINDS}, got {self.kind!r}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"1..vocab_size ({self.vocab_size})")


class _FirstEagleLayer(DecoderLayer):
    """EAGLE's layer 0: a Llama decoder layer without input_layernorm (fc's output
    goes straight into attention)."""

    def __init__(self, cfg: ModelConfig, backend):
        super().__init__(cfg, 0, backend)
        del self.input_layernorm

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn.attend(x, ctx)
        return x + self.mlp.apply_mlp(self.post_attention_layernorm(x))


class _FirstEagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention reads [normed embedding; normed feature] (2H wide)."""

    def __init__(self, cfg: ModelConfig, backend, norm_before_residual: bool):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, backend)
        attn = self.self_attn
        attn.qkv_proj = Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=cfg.attention_bias)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor,
                ctx: StepContext) -> torch.Tensor:
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [T, 2H]
        x = residual + self.self_attn.attend(x, ctx)
        return x + self.mlp.apply_mlp(self.post_attention_layernorm(x))


class DraftHead(nn.Module):
    """An EAGLE or EAGLE-3 head over a ragged batch and its own paged KV cache."""

    def __init__(self, cfg: HeadConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = cfg
        dec = cfg.decoder
        h = dec.hidden_size
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; have "
                             f"{sorted(ATTENTION_BACKENDS)}")
        self.attn_backend = ATTENTION_BACKENDS[attention](
            dec.num_heads, dec.num_kv_heads, dec.head_dim, dec.sliding_window)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.rotary = RotaryEmbedding(dec)
        rest = [DecoderLayer(dec, i, self.attn_backend) for i in range(1, dec.num_layers)]
        if cfg.kind == "eagle":
            self.fc = Linear(2 * h, h, bias=cfg.fc_bias)
            first: nn.Module = _FirstEagleLayer(dec, self.attn_backend)
            self.norm = None
            self.register_buffer("d2t", None)
        else:
            self.fc = Linear(len(cfg.target_layers) * cfg.target_hidden_size, h,
                             bias=cfg.fc_bias)
            first = _FirstEagle3Layer(dec, self.attn_backend, cfg.norm_before_residual)
            self.norm = RMSNorm(h, dec.rms_norm_eps)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.layers = nn.ModuleList([first, *rest])
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def make_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        return PagedKVCache.for_model(self.config.decoder, num_blocks, block_size, self.dtype,
                                      self.device)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden: [P, len(target_layers), H_t] -> the head's input features [P, H]."""
        if self.config.kind == "eagle":
            return target_hidden[:, 0]
        return linear(target_hidden.flatten(1), self.fc)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] the token following each row's position; features: [T, H];
        positions: [T] true positions (RoPE), while `meta` addresses the cache.
        Returns [T, H]: each row's output, the feature of the next position."""
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        ctx = StepContext(meta, cache, self.attn_backend.prepare(meta), cos, sin)
        embeds = self.embed_tokens(input_ids)
        first, *rest = self.layers
        if self.config.kind == "eagle":
            x = first(linear(torch.cat([embeds, features], dim=-1), self.fc), ctx)
        else:
            x = first(embeds, features, ctx)
        for layer in rest:
            x = layer(x, ctx)
        return x

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] row outputs -> [N, V_draft] logits over the draft vocabulary."""
        return linear(hidden if self.norm is None else self.norm(hidden), self.lm_head)

    def draft_token_ids(self, hidden: torch.Tensor,
                        with_confidence: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [N, H] row outputs -> ([N] greedy drafts as target token ids, [N] the
        head's probability of each draft when `with_confidence`, else None)."""
        logits = self.draft_logits(hidden)  # [N, V_draft]
        if with_confidence:
            confidence, ids = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        else:
            confidence, ids = None, logits.argmax(-1)
        return (ids if self.norm is None else ids + self.d2t[ids]), confidence

    def draft_top(self, hidden: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, H] row outputs -> ([N, width] the head's most likely tokens as target
        ids, most likely first; [N, width] float32 their probabilities)."""
        logits = self.draft_logits(hidden)  # [N, V_draft]
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(min(width, logits.shape[-1]), dim=-1)
        return (ids if self.norm is None else ids + self.d2t[ids]), probs


# -- loading -----------------------------------------------------------------------------

def load_head(kind: str, head_dir: str | Path, target_dir: str | Path,
              dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
              attention: str = "sdpa") -> DraftHead:
    """Load an EAGLE ("eagle") or EAGLE-3 ("eagle3") head for the target in target_dir.
    ValueError names whatever does not fit: a missing or misshaped tensor, a hidden
    size or vocabulary that differs from the target's, target layers out of range."""
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    if kind not in HEAD_KINDS:
        raise ValueError(f"head kind must be one of {HEAD_KINDS}, got {kind!r}")
    dtype = parse_dtype(dtype)
    raw = _read_json(head_dir / "config.json")
    try:
        target = ModelConfig.from_dir(target_dir)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    tensors = _read_head_tensors(head_dir)
    cfg = _head_config(kind, raw, target, tensors, head_dir)
    with torch.device("meta"):
        head = DraftHead(cfg, attention)
    head = head.to_empty(device=device).to(dtype)
    head.rotary.inv_freq = inv_frequencies(cfg.decoder).to(device)  # no values on meta
    _fill(head, tensors, target_dir, target, head_dir)
    if tensors:
        log.warning("%s: ignored tensors %s", head_dir, sorted(tensors)[:8])
    return head.eval()


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path.parent}: no config.json (expected an EAGLE head directory)")
    return json.loads(path.read_text())


def _read_head_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head, named without a `model.` prefix and with EAGLE-3's
    `midlayer.` as `layers.0.`."""
    try:
        files = safetensors_files(head_dir)
    except FileNotFoundError:
        bins = sorted(p.name for p in head_dir.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: convert it to safetensors)" if bins else ""
        raise ValueError(f"{head_dir}: no safetensors weights{hint}") from None
    tensors = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                key = name.removeprefix("model.")
                if key.startswith("midlayer."):
                    key = "layers.0." + key.removeprefix("midlayer.")
                tensors[key] = f.get_tensor(name)
    return tensors


def _head_config(kind: str, raw: dict[str, Any], target: ModelConfig,
                 tensors: dict[str, torch.Tensor], head_dir: Path) -> HeadConfig:
    where = f"{head_dir}/config.json"
    try:
        # The head's layers are Llama layers whatever its `architectures` says.
        decoder = ModelConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"],
                                            "vocab_size": raw.get("vocab_size", target.vocab_size)})
    except KeyError as e:
        raise ValueError(f"{where}: missing {e.args[0]}") from None
    # q/k/v biases are taken when the checkpoint has them (Qwen2-style heads).
    decoder = dataclasses.replace(
        decoder, attention_bias="layers.0.self_attn.q_proj.bias" in tensors)
    if decoder.vocab_size != target.vocab_size:
        raise ValueError(f"vocab mismatch: head vocab_size {decoder.vocab_size} ({where}), "
                         f"target vocab_size {target.vocab_size}")
    target_hidden = raw.get("target_hidden_size", decoder.hidden_size) if kind == "eagle3" \
        else decoder.hidden_size
    if target_hidden != target.hidden_size:
        raise ValueError(f"hidden size mismatch: head built for hidden_size {target_hidden} "
                         f"({where}), target hidden_size {target.hidden_size}")
    if kind == "eagle":
        # The feature is the target's final, normed hidden state: what vLLM and SGLang
        # hand an EAGLE head, and what the EAGLE repository trains on.
        layers: tuple[int, ...] = (target.num_layers,)
        draft_vocab = decoder.vocab_size
    else:
        layers = _eagle3_layers(raw, target, where)
        draft_vocab = raw.get("draft_vocab_size") or decoder.vocab_size
        if not 0 < draft_vocab <= decoder.vocab_size:
            raise ValueError(f"vocab mismatch: draft_vocab_size {draft_vocab} ({where}) must be "
                             f"in 1..{decoder.vocab_size}")
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state = false is not supported")
    return HeadConfig(kind=kind, decoder=decoder, target_hidden_size=target.hidden_size,
                      vocab_size=decoder.vocab_size, draft_vocab_size=draft_vocab,
                      target_layers=layers, fc_bias="fc.bias" in tensors,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)))


def _eagle3_layers(raw: dict[str, Any], target: ModelConfig, where: str) -> tuple[int, ...]:
    """The target layers EAGLE-3 reads, in HF numbering.

    vLLM captures `hidden_states + residual` on entering 0-based decoder layer j, for j
    in the head config's eagle_aux_hidden_state_layer_ids (top level, then
    eagle_config), else (2, L // 2, L - 3). The input of layer j is the output of
    layer j - 1, which Hugging Face numbers j: the ids carry over unchanged. vLLM
    concatenates them in the order it meets them, ascending."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or \
        (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    source = "eagle_aux_hidden_state_layer_ids" if ids else \
        f"the default (2, L // 2, L - 3) for a target of L = {target.num_layers} layers"
    L = target.num_layers
    ids = list(ids) if ids else [2, L // 2, L - 3]
    if any(not 0 <= i < L for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{where}: target layers {ids} from {source} must be distinct and in "
                         f"0..{L - 1}; set eagle_aux_hidden_state_layer_ids for this target")
    return tuple(sorted(ids))


class _Tensors:
    """Takes named tensors, checking each one's shape; errors name the tensor."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: Path):
        self.tensors = tensors
        self.where = where

    def has(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...], why: str = "config.json") -> torch.Tensor:
        t = self.tensors.pop(name, None)
        if t is None:
            raise ValueError(f"{self.where}: missing tensor {name}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{self.where}: tensor {name} has shape {tuple(t.shape)}, "
                             f"expected {shape} from {why}")
        return t


def _read_target_tensors(target_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    found = {}
    try:
        files = safetensors_files(target_dir)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in names & set(f.keys()):
                found[name] = f.get_tensor(name)
    return found


@torch.no_grad()
def _fill(head: DraftHead, tensors: dict[str, torch.Tensor], target_dir: Path,
          target: ModelConfig, head_dir: Path) -> None:
    cfg, dec = head.config, head.config.decoder
    h, v = dec.hidden_size, cfg.vocab_size
    own = _Tensors(tensors, head_dir)
    wanted = set()
    if not own.has("embed_tokens.weight"):
        wanted.add("model.embed_tokens.weight")
    if cfg.kind == "eagle":
        wanted.add("model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight")
    theirs = _Tensors(_read_target_tensors(target_dir, wanted) if wanted else {}, target_dir)

    def put(param: torch.Tensor, value: torch.Tensor) -> None:
        param.copy_(value.to(param.dtype))

    if own.has("embed_tokens.weight"):
        put(head.embed_tokens.weight, own.take("embed_tokens.weight", (v, h)))
        embed = None
    else:
        embed = theirs.take("model.embed_tokens.weight", (v, h), "the head's config.json")
        put(head.embed_tokens.weight, embed)
    if cfg.kind == "eagle":
        # EAGLE reuses the target's lm_head (tied to its embedding in some targets).
        name = "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"
        if name == "model.embed_tokens.weight" and embed is not None:
            head.lm_head.weight = head.embed_tokens.weight  # one copy, as in the target
        else:
            put(head.lm_head.weight, theirs.take(name, (v, h), "the head's config.json"))
        own.tensors.pop("layers.0.input_layernorm.weight", None)  # EAGLE does not use it
    else:
        put(head.lm_head.weight, own.take("lm_head.weight", (cfg.draft_vocab_size, h),
                                          "draft_vocab_size and hidden_size"))
        put(head.norm.weight, own.take("norm.weight", (h,)))
        _fill_d2t(head, own, cfg)
        own.tensors.pop("t2d", None)  # target -> draft membership: not needed to draft
    fc_in = head.fc.in_features
    why = ("hidden_size" if cfg.kind == "eagle" else
           f"{len(cfg.target_layers)} target layers {list(cfg.target_layers)} of the target's "
           f"hidden_size")
    put(head.fc.weight, own.take("fc.weight", (h, fc_in), why))
    if cfg.fc_bias:
        put(head.fc.bias, own.take("fc.bias", (h,)))
    for i, layer in enumerate(head.layers):
        _fill_layer(layer, own, f"layers.{i}.", dec,
                    2 * h if cfg.kind == "eagle3" and i == 0 else h)


def _fill_d2t(head: DraftHead, own: _Tensors, cfg: HeadConfig) -> None:
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if not own.has("d2t"):
        if dv != v:
            raise ValueError(f"{own.where}: missing tensor d2t (draft_vocab_size {dv} < "
                             f"vocab_size {v} needs the draft-to-target map)")
        head.d2t.zero_()
        return
    d2t = own.take("d2t", (dv,), "draft_vocab_size").to(torch.int64)
    targets = torch.arange(dv) + d2t
    bad = ((targets < 0) | (targets >= v)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"vocab mismatch: d2t maps draft id {i} to target id {int(targets[i])}, "
                         f"outside the target's vocabulary 0..{v - 1}")
    head.d2t.copy_(d2t)


def _fill_layer(layer: nn.Module, own: _Tensors, p: str, dec: ModelConfig, attn_in: int) -> None:
    h, d = dec.hidden_size, dec.head_dim
    q, kv = dec.num_heads * d, dec.num_kv_heads * d
    attn = layer.self_attn
    qkv = [own.take(f"{p}self_attn.{n}_proj.weight", (rows, attn_in))
           for n, rows in (("q", q), ("k", kv), ("v", kv))]
    attn.qkv_proj.weight.copy_(torch.cat(qkv).to(attn.qkv_proj.weight.dtype))
    if dec.attention_bias:
        bias = [own.take(f"{p}self_attn.{n}_proj.bias", (rows,))
                for n, rows in (("q", q), ("k", kv), ("v", kv))]
        attn.qkv_proj.bias.copy_(torch.cat(bias).to(attn.qkv_proj.bias.dtype))
    attn.o_proj.weight.copy_(own.take(f"{p}self_attn.o_proj.weight", (h, q)))
    i = dec.intermediate_size
    gate_up = [own.take(f"{p}mlp.{n}_proj.weight", (i, h)) for n in ("gate", "up")]
    layer.mlp.gate_up_proj.weight.copy_(torch.cat(gate_up).to(layer.mlp.gate_up_proj.weight.dtype))
    layer.mlp.down_proj.weight.copy_(own.take(f"{p}mlp.down_proj.weight", (h, i)))
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        if hasattr(layer, norm):
            getattr(layer, norm).weight.copy_(own.take(f"{p}{norm}.weight", (h,)))
