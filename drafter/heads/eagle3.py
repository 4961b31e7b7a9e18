"""The EAGLE-3 head (vLLM / SGLang llama_eagle3.py).

    f_i = fc([a_i; b_i; c_i])                  target layers (2, L//2, L-3), fc: [H, 3H_t]
    x   = f_i (or hidden_norm(f_i)) + attn([input_layernorm(embed); hidden_norm(f_i)])
    h   = x + mlp(post_attention_layernorm(x)) (then any further plain decoder layers)
    logits = lm_head(norm(h)) over a draft vocabulary; target id = d + d2t[d]
    the next step's feature is h (pre-norm), fc is not applied again.

The head brings its own norm and lm_head; its draft vocabulary (draft_vocab_size
rows, often fewer than the target's) maps to target ids through the `d2t`
offsets of its checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from drafter.heads.base import DraftHead, HeadConfig
from drafter.heads.checkpoint import HeadTensors
from specdec.models.config import ModelConfig
from specdec.models.linear import Linear, linear
from specdec.models.llama import MLP, Attention, RMSNorm, StepContext


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


class Eagle3Head(DraftHead):
    """fc fuses the target layers into the feature, layer 0 fuses it with the embedding;
    logits over the draft vocabulary, mapped to target ids by d2t."""

    def __init__(self, cfg: HeadConfig, attention: str = "sdpa"):
        super().__init__(cfg, attention)
        self.norm = RMSNorm(cfg.decoder.hidden_size, cfg.decoder.rms_norm_eps)
        # [V_draft] offsets: draft id d is target id d + d2t[d].
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    @staticmethod
    def fc_in_features(cfg: HeadConfig) -> int:
        return len(cfg.target_layers) * cfg.target_hidden_size  # the layers side by side

    def first_layer(self) -> _FirstEagle3Layer:
        return _FirstEagle3Layer(self.config.decoder, self.attn_backend,
                                 self.config.norm_before_residual)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return linear(target_hidden.flatten(1), self.fc)  # [P, layers * H_t] -> [P, H]

    def run_first_layer(self, first: _FirstEagle3Layer, embeds: torch.Tensor,
                        features: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return first(embeds, features, ctx)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(self.norm(hidden), self.lm_head)  # [N, V_draft]

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    # -- loading ------------------------------------------------------------------------

    @staticmethod
    def declared_target_hidden(raw: dict[str, Any], decoder: ModelConfig) -> int:
        return raw.get("target_hidden_size", decoder.hidden_size)

    @staticmethod
    def feature_config(raw: dict[str, Any], target: ModelConfig, decoder: ModelConfig,
                       where: str) -> tuple[tuple[int, ...], int]:
        layers = _target_layers(raw, target, where)
        draft_vocab = raw.get("draft_vocab_size") or decoder.vocab_size
        if not 0 < draft_vocab <= decoder.vocab_size:
            raise ValueError(f"vocab mismatch: draft_vocab_size {draft_vocab} ({where}) must be "
                             f"in 1..{decoder.vocab_size}")
        return layers, draft_vocab

    @staticmethod
    def target_tensor_names(target: ModelConfig) -> set[str]:
        return set()  # the head has its own lm_head

    def fc_shape_source(self) -> str:
        layers = self.config.target_layers
        return f"{len(layers)} target layers {list(layers)} of the target's hidden_size"

    def fill_output(self, own: HeadTensors, theirs: HeadTensors, target: ModelConfig,
                    embed_from_target: bool) -> None:
        cfg = self.config
        h = cfg.decoder.hidden_size
        lm_head = own.take("lm_head.weight", (cfg.draft_vocab_size, h),
                           "draft_vocab_size and hidden_size")
        self.lm_head.weight.copy_(lm_head.to(self.lm_head.weight.dtype))
        self.norm.weight.copy_(own.take("norm.weight", (h,)).to(self.norm.weight.dtype))
        self._fill_d2t(own)
        own.tensors.pop("t2d", None)  # target -> draft membership: not needed to draft

    def _fill_d2t(self, own: HeadTensors) -> None:
        dv, v = self.config.draft_vocab_size, self.config.vocab_size
        if not own.has("d2t"):
            if dv != v:
                raise ValueError(f"{own.where}: missing tensor d2t (draft_vocab_size {dv} < "
                                 f"vocab_size {v} needs the draft-to-target map)")
            self.d2t.zero_()
            return
        d2t = own.take("d2t", (dv,), "draft_vocab_size").to(torch.int64)
        targets = torch.arange(dv) + d2t
        bad = ((targets < 0) | (targets >= v)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"vocab mismatch: d2t maps draft id {i} to target id "
                             f"{int(targets[i])}, outside the target's vocabulary 0..{v - 1}")
        self.d2t.copy_(d2t)


def _target_layers(raw: dict[str, Any], target: ModelConfig, where: str) -> tuple[int, ...]:
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
