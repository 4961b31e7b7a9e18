"""load_head: an EAGLE or EAGLE-3 head from its checkpoint directory, for a target.

The kind picks the head's class (HEADS); the class says what its config and
checkpoint hold beyond what both kinds share. What a head lacks (embed_tokens;
EAGLE's lm_head) comes from the target directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from drafter.heads.base import DraftHead, HeadConfig
from drafter.heads.checkpoint import HeadTensors, fill_layer, read_head_tensors, read_target_tensors
from drafter.heads.eagle1 import Eagle1Head
from drafter.heads.eagle3 import Eagle3Head
from specdec.models.config import ModelConfig
from specdec.models.loader import parse_dtype
from specdec.models.rope import inv_frequencies

log = logging.getLogger(__name__)

# The drafter method names ("eagle", "eagle3") are the kinds.
HEADS: dict[str, type[DraftHead]] = {"eagle": Eagle1Head, "eagle3": Eagle3Head}


def load_head(kind: str, head_dir: str | Path, target_dir: str | Path,
              dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
              attention: str = "sdpa") -> DraftHead:
    """Load an EAGLE ("eagle") or EAGLE-3 ("eagle3") head for the target in target_dir.
    ValueError names whatever does not fit: a missing or misshaped tensor, a hidden
    size or vocabulary that differs from the target's, target layers out of range."""
    head_dir, target_dir = Path(head_dir), Path(target_dir)
    if kind not in HEADS:
        raise ValueError(f"head kind must be one of {tuple(HEADS)}, got {kind!r}")
    cls = HEADS[kind]
    dtype = parse_dtype(dtype)
    raw = _read_json(head_dir / "config.json")
    try:
        target = ModelConfig.from_dir(target_dir)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    tensors = read_head_tensors(head_dir)
    cfg = _head_config(cls, raw, target, tensors, head_dir)
    with torch.device("meta"):
        head = cls(cfg, attention)
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


def _head_config(cls: type[DraftHead], raw: dict[str, Any], target: ModelConfig,
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
    target_hidden = cls.declared_target_hidden(raw, decoder)
    if target_hidden != target.hidden_size:
        raise ValueError(f"hidden size mismatch: head built for hidden_size {target_hidden} "
                         f"({where}), target hidden_size {target.hidden_size}")
    layers, draft_vocab = cls.feature_config(raw, target, decoder, where)
    eagle_config = raw.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise ValueError(f"{where}: eagle_config.use_aux_hidden_state = false is not supported")
    return HeadConfig(decoder=decoder, target_hidden_size=target.hidden_size,
                      vocab_size=decoder.vocab_size, draft_vocab_size=draft_vocab,
                      target_layers=layers, fc_bias="fc.bias" in tensors,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)))


@torch.no_grad()
def _fill(head: DraftHead, tensors: dict[str, torch.Tensor], target_dir: Path,
          target: ModelConfig, head_dir: Path) -> None:
    """Fill the head from its tensors (taken out of `tensors` as they are used) and the
    target's; the order of the checks fixes which error a broken checkpoint gets."""
    cfg, dec = head.config, head.config.decoder
    h, v = dec.hidden_size, cfg.vocab_size
    own = HeadTensors(tensors, head_dir)
    wanted = head.target_tensor_names(target)
    if not own.has("embed_tokens.weight"):
        wanted.add("model.embed_tokens.weight")
    theirs = HeadTensors(read_target_tensors(target_dir, wanted) if wanted else {}, target_dir)

    def put(param: torch.Tensor, value: torch.Tensor) -> None:
        param.copy_(value.to(param.dtype))

    embed_from_target = not own.has("embed_tokens.weight")
    if embed_from_target:
        put(head.embed_tokens.weight,
            theirs.take("model.embed_tokens.weight", (v, h), "the head's config.json"))
    else:
        put(head.embed_tokens.weight, own.take("embed_tokens.weight", (v, h)))
    head.fill_output(own, theirs, target, embed_from_target)
    put(head.fc.weight, own.take("fc.weight", (h, head.fc.in_features), head.fc_shape_source()))
    if cfg.fc_bias:
        put(head.fc.bias, own.take("fc.bias", (h,)))
    for i, layer in enumerate(head.layers):
        fill_layer(layer, own, f"layers.{i}.", dec)
