"""Timing helpers shared by the kernel benchmarks (kernels.py, delta_kernels.py, fp8_fold_sweep.py): host-timed calls (`bench`),
device time per call as the slope between two chains of calls in one executable (`chained`, `device_time`), each
kernel's device time from a jax.profiler trace (`kernel_profile`) and two kernels interleaved under one clock
(`paired_profile`), the per-call figures by a --timing flag (`seconds_per_call`), and the copy and read-only
bandwidth ceilings measured in the same run. kernels.py's module docstring says how each method is used.
"""
from __future__ import annotations

import functools
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from device_trace import PALLAS_KIND, kernel_kind, kernels, load_events, newest_trace, union_us
from gpu_clocks import ClockSampler


def bench(fn, args, *, reps, inner, rounds=3):
    """Seconds per call: the best of `rounds` medians, each over `reps` samples of `inner` back-to-back
    calls. Best-of-rounds because a transient slowdown of the shared machine (seen once: one shape 30%
    slow in one run, normal on re-measurement) must not stand in for the kernel's speed; every kernel
    (ours, Triton, XLA, the copy) is timed the same way."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    medians = []
    for _ in range(rounds):
        samples = []
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(inner):
                out = fn(*args)
            jax.block_until_ready(out)
            samples.append((time.perf_counter() - t) / inner)
        medians.append(statistics.median(samples))
    return min(medians)


@functools.lru_cache(maxsize=None)    # one executable per (kernel, length): retraced only for new shapes
def chained(fn, calls: int):
    """One jitted function making `calls` back-to-back calls of fn(x, *rest) -> y, each call's first
    argument the previous call's output (y must have x's shape and dtype, as a decode kernel's output
    [B, Hq, D] has its q's). The data dependency is real, so XLA can neither drop a call nor merge two,
    and the calls run in order on the device inside one executable: one host dispatch for all of them."""
    def run(x, *rest):
        for _ in range(calls):
            x = fn(x, *rest)
        return x
    return jax.jit(run)


def device_time(fn, args, *, short, long, reps, rounds=3):
    """Device seconds per call of fn(*args) (args[0] is chained, see `chained`), without host dispatch:
    the time of one executable of `long` chained calls minus that of `short` chained calls, over
    long - short. The difference cancels what both pay once (the dispatch of the executable, the wake-up
    of block_until_ready), so what is left is the device time per call, launch gaps between kernels
    included, as a model step of many layers sees it. Also returned: `per_call_long`, the long chain's
    time / long (the slope's upper bound, a check on it). Each chain is timed with `bench` (inner 1)."""
    t_short = bench(chained(fn, short), args, reps=reps, inner=1, rounds=rounds)
    t_long = bench(chained(fn, long), args, reps=reps, inner=1, rounds=rounds)
    return dict(seconds=(t_long - t_short) / (long - short), per_call_long=t_long / long,
                short=short, long=long, t_short=t_short, t_long=t_long)


def kernel_profile(fn, args, *, calls: int) -> dict:
    """Device time per call of each kernel fn(*args) launches: one executable of `calls` chained calls (see
    `chained`), warmed, then run once under jax.profiler; each kernel's summed duration / calls. Returns
    {calls, kernels: {name: us per call}, pallas_us (the Pallas kernels' sum), busy_us (the union of every
    kernel's interval / calls: wrapper kernels included, launch gaps not), span_us (first start to last end /
    calls: gaps included)}. On a CPU backend the trace's XLA ops stand in for kernels."""
    on_gpu = jax.default_backend() == "gpu"
    events = traced_events(chained(fn, calls), args)
    return kernel_breakdown(kernels(events, "GPU" if on_gpu else "/host:CPU", xla_ops_only=not on_gpu), calls)


def traced_events(run, args) -> list[dict]:
    """The events of one call run(*args) under jax.profiler (perfetto), after one untraced call that compiles and
    warms it."""
    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run(*args))
        return load_events(newest_trace(d))


def kernel_breakdown(ks, calls: int) -> dict:
    """`kernel_profile`'s figures from device_trace Kernels of `calls` calls."""
    per_name: dict[str, float] = {}
    for k in ks:
        per_name[k.name] = per_name.get(k.name, 0.0) + k.us / calls
    span = (max(k.end_us for k in ks) - min(k.start_us for k in ks)) / calls if ks else 0.0
    return dict(calls=calls, kernels=dict(sorted(per_name.items(), key=lambda kv: -kv[1])),
                pallas_us=sum(us for n, us in per_name.items() if kernel_kind(n) == PALLAS_KIND),
                busy_us=union_us((k.start_us, k.end_us) for k in ks) / calls, span_us=span)


