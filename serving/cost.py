"""The cost model behind CostEstimate: what one request costs on the stack being served.

Inputs
    P       billed prompt tokens: the exact chat-templated count (CountTokens); no padding
    M       billed output tokens: the request's max_tokens (an upper bound: generation may stop earlier)
    t_step  measured decode step wall time (engine EMA), seconds
    r_pre   measured prefill throughput, tokens/s: the median of recent prefill steps of at least
            PrefillRate.min_tokens tokens (PrefillRate below), never the tiny warm-up step
    B       requests sharing a decode step: the running mean of the server's decode batch, at least 1
    kv      KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    prices  gpu_usd_per_hour, hbm_usd_per_gb_hour, transfer_usd_per_gb

Formula
    t_prefill       = P / r_pre                        GPU seconds of the prompt's prefill
    t_decode_wall   = M x t_step                       how long the request decodes
    compute_seconds = t_prefill + t_decode_wall / B    a decode step is shared by B requests
    compute_usd     = compute_seconds / 3600 x gpu_usd_per_hour

    The KV cache grows linearly: from 0 to P during prefill, from P to P + M during decode, so the
    token-seconds it holds are
    kv_token_s      = (P / 2) x t_prefill + (P + M / 2) x t_decode_wall
    kv_gb_hours     = kv x kv_token_s / 1e9 / 3600
    hbm_usd         = kv_gb_hours x hbm_usd_per_gb_hour

    transfer_gb     = (request bytes + M x bytes per streamed token) / 1e9
    transfer_usd    = transfer_gb x transfer_usd_per_gb

    estimated_cost_usd = compute_usd + hbm_usd + transfer_usd

Padding is never billed: P and M are the request's own tokens, not the prefill-chunk, batch-bucket or
page-rounded sizes the engine computes over. The bytes per streamed token are the wire size of a
one-token ContentDelta event (4 bytes of text, a 5-digit token id) plus gRPC's 5-byte message header.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics

from serving.proto.stratum.v1 import stratum_pb2 as pb

DEFAULT_GPU_USD_PER_HOUR = 3.50       # an on-demand H100/H200 hour, roughly
DEFAULT_TRANSFER_USD_PER_GB = 0.09    # typical cloud internet egress
DEFAULT_HBM_USD_PER_GB_HOUR = 0.025   # an H200 hour spread over its 141 GB of HBM

_GRPC_FRAME_BYTES = 5
BYTES_PER_STREAMED_TOKEN = pb.MessagesEvent(
    delta=pb.ContentDelta(text="abcd", token_ids=[12345])).ByteSize() + _GRPC_FRAME_BYTES

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class Prices:
    gpu_usd_per_hour: float = DEFAULT_GPU_USD_PER_HOUR
    transfer_usd_per_gb: float = DEFAULT_TRANSFER_USD_PER_GB
    hbm_usd_per_gb_hour: float = DEFAULT_HBM_USD_PER_GB_HOUR

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not (isinstance(value, (int, float)) and value >= 0):
                raise ValueError(f"--{field.name.replace('_', '-')} must be a number >= 0, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Measured:
    """The step times measured on the running server."""

    decode_step_ms: float
    prefill_tokens_per_s: float
    decode_batch: float


@dataclasses.dataclass(frozen=True)
class Cost:
    estimated_cost_usd: float
    compute_usd: float
    hbm_usd: float
    transfer_usd: float
    compute_seconds: float
    kv_gb_hours: float
    transfer_gb: float


REPRESENTATIVE_PREFILL_TOKENS = 64   # prefill steps smaller than this don't set the cost model's rate


class PrefillRate:
    """The prefill throughput the cost model bills with, from representative steps only.

    A prefill step's tokens/s grows with its size until the device is busy: the 3-token warm-up step ran at
    16.7 tok/s on a server that prefills thousands, and billed 1.65 compute-seconds for a 22-token prompt.
    So only prefill steps of at least `min_tokens` tokens count (the server runs one such step at start-up,
    serving/server.py _calibrate). `tokens_per_s` is 0.0 until one has been seen.

    Fed from the engine thread with the engine's `last_step` (StepTiming: kind, seconds, prefill_tokens)
    after every step that prefilled ("prefill", or "mixed" with decode tokens riding along, which is what
    a loaded server mostly runs); read from any thread (`tokens_per_s` is replaced whole).
    """

    def __init__(self, min_tokens: int = REPRESENTATIVE_PREFILL_TOKENS, window: int = 64) -> None:
        if min_tokens < 1:
            raise ValueError(f"min_tokens must be >= 1, got {min_tokens}")
        self.min_tokens = min_tokens
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self.tokens_per_s = 0.0

    def observe(self, step) -> None:
        """step: the engine's last StepTiming (or None)."""
        if (step is None or step.kind not in ("prefill", "mixed") or step.prefill_tokens < self.min_tokens
                or step.seconds <= 0):
            return
        self._recent.append(step.prefill_tokens / step.seconds)
        self.tokens_per_s = statistics.median(self._recent)


def kv_bytes_per_token(model_config) -> int:
    """K and V of one token across all layers, at the model's dtype."""
    dtype = str(getattr(model_config, "dtype", "float32"))
    dtype = dtype.rsplit(".", 1)[-1].strip("'>")    # accepts "bfloat16", jnp.bfloat16, "<class '...bfloat16'>"
    itemsize = _DTYPE_BYTES.get(dtype, 4)
    return 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * itemsize


def estimate(prompt_tokens: int, max_tokens: int, request_bytes: int, kv_bytes: int,
             measured: Measured, prices: Prices) -> Cost:
    """The formula of the module docstring. Raises ValueError when the step times are not measured yet."""
    if measured.decode_step_ms <= 0 or measured.prefill_tokens_per_s <= 0:
        raise ValueError("the server has not measured a representative decode step and prefill step yet: "
                         "send a request (a prompt of at least 64 tokens sets the prefill rate), then ask again")
    p, m = float(prompt_tokens), float(max_tokens)
    t_step = measured.decode_step_ms / 1e3
    t_prefill = p / measured.prefill_tokens_per_s
    t_decode_wall = m * t_step
    compute_seconds = t_prefill + t_decode_wall / max(1.0, measured.decode_batch)
    compute_usd = compute_seconds / 3600 * prices.gpu_usd_per_hour
    kv_token_s = (p / 2) * t_prefill + (p + m / 2) * t_decode_wall
    kv_gb_hours = kv_bytes * kv_token_s / 1e9 / 3600
    hbm_usd = kv_gb_hours * prices.hbm_usd_per_gb_hour
    transfer_gb = (request_bytes + m * BYTES_PER_STREAMED_TOKEN) / 1e9
    transfer_usd = transfer_gb * prices.transfer_usd_per_gb
    return Cost(compute_usd + hbm_usd + transfer_usd, compute_usd, hbm_usd, transfer_usd, compute_seconds,
                kv_gb_hours, transfer_gb)
