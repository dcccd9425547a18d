"""Serving under real traffic: replays a window of the Mooncake trace against a server over real gRPC.

    # the GPU run (one server per config, each replaying the window at 1x, 2x, 4x and 8x its recorded rate)
    python benchmarks/serving.py --model llama-1b --window-start 0 --num-requests 500 \\
        --length-scale 0.25 --max-context 8192 --rates 1,2,4,8 \\
        --server-args "--max-context 8192 --max-queue 2048" \\
        --configs "hab=--scheduler hab;fcfs=--scheduler fcfs" --out-prefix serving_llama-1b_h200

    # the CPU smoke run (the tiny preset; two configs with no extra flags; ~5 min on 2 cores)
    JAX_PLATFORMS=cpu python benchmarks/serving.py --model tiny --window-start 25 --num-requests 6 \\
        --length-scale 0.01 --rates 1,2 --configs "a=;b=" --warmup-requests 2 --out-prefix serving_tiny_cpu_smoke

    python benchmarks/serving.py --replot benchmarks/results/serving_tiny_cpu_smoke.json   # PNG only

    # --http: the same replay over the OpenAI-compatible HTTP API (streamed chat completions with
    # stream_options.include_usage, through the `openai` SDK), the servers started with --http-port 0
    python benchmarks/serving.py --http --model tiny ... --out-prefix serving_tiny_http

For each config of `--configs` (NAME=EXTRA SERVER FLAGS, `;`-separated) it starts its own server as a
subprocess (`python -m stratum_jax.serve --model M --host 127.0.0.1 --port 0 --metrics-port 0
<--server-args> <extra flags>`), reads the ports it logs, waits for grpc.health.v1 SERVING, asks Health
for the device, then replays the window once per rate and stops the server (SIGTERM, bounded wait).
With --http the requests go over HTTP instead (CountTokens, Health and GetMetrics stay on gRPC: the same
server answers both); each chunk's tokens are counted through the `return_token_ids` extension, so the
figures mean the same as gRPC's, and the server-side timings (queue_ms, server TTFT) are not available.

The workload. Request i of the window arrives at (timestamp_i - timestamp_first + u_i * slot) / rate. The
shared trace stamps its requests in 3 s slots (1,180 distinct timestamps for 12,031 requests, consecutive ones
2,997-3,003 ms apart; `trace_slot_ms`), so a timestamp says in which slot a request came, not when within it.
`--arrivals slot` (the default) draws u_i uniform in [0, 1) from the rate's salt and the trace line: given each
slot's count, that is where a Poisson process puts its arrivals. `--arrivals burst` (u_i = 0, the replay before
2026-12-01) sends a slot's requests, up to 28 of them, at one instant. Its prompt is
built from its `hash_ids`: each id is one block of text, the same text wherever the id appears (so
requests that share leading ids share a prompt prefix, as in the trace), with the last block cut so the
chat-templated prompt has round(input_length * length_scale) tokens; max_tokens is
round(output_length * length_scale). A block is ceil(512 * length_scale) tokens (the trace's blocks are
512 tokens; `--block-tokens` overrides), so scaling keeps the share of shared prefix. Tokens are
converted to text bytes with a ratio measured once per server through CountTokens (1.0 for the byte-level
tokenizer of the presets, exactly), and the chat template's own tokens are subtracted. Lengths are then
clipped to the context (`--max-context`, default the server's, less `--context-margin`) and to the
server's max_tokens cap; the number clipped is reported. Every rate uses fresh block text (a salt per
rate) so one rate's prefix cache does not serve the next; the sharing within a rate is the trace's.
Sampling is greedy; a model may still end a reply before max_tokens (stop reasons are reported).

Measured per config and rate, client-side, with TTFT counted from the request's scheduled arrival (so a
wait for `--max-concurrency` counts, as it would for a user):
    TTFT, TPOT ((last token - first token) / (tokens - 1)), ITL (gaps between streamed deltas), E2E at
    p50/p95/p99; input and output tokens/s over the rate's duration (first arrival to last reply);
    goodput (requests finished with TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, per second);
    requests finished / failed (by gRPC status); how late the client sent (send lag: if its p99 is large
    the client, not the server, was the bottleneck).
From the server's Prometheus endpoint: `stratum_jit_compilations_total` before/after (null if the server
has no such metric), the `stratum_gpu_idle_ms` histogram (bucket diff), and `stratum_gpu_idle_fraction`,
`stratum_queue_length` and `stratum_running_requests` sampled every --poll-s during the replay.

Writes benchmarks/results/<out-prefix>.json (per-request rows, columnar), <out-prefix>.tokens.json.gz
(each request's delta arrival times, ms after its scheduled arrival) and <out-prefix>.png (goodput and
P95 TTFT against rate, one line per config; skipped with a message when matplotlib is missing), and
prints a table. Bounds: --request-timeout per request, --run-timeout for the whole invocation (rates not
reached are recorded as skipped), --max-concurrency streams at once. Loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import functools
import gzip
import json
import math
import os
import pathlib
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

# This file is named serving.py, like the `serving` package it imports: drop its own directory from the
# import path (python puts it first when the file is run as a script) so `serving` means the package.
_HERE = pathlib.Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != _HERE]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
RESULTS = REPO / "benchmarks" / "results"
TRACE_BLOCK_TOKENS = 512          # one hash id per 512-token block in the Mooncake release
SERVICE = "stratum.v1.Stratum"
_LISTENING = re.compile(r"listening on (\S+):(\d+) \(.*?\); metrics (?:on http://(\S+?):(\d+)/metrics|off)")
_HTTP_LISTENING = re.compile(r"HTTP API on (\S+)/v1")
_OWN_FLAGS = ("--host", "--port", "--metrics-port", "--metrics-host", "--model", "--keys-file", "--tls-cert",
              "--tls-key", "--http-port", "--http-host")
_HTTP_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}   # as gRPC names them (no stop sequences sent)


# ---------------------------------------------------------------- the trace and the prompts (pure)

@dataclasses.dataclass(frozen=True)
class TraceRequest:
    index: int                  # line number in the trace (0-based)
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: pathlib.Path, start: int, count: int) -> list[TraceRequest]:
    """Lines [start, start + count) of a Mooncake-format trace; raises ValueError naming a bad line."""
    if start < 0 or count <= 0:
        raise ValueError(f"--window-start must be >= 0 and --num-requests > 0, got {start} and {count}")
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if i >= start + count:
                break
            try:
                d = json.loads(line)
                r = TraceRequest(i, int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                                 tuple(int(h) for h in d["hash_ids"]))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{i + 1}: not a Mooncake trace line ({e}): {line[:120]!r}") from e
            if r.input_length <= 0 or r.output_length <= 0 or not r.hash_ids:
                raise ValueError(f"{path}:{i + 1}: input/output lengths must be > 0 and hash_ids non-empty")
            out.append(r)
    if len(out) < count:
        raise ValueError(f"{path} has {start + len(out)} lines: the window [{start}, {start + count}) runs past "
                         f"its end; lower --window-start or --num-requests")
    return out


def arrival_offsets(timestamps_ms, rate: float, *, slot_ms: float = 0.0, keys=None, salt: str = "") -> list[float]:
    """Seconds after the window's first timestamp, time compressed by `rate` (2 = twice as fast).

    slot_ms > 0 spreads each request over the recorded slot its timestamp names: it arrives at a uniform
    offset in [timestamp, timestamp + slot_ms), drawn from (salt, its key). Given how many requests a slot
    holds, that is how a Poisson process places them, so clumps stay possible; the same (salt, key) always
    gives the same offset, so configs replaying one rate see the same arrivals."""
    if rate <= 0:
        raise ValueError(f"a rate must be > 0, got {rate}")
    if slot_ms < 0:
        raise ValueError(f"a slot must be >= 0 ms, got {slot_ms}")
    keys = range(len(timestamps_ms)) if keys is None else keys
    t0 = min(timestamps_ms)
    return [(t - t0 + (random.Random(f"{salt}/arrival/{k}").random() * slot_ms if slot_ms else 0.0)) / 1000.0 / rate
            for t, k in zip(timestamps_ms, keys, strict=True)]


def trace_slot_ms(timestamps_ms) -> float | None:
    """The trace's timestamp resolution: the median gap between consecutive distinct timestamps (None with
    fewer than two). The Mooncake conversation trace stamps its requests in 3 s slots: 1,180 distinct
    timestamps for 12,031 requests, every two consecutive ones 2,997-3,003 ms apart."""
    distinct = sorted(set(timestamps_ms))
    if len(distinct) < 2:
        return None
    return float(np.median(np.diff(distinct)))


@functools.lru_cache(maxsize=1 << 16)     # popular ids (id 0 starts most prompts) are built once
def block_text(salt: str, hash_id, n_bytes: int) -> str:
    """The text of one block: n_bytes of ASCII pseudo-words, a function of (salt, hash_id) only."""
    rng = random.Random(f"{salt}/{hash_id}")      # str seeds are hashed with sha512: stable across runs
    parts, size = [], 0
    while size < n_bytes:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) + " "
        parts.append(word)
        size += len(word)
    return "".join(parts)[:n_bytes]


def build_prompt(hash_ids, n_bytes: int, block_bytes: int, salt: str, request_key) -> str:
    """The hash ids' blocks in order, cut to n_bytes; if they are too short, blocks unique to this request
    (keyed by request_key) fill the rest."""
    if n_bytes < 0 or block_bytes <= 0:
        raise ValueError(f"need n_bytes >= 0 and block_bytes > 0, got {n_bytes} and {block_bytes}")
    blocks = [block_text(salt, h, block_bytes) for h in hash_ids[: -(-n_bytes // block_bytes)]]
    j = 0
    while len(blocks) * block_bytes < n_bytes:
        blocks.append(block_text(salt, f"fill-{request_key}-{j}", block_bytes))
        j += 1
    return "".join(blocks)[:n_bytes]


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the trace's lengths become one server's requests."""
    length_scale: float
    block_tokens: int           # tokens per hash-id block after scaling
    bytes_per_token: float      # text bytes per prompt token (measured via CountTokens)
    template_tokens: int        # tokens the chat template adds around an empty user message
    max_context: int            # prompt + max_tokens limit (already less the margin)
    max_tokens_cap: int


