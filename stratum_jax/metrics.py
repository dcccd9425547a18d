"""The Prometheus registry of a server and the name of every metric it exports.

The engine never imports this module: the serving layer feeds it with `Engine.stats()` snapshots (from
the engine thread, after each step) and with per-request figures (from the gRPC handlers, when a
request ends). Each server owns its own `CollectorRegistry`, so several servers can live in one process.

Every series carries a `stack` label (the first label, before a metric's own): a server that runs several
stacks (`--stacks stratum,baseline`, plus the long-context pool) feeds one `ServingMetrics` per stack, all in
one registry (`ServingMetrics.for_stack`), so the stacks sit side by side on one dashboard under the same
metric names. What happens before a stack is chosen belongs to no stack: it is counted under
`stack="router"` (`RouterMetrics`): the Messages calls refused before routing (a bad header, a malformed or
oversized request, a missing API key, a server still loading or draining) in stratum_requests_total, and the
router's stratum_prompt_length_entropy_bits (only there: ROUTER_ONLY). The label stays on every series, so a
`sum by (status)` still adds them all up. The stratum_dmlp_* metrics have no stack label: only the Stratum
stack runs a DMLP.

`python -m stratum_jax.metrics` prints the table of names that the README quotes.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

import prometheus_client as prom

from stratum_jax.engine_stats import EngineStats
from stratum_jax.step_work import DevicePeaks

# name -> (type, help). The single source of the exported names; the README table is printed from it.
METRICS: dict[str, tuple[str, str]] = {
    "stratum_ttft_seconds": ("histogram", "Time to first token: arrival of the request until its first token."),
    "stratum_tpot_seconds": ("histogram", "Time per output token after the first, per request."),
    "stratum_e2e_latency_seconds": ("histogram", "Arrival of the request until its last token."),
    "stratum_queue_length": ("gauge", "Requests waiting in the engine's queue."),
    "stratum_running_requests": ("gauge", "Requests being prefilled or decoded."),
    "stratum_in_flight_requests": ("gauge", "Accepted streams that have not ended yet."),
    "stratum_kv_pages_used": ("gauge", "KV cache pages in use, by memory tier."),
    "stratum_kv_pages_free": ("gauge", "KV cache pages free, by memory tier."),
    "stratum_kv_tokens_used": ("gauge", "KV token slots in use, by memory tier."),
    "stratum_kv_tokens_total": ("gauge", "KV token slots in all, by memory tier."),
    "stratum_prefix_cache_hits_total": ("counter", "Full prompt pages found in the prefix cache."),
    "stratum_prefix_cache_queries_total": ("counter", "Full prompt pages looked up in the prefix cache."),
    "stratum_cache_hit_rate": ("gauge", "stratum_prefix_cache_hits_total / stratum_prefix_cache_queries_total."),
    "stratum_kv_host_hits_total": ("counter", "Prefix pages a request got from the host tier (copied back, "
                                   "not recomputed); also counted in stratum_prefix_cache_hits_total."),
    "stratum_kv_prefetched_pages_total": ("counter", "Host-tier pages copied back ahead of their request's admission."),
    "stratum_kv_offloaded_pages_total": ("counter", "KV pages copied from HBM to the host tier on eviction."),
    "stratum_kv_host_reused_pages_total": ("counter", "KV pages evicted from HBM back to the host tier with the "
                                           "host copy kept since their recall (no copy)."),
    "stratum_kv_recalled_pages_total": ("counter", "KV pages copied from the host tier back to HBM (prefix hits "
                                        "and prefetches)."),
    "stratum_kv_recall_choices_total": ("counter", "Host-tier prefix hits by what the recall choice did with them: "
                                        "choice=recall (copied back) or recompute (prefilled again: the measured "
                                        "copy time was above the measured recompute time)."),
    "stratum_kv_recall_seconds": ("histogram", "Host-to-device copy time of one step's recalled pages (one "
                                  "observation per step that recalled any)."),
    "stratum_kv_bytes": ("gauge", "KV bytes held, by memory tier: in use on the device, cached on the host. With "
                         "DKVC the pages hold deltas and scales (the resident anchor is not counted)."),
    "stratum_kv_precision": ("gauge", "1, labelled with the KV precision running (bf16, fp16-delta, fp8-delta): "
                             "--kv-precision after its fallbacks."),
    "stratum_preemptions_total": ("counter", "Running requests preempted because the KV pool was full."),
    "stratum_engine_steps_total": ("counter", "Engine steps run."),
    "stratum_untimed_steps_total": ("counter", "Engine steps read back with no measured device time (they ran "
                                    "while the host was busy elsewhere), by how their rows were billed: "
                                    "billed=estimated (at the recent measured rates) or none (before any "
                                    "measured step of their kind)."),
    "stratum_decode_step_seconds": ("gauge", "Recent decode step wall time (moving average)."),
    "stratum_prefill_tokens_per_second": ("gauge", "Recent prefill throughput (moving average)."),
    "stratum_prefill_tokens_total": ("counter", "Prompt tokens the engine has prefilled (prefix-cache hits "
                                                "excluded): its rate while requests queue is the prefill throughput."),
    "stratum_gpu_idle_fraction": ("gauge", "Share of the last second with no engine step on the device."),
    "stratum_gpu_idle_ms": ("histogram", "Device idle gap between a step's results and the next step's dispatch."),
    "stratum_requests_total": ("counter", "Messages requests by terminal gRPC status (ok, invalid_argument, ...)."),
    "stratum_stop_reasons_total": ("counter", "Completed Messages requests by stop reason."),
    "stratum_input_tokens_total": ("counter", "Prompt tokens of requests that ended."),
    "stratum_cached_input_tokens_total": ("counter", "Prompt tokens served from the prefix cache."),
    "stratum_output_tokens_total": ("counter", "Tokens generated for requests that ended."),
    "stratum_routed_requests_total": ("counter", "Messages requests by their x-stratum-route header value."),
    "stratum_route_decisions_total": ("counter", "Messages requests by the pool they were routed to and why: "
                                      "route=default or long-context, reason=header, length, regex, "
                                      "low_entropy (below --route-entropy-bits: one pool) or short."),
    "stratum_prompt_length_entropy_bits": ("gauge", "Shannon entropy (bits) of the recent prompt lengths in log2 "
                                           "bins; above --route-entropy-bits requests are classified "
                                           "(stack=\"router\" only)."),
    "stratum_request_weight": ("histogram", "x-stratum-weight header values of Messages requests that sent one."),
    "stratum_metered_cost_usd_total": ("counter", "Metered usage: the cost formula (serving/cost.py) applied to "
                                       "what each finished request ran, USD, by cost term (compute, hbm, transfer)."),
    "stratum_metered_output_tokens_total": ("counter", "Output tokens of the requests in "
                                            "stratum_metered_cost_usd_total (cost per token = the ratio)."),
    "stratum_hbm_bandwidth_gbps": ("gauge", "Device memory copy bandwidth measured at start-up (GB/s)."),
    "stratum_read_bandwidth_gbps": ("gauge", "Device memory read bandwidth measured at start-up, a large bf16 sum "
                                    "(GB/s, summed over the stack's devices): stratum_hbm_bandwidth_utilization's "
                                    "ceiling."),
    "stratum_matmul_tflops": ("gauge", "bf16 matmul rate measured at start-up (TFLOP/s, summed over the stack's "
                              "devices): stratum_gpu_compute_utilization's ceiling."),
    "stratum_hbm_bandwidth_utilization": ("gauge", "Bytes the recent steps must move (weights read, KV read and "
                                          "written, counted by stratum_jax/step_work.py) per second of device "
                                          "time, over stratum_read_bandwidth_gbps (median of recent steps)."),
    "stratum_gpu_compute_utilization": ("gauge", "FLOPs of the recent steps (linear layers, LM head, attention, "
                                        "counted by stratum_jax/step_work.py) per second of device time, over "
                                        "stratum_matmul_tflops (median of recent steps)."),
    "stratum_jit_compilations_total": ("counter", "XLA compilations in the server process (counted through "
                                       "jax.monitoring); after SERVING each one is a bug and is logged."),
    "stratum_jit_compilations_after_serving_total": ("counter", "XLA compilations after the server reported "
                                                     "SERVING (on the request path)."),
    "stratum_hab_triggers_total": ("counter", "Times the HAB scheduler admitted by CPM because the device's "
                                   "accumulated idle time passed --hab-threshold-ms."),
}

# Exported only with --cache-policy dmlp (stratum_jax/dmlp/runtime.py registers them in the server's
# registry; the guard's four with --dmlp-guard, the default, from stratum_jax/dmlp/guard.py; the last
# three only with --dmlp-online, from stratum_jax/dmlp/online.py).
DMLP_METRICS: dict[str, tuple[str, str]] = {
    "stratum_dmlp_confidence": ("gauge", "DMLP hot/cold threshold on P(reuse within the decision horizon)."),
    "stratum_dmlp_guard_active": ("gauge", "1 while the shadow-LRU guard has the DMLP policy evict in LRU order."),
    "stratum_dmlp_guard_dmlp_hit_rate": ("gauge", "Prefix-cache hit rate of the live policy over the guard's "
                                         "last full window."),
    "stratum_dmlp_guard_lru_hit_rate": ("gauge", "Hit rate a ghost LRU of the same size would have had over "
                                        "the same accesses."),
    "stratum_dmlp_guard_ghost_dmlp_hit_rate": ("gauge", "Hit rate a ghost cache evicting by the DMLP would "
                                               "have had over the same accesses."),
    "stratum_dmlp_accuracy": ("gauge", "DMLP accuracy of the live weights on the online holdout window."),
    "stratum_dmlp_updates_total": ("counter", "Online fine-tuning weight hot-swaps."),
    "stratum_dmlp_online_dropped_total": ("counter", "Online examples dropped because the queue was full."),
}

# name -> its own label(s) beyond `stack`, for the metrics that have any (a tuple for more than one).
LABELS: dict[str, str | tuple[str, ...]] = {"stratum_kv_pages_used": "tier", "stratum_kv_pages_free": "tier", "stratum_kv_tokens_used": "tier",
          "stratum_kv_tokens_total": "tier", "stratum_kv_bytes": "tier", "stratum_kv_precision": "precision",
          "stratum_kv_recall_choices_total": "choice", "stratum_untimed_steps_total": "billed",
          "stratum_requests_total": "status", "stratum_stop_reasons_total": "reason",
          "stratum_routed_requests_total": "route", "stratum_route_decisions_total": ("route", "reason"),
          "stratum_metered_cost_usd_total": "term"}

STACK_LABEL = "stack"      # on every series of METRICS
DEFAULT_STACK = "stratum"  # the stack a ServingMetrics feeds unless told otherwise
ROUTER_STACK = "router"    # the `stack` of what happens before a stack is chosen (RouterMetrics)
ROUTER_ONLY = frozenset({"stratum_prompt_length_entropy_bits"})   # exported under stack="router" alone

KV_TIER = "device"
HOST_TIER = "host"   # the host-memory tier (--kv-host-tokens), only when there is one
_RECENT = 2048       # requests kept for the percentiles of GetMetrics

_RECALL_BUCKETS = (.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1)
_IDLE_MS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1024.0)
_TTFT_BUCKETS = (.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5)
_WEIGHT_BUCKETS = (0, .1, .2, .3, .4, .5, .6, .7, .8, .9, 1)
_E2E_BUCKETS = (.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclasses.dataclass(frozen=True)
class LatencySummary:
    count: int
    mean_s: float
    p50_s: float
    p95_s: float
    p99_s: float


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class _Recent:
    """A bounded window of recent observations, for percentiles that Prometheus histograms can't give."""

    def __init__(self) -> None:
        self._values: collections.deque[float] = collections.deque(maxlen=_RECENT)
        self._count = 0
        self._sum = 0.0
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)
            self._count += 1
            self._sum += value

    def summary(self) -> LatencySummary:
        with self._lock:
            values = sorted(self._values)
            count, total = self._count, self._sum
        return LatencySummary(count, total / count if count else 0.0,
                              _percentile(values, .50), _percentile(values, .95), _percentile(values, .99))


