"""The cost model behind CostEstimate (what one request will cost, on each stack the server runs) and
behind metered usage (what a finished request did cost: the same formula applied to what it used).

Inputs
    P       billed prompt tokens: the exact chat-templated count (CountTokens); no padding
    M       billed output tokens: the request's max_tokens (an upper bound: generation may stop earlier)
    t_step  decode step time per output token, seconds: the device time of the decode steps a request is in
    r_pre   prefill throughput, tokens/s: prompt tokens per second of the steps that prefill them
    B       how many ways a decode step's time is shared: t_step over the part of it one row pays (>= 1)
    S       the same for prefill steps (>= 1; 1 = a prompt has its prefill steps to itself)
    kv      KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element
    prices  gpu_usd_per_hour, hbm_usd_per_gb_hour, transfer_usd_per_gb

Formula
    t_prefill       = P / r_pre                        how long the prompt's prefill steps take
    t_decode_wall   = M x t_step                       how long the request's decode steps take
    compute_seconds = t_prefill / S + t_decode_wall / B    its share of those steps' device time
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

Metered usage: what a request used (`bill`, on each finished request's MessageStop and in
stratum_metered_cost_usd_total). The engine divides every step's measured device time over the tokens the
step processed and charges each request its tokens' share (stratum_jax/request_usage.py). The bill is the
formula with those sums in place of the products above: t_prefill / S and t_decode_wall / B are the device
time the request's prompt and decode tokens were charged, t_prefill and t_decode_wall the whole device time of
the steps it was in (for the KV term), M the tokens it generated, and the C prompt tokens served from the
prefix cache are not prefilled:
    kv_token_s  = (C + (P - C) / 2) x t_prefill + (P + M / 2) x t_decode_wall
So the bill prices each request with the batch it actually shared: alone in its steps it pays them whole,
among 40 others a 41st. The MessageStop reports the t_step, r_pre, B and S that reproduce it (`meter` with
them gives the bill back).

The estimate: the load a request will likely meet (`RecentRates`, serving/recent_rates.py). Each pool keeps
the per-token rates of its last bills (prefill device seconds and step seconds per billed prompt token, decode
device seconds and step seconds per output token) and prices a request with their medians. Each recent
request counts once, so the figures are those a typical recent request met: a server that was busy for a
thousand requests and then served two alone still quotes the busy price, and a bill for a request like the
busy ones meets its estimate (tests/test_cost_under_load.py). Before the pool's first bill, the estimate uses
the step times measured at start-up (the decode step median, PrefillRate below) with B = S = 1: the price of
a request that runs alone. (Before this, the estimate read B as an exponential average of the running batch
over the last ~10 steps and t_step as the median of recent decode-only steps, both as of the moment it was
asked, and the bill the same figures as of the moment the request finished; after a busy replay's idle tail
B had decayed to ~1 and the estimates came out 2-7x the bills: BENCHMARKS.md, issue #13's section.)

Per stack. Each stack (serving/stacks.py) is priced with its own bills' rates (its own engine's steps), and
its own kv (bf16 pages, or DKVC's delta bytes per token on the Stratum stack).

Simplifications. A step's time is divided per token, so a decode token and a prompt token in one step cost the
same (attention's context-dependent part is not apportioned by context). Steps the engine could not time
(device time 0) are charged at its recent measured rates, or nothing before the first measured step of their
kind (stratum_jax/request_usage.py), and with async scheduling the one token computed after a request stopped
is charged to nobody. The window's medians follow a change of load after half a window of requests.

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
from stratum_jax.request_usage import RequestUsage

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
    """The formula's measured inputs (module docstring): t_step in ms, r_pre, B and S."""

    decode_step_ms: float
    prefill_tokens_per_s: float
    decode_batch: float
    prefill_batch: float = 1.0

    def usage_for(self, prefill_tokens: int, output_tokens: int) -> RequestUsage:
        """The device time a request of `prefill_tokens` prompt tokens to prefill and `output_tokens` output
        tokens takes at these rates (the formula's t_prefill, t_decode_wall and their shares). Raises
        ValueError when the step times are not measured yet."""
        if self.decode_step_ms <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("the server has not measured a representative decode step and prefill step yet: "
                             "send a request (a prompt of at least 64 tokens sets the prefill rate), then ask again")
        t_prefill = prefill_tokens / self.prefill_tokens_per_s
        t_decode_wall = output_tokens * self.decode_step_ms / 1e3
        return RequestUsage(prefill_tokens=prefill_tokens, decode_tokens=output_tokens,
                            prefill_device_s=t_prefill / max(1.0, self.prefill_batch),
                            decode_device_s=t_decode_wall / max(1.0, self.decode_batch),
                            prefill_step_s=t_prefill, decode_step_s=t_decode_wall)

    @classmethod
    def of_rates(cls, rates: TokenRates) -> "Measured":
        """The inputs that price a request at `rates` (per-token seconds)."""
        return cls(decode_step_ms=1e3 * rates.decode_step_s,
                   prefill_tokens_per_s=1.0 / rates.prefill_step_s if rates.prefill_step_s > 0 else 0.0,
                   decode_batch=_ways(rates.decode_step_s, rates.decode_device_s),
                   prefill_batch=_ways(rates.prefill_step_s, rates.prefill_device_s))


