"""Load a Llama-family model from a Hugging Face directory (config.json plus
model.safetensors, or shards listed in model.safetensors.index.json)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.models.config import ModelConfig
from specdec.models.linear import pack_linear_weights
from specdec.models.llama import FusedOps, LlamaForCausalLM
from specdec.models.rope import inv_frequencies

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}

# Hugging Face names of the projections we fuse: (our parameter, shard index).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights")
    return found


def _shard_bounds(model: LlamaForCausalLM, fused: str, shard: int) -> tuple[int, int]:
    cfg = model.config
    if fused.endswith("qkv_proj"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        starts = [0, q, q + kv, q + 2 * kv]
    else:
        i = cfg.intermediate_size
        starts = [0, i, 2 * i]
    return starts[shard], starts[shard + 1]


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", attention: str = "sdpa",
               pack_linear: bool = True, fused: FusedOps | str | None = None) -> LlamaForCausalLM:
    """pack_linear: on CPU in float32, run the projections on oneDNN-packed
    weights and few rows on the small-rows kernel (see linear.pack_linear_weights;
    the packed copy costs a second copy of the projection weights, except under
    SPECDEC_BATCH_INVARIANT=1, where every row runs on the small-rows kernel).
    fused: the operations run as fused Triton kernels (llama.FusedOps; default:
    FusedOps.default_for(device))."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    dtype = parse_dtype(dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, attention=attention)
    model = model.to_empty(device=device).to(dtype)
    # Built on the meta device, the RoPE table holds no values yet.
    model.rotary.inv_freq = inv_frequencies(cfg).to(device)
    if cfg.tie_word_embeddings:  # to_empty breaks parameter sharing
        model.lm_head.weight = model.embed_tokens.weight

    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}  # parameter -> rows written (fused ones fill in parts)
    unexpected: list[str] = []
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target, rows = _target(model, name)
                if target is None or target not in params:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                param = params[target]
                dest = param.data if rows is None else param.data[rows[0]:rows[1]]
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} from config.json")
                dest.copy_(tensor.to(dtype))
                filled[target] = filled.get(target, 0) + tensor.shape[0]
    if unexpected:
        raise ValueError(f"{model_dir}: unexpected tensors {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''}")
    missing = [n for n, p in params.items()
               if filled.get(n, 0) != p.shape[0]
               and not (n == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing:
        raise ValueError(f"{model_dir}: missing tensors for {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    pack_linear_weights(model, pack_linear and dtype == torch.float32)
    model.set_fused(FusedOps.default_for(device) if fused is None else fused)
    return model.eval()


def _target(model: LlamaForCausalLM, hf_name: str) -> tuple[str | None, tuple[int, int] | None]:
    """Our parameter name for a Hugging Face tensor name, and the rows it fills
    when the parameter is a fused projection."""
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm.weight", None
    if hf_name == "lm_head.weight":
        return "lm_head.weight", None
    m = _LAYER.match(hf_name)
    if not m:
        return None, None
    layer, module, kind = m.groups()
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return f"layers.{layer}.{fused}.{kind}", _shard_bounds(model, fused, shard)
    return f"layers.{layer}.{module}.{kind}", None


def save_model(model: LlamaForCausalLM, path: str | Path) -> Path:
    """Write `model` as a Hugging Face directory that load_model (and transformers)
    reads back: config.json and model.safetensors with q/k/v and gate/up unfused."""
    from safetensors.torch import save_file

    path = Path(path)
    cfg = model.config
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    w = {"model.embed_tokens.weight": model.embed_tokens.weight,
         "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn = layer.self_attn
        for kind in ("weight", "bias") if cfg.attention_bias else ("weight",):
            qw, kw, vw = getattr(attn.qkv_proj, kind).split([q, kv, kv])
            w.update({p + f"self_attn.q_proj.{kind}": qw, p + f"self_attn.k_proj.{kind}": kw,
                      p + f"self_attn.v_proj.{kind}": vw})
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        w.update({p + "self_attn.o_proj.weight": attn.o_proj.weight,
                  p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                  p + "mlp.down_proj.weight": layer.mlp.down_proj.weight,
                  p + "input_layernorm.weight": layer.input_layernorm.weight,
                  p + "post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    return path
