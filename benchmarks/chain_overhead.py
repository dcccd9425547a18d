"""What a chain of kernel calls in one executable costs beyond its kernels: the check behind kernels.py's "device"
timing (#12's bar is judged on it beside the traced kernels).

kernels.py's device time is the slope between two chains of calls (kernel_timing.device_time). Where that slope sits
above the traced kernel time although the trace shows the kernels back to back, either the GPU idles where the trace
does not show it, or the host does work a call before the GPU starts, which the executable's wall time pays and the
trace's GPU span does not (what it found: BENCHMARKS.md #12, session 39). This script separates the two, for the
bar's two kernels (B=64, Hq=32, Hkv=8, D=128, 4K keys, pages --page; ncu_fp8_attention.bar_inputs): for each chain
length N it times the executable (wall, best of medians as `bench`), then traces one run of each and reports the
GPU's span (first kernel start to last kernel end), the host's lead (the jitted call's start to the first kernel's
start), its tail (the call's return minus the last kernel's end: negative when the dispatch returns while the GPU
still runs, positive when the host finishes after the GPU), and the host events by summed time. Run it twice, once
as is and once with command buffers off (XLA_FLAGS=--xla_gpu_enable_command_buffer=), to see whether the per-call
excess goes with them:

    python benchmarks/chain_overhead.py --out /tmp/chain_default.json
    XLA_FLAGS=--xla_gpu_enable_command_buffer= python benchmarks/chain_overhead.py --out /tmp/chain_nocb.json

--interpret --small runs it at small shapes in the Mosaic GPU interpreter (CPU; the figures then mean nothing).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from device_trace import kernels, top_kernels, union_us  # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from kernel_timing import bench, chained, traced_events  # noqa: E402
from ncu_fp8_attention import bar_inputs, shapes  # noqa: E402
from pallas_kernels.paged_attention import paged_attention  # noqa: E402
from pallas_kernels.swapped_decode_attention import swapped_paged_attention  # noqa: E402


def traced_chain(run, args, device: str) -> dict:
    """One run of the jitted chain `run` under jax.profiler: the device kernels' span and busy time, the host
    events' lead before the first kernel and tail after the last, and the top host events (us summed)."""
    events = traced_events(run, args)
    device_ks = kernels(events, device, xla_ops_only=device != "GPU")
    host = kernels(events, "/host")
    if not device_ks or not host:
        raise ValueError(f"the trace holds {len(device_ks)} {device} and {len(host)} host events: nothing to compare")
    # The dispatch starts at the jitted function's host event (jax's C++ fast path names it PjitFunction(<fn>)).
    dispatch = [k for k in host if k.name.startswith("PjitFunction")] or host
    first, last = min(k.start_us for k in device_ks), max(k.end_us for k in device_ks)
    busy = union_us((k.start_us, k.end_us) for k in device_ks)
    return dict(kernels=len(device_ks), span_us=last - first, busy_us=busy,
                host_lead_us=first - min(k.start_us for k in dispatch),
                host_tail_us=max(k.end_us for k in dispatch) - last, top_host=top_kernels(host, 12))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="paged,fp8", help="paged (bf16) and/or fp8 (the swapped kernel on e4m3)")
    ap.add_argument("--page", default="16")
    ap.add_argument("--chains", default="8,40,80", help="chain lengths, each timed and traced")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--interpret", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        lengths = sorted({int(x) for x in a.chains.split(",")})
    except ValueError:
        ap.error(f"--chains must be comma-separated chain lengths, e.g. 8,40,80; got {a.chains!r}")
    if not lengths or lengths[0] < 1:
        ap.error(f"--chains: every length must be >= 1, got {a.chains!r}")
    names = a.kernels.split(",")
    if not names or set(names) - {"paged", "fp8"}:
        ap.error(f"--kernels must name paged and/or fp8, got {a.kernels!r}")
    s = shapes(a.small)
    B, Hq, Hkv, D, ctx = s["batch"], s["q_heads"], s["kv_heads"], s["head_dim"], s["context"]
    q, k8, v8, tables = bar_inputs(B, Hq, Hkv, D, ctx, a.page)
    calls = {
        "paged": (lambda x, *r: paged_attention(x, *r, interpret=a.interpret),
                  (q.astype(jnp.bfloat16), k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), *tables)),
        "fp8": (lambda x, *r: swapped_paged_attention(x, *r, max_context=ctx, interpret=a.interpret),
                (q, k8, v8, *tables)),
    }
    device = "GPU" if jax.default_backend() == "gpu" else "/host:CPU"
    result = dict(meta=dict(provenance("chain_overhead"), xla_flags=os.environ.get("XLA_FLAGS", ""), batch=B,
                            q_heads=Hq, kv_heads=Hkv, head_dim=D, context=ctx, page=a.page, reps=a.reps,
                            rounds=a.rounds),
                  kernels={})
    print(f"{'kernel':6} {'N':>4} {'wall/N us':>10} {'span/N us':>10} {'busy/N us':>10} {'excess/N':>9} "
          f"{'lead us':>9} {'tail us':>8}")
    for name in names:
        fn, args = calls[name]
        rows = []
        for n in lengths:
            run = chained(fn, n)
            wall = bench(run, args, reps=a.reps, inner=1, rounds=a.rounds)
            trace = traced_chain(run, args, device)
            row = dict(calls=n, wall_us=wall * 1e6, **trace)
            rows.append(row)
            print(f"{name:6} {n:4d} {row['wall_us'] / n:10.1f} {row['span_us'] / n:10.1f} {row['busy_us'] / n:10.1f} "
                  f"{(row['wall_us'] - row['span_us']) / n:9.1f} {row['host_lead_us']:9.1f} {row['host_tail_us']:8.1f}")
        for r0, r1 in zip(rows, rows[1:]):
            r1["slope_us"] = (r1["wall_us"] - r0["wall_us"]) / (r1["calls"] - r0["calls"])
            r1["span_slope_us"] = (r1["span_us"] - r0["span_us"]) / (r1["calls"] - r0["calls"])
            print(f"{name:6} slope {r0['calls']}->{r1['calls']}: wall {r1['slope_us']:.1f} us a call, "
                  f"GPU span {r1['span_slope_us']:.1f}")
        print(f"{name:6} top host events at N={rows[-1]['calls']}: " + "; ".join(
            f"{h['name'][:48]} {h['us']:.0f} us x{h['launches']}" for h in rows[-1]["top_host"][:6]))
        result["kernels"][name] = rows
    if a.out:
        save_json(a.out, result)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