def scaled_lengths(r: TraceRequest, shape: Shape) -> tuple[int, int, bool]:
    """(prompt tokens, max_tokens, clipped) for one trace request under `shape`."""
    floor_in = shape.template_tokens + 1
    out = max(1, round(r.output_length * shape.length_scale))
    want_in = max(floor_in, round(r.input_length * shape.length_scale))
    out_c = min(out, shape.max_tokens_cap, shape.max_context - floor_in)
    in_c = min(want_in, shape.max_context - out_c)
    return in_c, out_c, (in_c, out_c) != (want_in, out)


def prompt_for(r: TraceRequest, shape: Shape, salt: str) -> tuple[str, int, int, bool]:
    """(user message text, target prompt tokens, max_tokens, clipped)."""
    n_in, n_out, clipped = scaled_lengths(r, shape)
    block_bytes = max(1, round(shape.block_tokens * shape.bytes_per_token))
    n_bytes = max(1, round((n_in - shape.template_tokens) * shape.bytes_per_token))
    return build_prompt(r.hash_ids, n_bytes, block_bytes, salt, r.index), n_in, n_out, clipped


# ---------------------------------------------------------------- statistics (pure)

@dataclasses.dataclass
class RequestResult:
    """One request of one rate. Times are seconds; token_times are after the scheduled arrival."""
    index: int                          # trace line
    arrival_s: float                    # scheduled, after the rate's start
    target_in: int
    target_out: int
    status: str = "NOT_SENT"            # "OK", a gRPC status name, NO_STOP_EVENT, CANCELLED_AT_END, NOT_SENT
    send_lag_s: float | None = None     # actual send - scheduled arrival (concurrency cap + client lag)
    prompt_tokens: int | None = None    # as the server counted them (MessageStart)
    cached_tokens: int | None = None
    output_tokens: int = 0
    stop_reason: str | None = None
    token_times: list = dataclasses.field(default_factory=list)   # one per delta with tokens
    server_queue_ms: float | None = None
    server_ttft_ms: float | None = None
    stack: str | None = None            # the stack that served it (MessageStop.stack; None: an older server)
    metered_usd: float | None = None    # its metered usage (MessageStop.metered.cost_usd)
    metered: dict | None = None         # the metered breakdown's rates and terms (`breakdown_rates`)

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.token_times[-1] if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        """(last token - first token) / (output tokens - 1); None for replies of one token."""
        if self.output_tokens < 2 or len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.output_tokens - 1)

    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


QUANTILES = (50, 95, 99)


def percentiles_ms(values_s) -> dict | None:
    """{"p50", "p95", "p99", "mean"} in ms (linear interpolation), or None for no values."""
    v = np.asarray([x for x in values_s if x is not None], dtype=np.float64)
    if v.size == 0:
        return None
    out = {f"p{q}": round(float(np.percentile(v, q)) * 1e3, 3) for q in QUANTILES}
    out["mean"] = round(float(v.mean()) * 1e3, 3)
    return out