def paired_profile(base_fn, base_args, fn, args, *, calls: int) -> dict:
    """The Pallas kernel of fn(*args) against that of base_fn(*base_args) under the same conditions: one
    executable alternating them `calls` times (base, then fn on base's output, the pair chained as in
    `chained`), warmed, then run once under jax.profiler. The H200 runs at its power cap, so its clock, and with
    it two kernels timed minutes apart, can differ by several percent (BENCHMARKS.md, session 22); interleaved,
    both see the same clock. Each must launch exactly one Pallas kernel a call (the k-th Pallas kernel of the
    trace is base's for even k, fn's for odd k); fn's other kernels (its wrapper work) are those that start
    between its pair's base kernel and the next pair's. Returns {calls, base_pallas_us, pallas_us (medians over the
    pairs), x_pallas (the median of the pairs' ratios), busy_us (fn's kernels, wrapper included: median of
    their union a pair), x_busy (the median of busy / base's Pallas kernel)}; ValueError when the trace does
    not hold 2 * calls Pallas kernels. GPU only (the interpreter leaves no Pallas kernel in a trace)."""
    n_base = len(base_args) - 1

    def pair(x, *rest):
        y = base_fn(x, *rest[:n_base]).astype(x.dtype)
        return fn(y, *rest[n_base:]).astype(x.dtype)
    inputs = (args[0], *base_args[1:], *args[1:])
    return pair_breakdown(kernels(traced_events(chained(pair, calls), inputs), "GPU"), calls)


def pair_breakdown(ks, calls: int) -> dict:
    """`paired_profile`'s figures from device_trace Kernels of `calls` interleaved (base, fn) pairs."""
    ks = sorted(ks, key=lambda k: k.start_us)
    # A Pallas kernel of either side: the attention kernels' kind, or any Mosaic GPU kernel (a Pallas GEMM between
    # attention calls, attention_bound.py --between, is a matmul by kind).
    pallas = [k for k in ks if kernel_kind(k.name) == PALLAS_KIND or "mosaic_gpu" in k.name]
    if len(pallas) != 2 * calls:
        raise ValueError(f"paired_profile: {len(pallas)} Pallas kernels in the trace of {calls} pairs, want "
                         f"{2 * calls}: each side must launch exactly one")
    base, mine = pallas[0::2], pallas[1::2]
    busy = []
    for i, b in enumerate(base):
        stop = base[i + 1].start_us if i + 1 < calls else float("inf")
        # By start time only: a trace's timestamps may put the next kernel's start a little before the last one's
        # end (seen with the granule-scale delta kernel, session 23), which an end-before-start filter would drop.
        busy.append(union_us((k.start_us, k.end_us) for k in ks if k is not b and b.start_us <= k.start_us < stop))
    return dict(calls=calls, base_pallas_us=statistics.median(k.us for k in base),
                pallas_us=statistics.median(k.us for k in mine),
                x_pallas=statistics.median(m.us / b.us for m, b in zip(mine, base)),
                busy_us=statistics.median(busy), x_busy=statistics.median(u / b.us for u, b in zip(busy, base)))


def seconds_per_call(fn, args, a) -> tuple[float, dict]:
    """fn(*args)'s seconds per call by --timing (every mode's kernels): host (`bench`) or device (`device_time`,
    args[0] chained); with both, the headline is host's (what the tables and plots show). With
    --profile-kernels (device/both) also "profile": `kernel_profile` of the short chain. Where nvidia-smi exists,
    also "gpu_clocks": the SM clock, power and throttle reasons sampled while it was timed (`ClockSampler`): a
    kernel bound by the SMs follows the clock, which this H200's power cap sets, and one bound by HBM does not, so
    a ratio of the two moves with it.
    Returns (headline seconds, {method: figures})."""
    out = {}
    with ClockSampler() as clocks:
        if a.timing in ("host", "both"):
            out["host"] = dict(seconds=bench(fn, args, reps=a.reps, inner=a.inner, rounds=a.rounds))
        if a.timing in ("device", "both"):
            short, long = a.chain_lengths
            out["device"] = device_time(fn, args, short=short, long=long, reps=a.reps, rounds=a.rounds)
            if a.profile_kernels:
                out["profile"] = kernel_profile(fn, args, calls=short)
    if (summary := clocks.summary()) is not None:
        out["gpu_clocks"] = summary
    return out["host" if "host" in out else "device"]["seconds"], out


def copy_ceiling(nbytes, reps, rounds=3):
    """Bytes read + written per second by a large device-to-device copy: the best of a few
    elementwise copies (fp32 / bf16, 2 sizes), each one read + one write of every element."""
    variants = []
    for dtype, size in ((jnp.float32, nbytes), (jnp.float32, 2 * nbytes), (jnp.bfloat16, nbytes)):
        x = jnp.ones((size // jnp.dtype(dtype).itemsize,), dtype)
        f = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))   # not a no-op, so XLA can't elide it
        t = bench(f, (x,), reps=reps, inner=5, rounds=rounds)
        variants.append(dict(dtype=jnp.dtype(dtype).name, bytes=2 * x.nbytes, seconds=t, tbps=2 * x.nbytes / t / 1e12))
        del x
    best = max(variants, key=lambda v: v["tbps"])
    return dict(best, variants=variants)


def read_ceiling(nbytes, reps, rounds=3):
    """Bytes read per second by a large bf16 sum to one fp32 scalar: a read-only stream, the ceiling a
    decode-attention kernel (which reads K/V and writes almost nothing) can approach."""
    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    t = bench(f, (x,), reps=reps, inner=5, rounds=rounds)
    rec = dict(dtype="bfloat16", bytes=x.nbytes, seconds=t, tbps=x.nbytes / t / 1e12)
    del x
    return rec
