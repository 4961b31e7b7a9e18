"""A checkpoint that does not fit its config fails at load with the tensor named."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec.models import ModelConfig, load_model
from tests.models.test_llama_vs_hf import make_tiny


@pytest.fixture
def tiny_dir(tmp_path):
    make_tiny("llama", tmp_path)
    return tmp_path


def rewrite(path, edit):
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, str(path / "model.safetensors"))


def test_missing_tensor_is_named(tiny_dir):
    rewrite(tiny_dir, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj"):
        load_model(tiny_dir)


def test_misshaped_tensor_is_named(tiny_dir):
    def edit(w):
        w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    rewrite(tiny_dir, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(tiny_dir)


def test_sharded_checkpoint_loads(tiny_dir):
    whole = load_file(tiny_dir / "model.safetensors")
    names = sorted(whole)
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: whole[k] for k in keys}, str(tiny_dir / shard))
    (tiny_dir / "model.safetensors").unlink()
    index = {"weight_map": {k: s for s, keys in halves.items() for k in keys}}
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(tiny_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.norm.weight, whole["model.norm.weight"].to(torch.bfloat16))


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict(dict(architectures=["GPT2LMHeadModel"], vocab_size=8,
                                      hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=2))


@pytest.mark.parametrize("tie", [False, True])
def test_save_model_round_trip(tmp_path, tie):
    from specdec.models import LlamaForCausalLM, save_model

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                      rope_theta=5000.0, max_position_embeddings=128, tie_word_embeddings=tie,
                      attention_bias=not tie, eos_token_ids=(3,))
    model = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # zero-initialised biases must round-trip too
    save_model(model, tmp_path / "m")
    loaded = load_model(tmp_path / "m", dtype="float64")
    assert ModelConfig.from_dir(tmp_path / "m") == cfg
    ours, theirs = dict(model.state_dict()), dict(loaded.state_dict())
    assert ours.keys() == theirs.keys()
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), name
