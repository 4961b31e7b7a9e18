"""Greedy decoding with our model reproduces transformers' greedy generate on
the prepared default model."""

from __future__ import annotations

import pytest
import torch
import transformers

from specdec.generate import greedy_generate
from specdec.models import load_model
from specdec.tokenizer import Tokenizer

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Summarise in three sentences why the sky is blue.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
]
NEW_TOKENS = 64

pytestmark = pytest.mark.model


def test_greedy_matches_transformers_generate(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    ours = greedy_generate(load_model(smollm2_dir, dtype="float32"), prompts, NEW_TOKENS)

    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    # Both sides run the full 64 tokens, past an end-of-turn token if one comes
    # (suppressing it instead, as min_new_tokens does, would change the argmax).
    hf.generation_config.eos_token_id = None
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              pad_token_id=0)
        want = out[0, len(prompt):].tolist()
        assert len(got) == NEW_TOKENS
        assert got == want, tok.decode(got) + "\n---\n" + tok.decode(want)
