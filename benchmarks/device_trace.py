"""Reading a jax.profiler trace: device kernel events, the host annotations around them, and what kind of
work each kernel is. Shared by profile_decode.py, tp_profile_split.py and mixed_step.py.

A trace taken with `jax.profiler.trace(dir, create_perfetto_trace=True)` leaves
`dir/plugins/profile/<run>/perfetto_trace.json.gz` (Chrome trace format: "M" metadata events name the
processes and threads, "X" events are complete intervals in µs) beside the `.xplane.pb` TensorBoard/XProf
open. Kernel names are the XLA fusion's name (`gemm_fusion_dot_1`, `loop_add_fusion_3`,
`input_scatter_fusion`), a library kernel's (cuBLAS: `nvjet_...`, `sm90_xmma_...`; NCCL: `ncclDevKernel_...`)
or a Pallas Mosaic GPU kernel's (`<function>_mosaic_gpu_kernel`).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import pathlib
import re

COMMUNICATION = re.compile(r"nccl|all-reduce|all_reduce|allreduce|all-gather|all_gather|allgather|"
                           r"reduce-scatter|reduce_scatter|reducescatter|collective-permute|all-to-all", re.I)
# Summary lines a converter may add to a device next to its streams: each repeats the kernels' time.
DERIVED_LINES = re.compile(r"^(XLA Modules|XLA Ops|Steps|Framework|TensorFlow|Source)", re.I)

# (kind, pattern over the kernel name), first match wins. Order matters: a collective is communication even
# when its name says "reduce"; a Triton GEMM fusion ("gemm_fusion_dot") is a matmul, not a fusion.
PALLAS_KIND = "attention kernel (Pallas)"
KERNEL_KINDS: tuple[tuple[str, re.Pattern], ...] = (
    ("communication", COMMUNICATION),
    # The attention kernels show up as `body_mosaic_gpu_kernel`; the projections' Pallas GEMMs as
    # `decode_matmul_{N}x{K}_mosaic_gpu_kernel` / `decode_gated_matmul_{N}x{K}_mosaic_gpu_kernel` (matmuls); the
    # fused q/k/v sum, RoPE and KV write as `rope_kv_write_mosaic_gpu_kernel` (a KV write); the residual add with its
    # norm as `residual_rmsnorm_mosaic_gpu_kernel` (a norm).
    (PALLAS_KIND, re.compile(r"^(?!.*(matmul|rope_kv_write|rmsnorm)).*(mosaic|pallas|paged_attention|delta_attention)",
                             re.I)),
    ("matmul", re.compile(r"nvjet|gemm|cutlass|cublas|xmma|matmul|dot", re.I)),
    ("KV write (scatter)", re.compile(r"scatter|rope_kv_write", re.I)),
    ("concatenate / copy", re.compile(r"concatenate|copy|memcpy|memset|transpose", re.I)),
    ("reductions (norms, sampling)", re.compile(r"reduce|argmax|sort|topk|top_k|rmsnorm", re.I)),
)
OTHER_KIND = "other fusions (RoPE, residual, activation)"
KINDS = tuple(k for k, _ in KERNEL_KINDS) + (OTHER_KIND,)


def kernel_kind(name: str) -> str:
    """The KINDS entry a kernel name belongs to."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), OTHER_KIND)


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    device: str          # the trace process, e.g. "/device:GPU:0"
    start_us: float
    end_us: float

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


def newest_trace(root: str | pathlib.Path) -> pathlib.Path:
    """The newest perfetto trace under `root`; FileNotFoundError names the directory and what to run."""
    traces = sorted(pathlib.Path(root).rglob("*perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    traces = traces or sorted(pathlib.Path(root).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {root}: trace with "
                                "jax.profiler.trace(dir, create_perfetto_trace=True)")
    return traces[-1]


def load_events(path: str | pathlib.Path) -> list[dict]:
    data = json.load(gzip.open(path))
    return data["traceEvents"] if isinstance(data, dict) else data


def union_us(intervals) -> float:
    """Total length of the union of [(start, end)] intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def annotation_windows(events: list[dict], name: str) -> list[tuple[float, float]]:
    """[(start_us, end_us)] of the complete ("X") events called `name` (the TraceAnnotations), in order."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                  if e.get("ph") == "X" and e.get("name") == name)


def _is_leaf_xla_op(args: dict) -> bool:
    op = str(args.get("hlo_op", ""))
    return bool(op) and not re.match(r"(while|conditional|call)(\.|$)", op)


def decode_call_spans(events: list[dict], window: dict, window_file: str) -> list[tuple[float, float]]:
    """The [(start_us, end_us)] of the traced decode calls a window file describes ({"annotation", "calls":
    [{"kind", "steps", ...}]}, written beside the trace by e2e_decode.py). ValueError when a traced call was
    not a decode call or the trace's annotations do not match the file's calls."""
    calls = window["calls"]
    if any(c["kind"] != "decode" for c in calls):
        raise ValueError(f"the traced calls were not all decode calls ({[c['kind'] for c in calls]}): trace "
                         "fewer calls than the run's decode calls, or decode more tokens")
    spans = annotation_windows(events, window["annotation"])
    if len(spans) != len(calls):
        raise ValueError(f"{len(spans)} {window['annotation']!r} annotations in the trace but {len(calls)} calls "
                         f"in {window_file}: the trace and the window file are from different runs")
    return spans


def kernels(events: list[dict], device: str = "GPU", windows: list[tuple[float, float]] | None = None,
            xla_ops_only: bool = False) -> list[Kernel]:
    """The complete events of every trace process whose name holds `device` (summary lines left out); with
    `windows` [(start_us, end_us)] (disjoint), only the part of each event inside them, one Kernel per part.
    xla_ops_only: only events the runtime tagged with their HLO op (args.hlo_op): on a CPU trace, where the
    host process holds Python and runtime events too, the XLA ops' executions."""
    names = {e["pid"]: str(e.get("args", {}).get("name", "")) for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): str(e.get("args", {}).get("name", "")) for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = []
    for e in events:
        process = names.get(e.get("pid"), "")
        if e.get("ph") != "X" or device not in process or DERIVED_LINES.match(threads.get((e["pid"], e.get("tid")), "")):
            continue
        # Control flow (while, conditional, call) is recorded around the ops it runs: count those only.
        if xla_ops_only and not _is_leaf_xla_op(e.get("args", {})):
            continue
        start = float(e["ts"])
        stop = start + float(e.get("dur", 0.0))
        parts = [(start, stop)] if windows is None else \
            [(max(start, a), min(stop, b)) for a, b in windows if min(stop, b) > max(start, a)]
        out += [Kernel(str(e.get("name", "")), process, a, b) for a, b in parts]
    return out


def by_kind_us(ks: list[Kernel]) -> dict[str, float]:
    """Summed kernel time per KINDS entry (every kind present, zero when none ran)."""
    out = dict.fromkeys(KINDS, 0.0)
    for k in ks:
        out[kernel_kind(k.name)] += k.us
    return out


def top_kernels(ks: list[Kernel], top: int = 20) -> list[dict]:
    """The `top` kernel names by summed time: [{"name", "kind", "us", "launches"}], largest first."""
    total: dict[str, list] = {}
    for k in ks:
        row = total.setdefault(k.name, [0.0, 0])
        row[0] += k.us
        row[1] += 1
    ranked = sorted(total.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": n, "kind": kernel_kind(n), "us": us, "launches": count} for n, (us, count) in ranked]
