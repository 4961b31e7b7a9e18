"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2) over a
ragged batch and a paged KV cache.

Tokens of all sequences are flattened into one [T] batch for every
projection and MLP; only attention sees sequences, through the backend.
q/k/v and gate/up projections are fused into one matmul each (fewer, larger
kernels: on CPU the step is bound by reading weights and by per-op
overhead). Logits are computed only at the positions asked for.

Every projection is a `Linear` run through `linear()` (linear.py), which
picks the CPU kernel by the number of rows once `pack_linear_weights(model)`
has prepared the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.attention import ATTENTION_BACKENDS, AttentionBackend
from specdec.models.config import ModelConfig
from specdec.models.kv_cache import AttentionMetadata, PagedKVCache
from specdec.models.linear import Linear, linear
from specdec.models.rope import RotaryEmbedding, apply_rotary


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalised in float32 whatever the model dtype, then scaled in the model
    dtype, as the reference implementation does (the logit tests check it)."""
    if x.dtype == torch.float32:
        # Same arithmetic as below; one fused kernel instead of seven ops.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True, slots=True)
class FusedOps:
    """Which of a step's small operations run as fused Triton kernels
    (specdec/models/fused/): on a GPU the step is bound by kernel count, not by the
    weights it reads. Off by default (`default_for`) until bench/gpu_check.py has run them
    on a GPU: they are tested against torch under Triton's interpreter on CPU, where the
    C kernels (small_rows, paged_attention) serve instead."""

    add_rms_norm: bool = False  # every residual add with the norm after it
    rotary_kv: bool = False  # rotary of q and k with the paged KV write
    silu_mul: bool = False  # the MLP's SiLU(gate) * up
    attention: bool = False  # decode and verify attention over the block table in place

    @classmethod
    def parse(cls, spec: str) -> FusedOps:
        """"all", "none", or a comma-separated list of the field names."""
        names = [f.name for f in fields(cls)]
        if spec in ("all", "none"):
            return cls(**dict.fromkeys(names, spec == "all"))
        wanted = [n for n in spec.split(",") if n]
        if unknown := sorted(set(wanted) - set(names)):
            raise ValueError(f"fused ops {unknown} unknown; have {names}, 'all' or 'none'")
        return cls(**{n: n in wanted for n in names})

    @classmethod
    def default_for(cls, device: torch.device | str) -> FusedOps:
        """What load_model turns on for `device`: nothing yet anywhere (see above); on
        CUDA "all" once the device check shows them exact and faster."""
        del device
        return cls()


NO_FUSION = FusedOps()


@dataclass(slots=True)
class StepContext:
    """What every layer needs for one forward pass."""

    meta: AttentionMetadata
    cache: PagedKVCache
    attn_state: object
    cos: torch.Tensor | None  # [T, 1, head_dim]; None where rotary_kv computes its own
    sin: torch.Tensor | None  # [T, 1, head_dim], first half negated (see rope.apply_rotary)
    fused: FusedOps = NO_FUSION
    # With fused.rotary_kv: the positions tokens are rotated by [T] and the model's
    # inverse frequencies [head_dim / 2] float32.
    rope_positions: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.backend = backend

    def attend(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        # Called as a plain method, and projections through linear(): on CPU
        # at batch 1, module-call overhead is a visible share of a step.
        t, h, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = linear(x, self.qkv_proj)
        qkv = qkv.view(t, h + 2 * hkv, self.head_dim)  # [T, H + 2 Hkv, D]
        if ctx.fused.rotary_kv:
            from specdec.models.fused.rotary_kv import rotary_kv_write

            if self.q_norm is not None:
                qkv = torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h:h + hkv]),
                                 qkv[:, h + hkv:]], dim=1)
            q = rotary_kv_write(qkv, h, ctx.rope_positions, ctx.meta.slot_mapping, ctx.inv_freq,
                                ctx.cache.k[self.layer], ctx.cache.v[self.layer])
            out = self.backend.forward(q, ctx.cache.k[self.layer], ctx.cache.v[self.layer],
                                       ctx.attn_state)
            return linear(out.reshape(t, self.q_size), self.o_proj)
        v = qkv[:, h + hkv:]
        if self.q_norm is not None:
            q = apply_rotary(self.q_norm(qkv[:, :h]), ctx.cos, ctx.sin)
            k = apply_rotary(self.k_norm(qkv[:, h:h + hkv]), ctx.cos, ctx.sin)
        else:
            # q and k share the rotation: one pass over [T, H + Hkv, D].
            qk = apply_rotary(qkv[:, :h + hkv], ctx.cos, ctx.sin)
            q, k = qk[:, :h], qk[:, h:]
        ctx.cache.write(self.layer, ctx.meta.slot_mapping, k, v)
        out = self.backend.forward(q, ctx.cache.k[self.layer], ctx.cache.v[self.layer], ctx.attn_state)
        return linear(out.reshape(t, self.q_size), self.o_proj)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def apply_mlp(self, x: torch.Tensor, fused: FusedOps = NO_FUSION) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)  # [T, 2I]
        if fused.silu_mul:
            from specdec.models.fused.silu_mul import silu_mul

            return linear(silu_mul(gate_up), self.down_proj)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        x = x + self.self_attn.attend(rms_norm(x, ln1.weight, ln1.eps), ctx)
        return x + self.mlp.apply_mlp(rms_norm(x, ln2.weight, ln2.eps), ctx.fused)


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor | None  # [N, vocab] at the requested positions
    # Hidden states of the requested layers at the requested positions:
    # [num_requested_layers, M, hidden], or None when none were asked for.
    hidden_states: torch.Tensor | None
    # [N] int64, the argmax of each logits row, where the step computed it (a CUDA
    # graph's, inside the graph); None elsewhere.
    argmax: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """Hidden-state layer numbering follows Hugging Face's output_hidden_states:
    0 is the embedding output, i the output of decoder layer i (1-based), and
    num_layers the final-norm output."""

    def __init__(self, cfg: ModelConfig, attention: str = "sdpa"):
        super().__init__()
        self.config = cfg
        if attention not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}; have {sorted(ATTENTION_BACKENDS)}")
        self.attn_backend = ATTENTION_BACKENDS[attention](
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, self.attn_backend) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg)
        self.fused = NO_FUSION

    def set_fused(self, fused: FusedOps | str) -> None:
        """Which operations run as fused Triton kernels from the next forward on."""
        self.fused = FusedOps.parse(fused) if isinstance(fused, str) else fused
        self.attn_backend.triton_paged = self.fused.attention

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def make_kv_cache(self, num_blocks: int, block_size: int = 16,
                      dtype: torch.dtype | None = None, *,
                      enable_prefix_caching: bool = False) -> PagedKVCache:
        return PagedKVCache.for_model(self.config, num_blocks, block_size,
                                      dtype or self.dtype, self.device, enable_prefix_caching)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKVCache,
        logits_indices: torch.Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        hidden_indices: torch.Tensor | None = None,
        static_shapes: bool = False,
    ) -> ForwardOutput:
        """input_ids: [T] new tokens laid out as in `meta` (already planned in
        `cache`). logits_indices: [N] token indices whose next-token logits are
        wanted (default: each sequence's last token; empty tensor for none).
        hidden_indices: [M] token indices for hidden_layers (default: all T).
        static_shapes: attention through AttentionBackend.prepare_static (one
        query length for all sequences; capturable in a CUDA graph)."""
        if logits_indices is None:
            logits_indices = meta.last_token_indices()
        rope = meta.positions if meta.rope_positions is None else meta.rope_positions
        fused = self.fused
        cos = sin = None
        if not fused.rotary_kv:
            cos, sin = self.rotary.cos_sin(rope, self.dtype)
        backend = self.attn_backend
        state = backend.prepare_static(meta) if static_shapes else backend.prepare(meta)
        ctx = StepContext(meta, cache, state, cos, sin, fused, rope, self.rotary.inv_freq)
        wanted = set(hidden_layers)
        for i in wanted:
            if not 0 <= i <= self.config.num_layers:
                raise ValueError(f"hidden layer {i} outside 0..{self.config.num_layers}")
        captured: dict[int, torch.Tensor] = {}

        def capture(i: int, h: torch.Tensor) -> None:
            if i in wanted:
                captured[i] = h if hidden_indices is None else h.index_select(0, hidden_indices)

        x = self.embed_tokens(input_ids)  # [T, hidden]
        capture(0, x)
        last = self.config.num_layers
        if fused.add_rms_norm:
            normed = self._fused_layers(x, ctx, capture)  # [T, hidden], final norm applied
            if last in wanted:
                capture(last, normed)
            if logits_indices.numel():
                normed = normed.index_select(0, logits_indices)
        else:
            for i, layer in enumerate(self.layers, start=1):
                x = layer(x, ctx)
                if i < last:
                    capture(i, x)
            if last in wanted:
                capture(last, self.norm(x))
            if logits_indices.numel():
                normed = self.norm(x.index_select(0, logits_indices))
        logits = linear(normed, self.lm_head) if logits_indices.numel() else None
        hidden = torch.stack([captured[i] for i in hidden_layers]) if hidden_layers else None
        return ForwardOutput(logits, hidden)

    def _fused_layers(self, x: torch.Tensor, ctx: StepContext, capture) -> torch.Tensor:
        """The decoder layers with every residual add fused into the norm after it: the
        post-attention norm of the same layer, the next layer's input norm, and after
        the last layer the final norm, whose output [T, hidden] this returns."""
        from specdec.models.fused.rms_norm import add_rms_norm
        from specdec.models.fused.rms_norm import rms_norm as fused_rms_norm

        first = self.layers[0].input_layernorm
        normed = fused_rms_norm(x, first.weight, first.eps)
        last = len(self.layers)
        for i, layer in enumerate(self.layers, start=1):
            post = layer.post_attention_layernorm
            h = layer.self_attn.attend(normed, ctx)
            x, normed = add_rms_norm(x, h, post.weight, post.eps)
            h = layer.mlp.apply_mlp(normed, ctx.fused)
            after = self.layers[i].input_layernorm if i < last else self.norm
            x, normed = add_rms_norm(x, h, after.weight, after.eps)  # x: layer i's output
            if i < last:
                capture(i, x)
        return normed