def meets_slo(r: RequestResult, slo_ttft_s: float, slo_tpot_s: float) -> bool:
    """Finished, first token within slo_ttft_s and TPOT within slo_tpot_s (one-token replies have no TPOT)."""
    if not r.ok or r.ttft_s is None or r.ttft_s > slo_ttft_s:
        return False
    tpot = r.tpot_s
    return tpot is None or tpot <= slo_tpot_s


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """The figures of one rate. duration_s: first scheduled arrival to the last reply's end."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    good = [r for r in ok if meets_slo(r, slo_ttft_s, slo_tpot_s)]
    lags = [r.send_lag_s for r in results if r.send_lag_s is not None]
    return {
        "requests": len(results),
        "finished": len(ok),
        "failed": len(results) - len(ok),
        "failed_by_status": dict(collections.Counter(r.status for r in results if not r.ok)),
        "stop_reasons": dict(collections.Counter(r.stop_reason for r in ok)),
        "duration_s": round(duration_s, 3),
        "ttft_ms": percentiles_ms(r.ttft_s for r in ok),
        "tpot_ms": percentiles_ms(r.tpot_s for r in ok),
        "itl_ms": percentiles_ms(g for r in ok for g in r.itls_s()),
        "e2e_ms": percentiles_ms(r.e2e_s for r in ok),
        "input_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "cached_input_tokens": sum(r.cached_tokens or 0 for r in ok),
        "output_tokens": sum(r.output_tokens for r in ok),
        "input_tokens_per_s": round(sum(r.prompt_tokens or 0 for r in ok) / duration_s, 2),
        "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / duration_s, 2),
        "goodput_rps": round(len(good) / duration_s, 4),
        "good_requests": len(good),
        "send_lag_ms": percentiles_ms(lags),
        **metered_summary(ok),
        "by_stack": by_stack(results, duration_s, slo_ttft_s, slo_tpot_s),
    }


def metered_summary(ok: list[RequestResult]) -> dict:
    """The metered usage of finished requests: total USD and USD per 1,000 output tokens (None without any)."""
    billed = [r for r in ok if r.metered_usd is not None]
    usd, out = sum(r.metered_usd for r in billed), sum(r.output_tokens for r in billed)
    return {"metered_usd": round(usd, 9) if billed else None,
            "metered_usd_per_1k_output_tokens": round(1e3 * usd / out, 9) if out else None}


def by_stack(results: list[RequestResult], duration_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict | None:
    """The same figures per serving stack (x-stratum-weight splits), over the rate's whole duration; None
    when no reply named its stack."""
    names = sorted({r.stack for r in results if r.stack})
    if not names:
        return None
    out = {}
    for name in names:
        mine = [r for r in results if r.stack == name]
        ok = [r for r in mine if r.ok]
        good = [r for r in ok if meets_slo(r, slo_ttft_s, slo_tpot_s)]
        out[name] = {"finished": len(ok), "ttft_ms": percentiles_ms(r.ttft_s for r in ok),
                     "tpot_ms": percentiles_ms(r.tpot_s for r in ok), "goodput_rps": round(len(good) / duration_s, 4),
                     "output_tokens": sum(r.output_tokens for r in ok), **metered_summary(ok)}
    return out


def histogram_diff(before: dict | None, after: dict | None) -> dict | None:
    """after - before of a histogram {"buckets": {le: cumulative count}, "sum", "count"}; None if absent."""
    if before is None or after is None:
        return None
    return {"buckets": {le: after["buckets"][le] - before["buckets"].get(le, 0) for le in after["buckets"]},
            "sum": after["sum"] - before["sum"], "count": after["count"] - before["count"]}


def series_summary(values) -> dict | None:
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {"n": len(v), "mean": round(float(np.mean(v)), 4), "max": round(float(np.max(v)), 4),
            "p50": round(float(np.percentile(v, 50)), 4), "p95": round(float(np.percentile(v, 95)), 4)}


# ---------------------------------------------------------------- Prometheus

def parse_metrics(text: str) -> dict[str, list[tuple[dict, float]]]:
    """sample name -> [(labels, value)] of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list] = collections.defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def counter_total(samples: dict, name: str) -> float | None:
    """The sum over labels of a sample, or None when the server does not export it."""
    return sum(v for _, v in samples[name]) if name in samples else None


def gauge(samples: dict, name: str) -> float | None:
    return samples[name][0][1] if name in samples else None


def histogram(samples: dict, name: str) -> dict | None:
    """A histogram summed over its label sets (the stacks)."""
    if f"{name}_bucket" not in samples:
        return None
    buckets: dict[str, float] = collections.defaultdict(float)
    for labels, v in samples[f"{name}_bucket"]:
        buckets[labels["le"]] += v
    return {"buckets": dict(buckets),
            "sum": counter_total(samples, f"{name}_sum"), "count": counter_total(samples, f"{name}_count")}


async def scrape(url: str | None) -> dict:
    if url is None:
        return {}

    def get() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.read().decode()
    return parse_metrics(await asyncio.to_thread(get))


class Poller:
    """Samples gauges from /metrics every period_s while the replay runs."""

    NAMES = ("stratum_gpu_idle_fraction", "stratum_queue_length", "stratum_running_requests",
             "stratum_prefill_tokens_total", "stratum_hbm_bandwidth_utilization", "stratum_gpu_compute_utilization")
    GAUGES = {"stratum_gpu_idle_fraction", "stratum_hbm_bandwidth_utilization", "stratum_gpu_compute_utilization"}

    def __init__(self, url: str | None, period_s: float) -> None:
        self.url, self.period_s = url, period_s
        self.samples: list[list] = []        # [t_s, *NAMES values]
        self.errors = 0
        self._task = None

    async def _run(self, t0: float) -> None:
        while True:
            try:
                s = await scrape(self.url)
                # The idle fraction and the utilizations are the first stack's (the Stratum stack's: its engine
                # measures its own steps); the queue, running and prefill figures are summed over the stacks.
                self.samples.append([round(time.perf_counter() - t0, 3)] + [
                    gauge(s, n) if n in self.GAUGES else counter_total(s, n) for n in self.NAMES])
            except (OSError, ValueError):      # a missed sample is counted, not fatal
                self.errors += 1
            await asyncio.sleep(self.period_s)

    def start(self, t0: float) -> None:
        if self.url is not None:
            self._task = asyncio.create_task(self._run(t0))

    async def stop(self) -> dict:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        cols = list(zip(*self.samples)) if self.samples else [[] for _ in range(len(self.NAMES) + 1)]
        return {"fields": ["t_s", *self.NAMES], "rows": self.samples, "scrape_errors": self.errors,
                **{n.removeprefix("stratum_"): series_summary(cols[i + 1]) for i, n in enumerate(self.NAMES)},
                **while_queued(self.samples), **utilization_while_running(self.samples)}


def utilization_while_running(rows: list[list]) -> dict:
    """The step utilization gauges (issue #18) over the Poller rows taken while requests ran (column 3 > 0):
    the gauges are medians of the engine's latest steps, so an idle server keeps showing its last ones."""
    busy = [r for r in rows if r[3]]
    return {f"{name}_while_running": series_summary([r[col] for r in busy])
            for name, col in (("hbm_bandwidth_utilization", 5), ("gpu_compute_utilization", 6))}


