"""The fused Triton kernels of a GPU step (specdec/models/fused/) against the torch ops
they replace, alone and inside the model: logits, hidden states, the KV they write and
greedy tokens. Without CUDA they run in a child pytest under Triton's interpreter
(tests/interpreted.py), which has no bfloat16 arithmetic (numpy lacks the type): so
float32 and float16 here; bench/gpu_check.py checks bfloat16 on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec.models import LlamaForCausalLM, ModelConfig
from specdec.models.llama import FusedOps
from tests.interpreted import needs_triton, run_interpreted

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SINGLE = ["add_rms_norm", "rotary_kv", "silu_mul", "attention"]
# Float32 against float32: the kernels sum in another order than torch's ops.
ATOL = 2e-5


def test_fused_ops_parse():
    assert FusedOps.parse("none") == FusedOps()
    assert FusedOps.parse("all") == FusedOps(True, True, True, True)
    assert FusedOps.parse("silu_mul,attention") == FusedOps(silu_mul=True, attention=True)
    with pytest.raises(ValueError, match="rope"):
        FusedOps.parse("rope")
    assert FusedOps.default_for("cpu") == FusedOps()


def test_kernels_interpreted():
    run_interpreted(__file__, "not kernels_interpreted and not parse and not splits", 15)


# -- kernels alone -------------------------------------------------------------

DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float16, id="float16")]


def _close(dtype) -> dict:
    return {"rtol": 0, "atol": ATOL} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_equals_the_add_then_the_norm(dtype):
    from specdec.models.fused.rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm

    gen = torch.Generator().manual_seed(0)
    # 72 columns: a row shorter than the kernel's power-of-two block.
    x, h = (torch.randn(5, 72, generator=gen).to(DEVICE, dtype) for _ in range(2))
    w = (torch.rand(72, generator=gen) + 0.5).to(DEVICE, dtype)
    total, normed = add_rms_norm(x, h, w, 1e-5)
    ref_total, ref_normed = add_rms_norm_reference(x, h, w, 1e-5)
    assert torch.equal(total, ref_total)  # the sum is rounded as the reference rounds it
    torch.testing.assert_close(normed, ref_normed, **_close(dtype))
    torch.testing.assert_close(rms_norm(x, w, 1e-5),
                               add_rms_norm_reference(x, torch.zeros_like(x), w, 1e-5)[1],
                               **_close(dtype))
    # Rows are normalised on their own: a row scaled by 10 gives the same normed row.
    again = rms_norm(torch.cat([x[:1] * 10, x[1:]]), w, 1e-5)
    torch.testing.assert_close(again[0], rms_norm(x, w, 1e-5)[0], rtol=1e-2, atol=1e-2)
    assert not torch.allclose(normed, ref_total)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_then_product(dtype):
    from specdec.models.fused.silu_mul import BLOCK, silu_mul, silu_mul_reference

    gen = torch.Generator().manual_seed(1)
    width = BLOCK + 76  # two column programs, the second partly past the row
    gate_up = (torch.randn(3, 2 * width, generator=gen) * 3).to(DEVICE, dtype)
    out = silu_mul(gate_up)
    assert out.shape == (3, width)
    torch.testing.assert_close(out, silu_mul_reference(gate_up), **_close(dtype))
    # gate and up are told apart: swapping the halves changes the result.
    swapped = torch.cat([gate_up[:, width:], gate_up[:, :width]], dim=1)
    assert not torch.allclose(silu_mul(swapped), out)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(3, 1), (4, 4)], ids=["gqa3to1", "mha4"])
def test_rotary_kv_write_rotates_and_writes_only_its_slots(dtype, heads):
    from specdec.models.fused.rotary_kv import rotary_kv_write, rotary_kv_write_reference
    from specdec.models.rope import inv_frequencies

    h, hkv = heads
    d = 24  # half a head (12) is not a power of two
    cfg = ModelConfig(vocab_size=8, hidden_size=h * d, intermediate_size=8, num_layers=1,
                      num_heads=h, num_kv_heads=hkv, head_dim=d, rope_theta=10_000.0)
    inv_freq = inv_frequencies(cfg).to(DEVICE)
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(6, h + 2 * hkv, d, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 5, 17, 3, 900, 2], device=DEVICE)
    slots = torch.tensor([7, 1, 2, 30, 11, 4], device=DEVICE)
    k_cache = torch.randn(40, hkv, d, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(40, hkv, d, generator=gen).to(DEVICE, dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q = rotary_kv_write(qkv, h, positions, slots, inv_freq, k_cache, v_cache)
    q_ref = rotary_kv_write_reference(qkv, h, positions, slots, inv_freq, k_ref, v_ref)
    torch.testing.assert_close(q, q_ref, **_close(dtype))
    torch.testing.assert_close(k_cache, k_ref, **_close(dtype))  # other slots: as they were
    assert torch.equal(v_cache, v_ref)  # values are copied, not rotated
    # Position 0 is the identity; other positions rotate.
    torch.testing.assert_close(q[0], qkv[0, :h], **_close(dtype))
    assert not torch.allclose(q[1], qkv[1, :h], atol=1e-2)


# -- inside the model ------------------------------------------------------------

VOCAB, BLOCK_SIZE = 97, 4  # VOCAB: check_padded_step draws its ids below 97


def _tiny(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # sharper logits: greedy paths that are not one token
    return model.to(DEVICE)


def _decode(model: LlamaForCausalLM, prompts: list[list[int]], steps: int, verify: int):
    """Prefill the prompts (one step), then `steps` greedy decode steps for all, then one
    verify step of `verify` rows each that re-feeds the last tokens. Returns the greedy
    tokens, every step's logits and the hidden states of the verify step."""
    cache = model.make_kv_cache(64, BLOCK_SIZE)
    for s in range(len(prompts)):
        cache.add(s)
    meta = cache.plan([(s, len(p)) for s, p in enumerate(prompts)])
    ids = torch.tensor([t for p in prompts for t in p], device=DEVICE)
    logits = [model(ids, meta, cache).logits]
    tokens = [logits[-1].argmax(-1)]
    for _ in range(steps):
        meta = cache.plan([(s, 1) for s in range(len(prompts))])
        logits.append(model(tokens[-1], meta, cache).logits)
        tokens.append(logits[-1].argmax(-1))
    meta = cache.plan([(s, verify) for s in range(len(prompts))])
    ids = torch.stack(tokens[-verify:], dim=1).reshape(-1)
    rows = torch.arange(ids.numel(), device=DEVICE)
    out = model(ids, meta, cache, logits_indices=rows, hidden_layers=(0, 1, 2))
    logits.append(out.logits)
    return torch.stack(tokens, dim=1), logits, out.hidden_states


