"""Where a decode step's time goes: device time per decode step by kernel kind and by model part, the host
gap, and the byte floor, from a jax.profiler trace of N decode calls.

    python benchmarks/profile_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256 \
        --attention kernel --calls 5
    tensorboard --logdir profiles/decode_llama-1b_b64      # or: xprof --logdir ... (the trace it leaves)

Takes every flag of benchmarks/e2e_decode.py (model, batch, context, --decode-steps, --tensor-parallel, ...;
one --attention and one --kv-precision) and runs it: the timed pass gives the decode step's wall time with
no profiler, then --calls full-batch decode calls are traced, each drained inside its own annotation, around
the timed pass's median context (where its median step ran), so wall and busy read the same KV.
Per decode step it reports:
    wall          e2e_decode's median decode step (untraced, async scheduling as configured)
    GPU busy      the union of the device's kernel intervals inside the traced calls
    by kind       kernel names classified (device_trace.py KINDS: matmul, the Pallas attention kernel, KV
                  scatter, concatenate / copy, reductions, other fusions, communication)
    by part       each kernel's HLO op (trace arg hlo_op, else its name) looked up in the decode program's
                  optimized HLO, whose op_name metadata carries the model's named scopes (LM head, q/k/v, MLP,
                  attention, KV write, RoPE, norms, sampling); a cuBLAS kernel (its name says nothing of the
                  op) by its launches per step when one part has that many cuBLAS calls in the program; the
                  Pallas kernel and the KV scatters by their kind
    host gap      wall - busy
    byte floor    (weights + KV read + KV written) / the read ceiling (a large bf16 sum measured in this run),
                  counted by stratum_jax/step_work.py at the traced calls' mean context
and the top kernels with their launches per step. JSON: --out (default
benchmarks/results/profile_decode_<model>_b<batch>.json); the trace stays in --trace-dir.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
import statistics
import sys

import jax

import e2e_decode  # noqa: E402  (benchmarks/, this script's directory)
from device_trace import (Kernel, by_kind_us, decode_call_spans, kernel_kind, kernels,  # noqa: E402
                          load_events, newest_trace, top_kernels, union_us)
from stratum_jax.step_work import ModelWork

# (part, pattern over an op's op_name), first match wins; the scopes are set in stratum_jax/model/llama.py and
# stratum_jax/decode.py.
MODEL_PARTS: tuple[tuple[str, re.Pattern], ...] = (
    ("sampling", re.compile(r"/sampling/")),
    ("LM head", re.compile(r"/lm_head/")),
    ("attention", re.compile(r"/attention/")),
    ("KV write", re.compile(r"/kv_write/")),
    ("RoPE", re.compile(r"/rope/")),
    ("q/k/v projections", re.compile(r"/(qkv_proj|q_proj|k_proj|v_proj)/")),
    ("o projection", re.compile(r"/o_proj/")),
    ("MLP gate/up", re.compile(r"/(gate_up_proj|gate_proj|up_proj)/")),
    ("MLP down", re.compile(r"/down_proj/")),
    ("norms", re.compile(r"layernorm|/norm/")),
    ("MLP activation", re.compile(r"/mlp/")),
    ("embedding", re.compile(r"embed_tokens")),
)
UNKNOWN_PART = "other / unattributed"
PARTS = tuple(p for p, _ in MODEL_PARTS) + (UNKNOWN_PART,)
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]+)"', re.M)


def model_part(op_name: str | None) -> str:
    if not op_name:
        return UNKNOWN_PART
    return next((part for part, pattern in MODEL_PARTS if pattern.search(op_name)), UNKNOWN_PART)


def _key(name: str) -> str:
    """HLO instruction names use '.' and '-' where kernel names have '_' (fusion.3 -> fusion_3)."""
    return re.sub(r"[.\-]", "_", name)


def op_names(hlo_text: str) -> dict[str, str]:
    """{instruction name (and its kernel-name spelling): op_name} of every instruction with metadata, and
    {Pallas kernel name: op_name} where `mosaic_kernel_ops` can tell."""
    out: dict[str, str] = {}
    for name, op in _INSTRUCTION.findall(hlo_text):
        out.setdefault(name, op)
        out.setdefault(_key(name), op)
    for name, op in mosaic_kernel_ops(hlo_text).items():
        out.setdefault(name, op)
    return out


_MOSAIC_CALL = re.compile(r'^.*custom_call_target="mosaic_gpu[^"]*".*$', re.M)
_MOSAIC_SYMBOL = re.compile(r"\\00(\w+)_mosaic_gpu\\00")
_MOSAIC_DIALECTS = {"stable"}         # `stable_mosaic_gpu` is a dialect name in the module, not a kernel


def mosaic_kernel_ops(hlo_text: str) -> dict[str, str]:
    """{`<function>_mosaic_gpu_kernel`: op_name} for the Pallas Mosaic GPU kernels of a program. A trace names such
    a kernel after its function, not its HLO instruction (a custom call); the call's serialized module holds the
    function's symbol (`\\00<function>_mosaic_gpu\\00`) beside its op_name. A name whose calls belong to more than one
    model part is left out (the projections' GEMM names its shape, pallas_kernels/decode_matmul.py, so each
    projection's kernel has a name of its own)."""
    ops: dict[str, str] = {}
    parts: dict[str, set[str]] = {}
    for line in _MOSAIC_CALL.findall(hlo_text):
        op = re.search(r'op_name="([^"]+)"', line)
        symbols = {m for m in _MOSAIC_SYMBOL.findall(line) if m not in _MOSAIC_DIALECTS}
        if op is None or len(symbols) != 1:
            continue
        name = f"{symbols.pop()}_mosaic_gpu_kernel"
        ops.setdefault(name, op.group(1))
        parts.setdefault(name, set()).add(model_part(op.group(1)))
    return {name: op for name, op in ops.items() if len(parts[name]) == 1}


_LIBRARY_GEMM = re.compile(r'custom_call_target="__cublas[^"]*".*?op_name="([^"]+)"')
# Kernel kinds whose part is known from the kind alone, when the HLO lookup finds nothing.
PART_OF_KIND = {"attention kernel (Pallas)": "attention", "KV write (scatter)": "KV write"}


def library_gemm_parts(hlo_text: str) -> dict[int, set[str]]:
    """{n: the parts that have n library (cuBLAS) GEMM calls in the program}. A decode step runs the loop
    body once, so a part with n such calls there launches n library kernels per step; a kernel whose
    launches per step match exactly one part is that part's (cuBLAS kernel names say nothing of the op)."""
    counts: dict[str, int] = {}
    for op in _LIBRARY_GEMM.findall(hlo_text):
        counts[model_part(op)] = counts.get(model_part(op), 0) + 1
    out: dict[int, set[str]] = {}
    for part, n in counts.items():
        out.setdefault(n, set()).add(part)
    return out


def kernel_op(event_args: dict, name: str, ops: dict[str, str]) -> str | None:
    """The op_name of a kernel: through its trace args' hlo_op when the profiler recorded one, else its name."""
    for candidate in (event_args.get("hlo_op"), name):
        if candidate and (candidate in ops or _key(candidate) in ops):
            return ops.get(candidate) or ops.get(_key(candidate))
    return None


def analyse(events: list[dict], window: dict, hlo_text: str, device: str = "GPU") -> dict:
    """Per decode step device time of the traced calls: busy, by kind, by part, and the top kernels.
    ValueError when the window does not fit the trace or no device kernel ran inside it."""
    calls = window["calls"]
    spans = decode_call_spans(events, window, e2e_decode.WINDOW_FILE)
    # A host "device" (a CPU run) also holds Python and runtime events: only its XLA ops count there.
    ks = kernels(events, device, spans, xla_ops_only=device.lower().startswith("/host"))
    if not ks:
        raise ValueError(f"no {device} kernel events inside the decode calls' annotations")
    steps = sum(c["steps"] for c in calls)
    ops = op_names(hlo_text)
    args_of = {(str(e.get("name", "")), float(e["ts"])): e.get("args", {}) for e in events if e.get("ph") == "X"}
    launches: dict[str, int] = {}
    for k in ks:
        launches[k.name] = launches.get(k.name, 0) + 1
    by_count = library_gemm_parts(hlo_text)
    part_of_name: dict[str, str] = {}
    for k in ks:
        if k.name in part_of_name:
            continue
        # A kernel cut by a window edge starts at the window, not at its event: then only the name is looked up.
        part = model_part(kernel_op(args_of.get((k.name, k.start_us), {}), k.name, ops))
        if part == UNKNOWN_PART:
            kind = kernel_kind(k.name)
            candidates = by_count.get(round(launches[k.name] / steps), set()) if kind == "matmul" else set()
            part = PART_OF_KIND.get(kind) or (next(iter(candidates)) if len(candidates) == 1 else UNKNOWN_PART)
        part_of_name[k.name] = part
    parts = dict.fromkeys(PARTS, 0.0)
    unattributed_launches = 0
    for k in ks:
        parts[part_of_name[k.name]] += k.us
        unattributed_launches += part_of_name[k.name] == UNKNOWN_PART
    ms = 1e-3 / steps
    top = top_kernels(ks, top=25)
    handoffs = kernel_handoffs_us([dataclasses.replace(k, name=part_of_name[k.name]) for k in ks], spans)
    return {
        "steps": steps, "calls": len(calls),
        "mean_context": statistics.fmean(c.get("mean_context", 0.0) for c in calls),
        "busy_ms": union_us([(k.start_us, k.end_us) for k in ks]) * ms,
        "kernel_ms": sum(k.us for k in ks) * ms,
        "by_kind_ms": {kind: us * ms for kind, us in by_kind_us(ks).items()},
        "by_part_ms": {part: us * ms for part, us in parts.items()},
        "attributed_share": 1 - parts[UNKNOWN_PART] / max(sum(parts.values()), 1e-9),
        # The same by kernel launches: fixed by the program and the window, not by how long each kernel took.
        "attributed_launch_share": 1 - unattributed_launches / len(ks),
        "top_kernels": [{"name": t["name"], "kind": t["kind"], "part": part_of_name.get(t["name"], UNKNOWN_PART),
                         "ms_per_step": t["us"] * ms, "launches_per_step": t["launches"] / steps} for t in top],
        "handoffs_us": handoffs,
    }


def kernel_handoffs_us(ks: list[Kernel], windows: list[tuple[float, float]] | None = None) -> dict[str, dict]:
    """Between each kernel and the next one to start on its device inside the same window (a traced call): the next
    one's start minus this one's end, in us (negative where they overlap, as a programmatic dependent launch
    allows), per "this -> next" pair of kernel names: {"mean_us", "count"}, most frequent pair first. A kernel cut
    by a window edge counts as cut."""
    def window_of(k: Kernel) -> int:
        return next((i for i, (a, b) in enumerate(windows or ()) if a <= k.start_us < b), -1)

    by_device: dict[tuple[str, int], list[Kernel]] = {}
    for k in ks:
        by_device.setdefault((k.device, window_of(k)), []).append(k)
    gaps: dict[str, list[float]] = {}
    for device_ks in by_device.values():
        device_ks.sort(key=lambda k: k.start_us)
        for a, b in zip(device_ks, device_ks[1:]):
            gaps.setdefault(f"{a.name} -> {b.name}", []).append(b.start_us - a.end_us)
    ranked = sorted(gaps.items(), key=lambda kv: -len(kv[1]))
    return {pair: {"mean_us": statistics.fmean(g), "count": len(g)} for pair, g in ranked}


def byte_floor_ms(run: dict, cfg, mean_context: float, read_bytes_per_s: float, dtype_bytes: int) -> dict:
    """The decode step's counted bytes at mean_context and their time at the read ceiling."""
    work = ModelWork.of(cfg, run["weight_bytes"], run["kv_bytes_per_token"], dtype_bytes)
    step = work.step([round(mean_context) + 1] * run["batch"])
    return {"bytes_per_step": step.bytes_moved, "flops_per_step": step.flops,
            "byte_floor_ms": step.bytes_moved / read_bytes_per_s * 1e3}


def print_table(result: dict) -> None:
    p = result["profile"]
    rows = [("wall time per step (e2e, no profiler)", result["wall_ms"]), ("GPU busy", p["busy_ms"])]
    rows += [(f"  {k}", v) for k, v in p["by_kind_ms"].items() if v > 0]
    rows += [("host gap (wall - busy)", result["host_gap_ms"]),
             (f"byte floor ({result['bytes_per_step'] / 1e9:.2f} GB / {result['read_tbps']:.2f} TB/s)",
              result["byte_floor_ms"])]
    print(f"\n{result['model']} batch {result['batch']}, context ~{p['mean_context']:.0f}, "
          f"{p['steps']} traced decode steps ({p['calls']} calls)")
    print(f"{'per decode step':48} {'ms':>8}")
    for name, v in rows:
        print(f"{name:48} {v:8.3f}")
    print(f"host gap {result['host_gap_ms'] / result['wall_ms']:.1%} of the step; step = "
          f"{result['wall_ms'] / result['byte_floor_ms']:.2f}x its byte floor")
    print(f"\nby model part ({p['attributed_share']:.0%} of kernel time attributed through the HLO)")
    for part, v in sorted(p["by_part_ms"].items(), key=lambda kv: -kv[1]):
        if v > 0:
            print(f"  {part:46} {v:8.3f}")
    handoffs = p.get("handoffs_us", {})
    if handoffs:
        print(f"\n{'kernel handoffs (next start - this end; < 0: overlap)':78} {'us':>7} {'count':>6}")
        for pair, h in list(handoffs.items())[:12]:
            print(f"  {pair[:76]:76} {h['mean_us']:7.2f} {h['count']:6d}")
    print(f"\n{'top kernels':60} {'ms/step':>8} {'launches':>8}  kind / part")
    for t in p["top_kernels"][:15]:
        print(f"  {t['name'][:58]:58} {t['ms_per_step']:8.3f} {t['launches_per_step']:8.2f}  {t['kind']} / {t['part']}")


def main(argv=None) -> int:
    ap = e2e_decode.build_parser(__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5, help="decode calls traced (each --decode-steps steps)")
    ap.add_argument("--trace-dir", default=None, help="where the trace goes (default profiles/decode_<model>_b<batch>)")
    ap.add_argument("--device", default="GPU", help="trace processes whose name holds this count as the device "
                    "('/host:CPU' for a CPU dry run, where host events count too)")
    args = ap.parse_args(argv)
    if len(args.attention) != 1 or len(args.kv_precision) != 1:
        ap.error("profile one configuration: give one --attention and one --kv-precision")
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    args.profile_dir = args.trace_dir or f"profiles/decode_{args.model}_b{args.batch}"
    args.profile_calls = args.calls
    model, copy_bw = e2e_decode.load(args)
    read_bw = args.peaks.read_bytes_per_s       # measured by e2e_decode.load, summed over the devices
    run = e2e_decode.run_one(model, args, args.attention[0], copy_bw, args.kv_precision[0])
    root = pathlib.Path(args.profile_dir)
    try:
        trace = newest_trace(root)
        window = json.loads((root / e2e_decode.WINDOW_FILE).read_text())
        profile = analyse(load_events(trace), window, (root / e2e_decode.HLO_FILE).read_text(), args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = model.config
    floor = byte_floor_ms(run, cfg, profile["mean_context"], read_bw, jax.numpy.dtype(cfg.dtype).itemsize)
    wall = run["decode_step_ms_median"]
    result = {
        "benchmark": "profile_decode", "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len,
        "attention": run["attention_backend"], "kv_precision": run["kv_precision"],
        "decode_steps_per_call": args.decode_steps, "tensor_parallel": args.tensor_parallel,
        "device": run["device"], "jax": jax.__version__, "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/profile_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trace": str(trace), "read_tbps": read_bw / 1e12, "copy_tbps": copy_bw / 1e12,
        "wall_ms": wall, "host_gap_ms": wall - profile["busy_ms"], **floor, "profile": profile, "e2e": run,
    }
    print_table(result)
    out = pathlib.Path(args.out or f"benchmarks/results/profile_decode_{args.model}_b{args.batch}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}; trace in {root} (tensorboard --logdir {root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
