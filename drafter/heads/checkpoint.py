"""Reading EAGLE checkpoints: the head's tensors, the target's, and the decoder
layers' weights, with errors that name the tensor.

Checkpoint tensor names are those of the EAGLE repositories (`fc.*`,
`layers.N.*` / `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`,
optional `embed_tokens.weight`); a `model.` prefix is accepted.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.loader import safetensors_files


class HeadTensors:
    """Takes named tensors, checking each one's shape; errors name the tensor. What is
    left in `tensors` after loading went unused."""

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


def read_head_tensors(head_dir: Path) -> dict[str, torch.Tensor]:
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


def read_target_tensors(target_dir: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """Those of `names` (Hugging Face names) that the target's safetensors hold."""
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
def fill_layer(layer: nn.Module, own: HeadTensors, p: str, dec: ModelConfig) -> None:
    """Fill decoder layer `layer` from the tensors under prefix p (e.g. "layers.0."),
    q/k/v and gate/up fused; attention reads qkv_proj.in_features wide rows (H, or
    EAGLE-3's 2H), and the norms are those the layer has."""
    h, d = dec.hidden_size, dec.head_dim
    q, kv = dec.num_heads * d, dec.num_kv_heads * d
    attn = layer.self_attn
    attn_in = attn.qkv_proj.in_features
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
