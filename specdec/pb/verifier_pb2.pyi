from specdec.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("start", "policy_update", "cancel")
    class Start(_message.Message):
        __slots__ = ("request_id", "prompt_token_ids", "sampling", "speculation", "disabled_reason", "cache_salt", "priority")
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        SPECULATION_FIELD_NUMBER: _ClassVar[int]
        DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
        CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
        PRIORITY_FIELD_NUMBER: _ClassVar[int]
        request_id: str
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        sampling: _common_pb2.SamplingParams
        speculation: _common_pb2.SpeculationPolicy
        disabled_reason: _common_pb2.DisabledReason
        cache_salt: str
        priority: int
        def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[_common_pb2.SpeculationPolicy, _Mapping]] = ..., disabled_reason: _Optional[_Union[_common_pb2.DisabledReason, str]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...
    class PolicyUpdate(_message.Message):
        __slots__ = ("num_speculative_tokens", "enabled", "disabled_reason", "auto_k")
        NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
        ENABLED_FIELD_NUMBER: _ClassVar[int]
        DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
        AUTO_K_FIELD_NUMBER: _ClassVar[int]
        num_speculative_tokens: int
        enabled: bool
        disabled_reason: _common_pb2.DisabledReason
        auto_k: bool
        def __init__(self, num_speculative_tokens: _Optional[int] = ..., enabled: _Optional[bool] = ..., disabled_reason: _Optional[_Union[_common_pb2.DisabledReason, str]] = ..., auto_k: _Optional[bool] = ...) -> None: ...
    class Cancel(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    START_FIELD_NUMBER: _ClassVar[int]
    POLICY_UPDATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    start: GenerateRequest.Start
    policy_update: GenerateRequest.PolicyUpdate
    cancel: GenerateRequest.Cancel
    def __init__(self, start: _Optional[_Union[GenerateRequest.Start, _Mapping]] = ..., policy_update: _Optional[_Union[GenerateRequest.PolicyUpdate, _Mapping]] = ..., cancel: _Optional[_Union[GenerateRequest.Cancel, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "step_stats", "finish_reason", "usage", "spec_decode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STEP_STATS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    step_stats: _common_pb2.StepStats
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    spec_decode: _common_pb2.SpecDecodeStats
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., step_stats: _Optional[_Union[_common_pb2.StepStats, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., spec_decode: _Optional[_Union[_common_pb2.SpecDecodeStats, _Mapping]] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_free_kv_blocks", "kv_block_size", "num_free_kv_tokens", "num_total_kv_tokens", "step_time_ema_ms", "max_num_seqs", "max_model_len", "drafters", "max_num_speculative_tokens", "model_name", "tokenizer", "prefix_caching_enabled", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate", "engine_times", "speculation_controller")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_EMA_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHING_ENABLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_TIMES_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_CONTROLLER_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    kv_block_size: int
    num_free_kv_tokens: int
    num_total_kv_tokens: int
    step_time_ema_ms: float
    max_num_seqs: int
    max_model_len: int
    drafters: _containers.RepeatedCompositeFieldContainer[ConfiguredDrafter]
    max_num_speculative_tokens: int
    model_name: str
    tokenizer: _common_pb2.TokenizerFingerprint
    prefix_caching_enabled: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    engine_times: EngineTimes
    speculation_controller: bool
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., num_free_kv_tokens: _Optional[int] = ..., num_total_kv_tokens: _Optional[int] = ..., step_time_ema_ms: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., max_model_len: _Optional[int] = ..., drafters: _Optional[_Iterable[_Union[ConfiguredDrafter, _Mapping]]] = ..., max_num_speculative_tokens: _Optional[int] = ..., model_name: _Optional[str] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerFingerprint, _Mapping]] = ..., prefix_caching_enabled: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., engine_times: _Optional[_Union[EngineTimes, _Mapping]] = ..., speculation_controller: _Optional[bool] = ...) -> None: ...

class EngineTimes(_message.Message):
    __slots__ = ("steps", "tokens", "schedule_ms", "draft_wait_ms", "forward_ms", "sample_ms", "postprocess_ms", "deliver_ms", "sequences", "rows", "drafter_ms")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_MS_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    DELIVER_MS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_MS_FIELD_NUMBER: _ClassVar[int]
    steps: int
    tokens: int
    schedule_ms: float
    draft_wait_ms: float
    forward_ms: float
    sample_ms: float
    postprocess_ms: float
    deliver_ms: float
    sequences: int
    rows: int
    drafter_ms: float
    def __init__(self, steps: _Optional[int] = ..., tokens: _Optional[int] = ..., schedule_ms: _Optional[float] = ..., draft_wait_ms: _Optional[float] = ..., forward_ms: _Optional[float] = ..., sample_ms: _Optional[float] = ..., postprocess_ms: _Optional[float] = ..., deliver_ms: _Optional[float] = ..., sequences: _Optional[int] = ..., rows: _Optional[int] = ..., drafter_ms: _Optional[float] = ...) -> None: ...

class ConfiguredDrafter(_message.Message):
    __slots__ = ("name", "method", "available", "max_num_speculative_tokens", "bet_lookups", "bet_hits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BET_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    BET_HITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    method: _common_pb2.SpecMethod
    available: bool
    max_num_speculative_tokens: int
    bet_lookups: int
    bet_hits: int
    def __init__(self, name: _Optional[str] = ..., method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., available: _Optional[bool] = ..., max_num_speculative_tokens: _Optional[int] = ..., bet_lookups: _Optional[int] = ..., bet_hits: _Optional[int] = ...) -> None: ...
