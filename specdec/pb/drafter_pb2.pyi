from specdec.pb import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("step", "entries", "continued")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    step: int
    entries: _containers.RepeatedCompositeFieldContainer[DraftEntry]
    continued: bool
    def __init__(self, step: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[DraftEntry, _Mapping]]] = ..., continued: _Optional[bool] = ...) -> None: ...

class DraftEntry(_message.Message):
    __slots__ = ("seq_id", "round", "start", "advance", "free")
    class Start(_message.Message):
        __slots__ = ("prompt_token_ids", "sampling", "max_num_speculative_tokens", "output_token_ids", "num_speculative_tokens", "tenant")
        PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        SAMPLING_FIELD_NUMBER: _ClassVar[int]
        MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
        OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
        TENANT_FIELD_NUMBER: _ClassVar[int]
        prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
        sampling: _common_pb2.SamplingParams
        max_num_speculative_tokens: int
        output_token_ids: _containers.RepeatedScalarFieldContainer[int]
        num_speculative_tokens: int
        tenant: str
        def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_num_speculative_tokens: _Optional[int] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., num_speculative_tokens: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...
    class Advance(_message.Message):
        __slots__ = ("num_drafted", "num_accepted", "new_token_ids", "num_rollback_tokens", "hidden_states", "num_speculative_tokens")
        NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
        NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
        NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        NUM_ROLLBACK_TOKENS_FIELD_NUMBER: _ClassVar[int]
        HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
        NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
        num_drafted: int
        num_accepted: int
        new_token_ids: _containers.RepeatedScalarFieldContainer[int]
        num_rollback_tokens: int
        hidden_states: HiddenStates
        num_speculative_tokens: int
        def __init__(self, num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_rollback_tokens: _Optional[int] = ..., hidden_states: _Optional[_Union[HiddenStates, _Mapping]] = ..., num_speculative_tokens: _Optional[int] = ...) -> None: ...
    class Free(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    ADVANCE_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    start: DraftEntry.Start
    advance: DraftEntry.Advance
    free: DraftEntry.Free
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., start: _Optional[_Union[DraftEntry.Start, _Mapping]] = ..., advance: _Optional[_Union[DraftEntry.Advance, _Mapping]] = ..., free: _Optional[_Union[DraftEntry.Free, _Mapping]] = ...) -> None: ...

class HiddenStates(_message.Message):
    __slots__ = ("tensor", "layers", "start_position")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    tensor: _common_pb2.Tensor
    layers: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    def __init__(self, tensor: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., layers: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("step", "proposals", "draft_time_ms", "unknown_seq_ids", "bets", "followup", "bets_follow", "tables", "continued")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    UNKNOWN_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BETS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWUP_FIELD_NUMBER: _ClassVar[int]
    BETS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CONTINUED_FIELD_NUMBER: _ClassVar[int]
    step: int
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    draft_time_ms: float
    unknown_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    bets: _containers.RepeatedCompositeFieldContainer[DraftBet]
    followup: bool
    bets_follow: bool
    tables: _containers.RepeatedCompositeFieldContainer[DraftTable]
    continued: bool
    def __init__(self, step: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., draft_time_ms: _Optional[float] = ..., unknown_seq_ids: _Optional[_Iterable[int]] = ..., bets: _Optional[_Iterable[_Union[DraftBet, _Mapping]]] = ..., followup: _Optional[bool] = ..., bets_follow: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[DraftTable, _Mapping]]] = ..., continued: _Optional[bool] = ...) -> None: ...

class DraftTable(_message.Message):
    __slots__ = ("seq_id", "round", "proposal", "group_sizes", "bonus", "lengths", "token_ids", "k", "copy_unlisted")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZES_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    COPY_UNLISTED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    proposal: _containers.RepeatedScalarFieldContainer[int]
    group_sizes: _containers.RepeatedScalarFieldContainer[int]
    bonus: _containers.RepeatedScalarFieldContainer[int]
    lengths: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    k: int
    copy_unlisted: bool
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., proposal: _Optional[_Iterable[int]] = ..., group_sizes: _Optional[_Iterable[int]] = ..., bonus: _Optional[_Iterable[int]] = ..., lengths: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., copy_unlisted: _Optional[bool] = ...) -> None: ...

class DraftBet(_message.Message):
    __slots__ = ("seq_id", "round", "new_token_ids", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("seq_id", "round", "token_ids", "probs", "parents")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    round: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: DraftProbs
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., round: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("dense", "sparse")
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    dense: _common_pb2.Tensor
    sparse: SparseProbs
    def __init__(self, dense: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sparse: _Optional[_Union[SparseProbs, _Mapping]] = ...) -> None: ...

class SparseProbs(_message.Message):
    __slots__ = ("row_lengths", "token_ids", "probs")
    ROW_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    row_lengths: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, row_lengths: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("method", "model_name", "tokenizer", "max_num_speculative_tokens", "needs_hidden_states", "hidden_state_layers", "hidden_size", "hidden_state_dtype", "target_model_name", "returns_probs", "supports_pipelining", "max_model_len", "max_request_bytes")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    RETURNS_PROBS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PIPELINING_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    method: _common_pb2.SpecMethod
    model_name: str
    tokenizer: _common_pb2.TokenizerFingerprint
    max_num_speculative_tokens: int
    needs_hidden_states: bool
    hidden_state_layers: _containers.RepeatedScalarFieldContainer[int]
    hidden_size: int
    hidden_state_dtype: _common_pb2.DType
    target_model_name: str
    returns_probs: bool
    supports_pipelining: bool
    max_model_len: int
    max_request_bytes: int
    def __init__(self, method: _Optional[_Union[_common_pb2.SpecMethod, str]] = ..., model_name: _Optional[str] = ..., tokenizer: _Optional[_Union[_common_pb2.TokenizerFingerprint, _Mapping]] = ..., max_num_speculative_tokens: _Optional[int] = ..., needs_hidden_states: _Optional[bool] = ..., hidden_state_layers: _Optional[_Iterable[int]] = ..., hidden_size: _Optional[int] = ..., hidden_state_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., target_model_name: _Optional[str] = ..., returns_probs: _Optional[bool] = ..., supports_pipelining: _Optional[bool] = ..., max_model_len: _Optional[int] = ..., max_request_bytes: _Optional[int] = ...) -> None: ...
