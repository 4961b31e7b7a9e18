"""The EAGLE head (v1/v2; SafeAILab/EAGLE cnets.py, vLLM llama_eagle.py).

    f_i = the target's last hidden state after its final norm (HF layer L)
    x   = fc([embed(t_{i+1}); f_i])            fc: [H, 2H], bias optional
    h   = decoder layers(x)                    layer 0 has no input_layernorm
    logits = target lm_head(h)                 no norm in between
    the next step's feature is h itself.

The head drafts over the target's whole vocabulary with the target's lm_head
(tied to its embedding in some targets), read from the target directory.
"""

from __future__ import annotations

from typing import Any

import torch

from drafter.heads.base import DraftHead, HeadConfig
from drafter.heads.checkpoint import HeadTensors
from specdec.models.config import ModelConfig
from specdec.models.linear import linear
from specdec.models.llama import DecoderLayer, StepContext


class _FirstEagleLayer(DecoderLayer):
    """EAGLE's layer 0: a Llama decoder layer without input_layernorm (fc's output
    goes straight into attention)."""

    def __init__(self, cfg: ModelConfig, backend):
        super().__init__(cfg, 0, backend)
        del self.input_layernorm

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn.attend(x, ctx)
        return x + self.mlp.apply_mlp(self.post_attention_layernorm(x))


def _lm_head_name(target: ModelConfig) -> str:
    """The target tensor EAGLE's lm_head is: the embedding in a target that ties them."""
    return "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"


class Eagle1Head(DraftHead):
    """fc fuses [embedding; feature] before layer 0; logits over the target's vocabulary."""

    @staticmethod
    def fc_in_features(cfg: HeadConfig) -> int:
        return 2 * cfg.decoder.hidden_size  # [embedding; feature]

    def first_layer(self) -> _FirstEagleLayer:
        return _FirstEagleLayer(self.config.decoder, self.attn_backend)

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden[:, 0]  # [P, H]: the one layer read, as it is

    def run_first_layer(self, first: _FirstEagleLayer, embeds: torch.Tensor,
                        features: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        fused = linear(torch.cat([embeds, features], dim=-1), self.fc)  # [T, 2H] -> [T, H]
        return first(fused, ctx)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.lm_head)  # [N, V]

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids  # the draft vocabulary is the target's

    # -- loading ------------------------------------------------------------------------

    @staticmethod
    def declared_target_hidden(raw: dict[str, Any], decoder: ModelConfig) -> int:
        return decoder.hidden_size  # fc's output is added to the target's features

    @staticmethod
    def feature_config(raw: dict[str, Any], target: ModelConfig, decoder: ModelConfig,
                       where: str) -> tuple[tuple[int, ...], int]:
        # The feature is the target's final, normed hidden state: what vLLM and SGLang
        # hand an EAGLE head, and what the EAGLE repository trains on.
        return (target.num_layers,), decoder.vocab_size

    @staticmethod
    def target_tensor_names(target: ModelConfig) -> set[str]:
        return {_lm_head_name(target)}

    def fc_shape_source(self) -> str:
        return "hidden_size"

    def fill_output(self, own: HeadTensors, theirs: HeadTensors, target: ModelConfig,
                    embed_from_target: bool) -> None:
        # EAGLE reuses the target's lm_head (tied to its embedding in some targets).
        h, v = self.config.decoder.hidden_size, self.config.vocab_size
        name = _lm_head_name(target)
        if name == "model.embed_tokens.weight" and embed_from_target:
            self.lm_head.weight = self.embed_tokens.weight  # one copy, as in the target
        else:
            weight = theirs.take(name, (v, h), "the head's config.json")
            self.lm_head.weight.copy_(weight.to(self.lm_head.weight.dtype))
        own.tensors.pop("layers.0.input_layernorm.weight", None)  # EAGLE does not use it
