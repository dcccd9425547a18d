"""Splits a GPU profile of tensor-parallel decode steps into compute and communication time.

    python benchmarks/e2e_decode.py --model llama-8b --batch 1 --tensor-parallel 2 --attention kernel \
        --profile-dir /tmp/prof --profile-calls 5
    python benchmarks/tp_profile_split.py /tmp/prof

Reads the newest perfetto_trace.json.gz under the directory (jax.profiler.trace(create_perfetto_trace=
True)) and the decode window e2e_decode.py wrote beside it (WINDOW_FILE: the name of the host-side
TraceAnnotation around each traced decode call, and each call's kind and decode steps). Only device
time inside those annotations counts, so the prefill, warm-up and anything else the trace caught stay
out, and "per step" divides by the decode steps those calls ran. (The host blocks on each call's sampled
tokens, so a call's kernels finish inside its annotation; the profiler puts host and device events on
one clock.)

On each GPU ("/device:GPU:N" processes), kernel events whose name says collective (NCCL kernels, XLA
all-reduce / all-gather / reduce-scatter ops) count as communication, every other kernel as compute.
Prints, per GPU and per decode step, the milliseconds of each and the busy time (the union of all kernel
intervals: compute and communication may overlap on different streams), beside the calls' wall time.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import statistics
import sys

from device_trace import (annotation_windows, decode_call_spans, kernel_kind, kernels, load_events,  # noqa: E402
                          newest_trace, union_us)

WINDOW_FILE = "decode_window.json"     # written by e2e_decode.py --profile-dir, read here


def split(events: list[dict], windows: list[tuple[float, float]] | None = None,
          device: str = "GPU") -> dict[str, dict[str, float]]:
    """Trace events (Chrome trace format) -> {device process name: {"compute_us", "communication_us",
    "busy_us"}} over the complete ("X") kernel events of each process whose name holds `device`; with
    `windows` [(start_us, end_us)] only the part of each event inside them counts."""
    out: dict[str, dict] = {}
    for k in kernels(events, device, windows):
        row = out.setdefault(k.device, {"compute_us": 0.0, "communication_us": 0.0, "intervals": []})
        kind = "communication_us" if kernel_kind(k.name) == "communication" else "compute_us"
        row[kind] += k.us
        row["intervals"].append((k.start_us, k.end_us))
    return {k: {"compute_us": v["compute_us"], "communication_us": v["communication_us"],
                "busy_us": union_us(v["intervals"])} for k, v in out.items() if v["intervals"]}


def per_step(events: list[dict], window: dict, device: str = "GPU") -> dict:
    """The split of the decode calls that `window` (WINDOW_FILE's contents: {"annotation", "calls": [{"kind",
    "steps", "seconds"}]}) describes, per decode step. ValueError when the trace and the window disagree."""
    calls = window["calls"]
    spans = decode_call_spans(events, window, WINDOW_FILE)
    steps = sum(c["steps"] for c in calls)
    result = split(events, spans, device)
    if not result:
        raise ValueError(f"no {device} kernel events inside the decode calls' annotations")
    wall_ms = statistics.median(c["seconds"] / c["steps"] for c in calls) * 1e3
    return {"steps": steps, "calls": len(calls), "wall_ms_per_step_median": wall_ms,
            "per_step": {gpu: {k.replace("_us", "_ms_per_step"): v / 1e3 / steps for k, v in row.items()}
                         for gpu, row in sorted(result.items())}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile_dir")
    ap.add_argument("--out", default=None, help="also write the split as JSON here")
    ap.add_argument("--device", default="GPU", help="split the trace processes whose name holds this (a CPU "
                    "dry run of a session script: '/host:CPU', where every host event counts; no real split)")
    args = ap.parse_args(argv)
    root = pathlib.Path(args.profile_dir)
    try:
        trace = newest_trace(root)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not (root / WINDOW_FILE).is_file():
        print(f"error: no {WINDOW_FILE} in {root}: profile with benchmarks/e2e_decode.py --profile-dir, which "
              "writes it", file=sys.stderr)
        return 2
    try:
        result = per_step(load_events(trace),
                          json.loads((root / WINDOW_FILE).read_text()), args.device)
    except ValueError as e:
        print(f"error: {trace}: {e}", file=sys.stderr)
        return 2
    for gpu, row in result["per_step"].items():
        print(f"{gpu}: compute {row['compute_ms_per_step']:.3f} ms, communication "
              f"{row['communication_ms_per_step']:.3f} ms, busy {row['busy_ms_per_step']:.3f} ms per step "
              f"(wall {result['wall_ms_per_step_median']:.3f} ms per step, {result['steps']} steps)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({
            "trace": str(trace), "jax": importlib.metadata.version("jax"),
            "date": datetime.date.today().isoformat(), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