def while_queued(rows: list[list]) -> dict:
    """The saturation figures of issue #10 from Poller rows [t_s, idle fraction, queue length, running,
    prefill tokens total]: over the sample intervals that start and end with requests queued, the mean
    device idle fraction and the prefill throughput (prefilled tokens / seconds). None without such
    intervals (or without the counter: an older server)."""
    idle, seconds, tokens = [], 0.0, 0.0
    for a, b in zip(rows, rows[1:]):
        if not (a[2] and b[2]):                           # queue empty (or not read) at either end
            continue
        if b[1] is not None:
            idle.append(b[1])
        if a[4] is not None and b[4] is not None:
            seconds += b[0] - a[0]
            tokens += b[4] - a[4]
    return {"queued_seconds": round(seconds, 3),
            "gpu_idle_fraction_while_queued": round(float(np.mean(idle)), 4) if idle else None,
            "prefill_tokens_per_s_while_queued": round(tokens / seconds, 1) if seconds > 0 else None}


# ---------------------------------------------------------------- the server

class ServerProcess:
    """`python -m stratum_jax.serve` on loopback with free ports; its log goes to log_path."""

    def __init__(self, model: str, flags: list[str], log_path: pathlib.Path, http: bool = False) -> None:
        self.cmd = [sys.executable, "-m", "stratum_jax.serve", "--model", model, "--host", "127.0.0.1",
                    "--port", "0", "--metrics-port", "0", *(["--http-port", "0"] if http else []), *flags]
        self.log_path = log_path
        self.target: str | None = None
        self.http_url: str | None = None      # e.g. http://127.0.0.1:PORT, with --http
        self.metrics_url: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._reader = None
        self._ports = asyncio.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)

    async def _read_log(self) -> None:
        with open(self.log_path, "w") as log:
            async for raw in self.proc.stderr:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip())
                if (h := _HTTP_LISTENING.search(line)) is not None:
                    self.http_url = h.group(1)      # logged before the gRPC line that sets _ports
                m = _LISTENING.search(line)
                if m and not self._ports.is_set():
                    self.target = f"{m.group(1)}:{m.group(2)}"
                    self.metrics_url = f"http://{m.group(3)}:{m.group(4)}/metrics" if m.group(3) else None
                    self._ports.set()

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = asyncio.create_task(self._read_log())
        deadline = time.monotonic() + timeout_s
        exited = asyncio.create_task(self.proc.wait())
        try:
            ports = asyncio.create_task(self._ports.wait())
            await asyncio.wait({ports, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not self._ports.is_set():
                ports.cancel()
                raise RuntimeError(self._why("did not log its ports"))
            await self._wait_serving(deadline, exited)
        except BaseException:
            await self.stop()
            raise
        finally:
            exited.cancel()

    async def _wait_serving(self, deadline: float, exited) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if exited.done():
                    raise RuntimeError(self._why("exited while loading"))
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(self._why("was not SERVING before the start timeout"))
                await asyncio.sleep(0.5)

    def _why(self, what: str) -> str:
        code = self.proc.returncode if self.proc else None
        tail = "\n".join(list(self.tail)[-15:])
        return f"the server {what} (exit status {code}; log {self.log_path}):\n{tail}"

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns its exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        return self.proc.returncode


# ---------------------------------------------------------------- the replay

@dataclasses.dataclass
class Planned:
    result: RequestResult
    text: str


def plan(window: list[TraceRequest], shape: Shape, rate: float, salt: str,
         slot_ms: float = 0.0) -> tuple[list[Planned], int]:
    """The requests of one rate in arrival order, and how many were clipped to the context. slot_ms > 0
    spreads each request over its timestamp's slot (arrival_offsets)."""
    offsets = arrival_offsets([r.timestamp_ms for r in window], rate, slot_ms=slot_ms,
                              keys=[r.index for r in window], salt=salt)
    out, clipped = [], 0
    for r, at in sorted(zip(window, offsets), key=lambda p: (p[1], p[0].index)):
        text, n_in, n_out, c = prompt_for(r, shape, salt)
        clipped += c
        out.append(Planned(RequestResult(r.index, at, n_in, n_out), text))
    return out, clipped


async def one_request(stub, pb, p: Planned, t0: float, timeout_s: float, sem: asyncio.Semaphore) -> None:
    """Sends one planned request when its turn comes and fills in p.result (also when cancelled)."""
    import grpc
    r = p.result
    request = pb.MessagesRequest(messages=[pb.Message(role="user", content=p.text)], max_tokens=r.target_out,
                                 temperature=0.0)
    call = None
    try:
        async with sem:
            arrival = t0 + r.arrival_s
            r.send_lag_s = time.perf_counter() - arrival
            r.status = "NO_STOP_EVENT"
            call = stub.Messages(request, timeout=timeout_s)
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "delta" and event.delta.token_ids:
                    r.token_times.append(time.perf_counter() - arrival)
                    r.output_tokens += len(event.delta.token_ids)
                elif kind == "start":
                    r.prompt_tokens = event.start.prompt_tokens
                elif kind == "stop":
                    s = event.stop
                    r.stop_reason = pb.StopReason.Name(s.stop_reason).lower()
                    r.cached_tokens = s.usage.cached_input_tokens
                    r.server_queue_ms, r.server_ttft_ms = s.timings.queue_ms, s.timings.ttft_ms
                    r.stack = s.stack or None
                    r.metered_usd = s.metered.cost_usd if s.HasField("metered") else None
                    r.metered = breakdown_rates(s.metered) if s.HasField("metered") else None
                    r.status = "OK"
    except grpc.aio.AioRpcError as e:
        r.status = e.code().name
    except asyncio.CancelledError:
        # The rate's time bound passed: the script cancels what still runs and records it as such.
        if call is not None:
            call.cancel()
        r.status = "CANCELLED_AT_END" if r.send_lag_s is not None else "NOT_SENT"


async def one_request_http(client, p: Planned, t0: float, timeout_s: float, sem: asyncio.Semaphore) -> None:
    """one_request over the OpenAI-compatible HTTP API: a streamed chat completion with the usage chunk."""
    import openai
    r = p.result
    try:
        async with sem:
            arrival = t0 + r.arrival_s
            r.send_lag_s = time.perf_counter() - arrival
            r.status = "NO_STOP_EVENT"
            stream = await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": p.text}], max_tokens=r.target_out, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
                timeout=timeout_s)
            async with stream:      # closes the connection (the server cancels) on any exit
                async for chunk in stream:
                    for choice in chunk.choices:
                        ids = (choice.model_extra or {}).get("token_ids") or ()
                        if ids:
                            r.token_times.append(time.perf_counter() - arrival)
                            r.output_tokens += len(ids)
                        if choice.finish_reason:
                            r.stop_reason = _HTTP_STOP_REASONS.get(choice.finish_reason, choice.finish_reason)
                    if chunk.usage is not None:
                        r.prompt_tokens = chunk.usage.prompt_tokens
                        details = chunk.usage.prompt_tokens_details
                        r.cached_tokens = details.cached_tokens if details is not None else None
                        r.status = "OK"
    except openai.APIStatusError as e:
        r.status = f"HTTP_{e.status_code}"
    except openai.APIError as e:            # a connection error, or an error event mid-stream
        r.status = type(e).__name__
    except asyncio.CancelledError:
        r.status = "CANCELLED_AT_END" if r.send_lag_s is not None else "NOT_SENT"


async def replay(send, planned: list[Planned], args, deadline: float) -> float:
    """Sends every planned request at its arrival time; returns the rate's start (perf_counter)."""
    sem = asyncio.Semaphore(args.max_concurrency)
    t0 = time.perf_counter() + 0.1
    tasks = []
    for p in planned:
        delay = t0 + p.result.arrival_s - time.perf_counter()
        if t0 + p.result.arrival_s > deadline:
            break                                   # the rest stay NOT_SENT
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(p, t0, args.request_timeout, sem)))
    if tasks:
        bound = min(deadline, t0 + planned[-1].result.arrival_s + args.request_timeout + 5.0)
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, bound - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return t0


