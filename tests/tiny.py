"""Tiny random float64 Llama models for exactness tests: in float64, a verify
pass and a one-token decode agree exactly, so outputs compare with ==."""

from __future__ import annotations

import torch

from specdec.models import LlamaForCausalLM, ModelConfig, PagedKVCache


def tiny_llama(vocab_size: int, seed: int, *, hidden_size: int = 64, head_dim: int = 16,
               max_len: int = 512, logit_scale: float = 4.0) -> LlamaForCausalLM:
    """2 layers, 4 heads over 2 KV heads. logit_scale sharpens the output
    distribution (greedy paths that are not one repeated token)."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                      intermediate_size=2 * hidden_size, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=head_dim, max_position_embeddings=max_len)
    m = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(logit_scale)
    return m


def next_token_logits(model: LlamaForCausalLM, contexts: list[list[int]]) -> torch.Tensor:
    """[n, V] float64 logits after each context, in one ragged forward."""
    bs = 16
    cache = PagedKVCache.for_model(model.config, sum(-(-len(c) // bs) for c in contexts), bs,
                                   model.dtype)
    for i in range(len(contexts)):
        cache.add(i)
    meta = cache.plan([(i, len(c)) for i, c in enumerate(contexts)])
    return model(torch.tensor([t for c in contexts for t in c]), meta, cache).logits
