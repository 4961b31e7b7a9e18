from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]

class SpecMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPEC_METHOD_UNSPECIFIED: _ClassVar[SpecMethod]
    SPEC_METHOD_NONE: _ClassVar[SpecMethod]
    SPEC_METHOD_NGRAM: _ClassVar[SpecMethod]
    SPEC_METHOD_DRAFT_MODEL: _ClassVar[SpecMethod]
    SPEC_METHOD_EAGLE: _ClassVar[SpecMethod]
    SPEC_METHOD_EAGLE3: _ClassVar[SpecMethod]
    SPEC_METHOD_SUFFIX: _ClassVar[SpecMethod]

class DisabledReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISABLED_REASON_NONE: _ClassVar[DisabledReason]
    DISABLED_REASON_REQUEST: _ClassVar[DisabledReason]
    DISABLED_REASON_QUEUE_SIZE: _ClassVar[DisabledReason]
    DISABLED_REASON_DRAFTER_UNAVAILABLE: _ClassVar[DisabledReason]
    DISABLED_REASON_DEADLINE: _ClassVar[DisabledReason]
    DISABLED_REASON_DYNAMIC_K: _ClassVar[DisabledReason]
    DISABLED_REASON_TOKENIZER_MISMATCH: _ClassVar[DisabledReason]
    DISABLED_REASON_DRAFTER_MAX_LEN: _ClassVar[DisabledReason]
    DISABLED_REASON_ENGINE_SAMPLING: _ClassVar[DisabledReason]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_TOKEN: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType
SPEC_METHOD_UNSPECIFIED: SpecMethod
SPEC_METHOD_NONE: SpecMethod
SPEC_METHOD_NGRAM: SpecMethod
SPEC_METHOD_DRAFT_MODEL: SpecMethod
SPEC_METHOD_EAGLE: SpecMethod
SPEC_METHOD_EAGLE3: SpecMethod
SPEC_METHOD_SUFFIX: SpecMethod
DISABLED_REASON_NONE: DisabledReason
DISABLED_REASON_REQUEST: DisabledReason
DISABLED_REASON_QUEUE_SIZE: DisabledReason
DISABLED_REASON_DRAFTER_UNAVAILABLE: DisabledReason
DISABLED_REASON_DEADLINE: DisabledReason
DISABLED_REASON_DYNAMIC_K: DisabledReason
DISABLED_REASON_TOKENIZER_MISMATCH: DisabledReason
DISABLED_REASON_DRAFTER_MAX_LEN: DisabledReason
DISABLED_REASON_ENGINE_SAMPLING: DisabledReason
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_TOKEN: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "structured_output", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "bad_words", "allowed_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    structured_output: StructuredOutput
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_tokens: int
    bad_words: _containers.RepeatedCompositeFieldContainer[TokenIds]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_tokens: _Optional[int] = ..., bad_words: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SpeculationPolicy(_message.Message):
    __slots__ = ("method", "drafter", "num_speculative_tokens", "auto_k")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AUTO_K_FIELD_NUMBER: _ClassVar[int]
    method: SpecMethod
    drafter: str
    num_speculative_tokens: int
    auto_k: bool
    def __init__(self, method: _Optional[_Union[SpecMethod, str]] = ..., drafter: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., auto_k: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_logprobs", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., token: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "token")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    token: str
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., token: _Optional[str] = ...) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("vocab_size", "hash")
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    hash: str
    def __init__(self, vocab_size: _Optional[int] = ..., hash: _Optional[str] = ...) -> None: ...

class StepStats(_message.Message):
    __slots__ = ("step", "num_speculative_tokens", "num_drafted", "num_accepted", "batch_size", "step_time_ms", "draft_wait_ms", "disabled_reason", "num_tokens")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step: int
    num_speculative_tokens: int
    num_drafted: int
    num_accepted: int
    batch_size: int
    step_time_ms: float
    draft_wait_ms: float
    disabled_reason: DisabledReason
    num_tokens: int
    def __init__(self, step: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., batch_size: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., draft_wait_ms: _Optional[float] = ..., disabled_reason: _Optional[_Union[DisabledReason, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class SpecDecodeStats(_message.Message):
    __slots__ = ("method", "num_drafts", "num_draft_tokens", "num_accepted_tokens", "acceptance_length", "disabled_reason")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    method: SpecMethod
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_length: float
    disabled_reason: DisabledReason
    def __init__(self, method: _Optional[_Union[SpecMethod, str]] = ..., num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., acceptance_length: _Optional[float] = ..., disabled_reason: _Optional[_Union[DisabledReason, str]] = ...) -> None: ...