async def wait_idle(stub, pb, timeout_s: float) -> bool:
    """Waits until the server has nothing queued, running or in flight; False if it did not within timeout_s."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        s = await stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
        stacks = list(s.stacks) or [s]      # every stack's engine (a server from before `stacks`: the one)
        if s.in_flight == 0 and all(x.running == 0 and x.queued == 0 for x in stacks):
            return True
        await asyncio.sleep(0.2)
    return False


async def calibrate(stub, pb) -> dict:
    """Template tokens and text bytes per token, from CountTokens on an empty and a long message."""
    async def count(text: str) -> int:
        r = await stub.CountTokens(pb.CountTokensRequest(messages=[pb.Message(role="user", content=text)]),
                                   timeout=30)
        return r.input_tokens
    sample = "".join(block_text("calibration", h, 512) for h in range(8))
    empty, full = await count(""), await count(sample)
    if full <= empty:
        raise RuntimeError(f"CountTokens gave {full} tokens for {len(sample)} bytes and {empty} for none")
    return {"template_tokens": empty, "sample_bytes": len(sample), "sample_tokens": full - empty,
            "bytes_per_token": len(sample) / (full - empty)}


# ---------------------------------------------------------------- one config

async def run_config(name: str, flags: list[str], window, args, deadline: float, out: dict) -> None:
    """Starts the config's server, replays every rate, stops it; fills out (the config's JSON entry)."""
    import grpc

    from serving.proto.stratum.v1 import stratum_pb2 as pb
    from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc

    log_dir = pathlib.Path(args.server_log_dir or tempfile.mkdtemp(prefix="serving-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, flags, log_dir / f"{args.out_prefix}_{name}.server.log", http=args.http)
    out.update(name=name, server_flags=flags, server_command=shlex.join(server.cmd), server_log=str(server.log_path),
               transport="http" if args.http else "grpc", rates={})
    started = time.monotonic()
    try:
        await server.start(min(args.start_timeout, max(1.0, deadline - time.perf_counter())))
    except RuntimeError as e:
        out["error"] = str(e)
        print(f"[{name}] {e}", file=sys.stderr)
        return
    out["server_start_s"] = round(time.monotonic() - started, 1)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel, _http_client(server, args) as client:
            stub = pb_grpc.StratumStub(channel)
            if args.http:
                if server.http_url is None:
                    raise RuntimeError("the server did not log its HTTP address")
                send = functools.partial(one_request_http, client)
            else:
                send = functools.partial(one_request, stub, pb)
            h = await stub.Health(pb.HealthRequest(), timeout=30)
            out["health"] = {"device": h.device, "platform": h.platform, "cuda_version": h.cuda_version,
                             "jax_version": h.jax_version, "version": h.version,
                             "hbm_bandwidth_gbps": round(h.hbm_bandwidth_gbps, 1), "model": h.model.name,
                             "dtype": h.model.dtype, "max_context": h.model.max_context,
                             "max_tokens_cap": h.model.max_tokens_cap}
            cal = await calibrate(stub, pb)
            out["calibration"] = cal
            context = min(args.max_context or h.model.max_context, h.model.max_context) - args.context_margin
            shape = Shape(args.length_scale, args.block_tokens or math.ceil(TRACE_BLOCK_TOKENS * args.length_scale),
                          cal["bytes_per_token"], cal["template_tokens"], context, h.model.max_tokens_cap)
            if context <= shape.template_tokens + 1:
                raise RuntimeError(f"a context of {context} tokens leaves no room for a prompt: raise --max-context")
            out["shape"] = dataclasses.asdict(shape)
            print(f"[{name}] serving on {server.target} ({h.device}, {h.platform}); started in "
                  f"{out['server_start_s']} s", file=sys.stderr)
            if args.warmup_requests:
                out["warmup"] = await warmup(send, stub, pb, window, shape, args, server.metrics_url, deadline)
            for i, rate in enumerate(args.rates):
                if time.perf_counter() >= deadline:
                    out["rates"][str(rate)] = {"skipped": "the --run-timeout passed"}
                    continue
                out["rates"][str(rate)] = await run_rate(send, stub, pb, window, shape, rate, f"rate{i}", args,
                                                         server.metrics_url, deadline)
    except (RuntimeError, grpc.aio.AioRpcError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] {out['error']}", file=sys.stderr)
    finally:
        out["server_exit_status"] = await server.stop(args.stop_timeout)


@contextlib.asynccontextmanager
async def _http_client(server: ServerProcess, args):
    """An AsyncOpenAI client on the server's HTTP API with --http (else None). No retries: a refused
    request is a result. The connection pool is as large as the concurrency, so none waits for a socket."""
    if not args.http:
        yield None
        return
    import httpx2 as httpx
    import openai
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    try:
        yield client
    finally:
        await client.close()


async def warmup(send, stub, pb, window, shape, args, metrics_url, deadline) -> dict:
    """The first --warmup-requests of the window, all at once, with their own text; not measured."""
    planned, _ = plan(window[: args.warmup_requests], shape, 1e9, "warmup")
    before = await scrape(metrics_url)
    t = time.perf_counter()
    await replay(send, planned, args, deadline)
    await wait_idle(stub, pb, args.request_timeout)
    after = await scrape(metrics_url)
    return {"requests": len(planned), "finished": sum(p.result.ok for p in planned),
            "seconds": round(time.perf_counter() - t, 2),
            "jit_compilations": _delta(counter_total(before, "stratum_jit_compilations_total"),
                                       counter_total(after, "stratum_jit_compilations_total"))}


def _delta(a, b):
    return None if a is None or b is None else b - a


async def run_rate(send, stub, pb, window, shape, rate, salt, args, metrics_url, deadline) -> dict:
    planned, clipped = plan(window, shape, rate, salt, args.arrival_slot_ms)
    idle_before = await wait_idle(stub, pb, args.request_timeout)
    before = await scrape(metrics_url)
    poller = Poller(metrics_url, args.poll_s)
    poller.start(time.perf_counter())
    await replay(send, planned, args, deadline)
    samples = await poller.stop()
    idle_after = await wait_idle(stub, pb, args.request_timeout)
    after = await scrape(metrics_url)
    results = [p.result for p in planned]
    ends = [r.arrival_s + r.e2e_s for r in results if r.e2e_s is not None]
    duration = max([planned[-1].result.arrival_s, *ends, 1e-3])
    s = summarize(results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    ttft, tpot = s["ttft_ms"] or {}, s["tpot_ms"] or {}
    print(f"  rate {rate}x: {s['finished']}/{s['requests']} finished, TTFT p95 {ttft.get('p95')} ms, "
          f"TPOT p95 {tpot.get('p95')} ms, goodput {s['goodput_rps']} req/s", file=sys.stderr)
    s.update(
        rate=rate, salt=salt, arrival_slot_ms=args.arrival_slot_ms, offered_rps=round(len(planned) / max(planned[-1].result.arrival_s, 1e-3), 4),
        window_span_s=round(planned[-1].result.arrival_s, 3), clipped_to_context=clipped,
        server_idle_before=idle_before, server_idle_after=idle_after,
        jit_compilations=_delta(counter_total(before, "stratum_jit_compilations_total"),
                                counter_total(after, "stratum_jit_compilations_total")),
        # Every compile since the server reported SERVING (absolute; should stay 0).
        jit_compilations_after_serving=counter_total(after, "stratum_jit_compilations_after_serving_total"),
        hab_triggers=_delta(counter_total(before, "stratum_hab_triggers_total"),
                            counter_total(after, "stratum_hab_triggers_total")),
        gpu_idle_ms_histogram=histogram_diff(histogram(before, "stratum_gpu_idle_ms"),
                                             histogram(after, "stratum_gpu_idle_ms")),
        preemptions=_delta(counter_total(before, "stratum_preemptions_total"),
                           counter_total(after, "stratum_preemptions_total")),
        metric_samples=samples, per_request=per_request_table(results))
    s["cost"] = await cost_figures(stub, pb, planned, args.cost_samples)
    s["_token_times"] = [[round(t * 1e3, 2) for t in r.token_times] for r in results]
    return s


BREAKDOWN_RATES = ("cost_usd", "compute_seconds", "estimated_compute_seconds", "decode_step_ms",
                   "prefill_tokens_per_s", "decode_batch", "prefill_batch", "billed_input_tokens",
                   "billed_output_tokens")


def breakdown_rates(b) -> dict:
    """A CostBreakdown's cost, device seconds, the rates it was priced at and the tokens it billed."""
    return {k: round(float(getattr(b, k)), 9) for k in BREAKDOWN_RATES}


