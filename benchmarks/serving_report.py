"""A replay's report (benchmarks/serving.py): the printed table, the comparison at FCFS's capacity, the PNG and the
git commit it was measured on."""
from __future__ import annotations

import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


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


def git_commit() -> str | None:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("-dirty" if dirty else "")) or None
