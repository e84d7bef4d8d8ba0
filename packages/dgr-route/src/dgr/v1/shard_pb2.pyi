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
    DTYPE_F32: _ClassVar[DType]
    DTYPE_F16: _ClassVar[DType]
    DTYPE_BF16: _ClassVar[DType]

class DraftSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_SOURCE_UNSPECIFIED: _ClassVar[DraftSource]
    DRAFT_SOURCE_LOOKUP: _ClassVar[DraftSource]
    DRAFT_SOURCE_MTP: _ClassVar[DraftSource]
DTYPE_UNSPECIFIED: DType
DTYPE_F32: DType
DTYPE_F16: DType
DTYPE_BF16: DType
DRAFT_SOURCE_UNSPECIFIED: DraftSource
DRAFT_SOURCE_LOOKUP: DraftSource
DRAFT_SOURCE_MTP: DraftSource

class BoundarySpec(_message.Message):
    __slots__ = ("hc", "n_embd", "needs_token_ids", "dtypes")
    HC_FIELD_NUMBER: _ClassVar[int]
    N_EMBD_FIELD_NUMBER: _ClassVar[int]
    NEEDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    hc: int
    n_embd: int
    needs_token_ids: bool
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    def __init__(self, hc: _Optional[int] = ..., n_embd: _Optional[int] = ..., needs_token_ids: _Optional[bool] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ...) -> None: ...

class CompatibilityDescriptor(_message.Message):
    __slots__ = ("model_fingerprint", "llama_cpp_commit", "patch_stack_sha256", "schema_version", "lane", "arch", "n_layer", "recipe")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LLAMA_CPP_COMMIT_FIELD_NUMBER: _ClassVar[int]
    PATCH_STACK_SHA256_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    N_LAYER_FIELD_NUMBER: _ClassVar[int]
    RECIPE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    llama_cpp_commit: str
    patch_stack_sha256: str
    schema_version: int
    lane: str
    arch: str
    n_layer: int
    recipe: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., llama_cpp_commit: _Optional[str] = ..., patch_stack_sha256: _Optional[str] = ..., schema_version: _Optional[int] = ..., lane: _Optional[str] = ..., arch: _Optional[str] = ..., n_layer: _Optional[int] = ..., recipe: _Optional[str] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeReply(_message.Message):
    __slots__ = ("compatibility", "layer_first", "layer_last", "boundary", "n_ctx", "max_sessions", "max_tokens_per_message", "max_message_bytes", "max_rollback")
    COMPATIBILITY_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIRST_FIELD_NUMBER: _ClassVar[int]
    LAYER_LAST_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    compatibility: CompatibilityDescriptor
    layer_first: int
    layer_last: int
    boundary: BoundarySpec
    n_ctx: int
    max_sessions: int
    max_tokens_per_message: int
    max_message_bytes: int
    max_rollback: int
    def __init__(self, compatibility: _Optional[_Union[CompatibilityDescriptor, _Mapping]] = ..., layer_first: _Optional[int] = ..., layer_last: _Optional[int] = ..., boundary: _Optional[_Union[BoundarySpec, _Mapping]] = ..., n_ctx: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_tokens_per_message: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_rollback: _Optional[int] = ...) -> None: ...

class CacheExpectation(_message.Message):
    __slots__ = ("epoch", "n_past", "prefix_hash", "truncate")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    n_past: int
    prefix_hash: int
    truncate: bool
    def __init__(self, epoch: _Optional[int] = ..., n_past: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., truncate: _Optional[bool] = ...) -> None: ...