async def cost_figures(stub, pb, planned: list[Planned], samples: int) -> dict | None:
    """CostEstimate after the rate, for the first `samples` finished requests (their own prompts and
    max_tokens, with each stack's step times as measured at the end of the rate): per stack, the estimated
    USD per 1,000 output tokens; and for each request against its own stack's estimate, the metered usage's
    error (metered - estimated) / estimated, with both breakdowns' rates side by side (`per_request`: which
    term makes a gap). None when the server has no per-stack CostEstimate."""
    import grpc
    done = [p for p in planned if p.result.ok and p.result.metered_usd is not None][:samples]
    if not done:
        return None
    usd, tokens, errors, pairs = collections.defaultdict(float), 0, [], []
    for p in done:
        request = pb.CostEstimateRequest(messages=[pb.Message(role="user", content=p.text)],
                                         max_tokens=p.result.target_out)
        try:
            r = await stub.CostEstimate(request, timeout=30)
        except grpc.aio.AioRpcError as e:
            return {"error": f"{e.code().name}: {e.details()}"}
        tokens += request.max_tokens
        for b in r.stacks:
            usd[b.stack] += b.cost_usd
            if b.stack == p.result.stack:
                errors.append((p.result.metered_usd - b.cost_usd) / b.cost_usd)
                pairs.append({"index": p.result.index, "stack": b.stack, "metered": p.result.metered,
                              "estimated": breakdown_rates(b)})
    return {"requests": len(done),
            "estimated_usd_per_1k_output_tokens": {k: round(1e3 * v / tokens, 9) for k, v in usd.items()},
            "metered_vs_estimated": {"mean": round(float(np.mean(errors)), 5),
                                     "mean_abs": round(float(np.mean(np.abs(errors))), 5)} if errors else None,
            "per_request": pairs}


REQUEST_FIELDS = ("index", "arrival_s", "status", "send_lag_ms", "target_in", "target_out", "prompt_tokens",
                  "cached_tokens", "output_tokens", "stop_reason", "ttft_ms", "tpot_ms", "e2e_ms",
                  "server_queue_ms", "server_ttft_ms", "stack", "metered_usd", "metered_compute_s",
                  "metered_decode_batch", "metered_prefill_batch")


def per_request_table(results: list[RequestResult]) -> dict:
    def ms(x):
        return None if x is None else round(x * 1e3, 2)
    rows = [[r.index, round(r.arrival_s, 4), r.status, ms(r.send_lag_s), r.target_in, r.target_out,
             r.prompt_tokens, r.cached_tokens, r.output_tokens, r.stop_reason, ms(r.ttft_s), ms(r.tpot_s),
             ms(r.e2e_s), None if r.server_queue_ms is None else round(r.server_queue_ms, 2),
             None if r.server_ttft_ms is None else round(r.server_ttft_ms, 2), r.stack, r.metered_usd,
             *((r.metered["compute_seconds"], r.metered["decode_batch"], r.metered["prefill_batch"]) if r.metered
               else (None, None, None))] for r in results]
    return {"fields": list(REQUEST_FIELDS), "rows": rows}


# ---------------------------------------------------------------- report

