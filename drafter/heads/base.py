"""What the EAGLE and EAGLE-3 draft heads share (eagle1.py, eagle3.py).

Both heads read the target's hidden states. Row i of a head's input is the
feature f_i of position i together with the embedding of the token that
follows it, t_{i+1}; its output h_i is the next feature, and the logits of
h_i draft the token at position i + 2. The head runs at position i (RoPE)
with its own paged KV cache.

Shared here: the token embedding, RoPE, `fc`, layers 1.. (plain Llama decoder
layers), `lm_head`, the KV cache and drafting from logits. A kind overrides the
hooks below that raise NotImplementedError: what fc reads and how features
enter layer 0, the logits and the draft-to-target id map, and what loading
(load.py) needs from its config and checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from drafter.heads.checkpoint import HeadTensors
from specdec.models.attention import ATTENTION_BACKENDS
from specdec.models.config import ModelConfig
from specdec.models.kv_cache import AttentionMetadata, PagedKVCache
from specdec.models.linear import Linear
from specdec.models.llama import DecoderLayer, StepContext
from specdec.models.rope import RotaryEmbedding


@dataclasses.dataclass(frozen=True, slots=True)
class HeadConfig:
    decoder: ModelConfig  # the head's own layers (num_layers = the head's decoder layers)
    target_hidden_size: int
    vocab_size: int  # the target's: drafts are its token ids
    draft_vocab_size: int  # rows of the head's logits (EAGLE-3 may use fewer)
    target_layers: tuple[int, ...]  # HF numbering, in the order fc reads them
    fc_bias: bool = False
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(f), not f

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in "
                             f"1..vocab_size ({self.vocab_size})")


class DraftHead(nn.Module):
    """A draft head over a ragged batch and its own paged KV cache."""

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
        self.fc = Linear(self.fc_in_features(cfg), h, bias=cfg.fc_bias)
        rest = [DecoderLayer(dec, i, self.attn_backend) for i in range(1, dec.num_layers)]
        self.layers = nn.ModuleList([self.first_layer(), *rest])
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

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, cache: PagedKVCache) -> torch.Tensor:
        """input_ids: [T] the token following each row's position; features: [T, H];
        positions: [T] true positions (RoPE), while `meta` addresses the cache.
        Returns [T, H]: each row's output, the feature of the next position."""
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        ctx = StepContext(meta, cache, self.attn_backend.prepare(meta), cos, sin)
        embeds = self.embed_tokens(input_ids)  # [T, H]
        first, *rest = self.layers
        x = self.run_first_layer(first, embeds, features, ctx)
        for layer in rest:
            x = layer(x, ctx)
        return x

    def draft_token_ids(self, hidden: torch.Tensor,
                        with_confidence: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [N, H] row outputs -> ([N] greedy drafts as target token ids, [N] the
        head's probability of each draft when `with_confidence`, else None)."""
        logits = self.draft_logits(hidden)  # [N, V_draft]
        if with_confidence:
            confidence, ids = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        else:
            confidence, ids = None, logits.argmax(-1)
        return self.target_ids(ids), confidence

    def draft_top(self, hidden: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: [N, H] row outputs -> ([N, width] the head's most likely tokens as target
        ids, most likely first; [N, width] float32 their probabilities)."""
        logits = self.draft_logits(hidden)  # [N, V_draft]
        probs, ids = torch.softmax(logits.float(), dim=-1).topk(min(width, logits.shape[-1]), dim=-1)
        return self.target_ids(ids), probs

    # -- what a kind defines: the model ------------------------------------------------

    @staticmethod
    def fc_in_features(cfg: HeadConfig) -> int:
        """Input width of fc."""
        raise NotImplementedError

    def first_layer(self) -> nn.Module:
        """Layer 0, built on self.config.decoder and self.attn_backend."""
        raise NotImplementedError

    def features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """target_hidden: [P, len(target_layers), H_t] -> the head's input features [P, H]."""
        raise NotImplementedError

    def run_first_layer(self, first: nn.Module, embeds: torch.Tensor, features: torch.Tensor,
                        ctx: StepContext) -> torch.Tensor:
        """Layer 0 over embeds: [T, H] and features: [T, H] -> [T, H]."""
        raise NotImplementedError

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] row outputs -> [N, V_draft] logits over the draft vocabulary."""
        raise NotImplementedError

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: draft-vocabulary ids (any shape) -> the target's ids, same shape."""
        raise NotImplementedError

    # -- what a kind defines: loading (load.py) ----------------------------------------

    @staticmethod
    def declared_target_hidden(raw: dict[str, Any], decoder: ModelConfig) -> int:
        """The target hidden size the head's config.json says it was built for."""
        raise NotImplementedError

    @staticmethod
    def feature_config(raw: dict[str, Any], target: ModelConfig, decoder: ModelConfig,
                       where: str) -> tuple[tuple[int, ...], int]:
        """(target layers fc reads, draft vocabulary size) from the head's config.json;
        ValueError names what does not fit the target."""
        raise NotImplementedError

    @staticmethod
    def target_tensor_names(target: ModelConfig) -> set[str]:
        """Tensors besides the embedding that the head takes from the target."""
        raise NotImplementedError

    def fc_shape_source(self) -> str:
        """Where fc's input width comes from, for an error naming a misshaped fc.weight."""
        raise NotImplementedError

    def fill_output(self, own: HeadTensors, theirs: HeadTensors, target: ModelConfig,
                    embed_from_target: bool) -> None:
        """Fill lm_head and what drafting from it needs, from the head's own tensors and
        the target's (embed_from_target: the embedding was the target's); take or drop
        every own tensor of the kind that fill_layer does not."""
        raise NotImplementedError
