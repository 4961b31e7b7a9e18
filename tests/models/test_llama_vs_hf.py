"""Our decoder's logits against transformers' on tiny random models (float64)
and on the prepared SmolLM2 (float32), over a ragged batch and across the
verify-then-rollback pattern."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec.models import load_model

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5)

ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama3-scaled-tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=32))),
    "mistral-sliding": (transformers.MistralConfig, transformers.MistralForCausalLM,
                        dict(sliding_window=6)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(head_dim=24)),
}


def make_tiny(arch: str, path) -> transformers.PreTrainedModel:
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**TINY, **extra)).to(torch.float64).eval()
    # Random biases too, so the Qwen2 qkv bias path is exercised.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path)
    return hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def ragged_step(model, cache, appends: dict[int, list[int]]) -> dict[int, torch.Tensor]:
    """Append each sequence's tokens in one forward; logits at every new position."""
    meta = cache.plan([(s, len(t)) for s, t in appends.items()])
    ids = torch.tensor([tok for t in appends.values() for tok in t])
    out = model(ids, meta, cache, logits_indices=torch.arange(len(ids)))
    split = out.logits.split(meta.query_lens)
    return dict(zip(appends, split, strict=True))


def check_verify_rollback(hf, model, vocab: int, tol: float) -> None:
    gen = torch.Generator().manual_seed(1)
    seqs = {s: torch.randint(vocab, (n,), generator=gen).tolist() for s, n in
            [(0, 5), (1, 21), (2, 3)]}
    cache = model.make_kv_cache(num_blocks=32, block_size=4)
    for s in seqs:
        cache.add(s)
    for s, got in ragged_step(model, cache, seqs).items():
        assert (got - hf_logits(hf, seqs[s])).abs().max() < tol

    # Verify a block of 4 on sequence 1, reject the last 3 (roll back), then
    # append a new block; the others decode one token and prefill a chunk.
    block = torch.randint(vocab, (4,), generator=gen).tolist()
    ragged_step(model, cache, {1: block})
    cache.truncate(1, 21 + 1)
    seqs[1] += block[:1]
    new = {0: [7], 1: [9, 10, 11], 2: [3, 4, 5, 6, 7, 8, 9]}
    for s, got in ragged_step(model, cache, new).items():
        seqs[s] += new[s]
        want = hf_logits(hf, seqs[s])[-len(new[s]):]
        assert (got - want).abs().max() < tol, (s, (got - want).abs().max())
    assert cache.length(1) == len(seqs[1])


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_tiny_float64_matches_transformers(arch, tmp_path):
    hf = make_tiny(arch, tmp_path)
    model = load_model(tmp_path, dtype="float64")
    check_verify_rollback(hf, model, TINY["vocab_size"], tol=1e-9)


def test_hidden_states_follow_hf_numbering(tmp_path):
    hf = make_tiny("qwen3", tmp_path)
    model = load_model(tmp_path, dtype="float64")
    tokens = list(range(10, 17))
    cache = model.make_kv_cache(num_blocks=8, block_size=4)
    cache.add(0)
    meta = cache.plan([(0, len(tokens))])
    layers = (0, 2, TINY["num_hidden_layers"])
    out = model(torch.tensor(tokens), meta, cache, hidden_layers=layers,
                hidden_indices=torch.tensor([1, 6]))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    assert out.hidden_states.shape == (3, 2, TINY["hidden_size"])
    for j, layer in enumerate(layers):
        assert (out.hidden_states[j] - ref[layer][0, [1, 6]]).abs().max() < 1e-9


@pytest.mark.model
def test_smollm2_float32_matches_transformers(smollm2_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    model = load_model(smollm2_dir, dtype="float32")
    check_verify_rollback(hf, model, hf.config.vocab_size, tol=1e-3)
