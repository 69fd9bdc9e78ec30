from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingConfig(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "repetition_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., repetition_penalty: _Optional[float] = ...) -> None: ...

class SparseDist(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class TargetFeature(_message.Message):
    __slots__ = ("prefix_len", "encoding", "data", "scale")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    encoding: str
    data: bytes
    scale: float
    def __init__(self, prefix_len: _Optional[int] = ..., encoding: _Optional[str] = ..., data: _Optional[bytes] = ..., scale: _Optional[float] = ...) -> None: ...

class TargetStates(_message.Message):
    __slots__ = ("first", "count", "encoding", "data", "scales")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    first: int
    count: int
    encoding: str
    data: bytes
    scales: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, first: _Optional[int] = ..., count: _Optional[int] = ..., encoding: _Optional[str] = ..., data: _Optional[bytes] = ..., scales: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling_cfg", "seed", "correction", "max_new_tokens", "feature_encoding", "feature_window")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CFG_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    FEATURE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_cfg: SamplingConfig
    seed: int
    correction: str
    max_new_tokens: int
    feature_encoding: str
    feature_window: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling_cfg: _Optional[_Union[SamplingConfig, _Mapping]] = ..., seed: _Optional[int] = ..., correction: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., feature_encoding: _Optional[str] = ..., feature_window: _Optional[int] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("ctx_id", "ctx_len", "ctx_hash", "vocab_size", "counters_json", "feature", "states", "numerics", "node_budget", "tokenizer_fingerprint", "node_acceptance", "forward_cost")
    CTX_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    CTX_HASH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_JSON_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NODE_ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    ctx_id: str
    ctx_len: int
    ctx_hash: str
    vocab_size: int
    counters_json: str
    feature: TargetFeature
    states: TargetStates
    numerics: str
    node_budget: int
    tokenizer_fingerprint: str
    node_acceptance: NodeAcceptance
    forward_cost: ForwardCost
    def __init__(self, ctx_id: _Optional[str] = ..., ctx_len: _Optional[int] = ..., ctx_hash: _Optional[str] = ..., vocab_size: _Optional[int] = ..., counters_json: _Optional[str] = ..., feature: _Optional[_Union[TargetFeature, _Mapping]] = ..., states: _Optional[_Union[TargetStates, _Mapping]] = ..., numerics: _Optional[str] = ..., node_budget: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., node_acceptance: _Optional[_Union[NodeAcceptance, _Mapping]] = ..., forward_cost: _Optional[_Union[ForwardCost, _Mapping]] = ...) -> None: ...

class NodeAcceptance(_message.Message):
    __slots__ = ("kept", "tried")
    KEPT_FIELD_NUMBER: _ClassVar[int]
    TRIED_FIELD_NUMBER: _ClassVar[int]
    kept: _containers.RepeatedScalarFieldContainer[float]
    tried: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, kept: _Optional[_Iterable[float]] = ..., tried: _Optional[_Iterable[float]] = ...) -> None: ...

class TopIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("ctx_id", "ctx_len", "ctx_hash", "append_ids", "draft_tokens", "q_token_probs", "q_dists", "draft_kind", "hard_mask", "k", "return_top_k", "request_id", "sampling_cfg", "check_last", "tree", "tree_parents")
    CTX_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    CTX_HASH_FIELD_NUMBER: _ClassVar[int]
    APPEND_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_TOKEN_PROBS_FIELD_NUMBER: _ClassVar[int]
    Q_DISTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KIND_FIELD_NUMBER: _ClassVar[int]
    HARD_MASK_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CFG_FIELD_NUMBER: _ClassVar[int]
    CHECK_LAST_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    ctx_id: str
    ctx_len: int
    ctx_hash: str
    append_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    q_token_probs: _containers.RepeatedScalarFieldContainer[float]
    q_dists: _containers.RepeatedCompositeFieldContainer[SparseDist]
    draft_kind: str
    hard_mask: _containers.RepeatedScalarFieldContainer[int]
    k: int
    return_top_k: int
    request_id: str
    sampling_cfg: SamplingConfig
    check_last: bool
    tree: bool
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ctx_id: _Optional[str] = ..., ctx_len: _Optional[int] = ..., ctx_hash: _Optional[str] = ..., append_ids: _Optional[_Iterable[int]] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., q_token_probs: _Optional[_Iterable[float]] = ..., q_dists: _Optional[_Iterable[_Union[SparseDist, _Mapping]]] = ..., draft_kind: _Optional[str] = ..., hard_mask: _Optional[_Iterable[int]] = ..., k: _Optional[int] = ..., return_top_k: _Optional[int] = ..., request_id: _Optional[str] = ..., sampling_cfg: _Optional[_Union[SamplingConfig, _Mapping]] = ..., check_last: _Optional[bool] = ..., tree: _Optional[bool] = ..., tree_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class RoundMetrics(_message.Message):
    __slots__ = ("alpha_mean", "la_over_k", "prefill_ms", "queue_ms", "la_over_depth", "row_ms")
    ALPHA_MEAN_FIELD_NUMBER: _ClassVar[int]
    LA_OVER_K_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    LA_OVER_DEPTH_FIELD_NUMBER: _ClassVar[int]
    ROW_MS_FIELD_NUMBER: _ClassVar[int]
    alpha_mean: float
    la_over_k: float
    prefill_ms: float
    queue_ms: float
    la_over_depth: float
    row_ms: float
    def __init__(self, alpha_mean: _Optional[float] = ..., la_over_k: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., la_over_depth: _Optional[float] = ..., row_ms: _Optional[float] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("accepted_len", "correction", "next_kind", "target_dist", "ctx_len", "ctx_hash", "top_k_ids", "metrics", "feature", "accepted_nodes", "states", "node_budget")
    ACCEPTED_LEN_FIELD_NUMBER: _ClassVar[int]
    CORRECTION_FIELD_NUMBER: _ClassVar[int]
    NEXT_KIND_FIELD_NUMBER: _ClassVar[int]
    TARGET_DIST_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    CTX_HASH_FIELD_NUMBER: _ClassVar[int]
    TOP_K_IDS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_NODES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    accepted_len: int
    correction: int
    next_kind: str
    target_dist: SparseDist
    ctx_len: int
    ctx_hash: str
    top_k_ids: _containers.RepeatedCompositeFieldContainer[TopIds]
    metrics: RoundMetrics
    feature: TargetFeature
    accepted_nodes: _containers.RepeatedScalarFieldContainer[int]
    states: TargetStates
    node_budget: int
    def __init__(self, accepted_len: _Optional[int] = ..., correction: _Optional[int] = ..., next_kind: _Optional[str] = ..., target_dist: _Optional[_Union[SparseDist, _Mapping]] = ..., ctx_len: _Optional[int] = ..., ctx_hash: _Optional[str] = ..., top_k_ids: _Optional[_Iterable[_Union[TopIds, _Mapping]]] = ..., metrics: _Optional[_Union[RoundMetrics, _Mapping]] = ..., feature: _Optional[_Union[TargetFeature, _Mapping]] = ..., accepted_nodes: _Optional[_Iterable[int]] = ..., states: _Optional[_Union[TargetStates, _Mapping]] = ..., node_budget: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("ctx_id",)
    CTX_ID_FIELD_NUMBER: _ClassVar[int]
    ctx_id: str
    def __init__(self, ctx_id: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("ctx_id",)
    CTX_ID_FIELD_NUMBER: _ClassVar[int]
    ctx_id: str
    def __init__(self, ctx_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "vocab_size", "eos_ids", "max_context", "dtype", "device", "tokenizer_fingerprint", "max_k", "tokenizer_size", "feature_size", "feature_encodings", "tensor_parallel", "max_tree_nodes", "max_feature_window", "session_stream", "max_generate_tokens", "dtype_reason", "batch_invariant", "runner", "forward_cost", "numerics", "forward_path", "batch_invariant_probe")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_ENCODINGS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_FEATURE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SESSION_STREAM_FIELD_NUMBER: _ClassVar[int]
    MAX_GENERATE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    FORWARD_COST_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PATH_FIELD_NUMBER: _ClassVar[int]
    BATCH_INVARIANT_PROBE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    dtype: str
    device: str
    tokenizer_fingerprint: str
    max_k: int
    tokenizer_size: int
    feature_size: int
    feature_encodings: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel: int
    max_tree_nodes: int
    max_feature_window: int
    session_stream: bool
    max_generate_tokens: int
    dtype_reason: str
    batch_invariant: bool
    runner: str
    forward_cost: ForwardCost
    numerics: str
    forward_path: str
    batch_invariant_probe: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_k: _Optional[int] = ..., tokenizer_size: _Optional[int] = ..., feature_size: _Optional[int] = ..., feature_encodings: _Optional[_Iterable[str]] = ..., tensor_parallel: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_feature_window: _Optional[int] = ..., session_stream: _Optional[bool] = ..., max_generate_tokens: _Optional[int] = ..., dtype_reason: _Optional[str] = ..., batch_invariant: _Optional[bool] = ..., runner: _Optional[str] = ..., forward_cost: _Optional[_Union[ForwardCost, _Mapping]] = ..., numerics: _Optional[str] = ..., forward_path: _Optional[str] = ..., batch_invariant_probe: _Optional[str] = ...) -> None: ...

class ForwardCost(_message.Message):
    __slots__ = ("base_ms", "row_ms", "prefill_token_ms", "forwards", "tokens_per_second", "node_value", "linear_row_ms", "per_bucket")
    BASE_MS_FIELD_NUMBER: _ClassVar[int]
    ROW_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKEN_MS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    NODE_VALUE_FIELD_NUMBER: _ClassVar[int]
    LINEAR_ROW_MS_FIELD_NUMBER: _ClassVar[int]
    PER_BUCKET_FIELD_NUMBER: _ClassVar[int]
    base_ms: float
    row_ms: float
    prefill_token_ms: float
    forwards: int
    tokens_per_second: float
    node_value: float
    linear_row_ms: float
    per_bucket: bool
    def __init__(self, base_ms: _Optional[float] = ..., row_ms: _Optional[float] = ..., prefill_token_ms: _Optional[float] = ..., forwards: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., node_value: _Optional[float] = ..., linear_row_ms: _Optional[float] = ..., per_bucket: _Optional[bool] = ...) -> None: ...

class StreamSessionRequest(_message.Message):
    __slots__ = ("ctx_id", "ctx_len", "ctx_hash", "max_new_tokens", "stop_at_eos")
    CTX_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    CTX_HASH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    ctx_id: str
    ctx_len: int
    ctx_hash: str
    max_new_tokens: int
    stop_at_eos: bool
    def __init__(self, ctx_id: _Optional[str] = ..., ctx_len: _Optional[int] = ..., ctx_hash: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., stop_at_eos: _Optional[bool] = ...) -> None: ...

class StreamedToken(_message.Message):
    __slots__ = ("token_id", "ctx_len", "feature", "states", "node_budget")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    NODE_BUDGET_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    ctx_len: int
    feature: TargetFeature
    states: TargetStates
    node_budget: int
    def __init__(self, token_id: _Optional[int] = ..., ctx_len: _Optional[int] = ..., feature: _Optional[_Union[TargetFeature, _Mapping]] = ..., states: _Optional[_Union[TargetStates, _Mapping]] = ..., node_budget: _Optional[int] = ...) -> None: ...

class StreamMetrics(_message.Message):
    __slots__ = ("decode_ms", "queue_ms", "total_ms", "stop_reason")
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    decode_ms: float
    queue_ms: float
    total_ms: float
    stop_reason: str
    def __init__(self, decode_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class StreamDone(_message.Message):
    __slots__ = ("tokens", "ctx_len", "ctx_hash", "metrics")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CTX_LEN_FIELD_NUMBER: _ClassVar[int]
    CTX_HASH_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    ctx_len: int
    ctx_hash: str
    metrics: StreamMetrics
    def __init__(self, tokens: _Optional[int] = ..., ctx_len: _Optional[int] = ..., ctx_hash: _Optional[str] = ..., metrics: _Optional[_Union[StreamMetrics, _Mapping]] = ...) -> None: ...

class StreamSessionEvent(_message.Message):
    __slots__ = ("token", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: StreamedToken
    done: StreamDone
    def __init__(self, token: _Optional[_Union[StreamedToken, _Mapping]] = ..., done: _Optional[_Union[StreamDone, _Mapping]] = ...) -> None: ...