def label_names(name: str) -> tuple[str, ...]:
    """The labels of a metric of METRICS: `stack`, then its own (LABELS)."""
    own = LABELS.get(name, ())
    return (STACK_LABEL,) + ((own,) if isinstance(own, str) else tuple(own))


class _StackBound:
    """A family with a second label, its stack label fixed: `labels(value)` is the (stack, value) child."""

    def __init__(self, family, stack: str) -> None:
        self._family = family
        self._stack = stack

    def labels(self, *values: str):
        return self._family.labels(self._stack, *values)


class MetricFamilies:
    """Every metric family of METRICS in one registry, each labelled (stack, [its own label])."""

    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.registry = registry
        self.families: dict[str, object] = {}
        buckets = {"stratum_ttft_seconds": _TTFT_BUCKETS, "stratum_tpot_seconds": _TPOT_BUCKETS,
                   "stratum_e2e_latency_seconds": _E2E_BUCKETS, "stratum_kv_recall_seconds": _RECALL_BUCKETS,
                   "stratum_gpu_idle_ms": _IDLE_MS_BUCKETS, "stratum_request_weight": _WEIGHT_BUCKETS}
        for name, (kind, text) in METRICS.items():
            labels = label_names(name)
            if kind == "counter":   # prometheus_client appends the _total suffix itself
                family = prom.Counter(name.removesuffix("_total"), text, labels, registry=registry)
            elif kind == "gauge":
                family = prom.Gauge(name, text, labels, registry=registry)
            else:
                family = prom.Histogram(name, text, labels, buckets=buckets[name], registry=registry)
            self.families[name] = family

    def bound(self, name: str, stack: str):
        """The series of `stack`: a child (inc/set/observe) or, with a second label, a _StackBound."""
        if name in ROUTER_ONLY and stack != ROUTER_STACK:
            raise ValueError(f"{name} is the router's (stack={ROUTER_STACK!r}), not stack {stack!r}'s")
        family = self.families[name]
        return _StackBound(family, stack) if name in LABELS else family.labels(stack)


