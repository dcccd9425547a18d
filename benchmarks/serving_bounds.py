"""Bounds for a Mooncake replay (benchmarks/serving.py): what an ideal server could reach on the same requests.

    python benchmarks/serving_bounds.py benchmarks/results/serving_llama-1b_h200_v11_slot.json \\
        --model llama-1b --prefill-tok-s 179704 --read-tb-s 4.40 --out serving_bounds_llama-1b_v11

Two figures per config and rate of each result file, from its per-request rows (prompt tokens, prefix-cache
hits, output tokens, arrival time):

1. **The prefill share at saturation.** Issue #10 asks that, while requests queue, the server prefill at
   >= 70% of `e2e_decode.py`'s prefill rate S. But every request the server admits must also be decoded:
   each of its output tokens reads the request's whole KV (prompt + tokens so far) once. Over a saturated
   stretch that admits the replay's mix, decode therefore takes at least
       delta = sum over requests of sum_{i < out} (prompt + i) * kv_bytes_per_token / read_bandwidth
   seconds per sum(prompt - cached) prefilled tokens, and the prefill rate P/T obeys P/T <= S (1 - delta P/T),
   i.e. P/T / S <= prefill_time / (prefill_time + delta), prefill_time = sum(prompt - cached) / S. It is an
   upper bound: it charges decode nothing but its KV reads (no weights, no other work) at the full read
   bandwidth, and assumes the server prefills no faster than S. It is given per KV precision (bf16, and a
   KV of half the bytes: fp8 deltas).
2. **An ideal prefill-only server's TTFT**: one server prefilling at S tokens/s, preemptive shortest-remaining
   first, no decode work, on the rate's actual arrival times: p50 / p95 of (first-token time - arrival). What
   the replay's TTFT would be if nothing but prefill at S ran. The same server is also run at S x the bf16
   prefill-share bound (1.), the highest average prefill rate left to a server that must also decode these
   requests: its TTFT is still optimistic (no decode ever delays a prompt), but it is reachable only by a
   server that does no other work. For each, the number of requests whose ideal TTFT is within --ttft-slo-ms:
   no server on this device, model and prefill rate can count more requests as good than that.

Prints a table and writes <--results-dir>/<--out>.json (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stratum_jax.model.config import PRESETS   # noqa: E402

KV_PRECISIONS = {"bf16": 2.0, "fp8-delta": 1.0}     # bytes per K or V element


def kv_bytes_per_token(model: str, element_bytes: float) -> float:
    """K and V of one token over every layer: 2 * layers * kv_heads * head_dim * element_bytes."""
    if model not in PRESETS:
        raise ValueError(f"--model {model!r}: not a preset; choose from {', '.join(sorted(PRESETS))}")
    c = PRESETS[model]
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * element_bytes


def prefill_share_bound(requests, prefill_tok_s: float, kv_token_bytes: float, read_bytes_s: float) -> dict:
    """requests: dicts with prompt_tokens, cached_tokens, output_tokens. The largest prefill rate at
    saturation, as a fraction of prefill_tok_s, that leaves time for the requests' decode KV reads."""
    prefill_s = sum(r["prompt_tokens"] - r["cached_tokens"] for r in requests) / prefill_tok_s
    # sum_{i < n} (p + i) = n p + n (n - 1) / 2 token reads per request
    reads = sum(r["output_tokens"] * r["prompt_tokens"] + r["output_tokens"] * (r["output_tokens"] - 1) / 2
                for r in requests)
    decode_s = reads * kv_token_bytes / read_bytes_s
    return {"prefill_s": round(prefill_s, 4), "decode_kv_read_s": round(decode_s, 4),
            "max_prefill_fraction": round(prefill_s / (prefill_s + decode_s), 4)}


def ideal_ttft_s(arrivals_s, new_tokens, prefill_tok_s: float) -> np.ndarray:
    """First-token times less arrivals [n] of one server prefilling at prefill_tok_s, preemptive
    shortest-remaining-first (ties: earlier arrival), no decode work."""
    order = sorted(range(len(arrivals_s)), key=lambda i: (arrivals_s[i], i))
    remaining: dict[int, float] = {}
    done = np.zeros(len(order))
    t, k = 0.0, 0
    while k < len(order) or remaining:
        if not remaining:
            t = max(t, arrivals_s[order[k]])
        while k < len(order) and arrivals_s[order[k]] <= t:
            remaining[order[k]] = max(new_tokens[order[k]], 1) / prefill_tok_s
            k += 1
        i = min(remaining, key=lambda j: (remaining[j], arrivals_s[j], j))
        next_arrival = arrivals_s[order[k]] if k < len(order) else float("inf")
        run = min(remaining[i], next_arrival - t)
        remaining[i] -= run
        t += run
        if remaining[i] <= 1e-12:
            done[i] = t - arrivals_s[i]
            del remaining[i]
    return done


def rows_of(rate_result: dict) -> list[dict]:
    """One rate's per-request rows (serving.py stores them columnar) as dicts keyed by field name."""
    table = rate_result["per_request"]
    return [dict(zip(table["fields"], row)) for row in table["rows"]]


def _ttft_summary(ttft_s: np.ndarray, ttft_slo_ms: float) -> dict:
    """p50 / p95 in ms of [n] TTFTs in seconds, and how many are within the SLO."""
    return {"p50": round(float(np.percentile(ttft_s, 50)) * 1e3, 1),
            "p95": round(float(np.percentile(ttft_s, 95)) * 1e3, 1),
            "within_slo": int((ttft_s * 1e3 <= ttft_slo_ms).sum())}


