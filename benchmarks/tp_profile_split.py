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
import gzip
import importlib.metadata
import json
import pathlib
import re
import statistics
import sys

COMMUNICATION = re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|allgather|"
                           r"reduce-scatter|reduce_scatter|reducescatter|collective-permute|all-to-all", re.I)
# Summary lines a converter may add to a device next to its streams: each repeats the kernels' time.
DERIVED_LINES = re.compile(r"^(XLA Modules|XLA Ops|Steps|Framework|TensorFlow|Source)", re.I)
WINDOW_FILE = "decode_window.json"     # written by e2e_decode.py --profile-dir, read here


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _clip(start: float, stop: float, windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of [start, stop) inside the (disjoint) windows."""
    return [(max(start, a), min(stop, b)) for a, b in windows if min(stop, b) > max(start, a)]


def annotation_windows(events: list[dict], name: str) -> list[tuple[float, float]]:
    """[(start_us, end_us)] of the complete ("X") events called `name` (the TraceAnnotations), in order."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                  if e.get("ph") == "X" and e.get("name") == name)


def split(events: list[dict], windows: list[tuple[float, float]] | None = None,
          device: str = "GPU") -> dict[str, dict[str, float]]:
    """Trace events (Chrome trace format) -> {device process name: {"compute_us", "communication_us",
    "busy_us"}} over the complete ("X") kernel events of each process whose name holds `device`; with
    `windows` [(start_us, end_us)] only the part of each event inside them counts."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out: dict[str, dict] = {}
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or device not in name or DERIVED_LINES.match(threads.get((e["pid"], e.get("tid")), "")):
            continue
        start = float(e["ts"])
        parts = [(start, start + float(e.get("dur", 0.0)))]
        if windows is not None:
            parts = _clip(*parts[0], windows)
        row = out.setdefault(name, {"compute_us": 0.0, "communication_us": 0.0, "intervals": []})
        kind = "communication_us" if COMMUNICATION.search(e.get("name", "")) else "compute_us"
        row[kind] += sum(b - a for a, b in parts)
        row["intervals"] += parts
    return {k: {"compute_us": v["compute_us"], "communication_us": v["communication_us"],
                "busy_us": _union_us(v["intervals"])} for k, v in out.items() if v["intervals"]}


def per_step(events: list[dict], window: dict, device: str = "GPU") -> dict:
    """The split of the decode calls that `window` (WINDOW_FILE's contents: {"annotation", "calls": [{"kind",
    "steps", "seconds"}]}) describes, per decode step. ValueError when the trace and the window disagree."""
    calls = window["calls"]
    if any(c["kind"] != "decode" for c in calls):
        raise ValueError(f"the traced calls were not all decode calls ({[c['kind'] for c in calls]}): "
                         "re-run e2e_decode.py with fewer --profile-calls than its decode calls")
    spans = annotation_windows(events, window["annotation"])
    if len(spans) != len(calls):
        raise ValueError(f"{len(spans)} {window['annotation']!r} annotations in the trace but {len(calls)} calls "
                         f"in {WINDOW_FILE}: the trace and the window file are from different runs")
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
    traces = sorted(root.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        print(f"error: no perfetto_trace.json.gz under {root}", file=sys.stderr)
        return 2
    if not (root / WINDOW_FILE).is_file():
        print(f"error: no {WINDOW_FILE} in {root}: profile with benchmarks/e2e_decode.py --profile-dir, which "
              "writes it", file=sys.stderr)
        return 2
    data = json.load(gzip.open(traces[-1]))
    try:
        result = per_step(data["traceEvents"] if isinstance(data, dict) else data,
                          json.loads((root / WINDOW_FILE).read_text()), args.device)
    except ValueError as e:
        print(f"error: {traces[-1]}: {e}", file=sys.stderr)
        return 2
    for gpu, row in result["per_step"].items():
        print(f"{gpu}: compute {row['compute_ms_per_step']:.3f} ms, communication "
              f"{row['communication_ms_per_step']:.3f} ms, busy {row['busy_ms_per_step']:.3f} ms per step "
              f"(wall {result['wall_ms_per_step_median']:.3f} ms per step, {result['steps']} steps)")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({
            "trace": str(traces[-1]), "jax": importlib.metadata.version("jax"),
            "date": datetime.date.today().isoformat(), **result}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
