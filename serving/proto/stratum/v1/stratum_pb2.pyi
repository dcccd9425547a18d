from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StopReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STOP_REASON_UNSPECIFIED: _ClassVar[StopReason]
    END_TURN: _ClassVar[StopReason]
    MAX_TOKENS: _ClassVar[StopReason]
    STOP_SEQUENCE: _ClassVar[StopReason]
    CANCELLED: _ClassVar[StopReason]
STOP_REASON_UNSPECIFIED: StopReason
END_TURN: StopReason
MAX_TOKENS: StopReason
STOP_SEQUENCE: StopReason
CANCELLED: StopReason

class Message(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class MessagesRequest(_message.Message):
    __slots__ = ("model", "system", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop_sequences", "logprobs", "request_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    system: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    logprobs: int
    request_id: str
    def __init__(self, model: _Optional[str] = ..., system: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., logprobs: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class MessagesEvent(_message.Message):
    __slots__ = ("start", "delta", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: MessageStart
    delta: ContentDelta
    stop: MessageStop
    def __init__(self, start: _Optional[_Union[MessageStart, _Mapping]] = ..., delta: _Optional[_Union[ContentDelta, _Mapping]] = ..., stop: _Optional[_Union[MessageStop, _Mapping]] = ...) -> None: ...

class MessageStart(_message.Message):
    __slots__ = ("request_id", "prompt_tokens", "model")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tokens: int
    model: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ContentDelta(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("input_tokens", "output_tokens", "cached_input_tokens")
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., cached_input_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_ms", "ttft_ms", "total_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    ttft_ms: float
    total_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., total_ms: _Optional[float] = ...) -> None: ...

class MessageStop(_message.Message):
    __slots__ = ("stop_reason", "usage", "timings", "stack", "route", "metered")
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    METERED_FIELD_NUMBER: _ClassVar[int]
    stop_reason: StopReason
    usage: Usage
    timings: Timings
    stack: str
    route: str
    metered: CostBreakdown
    def __init__(self, stop_reason: _Optional[_Union[StopReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., stack: _Optional[str] = ..., route: _Optional[str] = ..., metered: _Optional[_Union[CostBreakdown, _Mapping]] = ...) -> None: ...

class CountTokensRequest(_message.Message):
    __slots__ = ("model", "system", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    system: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, model: _Optional[str] = ..., system: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class CountTokensResponse(_message.Message):
    __slots__ = ("input_tokens",)
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    input_tokens: int
    def __init__(self, input_tokens: _Optional[int] = ...) -> None: ...

class CostEstimateRequest(_message.Message):
    __slots__ = ("model", "system", "messages", "max_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    system: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    max_tokens: int
    def __init__(self, model: _Optional[str] = ..., system: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class CostBreakdown(_message.Message):
    __slots__ = ("stack", "compute_usd", "hbm_usd", "transfer_usd", "compute_seconds", "kv_gb_hours", "transfer_gb", "decode_step_ms", "prefill_tokens_per_s", "decode_batch", "kv_bytes_per_token", "cost_usd", "billed_input_tokens", "billed_output_tokens", "prefill_batch", "estimated_compute_seconds")
    STACK_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_USD_FIELD_NUMBER: _ClassVar[int]
    HBM_USD_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_USD_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_GB_HOURS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_GB_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_BATCH_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    BILLED_INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BILLED_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BATCH_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    stack: str
    compute_usd: float
    hbm_usd: float
    transfer_usd: float
    compute_seconds: float
    kv_gb_hours: float
    transfer_gb: float
    decode_step_ms: float
    prefill_tokens_per_s: float
    decode_batch: float
    kv_bytes_per_token: int
    cost_usd: float
    billed_input_tokens: int
    billed_output_tokens: int
    prefill_batch: float
    estimated_compute_seconds: float
    def __init__(self, stack: _Optional[str] = ..., compute_usd: _Optional[float] = ..., hbm_usd: _Optional[float] = ..., transfer_usd: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., kv_gb_hours: _Optional[float] = ..., transfer_gb: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_batch: _Optional[float] = ..., kv_bytes_per_token: _Optional[int] = ..., cost_usd: _Optional[float] = ..., billed_input_tokens: _Optional[int] = ..., billed_output_tokens: _Optional[int] = ..., prefill_batch: _Optional[float] = ..., estimated_compute_seconds: _Optional[float] = ...) -> None: ...

class CostEstimateResponse(_message.Message):
    __slots__ = ("estimated_cost_usd", "input_tokens", "max_output_tokens", "gpu_usd_per_hour", "transfer_usd_per_gb", "hbm_usd_per_gb_hour", "breakdown", "stacks")
    ESTIMATED_COST_USD_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GPU_USD_PER_HOUR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_USD_PER_GB_FIELD_NUMBER: _ClassVar[int]
    HBM_USD_PER_GB_HOUR_FIELD_NUMBER: _ClassVar[int]
    BREAKDOWN_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    estimated_cost_usd: float
    input_tokens: int
    max_output_tokens: int
    gpu_usd_per_hour: float
    transfer_usd_per_gb: float
    hbm_usd_per_gb_hour: float
    breakdown: CostBreakdown
    stacks: _containers.RepeatedCompositeFieldContainer[CostBreakdown]
    def __init__(self, estimated_cost_usd: _Optional[float] = ..., input_tokens: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., gpu_usd_per_hour: _Optional[float] = ..., transfer_usd_per_gb: _Optional[float] = ..., hbm_usd_per_gb_hour: _Optional[float] = ..., breakdown: _Optional[_Union[CostBreakdown, _Mapping]] = ..., stacks: _Optional[_Iterable[_Union[CostBreakdown, _Mapping]]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "dtype", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context", "max_tokens_cap", "kv_bytes_per_token")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_CAP_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    max_tokens_cap: int
    kv_bytes_per_token: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., max_tokens_cap: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ...) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "state", "device", "platform", "cuda_version", "hbm_bandwidth_gbps", "model", "version", "jax_version")
    READY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    HBM_BANDWIDTH_GBPS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    JAX_VERSION_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    state: str
    device: str
    platform: str
    cuda_version: str
    hbm_bandwidth_gbps: float
    model: ModelInfo
    version: str
    jax_version: str
    def __init__(self, ready: _Optional[bool] = ..., state: _Optional[str] = ..., device: _Optional[str] = ..., platform: _Optional[str] = ..., cuda_version: _Optional[str] = ..., hbm_bandwidth_gbps: _Optional[float] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., version: _Optional[str] = ..., jax_version: _Optional[str] = ...) -> None: ...

class GetMetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("count", "mean_ms", "p50_ms", "p95_ms", "p99_ms")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    def __init__(self, count: _Optional[int] = ..., mean_ms: _Optional[float] = ..., p50_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ...) -> None: ...

class MetricsSnapshot(_message.Message):
    __slots__ = ("queued", "running", "in_flight", "kv_pages_total", "kv_pages_used", "kv_pages_free", "kv_tokens_total", "kv_tokens_used", "prefix_cache_hits", "prefix_cache_queries", "cache_hit_rate", "preemptions", "steps", "decode_step_ms", "prefill_tokens_per_s", "input_tokens", "output_tokens", "requests_by_status", "accepted", "finished", "ttft", "tpot", "e2e", "draining", "dmlp", "stack", "stacks", "router_requests_by_status", "prompt_length_entropy_bits")
    class RequestsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class RouterRequestsByStatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_USED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TTFT_FIELD_NUMBER: _ClassVar[int]
    TPOT_FIELD_NUMBER: _ClassVar[int]
    E2E_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DMLP_FIELD_NUMBER: _ClassVar[int]
    STACK_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_REQUESTS_BY_STATUS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_ENTROPY_BITS_FIELD_NUMBER: _ClassVar[int]
    queued: int
    running: int
    in_flight: int
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_free: int
    kv_tokens_total: int
    kv_tokens_used: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    cache_hit_rate: float
    preemptions: int
    steps: int
    decode_step_ms: float
    prefill_tokens_per_s: float
    input_tokens: int
    output_tokens: int
    requests_by_status: _containers.ScalarMap[str, int]
    accepted: int
    finished: int
    ttft: LatencySummary
    tpot: LatencySummary
    e2e: LatencySummary
    draining: bool
    dmlp: DmlpStatus
    stack: str
    stacks: _containers.RepeatedCompositeFieldContainer[MetricsSnapshot]
    router_requests_by_status: _containers.ScalarMap[str, int]
    prompt_length_entropy_bits: float
    def __init__(self, queued: _Optional[int] = ..., running: _Optional[int] = ..., in_flight: _Optional[int] = ..., kv_pages_total: _Optional[int] = ..., kv_pages_used: _Optional[int] = ..., kv_pages_free: _Optional[int] = ..., kv_tokens_total: _Optional[int] = ..., kv_tokens_used: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., cache_hit_rate: _Optional[float] = ..., preemptions: _Optional[int] = ..., steps: _Optional[int] = ..., decode_step_ms: _Optional[float] = ..., prefill_tokens_per_s: _Optional[float] = ..., input_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., requests_by_status: _Optional[_Mapping[str, int]] = ..., accepted: _Optional[int] = ..., finished: _Optional[int] = ..., ttft: _Optional[_Union[LatencySummary, _Mapping]] = ..., tpot: _Optional[_Union[LatencySummary, _Mapping]] = ..., e2e: _Optional[_Union[LatencySummary, _Mapping]] = ..., draining: _Optional[bool] = ..., dmlp: _Optional[_Union[DmlpStatus, _Mapping]] = ..., stack: _Optional[str] = ..., stacks: _Optional[_Iterable[_Union[MetricsSnapshot, _Mapping]]] = ..., router_requests_by_status: _Optional[_Mapping[str, int]] = ..., prompt_length_entropy_bits: _Optional[float] = ...) -> None: ...

class DmlpStatus(_message.Message):
    __slots__ = ("confidence", "online", "accuracy", "updates", "dropped")
    CONFIDENCE_FIELD_NUMBER: _ClassVar[int]
    ONLINE_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    confidence: float
    online: bool
    accuracy: float
    updates: int
    dropped: int
    def __init__(self, confidence: _Optional[float] = ..., online: _Optional[bool] = ..., accuracy: _Optional[float] = ..., updates: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class ProfileRequest(_message.Message):
    __slots__ = ("num_steps", "name", "timeout_s")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    name: str
    timeout_s: float
    def __init__(self, num_steps: _Optional[int] = ..., name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class ProfileResponse(_message.Message):
    __slots__ = ("trace_dir", "steps_captured", "files")
    TRACE_DIR_FIELD_NUMBER: _ClassVar[int]
    STEPS_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    trace_dir: str
    steps_captured: int
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, trace_dir: _Optional[str] = ..., steps_captured: _Optional[int] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...
