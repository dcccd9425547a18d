"""Splits a GPU profile of tensor-parallel decode steps into compute and communication time.

    python benchmarks/e2e_decode.py --model llama-8b --batch 1 --tensor-parallel 2 --attention kernel \
        --profile-dir /tmp/prof --profile-calls 5
    python benchmarks/tp_profile_split.py /tmp/prof --calls 5 --steps-per-call 8

Reads the newest perfetto_trace.json.gz under the directory (jax.profiler.trace(create_perfetto_trace=
True)). On each GPU ("/device:GPU:N" processes), kernel events whose name says collective (NCCL kernels,
XLA all-reduce / all-gather / reduce-scatter ops) count as communication, every other kernel as
compute. Prints, per GPU and per decode step, the milliseconds of each and the busy time (the union of
all kernel intervals: compute and communication may overlap on different streams).
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import sys

COMMUNICATION = re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|allgather|"
                           r"reduce-scatter|reduce_scatter|reducescatter|collective-permute|all-to-all", re.I)


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def split(events: list[dict]) -> dict[str, dict[str, float]]:
    """Trace events (Chrome trace format) -> {gpu process name: {"compute_us", "communication_us",
    "busy_us"}} over the complete ("X") events of each GPU process."""
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    out: dict[str, dict] = {}
    for e in events:
        name = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or "GPU" not in name:
            continue
        row = out.setdefault(name, {"compute_us": 0.0, "communication_us": 0.0, "intervals": []})
        kind = "communication_us" if COMMUNICATION.search(e.get("name", "")) else "compute_us"
        row[kind] += float(e.get("dur", 0.0))
        row["intervals"].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    return {k: {"compute_us": v["compute_us"], "communication_us": v["communication_us"],
                "busy_us": _union_us(v["intervals"])} for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile_dir")
    ap.add_argument("--calls", type=int, required=True, help="decode calls traced (--profile-calls)")
    ap.add_argument("--steps-per-call", type=int, required=True, help="decode steps per call (--decode-steps)")
    ap.add_argument("--out", default=None, help="also write the split as JSON here")
    args = ap.parse_args(argv)
    traces = sorted(pathlib.Path(args.profile_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        print(f"error: no perfetto_trace.json.gz under {args.profile_dir}", file=sys.stderr)
        return 2
    data = json.load(gzip.open(traces[-1]))
    result = split(data["traceEvents"] if isinstance(data, dict) else data)
    if not result:
        print(f"error: {traces[-1]} has no GPU kernel events", file=sys.stderr)
        return 2
    steps = args.calls * args.steps_per_call
    per_step = {gpu: {k.replace("_us", "_ms_per_step"): v / 1e3 / steps for k, v in row.items()}
                for gpu, row in sorted(result.items())}
    for gpu, row in per_step.items():
        print(f"{gpu}: compute {row['compute_ms_per_step']:.3f} ms, communication "
              f"{row['communication_ms_per_step']:.3f} ms, busy {row['busy_ms_per_step']:.3f} ms per step")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"trace": str(traces[-1]), "steps": steps,
                                                      "per_step": per_step}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