@dataclasses.dataclass(frozen=True)
class TokenRates:
    """Seconds per token: of device time charged (`*_device_s`) and of the steps' whole device time
    (`*_step_s`), per billed prompt token (prefill) and per output token (decode)."""

    prefill_device_s: float
    prefill_step_s: float
    decode_device_s: float
    decode_step_s: float

    @classmethod
    def of_usage(cls, usage: RequestUsage, billed_prompt_tokens: int, output_tokens: int) -> "TokenRates":
        """A finished request's rates (0 where it billed no such tokens)."""
        p, m = max(0, billed_prompt_tokens), max(0, output_tokens)
        return cls(usage.prefill_device_s / p if p else 0.0, usage.prefill_step_s / p if p else 0.0,
                   usage.decode_device_s / m if m else 0.0, usage.decode_step_s / m if m else 0.0)


def _ways(step_s: float, device_s: float) -> float:
    """How many ways a step's time was shared: its whole over the part charged (1 when nothing was)."""
    return max(1.0, step_s / device_s) if device_s > 0 else 1.0


@dataclasses.dataclass(frozen=True)
class Cost:
    estimated_cost_usd: float
    compute_usd: float
    hbm_usd: float
    transfer_usd: float
    compute_seconds: float
    kv_gb_hours: float
    transfer_gb: float
    # Of compute_seconds, what was charged at recent rates for steps the engine could not time (a bill only:
    # RequestUsage.estimated_device_s; 0 in an estimate).
    estimated_compute_seconds: float = 0.0


REPRESENTATIVE_PREFILL_TOKENS = 64   # prefill steps smaller than this don't set the cost model's rate


class PrefillRate:
    """The prefill throughput CostEstimate uses before a pool's first bill (Pool.calibrated; afterwards the
    bills' own rates, serving/recent_rates.py), from representative steps only.

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
    return _cost(prompt_tokens, 0, max_tokens, request_bytes, kv_bytes, measured.usage_for(prompt_tokens, max_tokens),
                 prices)


def meter(prompt_tokens: int, cached_prompt_tokens: int, output_tokens: int, request_bytes: int, kv_bytes: int,
          measured: Measured, prices: Prices) -> Cost:
    """The formula applied to what ran, at given rates: the tokens it generated, and no prefill compute for
    its prefix-cache hits. `meter` with a bill's reported rates gives the bill back. Raises ValueError when
    the step times are not measured yet."""
    cached = min(cached_prompt_tokens, prompt_tokens)
    return _cost(prompt_tokens, cached, output_tokens, request_bytes, kv_bytes,
                 measured.usage_for(prompt_tokens - cached, output_tokens), prices)


def bill(prompt_tokens: int, cached_prompt_tokens: int, output_tokens: int, request_bytes: int, kv_bytes: int,
         usage: RequestUsage, prices: Prices) -> Cost:
    """Metered usage of a finished request (module docstring): the device time it was charged, step by step."""
    return _cost(prompt_tokens, min(cached_prompt_tokens, prompt_tokens), output_tokens, request_bytes, kv_bytes,
                 usage, prices)


def _cost(prompt_tokens: int, cached_tokens: int, output_tokens: int, request_bytes: int, kv_bytes: int,
          usage: RequestUsage, prices: Prices) -> Cost:
    p, c, m = float(prompt_tokens), float(cached_tokens), float(output_tokens)
    compute_seconds = usage.prefill_device_s + usage.decode_device_s
    compute_usd = compute_seconds / 3600 * prices.gpu_usd_per_hour
    kv_token_s = (c + (p - c) / 2) * usage.prefill_step_s + (p + m / 2) * usage.decode_step_s
    kv_gb_hours = kv_bytes * kv_token_s / 1e9 / 3600
    hbm_usd = kv_gb_hours * prices.hbm_usd_per_gb_hour
    transfer_gb = (request_bytes + m * BYTES_PER_STREAMED_TOKEN) / 1e9
    transfer_usd = transfer_gb * prices.transfer_usd_per_gb
    return Cost(compute_usd + hbm_usd + transfer_usd, compute_usd, hbm_usd, transfer_usd, compute_seconds,
                kv_gb_hours, transfer_gb, usage.estimated_device_s)
