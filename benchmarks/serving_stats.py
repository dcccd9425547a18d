"""One replay's per-request results and their statistics (benchmarks/serving.py): percentiles, goodput under the
SLOs, the metered cost, per-stack splits and the columnar per-request table. Pure."""
from __future__ import annotations

import collections
import dataclasses

import numpy as np


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