class ServingMetrics:
    """Every metric of one stack of one server. Safe to call from any thread.

    `ServingMetrics()` makes a registry of its own; `for_stack(name)` gives the metrics of another stack in
    the same registry (the same names, another `stack` label value).
    """

    def __init__(self, registry: prom.CollectorRegistry | None = None, stack: str = DEFAULT_STACK,
                 families: MetricFamilies | None = None) -> None:
        self.registry = registry or (families.registry if families is not None else prom.CollectorRegistry())
        self.stack = stack
        self._families = families or MetricFamilies(self.registry)

        def bound(name: str):
            return self._families.bound(name, stack)

        self.ttft = bound("stratum_ttft_seconds")
        self.tpot = bound("stratum_tpot_seconds")
        self.e2e = bound("stratum_e2e_latency_seconds")
        self.queue_length = bound("stratum_queue_length")
        self.running = bound("stratum_running_requests")
        self.in_flight = bound("stratum_in_flight_requests")
        self.kv_pages_used = bound("stratum_kv_pages_used")
        self.kv_pages_free = bound("stratum_kv_pages_free")
        self.kv_tokens_used = bound("stratum_kv_tokens_used")
        self.kv_tokens_total = bound("stratum_kv_tokens_total")
        self.cache_hits = bound("stratum_prefix_cache_hits_total")
        self.cache_queries = bound("stratum_prefix_cache_queries_total")
        self.host_hits = bound("stratum_kv_host_hits_total")
        self.prefetched = bound("stratum_kv_prefetched_pages_total")
        self.offloaded = bound("stratum_kv_offloaded_pages_total")
        self.host_reused = bound("stratum_kv_host_reused_pages_total")
        self.recalled = bound("stratum_kv_recalled_pages_total")
        self.recall_seconds = bound("stratum_kv_recall_seconds")
        self.recall_choices = bound("stratum_kv_recall_choices_total")
        self.kv_bytes = bound("stratum_kv_bytes")
        self.kv_precision = bound("stratum_kv_precision")
        self.cache_hit_rate = bound("stratum_cache_hit_rate")
        self.preemptions = bound("stratum_preemptions_total")
        self.steps = bound("stratum_engine_steps_total")
        self.untimed_steps = bound("stratum_untimed_steps_total")
        self.decode_step = bound("stratum_decode_step_seconds")
        self.prefill_tps = bound("stratum_prefill_tokens_per_second")
        self.prefill_tokens = bound("stratum_prefill_tokens_total")
        self.gpu_idle_fraction = bound("stratum_gpu_idle_fraction")
        self.gpu_idle_ms = bound("stratum_gpu_idle_ms")
        self.requests = bound("stratum_requests_total")
        self.stop_reasons = bound("stratum_stop_reasons_total")
        self.input_tokens = bound("stratum_input_tokens_total")
        self.cached_input_tokens = bound("stratum_cached_input_tokens_total")
        self.output_tokens = bound("stratum_output_tokens_total")
        self.routes = bound("stratum_routed_requests_total")
        self.route_decisions = bound("stratum_route_decisions_total")
        self.weights = bound("stratum_request_weight")
        self.metered_usd = bound("stratum_metered_cost_usd_total")
        self.metered_output_tokens = bound("stratum_metered_output_tokens_total")
        self.hbm_bandwidth = bound("stratum_hbm_bandwidth_gbps")
        self.read_bandwidth = bound("stratum_read_bandwidth_gbps")
        self.matmul_tflops = bound("stratum_matmul_tflops")
        self.hbm_utilization = bound("stratum_hbm_bandwidth_utilization")
        self.compute_utilization = bound("stratum_gpu_compute_utilization")
        self._peaks: DevicePeaks | None = None      # the start-up ceilings: set_device_peaks
        self.jit_compilations = bound("stratum_jit_compilations_total")
        self.jit_compilations_after_serving = bound("stratum_jit_compilations_after_serving_total")
        self.hab_triggers = bound("stratum_hab_triggers_total")

        # The engine reports cumulative counts; Prometheus counters only go up by increments.
        self._last_engine_counts: dict[str, int] = {}
        self._status_counts: collections.Counter[str] = collections.Counter()
        self._tokens = collections.Counter()
        self._lock = threading.Lock()
        self.recent_ttft, self.recent_tpot, self.recent_e2e = _Recent(), _Recent(), _Recent()

    def for_stack(self, stack: str) -> "ServingMetrics":
        """The metrics of `stack` in this registry (its own series, counters and recent-latency windows)."""
        if stack == ROUTER_STACK:
            raise ValueError(f"{ROUTER_STACK!r} is the router's stack label, not a stack: use router()")
        return ServingMetrics(stack=stack, families=self._families)

    def router(self) -> "RouterMetrics":
        """The series of the router (stack="router") in this registry."""
        return RouterMetrics(self._families)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The current value of one of this stack's samples (tests, benchmarks), e.g.
        value("stratum_requests_total", {"status": "ok"}); None when the series does not exist."""
        return self.registry.get_sample_value(name, {STACK_LABEL: self.stack, **(labels or {})})

    # ---- engine side (engine thread, after each step) ----

    def _advance(self, name: str, counter, value) -> None:
        """Moves a Prometheus counter to the engine's cumulative count `value` (snapshots may repeat)."""
        delta = int(value) - self._last_engine_counts.get(name, 0)
        if delta > 0:
            counter.inc(delta)
        self._last_engine_counts[name] = int(value)

    def set_device_peaks(self, peaks: DevicePeaks) -> None:
        """The start-up measurements the utilization gauges are taken against (stratum_jax/bandwidth.py)."""
        self._peaks = peaks
        self.read_bandwidth.set(peaks.read_bytes_per_s / 1e9)
        self.matmul_tflops.set(peaks.matmul_flops_per_s / 1e12)

    def observe_engine(self, stats: EngineStats) -> None:
        """Copies an `EngineStats` snapshot into the gauges and counters."""
        if self._peaks is not None and stats.step_bytes_per_s > 0:
            hbm, compute = self._peaks.of_rates(stats.step_bytes_per_s, stats.step_flops_per_s)
            self.hbm_utilization.set(hbm)
            self.compute_utilization.set(compute)
        self.queue_length.set(stats.queued)
        self.running.set(stats.running)
        self.kv_pages_used.labels(KV_TIER).set(stats.kv_pages_total - stats.kv_pages_free)
        self.kv_pages_free.labels(KV_TIER).set(stats.kv_pages_free)
        self.kv_tokens_used.labels(KV_TIER).set(stats.kv_tokens_used)
        self.kv_tokens_total.labels(KV_TIER).set(stats.kv_tokens_total)
        host_total = stats.kv_host_tokens_total
        if host_total:
            used = stats.kv_host_tokens_used
            self.kv_tokens_used.labels(HOST_TIER).set(used)
            self.kv_tokens_total.labels(HOST_TIER).set(host_total)
            self.kv_pages_used.labels(HOST_TIER).set(used // 8)          # in 8-token base pages, like HBM
            self.kv_pages_free.labels(HOST_TIER).set((host_total - used) // 8)
        self.decode_step.set(stats.decode_step_ms / 1e3)
        self.prefill_tps.set(stats.prefill_tokens_per_s)
        self.kv_precision.labels(stats.kv_precision).set(1)
        bytes_per_token = stats.kv_bytes_per_token
        self.kv_bytes.labels(KV_TIER).set(stats.kv_tokens_used * bytes_per_token)
        if host_total:
            self.kv_bytes.labels(HOST_TIER).set(stats.kv_host_tokens_used * bytes_per_token)
        # The recall times of the steps since the last snapshot (the engine keeps the latest few).
        batches, recent = stats.kv_recall_batches, stats.kv_recall_seconds
        new = batches - self._last_engine_counts.get("kv_recall_batches", 0)
        for seconds in recent[len(recent) - min(new, len(recent)):]:
            self.recall_seconds.observe(seconds)
        self._last_engine_counts["kv_recall_batches"] = batches
        for name, metric in (("prefix_cache_hits", self.cache_hits), ("prefix_cache_queries", self.cache_queries),
                             ("preemptions", self.preemptions), ("steps", self.steps),
                             ("kv_host_hits", self.host_hits), ("kv_prefetched_pages", self.prefetched),
                             ("kv_offloaded_pages", self.offloaded), ("kv_recalled_pages", self.recalled),
                             ("kv_host_reused_pages", self.host_reused),
                             ("jit_compilations", self.jit_compilations),
                             ("jit_compilations_after_serving", self.jit_compilations_after_serving),
                             ("hab_triggers", self.hab_triggers), ("prefill_tokens", self.prefill_tokens)):
            self._advance(name, metric, getattr(stats, name))
        self._advance("estimated_steps", self.untimed_steps.labels("estimated"), stats.estimated_steps)
        self._advance("unbilled_steps", self.untimed_steps.labels("none"), stats.untimed_steps - stats.estimated_steps)
        for choice in ("recall", "recompute"):
            self._advance(f"kv_{choice}_choices", self.recall_choices.labels(choice),
                          getattr(stats, f"kv_{choice}_choices"))
        queries = stats.prefix_cache_queries
        self.cache_hit_rate.set(stats.prefix_cache_hits / queries if queries else 0.0)
        idle = stats.gpu_idle_frac
        if idle is not None:
            self.gpu_idle_fraction.set(idle)
        gap = stats.gpu_idle_gap_ms
        if gap is not None and self._last_engine_counts.get("idle_gap_step") != stats.steps:
            self.gpu_idle_ms.observe(gap)          # once per engine step that reported a new gap
            self._last_engine_counts["idle_gap_step"] = stats.steps

    # ---- request side (gRPC handlers) ----

    def request_ended(self, status: str) -> None:
        """Counts one Messages request by its terminal status ("ok", "invalid_argument", ...)."""
        self.requests.labels(status).inc()
        with self._lock:
            self._status_counts[status] += 1

    def request_completed(self, *, stop_reason: str, output_tokens: int, ttft_s: float | None,
                          e2e_s: float) -> None:
        """Records the latencies of a request that ran to a stop reason (its status is counted separately)."""
        self.stop_reasons.labels(stop_reason).inc()
        self.e2e.observe(e2e_s)
        self.recent_e2e.add(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.recent_ttft.add(ttft_s)
            if output_tokens > 1:
                tpot = (e2e_s - ttft_s) / (output_tokens - 1)
                self.tpot.observe(tpot)
                self.recent_tpot.add(tpot)

    def record_tokens(self, input_tokens: int, cached_input_tokens: int, output_tokens: int) -> None:
        """Counts the tokens of an accepted request, from its final StepOutput, however it ended."""
        self.input_tokens.inc(input_tokens)
        self.cached_input_tokens.inc(cached_input_tokens)
        self.output_tokens.inc(output_tokens)
        with self._lock:
            self._tokens["input"] += input_tokens
            self._tokens["output"] += output_tokens

    def record_metered(self, *, compute_usd: float, hbm_usd: float, transfer_usd: float, output_tokens: int) -> None:
        """Adds one finished request's metered usage (serving/cost.py meter), by cost term."""
        for term, usd in (("compute", compute_usd), ("hbm", hbm_usd), ("transfer", transfer_usd)):
            self.metered_usd.labels(term).inc(usd)
        self.metered_output_tokens.inc(output_tokens)

    def record_route(self, route: str, reason: str) -> None:
        """Counts one routing decision (the pool, and why it was chosen)."""
        self.route_decisions.labels(route, reason).inc()

    def status_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._status_counts)

    def token_counts(self) -> tuple[int, int]:
        with self._lock:
            return self._tokens["input"], self._tokens["output"]

    def start_http_server(self, host: str, port: int) -> tuple[object, int]:
        """Serves the exposition format on http://host:port/metrics; port 0 picks a free one."""
        httpd, _thread = prom.start_http_server(port, addr=host, registry=self.registry)
        return httpd, httpd.server_port


class RouterMetrics:
    """What happens before a stack is chosen (the module docstring): the calls refused then, by status, and the
    prompt-length entropy the router decides by. Only these two series exist under stack="router" (binding
    every metric would export empty stack="router" KV and latency series). Safe to call from any thread."""

    stack = ROUTER_STACK

    def __init__(self, families: MetricFamilies) -> None:
        self.requests = families.bound("stratum_requests_total", ROUTER_STACK)
        self.prompt_length_entropy = families.bound("stratum_prompt_length_entropy_bits", ROUTER_STACK)
        self._status_counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def request_ended(self, status: str) -> None:
        """Counts one Messages call that ended before it reached a stack, by its terminal status."""
        self.requests.labels(status).inc()
        with self._lock:
            self._status_counts[status] += 1

    def status_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._status_counts)


def markdown_table() -> str:
    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{name}` | {kind} | {', '.join(label_names(name))} | {text} |"
             for name, (kind, text) in METRICS.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