def print_table(report: dict) -> None:
    head = (f"{'config':<10} {'rate':>5} {'req/s':>7} {'ok/fail':>9} {'TTFT p50':>9} {'p95':>9} {'TPOT p50':>9} "
            f"{'p95':>8} {'ITL p95':>8} {'out tok/s':>10} {'goodput':>8} {'compiles':>8} {'queued: prefill tok/s':>21} "
            f"{'idle':>5} {'HBM/MMA util':>12}")
    print(head)
    print("-" * len(head))

    def f(d, k, w):
        v = (d or {}).get(k)
        return f"{v:>{w}.1f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
    for c in report["configs"]:
        if "error" in c and not c.get("rates"):
            print(f"{c['name']:<10} error: {c['error'].splitlines()[0]}")
            continue
        for rate, s in c["rates"].items():
            if "skipped" in s:
                print(f"{c['name']:<10} {rate:>5} skipped: {s['skipped']}")
                continue
            comp = "null" if s["jit_compilations"] is None else f"{s['jit_compilations']:.0f}"
            q = s.get("metric_samples") or {}
            idle = q.get("gpu_idle_fraction_while_queued")
            idle = "-" if idle is None else f"{idle:.0%}"
            hbm, mma = (q.get(f"{k}_while_running") for k in ("hbm_bandwidth_utilization", "gpu_compute_utilization"))
            util = f"{hbm['p50']:.0%}/{mma['p50']:.0%}" if hbm and mma else "-"
            print(f"{c['name']:<10} {rate + 'x':>5} {s['offered_rps']:>7.2f} {s['finished']:>4}/{s['failed']:<4} "
                  f"{f(s['ttft_ms'], 'p50', 9)} {f(s['ttft_ms'], 'p95', 9)} {f(s['tpot_ms'], 'p50', 9)} "
                  f"{f(s['tpot_ms'], 'p95', 8)} {f(s['itl_ms'], 'p95', 8)} {s['output_tokens_per_s']:>10.1f} "
                  f"{s['goodput_rps']:>8.3f} {comp:>8} {f(q, 'prefill_tokens_per_s_while_queued', 21)} "
                  f"{idle:>5} {util:>12}")
    print("(times in ms; req/s offered; goodput: requests/s meeting "
          f"TTFT <= {report['args']['slo_ttft_ms']} ms and TPOT <= {report['args']['slo_tpot_ms']} ms; "
          "queued: over the /metrics sample intervals with requests queued at both ends; util: median "
          "stratum_hbm_bandwidth_utilization / stratum_gpu_compute_utilization over the samples with requests running)")
    cmp = report.get("comparison")
    if cmp:
        ratios = ", ".join(f"{n} {r:.3f}x" if r is not None else f"{n} -" for n, r in cmp["goodput_ratio"].items())
        print(f"goodput over {cmp['baseline']} at {cmp['rate']:g}x, the highest rate tried where {cmp['baseline']} "
              f"met the SLO for >= half of its requests ({cmp['baseline_good_fraction']:.0%}): {ratios}")


def compare_at_fcfs_capacity(report: dict, baseline: str = "fcfs") -> dict | None:
    """Issue #10's HAB target, read off a report: the highest rate at which the `baseline` config still
    met the SLO for at least half of its requests, and every other config's goodput there over the
    baseline's. None when the report has no such config or rate.

    -> {"baseline", "rate", "baseline_good_fraction", "baseline_goodput_rps",
        "goodput_ratio": {config: ratio or None}, "rates_tried": [...]}
    """
    by_name = {c["name"]: c for c in report["configs"]}
    base = by_name.get(baseline)
    if base is None:
        return None
    done = {float(k): s for k, s in base.get("rates", {}).items() if "skipped" not in s and s.get("requests")}
    holding = [r for r, s in done.items() if s["good_requests"] >= s["requests"] / 2]
    if not holding:
        return None
    rate = max(holding)
    s = done[rate]
    ratios, p95 = {}, {baseline: (s.get("ttft_ms") or {}).get("p95")}
    for name, c in by_name.items():
        if name == baseline:
            continue
        other = next((o for k, o in c.get("rates", {}).items() if float(k) == rate and "skipped" not in o), None)
        ratios[name] = (round(other["goodput_rps"] / s["goodput_rps"], 3)
                        if other is not None and s["goodput_rps"] > 0 else None)
        p95[name] = None if other is None else (other.get("ttft_ms") or {}).get("p95")
    return {"baseline": baseline, "rate": rate, "baseline_good_fraction": round(s["good_requests"] / s["requests"], 3),
            "baseline_goodput_rps": s["goodput_rps"], "goodput_ratio": ratios, "ttft_p95_ms": p95,
            "rates_tried": sorted(done)}