@needs_triton
@pytest.mark.parametrize("fused", [*SINGLE, "all"])
def test_fused_model_matches_the_unfused_one(fused):
    """Greedy tokens equal, logits and hidden states within float32 rounding, over a
    prefill, decode steps and a verify step; prompts of 20 tokens (a prefill the Triton
    attention leaves to torch's path) beside short ones."""
    model = _tiny()
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 20, 1, 11)]
    ref_tokens, ref_logits, ref_hidden = _decode(model, prompts, steps=6, verify=3)
    model.set_fused(fused)
    tokens, logits, hidden = _decode(model, prompts, steps=6, verify=3)
    assert torch.equal(tokens, ref_tokens)
    assert len(set(ref_tokens.flatten().tolist())) > 4
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(hidden, ref_hidden, rtol=0, atol=ATOL)


@needs_triton
@pytest.mark.parametrize("qs", [[1, 1, 1], [3, 1, 5]], ids=["decode", "ragged_verify"])
def test_graph_runner_steps_with_every_fusion_equal_eager(qs):
    """The CUDA-graph runner's padded static-shape step (capture off: the same padding,
    replayed eagerly) with the Triton paged attention and every fusion equals the
    eager step, and writes nothing outside its slots and the scratch block."""
    from specdec.models.cuda_graphs import CudaGraphRunner
    from tests.verifier.test_cuda_graphs import check_padded_step

    model = _tiny(1)
    model.set_fused("all")
    cache = model.make_kv_cache(96, BLOCK_SIZE)
    runner = CudaGraphRunner(model, cache, max_batch=4, max_query_len=5, max_model_len=64,
                             capture=False, min_context=8)
    rng = random.Random(len(qs))
    for s, n in enumerate(rng.randint(1, 30) for _ in qs):
        cache.add(s)
        model(torch.randint(0, VOCAB, (n,), device=DEVICE), cache.plan([(s, n)]), cache,
              logits_indices=torch.empty(0, dtype=torch.int64, device=DEVICE))
    check_padded_step(model, runner, len(qs), qs, atol=ATOL)


def test_attention_splits_the_keys_to_fill_the_gpu(monkeypatch):
    """Flash decoding's split count from shapes alone: a lone sequence over 4 kv heads
    splits its 256 keys into tiles' worth, a full batch does not split at all."""
    from specdec.models.fused import paged_attention as triton_paged

    monkeypatch.setattr(triton_paged, "_multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert triton_paged.split_keys(1, 4, 256, cuda) == triton_paged.BLOCK_N  # 4 splits
    assert triton_paged.split_keys(1, 4, 8192, cuda) == 8192 // 66 + 1
    assert triton_paged.split_keys(64, 8, 256, cuda) == 256  # 512 programs already
    assert triton_paged.split_keys(1, 4, 256, torch.device("cpu")) == 256
