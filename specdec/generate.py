"""Plain greedy decoding with the model core: the reference that speculative
decoding must reproduce, and the engine behind `specdec chat` until the
services run."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specdec.models import LlamaForCausalLM, PagedKVCache


def greedy_stream(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: frozenset[int] | set[int] = frozenset(),
    block_size: int = 16,
) -> Iterator[list[int | None]]:
    """Yield, per step, the new token of every prompt (None once it finished).

    All prompts prefill in one ragged forward, then decode one token each per
    forward. A sequence finishes after max_new_tokens or on a stop id (which
    is yielded)."""
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts) + max_new_tokens
    blocks = len(prompts) * -(-longest // block_size)
    cache = PagedKVCache.for_model(model.config, blocks, block_size, model.dtype, model.device)
    for i in range(len(prompts)):
        cache.add(i)
    active = list(range(len(prompts)))
    feed = {i: prompts[i] for i in active}
    for _ in range(max_new_tokens):
        meta = cache.plan([(i, len(feed[i])) for i in active])
        ids = torch.tensor([t for i in active for t in feed[i]], device=model.device)
        next_ids = model(ids, meta, cache).logits.argmax(-1).tolist()
        step: list[int | None] = [None] * len(prompts)
        for i, tok in zip(active, next_ids, strict=True):
            step[i] = tok
            feed[i] = [tok]
        yield step
        active = [i for i in active if step[i] not in stop_ids]
        if not active:
            return


def greedy_generate(model: LlamaForCausalLM, prompts: list[list[int]], max_new_tokens: int,
                    stop_ids: frozenset[int] | set[int] = frozenset()) -> list[list[int]]:
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in greedy_stream(model, prompts, max_new_tokens, stop_ids):
        for out, tok in zip(outputs, step, strict=True):
            if tok is not None:
                out.append(tok)
    return outputs