def plot(report: dict, path: pathlib.Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib here: no PNG (the JSON has every figure; plot later with --replot)", file=sys.stderr)
        return False
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for c in report["configs"]:
        done = [(float(k), s) for k, s in c.get("rates", {}).items() if "skipped" not in s]
        if not done:
            continue
        xs = [k for k, _ in done]
        ax[0].plot(xs, [s["goodput_rps"] for _, s in done], "o-", label=c["name"])
        ax[1].plot(xs, [(s["ttft_ms"] or {}).get("p95", float("nan")) for _, s in done], "o-", label=c["name"])
    rates = sorted({float(k) for c in report["configs"] for k in c.get("rates", {})})
    for a, ylabel in zip(ax, ("goodput (req/s)", "P95 TTFT (ms)")):
        a.set_xscale("log", base=2)
        a.set_xticks(rates, [f"{r:g}x" for r in rates])
        a.set_xlabel("rate (x the trace's)")
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        a.legend()
    if any(v > 0 for line in ax[1].get_lines() for v in line.get_ydata()):   # NaN-only: no log axis
        ax[1].set_yscale("log")
    a = report["args"]
    dev = next((c["health"]["device"] for c in report["configs"] if "health" in c), "?")
    fig.suptitle(f"{a['model']} on {dev}: Mooncake conversation [{a['window_start']}, "
                 f"{a['window_start'] + a['num_requests']}), lengths x{a['length_scale']}; SLO TTFT "
                 f"{a['slo_ttft_ms']} ms, TPOT {a['slo_tpot_ms']} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) or None


# ---------------------------------------------------------------- command line

def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """'hab=--scheduler hab;fcfs=--scheduler fcfs' -> [("hab", ["--scheduler", "hab"]), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, flags = part.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"--configs: {part!r} is not NAME=FLAGS (a name of letters, digits, _ . -)")
        out.append((name, shlex.split(flags)))
    names = [n for n, _ in out]
    if not out or len(set(names)) != len(names):
        raise ValueError(f"--configs needs at least one NAME=FLAGS and distinct names, got {names}")
    return out


def check_server_flags(flags: list[str]) -> None:
    for f in flags:
        if f.split("=", 1)[0] in _OWN_FLAGS:
            raise ValueError(f"server flag {f}: this script sets the model, loopback host and free ports itself "
                             f"(and sends no API key or TLS); leave {', '.join(_OWN_FLAGS)} out")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model", default="tiny", help="--model of the servers (a preset or a checkpoint directory)")
    p.add_argument("--trace", type=pathlib.Path, default=TRACE)
    p.add_argument("--window-start", type=int, default=0, help="first trace line replayed (0-based)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rates", default="1,2,4,8", help="time compressions of the recorded arrivals")
    p.add_argument("--arrivals", choices=("slot", "burst"), default="slot",
                   help="slot: each request at a uniform offset within the trace's timestamp slot (a Poisson "
                        "process given each slot's count; seeded per rate); burst: every request of a timestamp "
                        "at the same instant (the replay before 2026-12-01)")
    p.add_argument("--arrival-slot-ms", type=float, default=0.0,
                   help="with --arrivals slot: the slot width (default: the window's median gap between distinct "
                        "timestamps, 3000 for the shared trace)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiplies input and output lengths")
    p.add_argument("--block-tokens", type=int, default=0,
                   help="tokens per hash-id block (default ceil(512 * --length-scale))")
    p.add_argument("--max-context", type=int, default=0,
                   help="clip prompt + max_tokens to this (default, and at most, the server's --max-context)")
    p.add_argument("--context-margin", type=int, default=0,
                   help="tokens kept free below the context, for tokenizers where text and tokens do not add up")
    p.add_argument("--configs", default="default=", help="NAME=EXTRA SERVER FLAGS;... one server each, in order")
    p.add_argument("--server-args", default="", help="flags every server gets (before the config's)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--http", action="store_true",
                   help="replay over the OpenAI-compatible HTTP API (--http-port 0) instead of gRPC Messages")
    p.add_argument("--max-concurrency", type=int, default=512, help="streams open at once (later arrivals wait)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline of each request (s)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="bound on the whole invocation (s)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="bound on a server's load + warm-up (s)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="after SIGTERM, SIGKILL past this (s)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="send this many requests (own text, all at once) before the first rate, unmeasured")
    p.add_argument("--poll-s", type=float, default=0.5, help="period of the /metrics samples")
    p.add_argument("--out-prefix", default="serving", help="file names under benchmarks/results/")
    p.add_argument("--compare-baseline", default="fcfs",
                   help="the config the others' goodput is compared with, at its capacity (e.g. w0 for a "
                        "--stratum-weight 0 config of a two-stack server)")
    p.add_argument("--cost-samples", type=int, default=16,
                   help="finished requests per rate priced with CostEstimate after the rate (0 = none)")
    p.add_argument("--server-log-dir", default=None, help="where server logs go (default: a temporary directory)")
    p.add_argument("--replot", type=pathlib.Path, metavar="JSON", help="only redraw the PNG of a result file")
    return p


def validate(args, parser) -> None:
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates: give numbers separated by commas, e.g. 1,2,4,8; got {args.rates!r}")
    if not args.rates or any(r <= 0 for r in args.rates):
        parser.error("--rates must be positive numbers")
    args.rates = [int(r) if r.is_integer() else r for r in args.rates]
    bounds = [("length_scale", 0 < args.length_scale <= 4), ("num_requests", 1 <= args.num_requests <= 100_000),
              ("window_start", args.window_start >= 0), ("block_tokens", args.block_tokens >= 0),
              ("max_context", args.max_context >= 0), ("context_margin", args.context_margin >= 0),
              ("max_concurrency", 1 <= args.max_concurrency <= 10_000),
              ("request_timeout", 0 < args.request_timeout <= 3600), ("run_timeout", 0 < args.run_timeout <= 86_400),
              ("start_timeout", args.start_timeout > 0), ("stop_timeout", args.stop_timeout > 0),
              ("poll_s", 0.05 <= args.poll_s <= 60), ("slo_ttft_ms", args.slo_ttft_ms > 0),
              ("slo_tpot_ms", args.slo_tpot_ms > 0),
              ("warmup_requests", 0 <= args.warmup_requests <= args.num_requests),
              ("arrival_slot_ms", 0 <= args.arrival_slot_ms <= 3_600_000)]
    for name, ok in bounds:
        if not ok:
            parser.error(f"--{name.replace('_', '-')} is out of range: {getattr(args, name)} (see --help)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.out_prefix):
        parser.error(f"--out-prefix {args.out_prefix!r}: use letters, digits, _ . - (it names files)")
    try:
        args.config_list = parse_configs(args.configs)
        args.common_flags = shlex.split(args.server_args)
        for flags in [args.common_flags] + [f for _, f in args.config_list]:
            check_server_flags(flags)
    except ValueError as e:
        parser.error(str(e))


async def run_all(args, window) -> list[dict]:
    deadline = time.perf_counter() + args.run_timeout
    configs = []
    for name, flags in args.config_list:
        entry: dict = {}
        configs.append(entry)
        if time.perf_counter() >= deadline:
            entry.update(name=name, rates={}, error="skipped: the --run-timeout passed")
            continue
        print(f"[{name}] starting a server: {args.model} {shlex.join(args.common_flags + flags)}", file=sys.stderr)
        await run_config(name, args.common_flags + flags, window, args, deadline, entry)
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    validate(args, parser)
    try:
        window = load_trace(args.trace, args.window_start, args.num_requests)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if args.arrivals == "burst":
        args.arrival_slot_ms = 0.0
    elif not args.arrival_slot_ms:
        args.arrival_slot_ms = trace_slot_ms([r.timestamp_ms for r in window])
        if args.arrival_slot_ms is None:
            parser.error("--arrivals slot: every request of the window has the same timestamp, so its slot width "
                         "is unknown; pass --arrival-slot-ms, or --arrivals burst")
    print(f"arrivals: {args.arrivals}" + (f" (uniform within {args.arrival_slot_ms:g} ms slots)"
                                          if args.arrival_slot_ms else ""), file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    configs = asyncio.run(run_all(args, window))
    token_times = {c["name"]: {rate: s.pop("_token_times") for rate, s in c.get("rates", {}).items()
                               if "_token_times" in s} for c in configs}
    health = next((c["health"] for c in configs if "health" in c), {})
    report = {
        "benchmark": "serving (issue #10): Mooncake conversation trace replayed over "
                     + ("HTTP (OpenAI API, issue #17)" if args.http else "gRPC"),
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["serving.py", *argv]),
        "git_commit": _git_commit(),
        "device": health.get("device"), "platform": health.get("platform"),
        "jax_version": health.get("jax_version"), "cuda_version": health.get("cuda_version"),
        "trace": str(args.trace), "window": [args.window_start, args.window_start + args.num_requests],
        "length_scale": args.length_scale,
        "notes": ("TTFT/E2E from each request's scheduled arrival; TPOT = (last - first token) / (tokens - 1); "
                  "ITL = gaps between streamed deltas; throughput and goodput over first arrival to last reply; "
                  f"arrivals: {args.arrivals}"
                  + (f" (uniform within {args.arrival_slot_ms:g} ms timestamp slots)" if args.arrival_slot_ms else "")
                  + "; lengths x length_scale, then clipped to the context (clipped_to_context); fresh block text "
                  "per rate (salt), so rates do not share prefix cache; temperature 0"),
        "args": {k: v for k, v in vars(args).items() if k not in ("config_list", "common_flags", "replot")},
        "configs": configs,
    }
    report["args"]["trace"] = str(args.trace)
    report["comparison"] = compare_at_fcfs_capacity(report, args.compare_baseline)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out_prefix}.json"
    path.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    tokens_path = RESULTS / f"{args.out_prefix}.tokens.json.gz"
    with gzip.open(tokens_path, "wt") as f:
        json.dump({"fields": "per config, per rate: each request's delta times (ms after its scheduled arrival), "
                             "in the order of per_request.rows", "configs": token_times}, f, separators=(",", ":"))
    print_table(report)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and {tokens_path.name}", file=sys.stderr)
    if path.stat().st_size > 5e6:
        print("note: the JSON is over 5 MB: keep it out of git (or run fewer requests)", file=sys.stderr)
    if plot(report, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}", file=sys.stderr)
    failed = any("error" in c for c in configs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
