"""Rotary position embeddings, computed the way Hugging Face does (float32
frequencies, cast to the model dtype last) so that logits match it bit for
bit in float64 tests."""

from __future__ import annotations

import math

import torch

from specdec.models.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies, with RoPE scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and
    # the band in between interpolated smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.register_buffer("inv_freq", inv_frequencies(cfg), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return cos_sin(positions, self.inv_freq, dtype)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int64, inv_freq: [D/2] -> cos, signed_sin: [T, 1, D] in `dtype`.

    signed_sin is sin with its first half negated, so that rotate-half
    becomes a roll (see apply_rotary)."""
    freqs = positions[:, None].float() * inv_freq.float()  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    half = sin.shape[-1] // 2
    signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
    return emb.cos().to(dtype)[:, None], signed_sin.to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, signed_sin: [T, 1, D]. HF's rotate-half,
    x * cos + cat(-x2, x1) * sin, written as a roll: x.roll(D/2) = cat(x2, x1),
    and the sign moves onto sin, which leaves every product bit-identical."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
