"""The cost model behind CostEstimate (what one request will cost, on each stack the server runs) and
behind metered usage (what a finished request did cost: the same formula applied to what ran).

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

Per stack. Each stack (serving/stacks.py) is priced with its own measured t_step, r_pre and B (its own
engine's), and its own kv (bf16 pages, or DKVC's delta bytes per token on the Stratum stack).

Metered usage (`meter`, on each finished request's MessageStop and in stratum_metered_cost_usd_total). The
same formula with what ran instead of what was asked: M = the tokens generated (not max_tokens), and the C
prompt tokens served from the prefix cache are not prefilled, so only P - C are billed compute:
    t_prefill   = (P - C) / r_pre
    kv_token_s  = (C + (P - C) / 2) x t_prefill + (P + M / 2) x t_decode_wall
with t_step, r_pre and B as measured when the request finished. For a request with no prefix-cache hit that
runs to max_tokens, under steady step times, the bill equals the estimate; the differences are an early
stop, cache hits, and the step times and batch moving between the estimate and the finish.

Default prices. The figures issue #13 quotes for the design: $3.92 per GPU-hour, $0.01 per GB transferred and
$0.00012 per GB-hour of HBM (DESIGN.md itself names the three prices but no figures). They are used as given
and were not checked against a provider's price list here. Read them as: the GPU-hour is one H200's on-demand
hour; the transfer price is in-region (behind a load balancer), not internet egress; the HBM price charges
only the opportunity cost of the KV a request holds, since the HBM itself is paid for in the GPU-hour (so it
is far below the GPU-hour spread over 141 GB, $3.92 / 141 = $0.028). All three are flags
(--gpu-usd-per-hour, --transfer-usd-per-gb, --hbm-usd-per-gb-hour).
"""
from __future__ import annotations

import collections
import dataclasses
import statistics

from serving.proto.stratum.v1 import stratum_pb2 as pb

# The prices issue #13 quotes for the design (the module docstring says what each one means).
DEFAULT_GPU_USD_PER_HOUR = 3.92       # one H200 GPU-hour
DEFAULT_TRANSFER_USD_PER_GB = 0.01    # in-region transfer
DEFAULT_HBM_USD_PER_GB_HOUR = 0.00012 # holding 1 GB of HBM for an hour

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
    return _cost(prompt_tokens, 0, max_tokens, request_bytes, kv_bytes, measured, prices)


def meter(prompt_tokens: int, cached_prompt_tokens: int, output_tokens: int, request_bytes: int, kv_bytes: int,
          measured: Measured, prices: Prices) -> Cost:
    """Metered usage of a finished request (module docstring): the tokens it generated, and no prefill
    compute for its prefix-cache hits. Raises ValueError when the step times are not measured yet."""
    return _cost(prompt_tokens, min(cached_prompt_tokens, prompt_tokens), output_tokens, request_bytes, kv_bytes,
                 measured, prices)


def _cost(prompt_tokens: int, cached_tokens: int, output_tokens: int, request_bytes: int, kv_bytes: int,
          measured: Measured, prices: Prices) -> Cost:
    if measured.decode_step_ms <= 0 or measured.prefill_tokens_per_s <= 0:
        raise ValueError("the server has not measured a representative decode step and prefill step yet: "
                         "send a request (a prompt of at least 64 tokens sets the prefill rate), then ask again")
    p, c, m = float(prompt_tokens), float(cached_tokens), float(output_tokens)
    t_step = measured.decode_step_ms / 1e3
    t_prefill = (p - c) / measured.prefill_tokens_per_s
    t_decode_wall = m * t_step
    compute_seconds = t_prefill + t_decode_wall / max(1.0, measured.decode_batch)
    compute_usd = compute_seconds / 3600 * prices.gpu_usd_per_hour
    kv_token_s = (c + (p - c) / 2) * t_prefill + (p + m / 2) * t_decode_wall
    kv_gb_hours = kv_bytes * kv_token_s / 1e9 / 3600
    hbm_usd = kv_gb_hours * prices.hbm_usd_per_gb_hour
    transfer_gb = (request_bytes + m * BYTES_PER_STREAMED_TOKEN) / 1e9
    transfer_usd = transfer_gb * prices.transfer_usd_per_gb
    return Cost(compute_usd + hbm_usd + transfer_usd, compute_usd, hbm_usd, transfer_usd, compute_seconds,
                kv_gb_hours, transfer_gb)