def analyse(result: dict, model: str, prefill_tok_s: float, read_tb_s: float,
            ttft_slo_ms: float = 1000.0) -> list[dict]:
    """A serving.py result -> one dict per (config, rate) that has per-request rows: the prefill-share bound
    per KV precision, the ideal server's TTFT p50/p95 and count within the SLO (at S, and at S x the bf16
    bound), and the measured TTFT, good requests and prefill rate beside them.
    Requests that got no reply are left out (said on stderr)."""
    out = []
    for config in result["configs"]:
        for rate, r in config.get("rates", {}).items():
            if "per_request" not in r:
                continue
            rows = [x for x in rows_of(r) if x["prompt_tokens"] is not None and x["output_tokens"]]
            if len(rows) != len(rows_of(r)):
                print(f"note: {config['name']} {rate}x: {len(rows_of(r)) - len(rows)} requests without a reply "
                      f"left out", file=sys.stderr)
            ideal = ideal_ttft_s([x["arrival_s"] for x in rows],
                                 [x["prompt_tokens"] - x["cached_tokens"] for x in rows], prefill_tok_s)
            measured = [x["ttft_ms"] for x in rows if x["ttft_ms"] is not None]
            share = {p: prefill_share_bound(rows, prefill_tok_s, kv_bytes_per_token(model, b), read_tb_s * 1e12)
                     for p, b in KV_PRECISIONS.items()}
            decoding = ideal_ttft_s([x["arrival_s"] for x in rows],
                                    [x["prompt_tokens"] - x["cached_tokens"] for x in rows],
                                    prefill_tok_s * share["bf16"]["max_prefill_fraction"])
            out.append({
                "config": config["name"], "rate": rate, "requests": len(rows),
                "prefill_share_bound": share,
                "ideal_ttft_ms": _ttft_summary(ideal, ttft_slo_ms),
                # The same ideal server at S x the bf16 prefill-share bound (see the module docstring).
                "ideal_ttft_ms_decoding": _ttft_summary(decoding, ttft_slo_ms),
                "measured_good_requests": r.get("good_requests"),
                "measured_ttft_ms": {"p50": round(float(np.percentile(measured, 50)), 1),
                                     "p95": round(float(np.percentile(measured, 95)), 1)},
                "measured_prefill_tok_s_while_queued": (r.get("metric_samples") or {}).get(
                    "prefill_tokens_per_s_while_queued"),
            })
    return out


def _share(tok_s, prefill_tok_s) -> str:
    return "-" if tok_s is None else f"{tok_s / prefill_tok_s:.1%}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=pathlib.Path, help="benchmarks/serving.py result JSONs")
    ap.add_argument("--model", default="llama-1b", help="the preset the replay served (its KV bytes per token)")
    ap.add_argument("--prefill-tok-s", type=float, default=179_704.0,
                    help="e2e_decode.py's prefill rate (default: llama-1b, batch 8 x 12,288-token prompts, H200, "
                         "e2e_llama-1b_b8_prompt12k_h200.json)")
    ap.add_argument("--read-tb-s", type=float, default=4.40, help="the device's read bandwidth (H200: 4.40)")
    ap.add_argument("--ttft-slo-ms", type=float, default=1000.0,
                    help="the TTFT SLO of the replay's goodput (serving.py's default: 1000)")
    ap.add_argument("--out", default="serving_bounds", help="JSON name under --results-dir")
    ap.add_argument("--results-dir", type=pathlib.Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    if a.prefill_tok_s <= 0 or a.read_tb_s <= 0 or a.ttft_slo_ms <= 0:
        ap.error("--prefill-tok-s, --read-tb-s and --ttft-slo-ms must be > 0")
    report = {"benchmark": "serving bounds (issue #10): prefill share at saturation, ideal prefill-only TTFT",
              "date": datetime.date.today().isoformat(), "model": a.model, "prefill_tok_s": a.prefill_tok_s,
              "read_tb_s": a.read_tb_s, "ttft_slo_ms": a.ttft_slo_ms, "files": {}}
    print(f"{'file':44} {'config':6} {'rate':>4} {'bf16 bound':>10} {'fp8 bound':>9} {'measured':>8} "
          f"{'ideal TTFT p50/p95':>19} {'decoding p50/p95':>17} {'measured p50/p95':>17} "
          f"{'good: ideal/decoding/measured':>30}")
    for path in a.results:
        try:
            result = json.loads(path.read_text())
            rows = analyse(result, a.model, a.prefill_tok_s, a.read_tb_s, a.ttft_slo_ms)
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"{path}: not a benchmarks/serving.py result ({type(e).__name__}: {e})")
        report["files"][path.name] = {"arrivals": result.get("notes", ""), "rows": rows}
        for r in rows:
            b = r["prefill_share_bound"]
            print(f"{path.name[:44]:44} {r['config'][:6]:6} {r['rate']:>4} {b['bf16']['max_prefill_fraction']:>10.1%} "
                  f"{b['fp8-delta']['max_prefill_fraction']:>9.1%} "
                  f"{_share(r['measured_prefill_tok_s_while_queued'], a.prefill_tok_s):>8} "
                  f"{r['ideal_ttft_ms']['p50']:>9.0f}/{r['ideal_ttft_ms']['p95']:<9.0f}"
                  f"{r['ideal_ttft_ms_decoding']['p50']:>8.0f}/{r['ideal_ttft_ms_decoding']['p95']:<8.0f} "
                  f"{r['measured_ttft_ms']['p50']:>8.0f}/{r['measured_ttft_ms']['p95']:<8.0f} "
                  f"{r['ideal_ttft_ms']['within_slo']:>14}/{r['ideal_ttft_ms_decoding']['within_slo']}/"
                  f"{r['measured_good_requests'] if r['measured_good_requests'] is not None else '-'}")
    path = a.results_dir / f"{a.out}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