class Boundary(_message.Message):
    __slots__ = ("dtype", "shape", "payload", "crc32")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    crc32: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "want_logits")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    WANT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    want_logits: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., want_logits: _Optional[bool] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("session_id", "expect", "positions", "token_ids", "boundary", "chunk_index", "last_chunk", "sampling", "boundary_dtype", "route", "max_tokens", "stop_ids", "token_interval_ms", "draft", "n_draft")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_CHUNK_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    N_DRAFT_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    expect: CacheExpectation
    positions: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    boundary: Boundary
    chunk_index: int
    last_chunk: bool
    sampling: Sampling
    boundary_dtype: DType
    route: RouteSpec
    max_tokens: int
    stop_ids: _containers.RepeatedScalarFieldContainer[int]
    token_interval_ms: int
    draft: Draft
    n_draft: int
    def __init__(self, session_id: _Optional[int] = ..., expect: _Optional[_Union[CacheExpectation, _Mapping]] = ..., positions: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., boundary: _Optional[_Union[Boundary, _Mapping]] = ..., chunk_index: _Optional[int] = ..., last_chunk: _Optional[bool] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., boundary_dtype: _Optional[_Union[DType, str]] = ..., route: _Optional[_Union[RouteSpec, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_ids: _Optional[_Iterable[int]] = ..., token_interval_ms: _Optional[int] = ..., draft: _Optional[_Union[Draft, _Mapping]] = ..., n_draft: _Optional[int] = ...) -> None: ...

class Draft(_message.Message):
    __slots__ = ("source", "max_draft", "ngram_min", "ngram_max")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MIN_FIELD_NUMBER: _ClassVar[int]
    NGRAM_MAX_FIELD_NUMBER: _ClassVar[int]
    source: DraftSource
    max_draft: int
    ngram_min: int
    ngram_max: int
    def __init__(self, source: _Optional[_Union[DraftSource, str]] = ..., max_draft: _Optional[int] = ..., ngram_min: _Optional[int] = ..., ngram_max: _Optional[int] = ...) -> None: ...

class RouteSpec(_message.Message):
    __slots__ = ("stages", "stage_index")
    STAGES_FIELD_NUMBER: _ClassVar[int]
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    stages: _containers.RepeatedScalarFieldContainer[str]
    stage_index: int
    def __init__(self, stages: _Optional[_Iterable[str]] = ..., stage_index: _Optional[int] = ...) -> None: ...

class StageError(_message.Message):
    __slots__ = ("stage", "address", "code", "message")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stage: int
    address: str
    code: int
    message: str
    def __init__(self, stage: _Optional[int] = ..., address: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("token_id", "logprob", "logits")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    logits: Boundary
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., logits: _Optional[_Union[Boundary, _Mapping]] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("session_id", "n_past", "prefix_hash", "boundary", "token", "error", "epoch", "more_tokens", "drafted", "accepted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    N_PAST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    n_past: int
    prefix_hash: int
    boundary: Boundary
    token: TokenResult
    error: StageError
    epoch: int
    more_tokens: _containers.RepeatedCompositeFieldContainer[TokenResult]
    drafted: int
    accepted: int
    def __init__(self, session_id: _Optional[int] = ..., n_past: _Optional[int] = ..., prefix_hash: _Optional[int] = ..., boundary: _Optional[_Union[Boundary, _Mapping]] = ..., token: _Optional[_Union[TokenResult, _Mapping]] = ..., error: _Optional[_Union[StageError, _Mapping]] = ..., epoch: _Optional[int] = ..., more_tokens: _Optional[_Iterable[_Union[TokenResult, _Mapping]]] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ...) -> None: ...

class LoopReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    epoch: int
    def __init__(self, session_id: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("n_ctx",)
    N_CTX_FIELD_NUMBER: _ClassVar[int]
    n_ctx: int
    def __init__(self, n_ctx: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("ready", "draining", "sessions", "capacity", "queue_depth", "widest_batch")
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WIDEST_BATCH_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    draining: bool
    sessions: int
    capacity: int
    queue_depth: int
    widest_batch: int
    def __init__(self, ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., sessions: _Optional[int] = ..., capacity: _Optional[int] = ..., queue_depth: _Optional[int] = ..., widest_batch: _Optional[int] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    add_special: bool
    def __init__(self, text: _Optional[bytes] = ..., add_special: _Optional[bool] = ...) -> None: ...

class TokenizeReply(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeReply(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: bytes
    def __init__(self, text: _Optional[bytes] = ...) -> None: ...

class VocabularyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VocabularyReply(_message.Message):
    __slots__ = ("n_vocab", "eog")
    N_VOCAB_FIELD_NUMBER: _ClassVar[int]
    EOG_FIELD_NUMBER: _ClassVar[int]
    n_vocab: int
    eog: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, n_vocab: _Optional[int] = ..., eog: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: bytes
    content: bytes
    def __init__(self, role: _Optional[bytes] = ..., content: _Optional[bytes] = ...) -> None: ...

class ChatTemplateRequest(_message.Message):
    __slots__ = ("messages", "add_assistant")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_ASSISTANT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_assistant: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_assistant: _Optional[bool] = ...) -> None: ...

class ChatTemplateReply(_message.Message):
    __slots__ = ("prompt",)
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    prompt: bytes
    def __init__(self, prompt: _Optional[bytes] = ...) -> None: ...
