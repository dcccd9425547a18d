"""Paged decode attention kernel benchmark: this repo's Mosaic GPU kernel vs jax's Triton paged
attention vs XLA dense decode attention, beside a measured device-to-device copy ceiling.

    python benchmarks/kernels.py                       # H200 shapes: B=64, Hq=32, Hkv=8, D=128
    python benchmarks/kernels.py --contexts 4096 --pages 16,64 --out /tmp/k.json
    python benchmarks/kernels.py --dry-run             # tiny shapes, Mosaic GPU interpreter, on CPU
    python benchmarks/kernels.py --delta               # delta-KV kernel (fp16/fp8 deltas) vs the paged kernel
    python benchmarks/kernels.py --delta-prefill       # delta prefill kernel vs paged_prefill_attention, 4K/16K

For each context (1K/4K/16K) and page size (8..256, plus a batch mixing all sizes) it
  - checks every kernel's output against XLA dense attention on the same tokens (fp32),
  - times a sweep of TuningConfigs and keeps the best,
  - times jax's Triton `paged_attention` (a few configs, best kept) and XLA dense attention.
Bandwidth counts the bytes a decode step must move: the K and V of every live token once, plus q
and the output. Before the sweep, small ragged cases (every page size, GQA 1/4/8, D 64/128, soft cap,
split-K, NaN in free slots, zero-length rows) are checked against float64 numpy.

Timing (`--timing`, default `host`, which the published figures used; `both` with --delta):
  - host: 3 warm-up calls, then the best of `--rounds` medians, each over `--reps` samples of `--inner`
    back-to-back calls of one jitted kernel, closed by block_until_ready. Each call is one host dispatch,
    so a short kernel's figure includes what the host adds per call (a call with every length 0 took
    45-62 us this way on the H200), which a model step of many layers in one executable does not pay.
  - device: the kernel's device time. One executable chains `--chain` short/long (default 8 and 40)
    calls, each call's q the previous call's output (a data dependency XLA cannot fold away); each chain
    is timed as above with one call per sample, and the per-call time is the difference of the two
    chains' times over the difference of their lengths, which cancels the one dispatch and the final
    sync. `per_call_long` (the long chain's time / its length) is kept beside it as a check.
  - both: each method; the table and plot use host's figures, the JSON has both under "timing".
  `--profile-kernels` (with device/both) also traces one executable of the short chain with jax.profiler and
  keeps each kernel's device time per call ("timing" -> "profile": every launched kernel by name, the Pallas
  kernels' sum, the busy time): what a timed call's wrapper work (q prep, split-K merge, the fold's scale and
  anchor) costs beside the Pallas kernel itself. --delta then also profiles each delta run interleaved with the
  paged kernel in one executable (`paired_profile`: both under the same clock, which the H200 at its power cap
  moves between runs) and judges #12's bars a third way, on the Pallas kernels alone.
The inputs are far larger than L2 (268 MB of K/V at 1K context, D=128, against 50 MB), so no rotation
is needed. A read ceiling (a large bf16 sum) and a copy ceiling are measured in the same run.
Writes the full JSON (`--out`) and a PNG (bandwidth vs page size per context) next to it. `--configs`
times given TuningConfigs instead of the sweep; `--head-dim 64` is llama-1b's decode shape.

`--kernels paged,swapped` also times the swapped-operand kernel (pallas_kernels/swapped_decode_attention.py:
keys on WGMMA's M, the GQA group on N) at the same shapes, page layouts and timing, with `--swapped-configs`
(SwappedConfig overrides of `default_swapped_config(head_dim)`, ';'-separated; default: that config). Each
record in "ours" names its kernel; a shape's "best" stays the paged kernel's (what the table and plot show),
"best_by_kernel" has each kernel's, and a swapped-vs-paged table (time ratio, % of the read ceiling) is
printed at the end. `--kernels swapped` times only the swapped kernel.

`--delta` and `--delta-prefill` time the delta-KV kernels instead (#12's bars): benchmarks/delta_kernels.py, whose
docstring says what they measure and write.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import sys
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from config_flags import parse_overrides       # noqa: E402  (beside this script)
from kernel_timing import copy_ceiling, read_ceiling, seconds_per_call   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from paged_layout import MIXED, batch_page_sizes, dense_from_pages, page_layout, xla_decode_attention   # noqa: E402
from delta_kernels import run_delta, run_delta_prefill   # noqa: E402  (beside this script)
from pallas_kernels.testing import float64_attention, random_paged_case   # noqa: E402
from pallas_kernels.paged_attention import (   # noqa: E402
    TuningConfig, default_config, paged_attention)
from pallas_kernels.swapped_decode_attention import (   # noqa: E402
    SwappedConfig, default_swapped_config, swapped_paged_attention)

KERNELS = ("paged", "swapped")     # --kernels: the decode kernels this benchmark can time side by side


# ---------------------------------------------------------------------------------------------
# Flags (timing itself: kernel_timing.py)
# ---------------------------------------------------------------------------------------------

def parse_configs(spec: str, head_dim: int) -> list[TuningConfig]:
    """`--configs`: TuningConfigs separated by ';', each 'default' (what the kernel runs with no config at
    this head_dim, `default_config`) or comma-separated field=value overrides of it, e.g.
    'default;block_kv=128;num_stages=3,num_splits=2'."""
    return parse_overrides(spec, default_config(head_dim))


def parse_swapped_configs(spec: str, head_dim: int, max_context: int | None = None) -> list[SwappedConfig]:
    """`--swapped-configs`: SwappedConfigs as `parse_configs` writes TuningConfigs, overriding
    `default_swapped_config(head_dim, max_context)`, e.g. 'default;block_kv=64,num_stages=3'. A shape's
    context is its rows' longest, so max_context = the context gives the config an engine bounded by it
    (--max-context) would run: at head_dim 64 the short-context tile up to SHORT_CONTEXT_KEYS."""
    return parse_overrides(spec, default_swapped_config(head_dim, max_context))


def parse_kernels(spec: str) -> tuple[str, ...]:
    """`--kernels`: comma-separated names from KERNELS, in the given order, at least one."""
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    bad = [n for n in names if n not in KERNELS]
    if bad or not names:
        raise SystemExit(f"--kernels: {spec!r}: give one or more of {', '.join(KERNELS)}")
    return names


KERNEL_FNS = {"paged": paged_attention, "swapped": swapped_paged_attention}


# ---------------------------------------------------------------------------------------------
# Small float64 correctness checks (every page size, GQA, D, soft cap, split, NaN slots)
# ---------------------------------------------------------------------------------------------

def run_checks(configs, *, interpret, kernel="paged"):
    """The small float64 checks of `configs` of one kernel (KERNEL_FNS name); the swapped kernel has no
    soft cap, so its cases skip that one. Each record names its kernel."""
    lengths = [1, 15, 33, 65, 127, 300, 0, 1000]
    sizes = [8, 16, 32, 64, 128, 256, 8, 32]
    cases = [dict(Hq=32, Hkv=8, D=128), dict(Hq=8, Hkv=8, D=128), dict(Hq=16, Hkv=2, D=64),
             dict(Hq=32, Hkv=8, D=128, soft_cap=20.0)]
    if interpret:
        lengths, sizes = [1, 65, 0, 300], [8, 64, 8, 256]
        cases = [dict(Hq=4, Hkv=1, D=64)]
    if kernel != "paged":
        cases = [c for c in cases if "soft_cap" not in c]
    fn = KERNEL_FNS[kernel]
    results = []
    for seed, case in enumerate(cases):
        inputs = random_paged_case(seed, lengths=lengths, page_sizes=sizes, num_q_heads=case["Hq"],
                                   num_kv_heads=case["Hkv"], head_dim=case["D"])
        want = float64_attention(inputs, soft_cap=case.get("soft_cap"))
        for cfg in configs:
            rec = dict(kernel=kernel, case=case, config=dataclasses.asdict(cfg))
            try:
                cap = {"soft_cap": case["soft_cap"]} if "soft_cap" in case else {}
                out = fn(**inputs, **cap, config=cfg, interpret=interpret)
                out = np.asarray(out.astype(jnp.float32))
                rec.update(max_abs_err=float(np.abs(out - want).max()), has_nan=bool(np.isnan(out).any()))
                rec["ok"] = rec["max_abs_err"] <= 2e-2 and not rec["has_nan"]
            except Exception as e:  # noqa: BLE001 - one failing config must not kill the run
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            results.append(rec)
            print(f"check {kernel} {case} {cfg}: {'OK' if rec['ok'] else 'FAIL'} "
                  f"{rec.get('max_abs_err', rec.get('error'))}", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# Triton baseline
# ---------------------------------------------------------------------------------------------

JAX_TRITON_DEFAULTS = dict(block_h=16, pages_per_compute_block=8, k_splits=16, num_warps=8, num_stages=2)


def triton_default_config(pages_per_seq):
    """jax's own defaults for `paged_attention` (what a user gets with no tuning; the brief's 1.64 TB/s
    figure), with k_splits lowered to the largest divisor of the page count where 16 does not divide it."""
    cfg = dict(JAX_TRITON_DEFAULTS)
    k = cfg["k_splits"]
    while pages_per_seq % k:
        k //= 2
    cfg["k_splits"] = k
    return cfg


def triton_configs(pages_per_seq, page):
    """jax's default config first, then a few tuned ones (k_splits must divide the pages). The best
    correct one is `triton_best`; the default is `triton_default`."""
    out = [dict(triton_default_config(pages_per_seq), default=True)]
    for k_splits in (1, 4, 16):
        if pages_per_seq % k_splits:
            continue
        ppp = pages_per_seq // k_splits
        for block_tokens in (128,):
            ppcb = max(1, min(ppp, block_tokens // page))
            if ppp % ppcb == 0 and (k_splits, ppcb) not in [(c["k_splits"], c["pages_per_compute_block"]) for c in out[1:]]:
                out.append(dict(k_splits=k_splits, pages_per_compute_block=ppcb, block_h=16,
                                num_warps=4, num_stages=2))
    return out


def make_triton(args_np):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from jax.experimental.pallas.ops.gpu import paged_attention as triton_pa
        return triton_pa.paged_attention
    except Exception as e:  # noqa: BLE001
        print(f"Triton paged_attention unavailable: {type(e).__name__}: {e}", flush=True)
        return None


# ---------------------------------------------------------------------------------------------
# Main sweep
# ---------------------------------------------------------------------------------------------

def sweep_configs(head_dim, table_width, quick, short=False):
    C = functools.partial(TuningConfig, num_splits=1, no_auto_barriers=False)
    if short:       # the configs that won or came close in the full sweep
        cands = [C(num_stages=2), C(num_stages=2, no_auto_barriers=True), C(num_stages=3, no_auto_barriers=True),
                 C(block_kv=128, num_stages=2, no_auto_barriers=True)]
    else:
        cands = [C(num_stages=2), C(num_stages=3), C(num_stages=4), C(num_stages=2, no_auto_barriers=True),
                 C(num_stages=4, no_auto_barriers=True), C(num_stages=2, num_splits=2, no_auto_barriers=True),
                 C(block_kv=128, num_stages=2, no_auto_barriers=True)]
    if quick:
        cands = cands[:2]
    # Keep what fits in 227 KB of SMEM (the lowering would refuse the rest anyway).
    return [c for c in cands if c.smem_bytes(head_dim, table_width) <= 227 * 1024]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--pages", default="8,16,32,64,128,256,mixed")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds per kernel; the best median is kept")
    ap.add_argument("--quick", action="store_true", help="two kernel configs only")
    ap.add_argument("--no-check", action="store_true", help="skip the small float64 checks")
    ap.add_argument("--no-triton", action="store_true")
    ap.add_argument("--triton-only", action="store_true", help="time only jax's Triton kernel")
    ap.add_argument("--short-sweep", action="store_true", help="the 4 configs that won the full sweep")
    ap.add_argument("--default-only", action="store_true",
                    help="time only default_config(head_dim) (what the engine runs), no sweep")
    ap.add_argument("--configs", default=None,
                    help="time these TuningConfigs instead of a sweep: ';'-separated, each 'default' or "
                         "field=value overrides, e.g. 'default;block_kv=128;num_stages=3,num_splits=2'")
    ap.add_argument("--kernels", default="paged",
                    help="comma-separated decode kernels to time side by side: paged (paged_attention, its configs "
                         "from --configs/--default-only/the sweep) and/or swapped (swapped_paged_attention)")
    ap.add_argument("--swapped-configs", default="default",
                    help="with --kernels ...swapped: SwappedConfigs, ';'-separated, each 'default' "
                         "(default_swapped_config(head_dim)) or field=value overrides, e.g. "
                         "'default;block_kv=64,num_stages=3'")
    ap.add_argument("--timing", default=None, choices=["host", "device", "both"],
                    help="host: one kernel per jitted call (the published figures; the default, except --delta's: "
                         "both, since its bars are judged on device time); device: chains of kernel calls in one "
                         "executable, dispatch cancelled (see the module docstring)")
    ap.add_argument("--chain", default="8,40", help="with --timing device/both: the short and long chain lengths")
    ap.add_argument("--profile-kernels", action="store_true",
                    help="with --timing device/both: also each launched kernel's device time per call, from a "
                         "jax.profiler trace of the short chain (the Pallas kernel apart from its wrapper's work)")
    ap.add_argument("--no-xla", action="store_true", help="skip XLA dense attention")
    ap.add_argument("--check-configs", default="default", choices=["default", "all"])
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in the Mosaic GPU interpreter (CPU)")
    ap.add_argument("--delta", action="store_true", help="the delta-KV kernel vs the paged kernel (see above)")
    ap.add_argument("--delta-prefill", action="store_true",
                    help="the delta prefill kernel vs paged_prefill_attention (see above)")
    ap.add_argument("--prefill-batch", type=int, default=8, help="with --delta-prefill: sequences")
    ap.add_argument("--prefill-tokens", type=int, default=512,
                    help="with --delta-prefill: query tokens per sequence (its last positions)")
    ap.add_argument("--precisions", default="fp16-delta,fp8-delta", help="with --delta")
    ap.add_argument("--anchor-lens", default="1,256", help="with --delta: 1 (mean) and/or multiples of 256")
    ap.add_argument("--bars-only", action="store_true",
                    help="with --delta: only what #12's bars count (implies --quick): at 4K and more the engine's "
                         "decode paths, not the fold's per-head-scale variant; below 4K the bf16 "
                         "kernels alone on every page size (their >= 80%% of the read ceiling bar)")
    ap.add_argument("--fold-configs", default="",
                    help="with --delta: ';'-separated SwappedConfig overrides (field=value,...) of the fold's default "
                         "config, each also timed on the engine's fold path and shown, not counted for the bars")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_h200.json, "
                                                "or delta_kernels_h200.json with --delta)")
    a = ap.parse_args(argv)
    if a.timing is None:     # the interpreter's dry run stays host-timed: chains of interpreted calls take minutes
        a.timing = "both" if a.delta and not a.dry_run else "host"
    try:
        chain_short, chain_long = (int(x) for x in a.chain.split(","))
    except ValueError:
        chain_short = chain_long = 0
    if not 1 <= chain_short < chain_long:
        ap.error(f"--chain must be two lengths short,long with 1 <= short < long (e.g. 8,40), got {a.chain!r}")
    if a.profile_kernels and a.timing == "host":
        ap.error("--profile-kernels traces the device chains: give --timing device or both")
    a.chain_lengths = (chain_short, chain_long)
    if a.out is None:
        name = ("delta_prefill_kernels_h200.json" if a.delta_prefill else
                "delta_kernels_h200.json" if a.delta else "kernels_h200.json")
        a.out = str(ROOT / "benchmarks/results" / name)
    if a.delta_prefill:
        if a.contexts == ap.get_default("contexts"):
            a.contexts = "4096,16384"
        return run_delta_prefill(a)
    if a.bars_only and not a.delta:
        ap.error("--bars-only is a --delta option (#12's bars): add --delta")
    if a.delta:
        a.quick = a.quick or a.bars_only
        return run_delta(a)

    interpret = a.dry_run
    kernel_names = parse_kernels(a.kernels)
    if a.dry_run:
        a.batch, a.q_heads, a.kv_heads, a.head_dim = 2, 4, 1, 64
        a.contexts, a.reps, a.inner, a.quick, a.no_triton = "512", 1, 1, True, True
    swapped_cfgs = parse_swapped_configs(a.swapped_configs, a.head_dim) if "swapped" in kernel_names else []
    contexts = [int(c) for c in a.contexts.split(",")]
    pages = [p if p == MIXED else int(p) for p in a.pages.split(",")]
    dev = jax.devices()[0]
    meta = dict(provenance("kernels"), platform=dev.platform, batch=a.batch, q_heads=a.q_heads,
                kv_heads=a.kv_heads, head_dim=a.head_dim, reps=a.reps, inner=a.inner, rounds=a.rounds,
                dry_run=a.dry_run, timing=a.timing, chain=a.chain, kernels=list(kernel_names))
    print(json.dumps(meta), flush=True)
    out_path = pathlib.Path(a.out)
    result = dict(meta=meta, checks=[], copy=None, shapes=[])

    def save():
        save_json(out_path, result)

    if not a.no_check:
        check_cfgs = [TuningConfig(num_splits=1), TuningConfig(block_kv=128, num_stages=2, num_splits=2),
                      TuningConfig(num_stages=2, num_splits=3, p_via_smem=True),
                      TuningConfig(num_stages=4, num_splits=1, no_auto_barriers=True)]
        if a.check_configs == "default":
            check_cfgs = [TuningConfig(num_splits=1), TuningConfig()]   # the default: auto split
        result["checks"] = run_checks(check_cfgs, interpret=interpret) if "paged" in kernel_names else []
        if swapped_cfgs:    # unsplit, and with the grid's split (the check batch of 8 picks split-K)
            first = swapped_cfgs[0]
            checked = [dataclasses.replace(first, num_splits=1), dataclasses.replace(first, num_splits=None)]
            result["checks"] += run_checks(checked, interpret=interpret, kernel="swapped")
        save()

    copy = copy_ceiling(64 << 20 if a.dry_run else 2 << 30, reps=a.reps, rounds=a.rounds)
    result["copy"] = copy
    read = result["read"] = read_ceiling(64 << 20 if a.dry_run else 4 << 30, reps=a.reps, rounds=a.rounds)
    print(f"copy ceiling: {copy['tbps']:.3f} TB/s; read ceiling (bf16 sum): {read['tbps']:.3f} TB/s", flush=True)
    save()
    timings = ("host", "device") if a.timing == "both" else (a.timing,)

    def timed(fn, args):
        """{timing: metrics} for fn(*args) by each --timing method (seconds per call)."""
        return seconds_per_call(fn, args, a)[1]

    B, Hq, Hkv, D = a.batch, a.q_heads, a.kv_heads, a.head_dim
    scale = 1.0 / math.sqrt(D)
    triton = None if a.no_triton else make_triton(None)
    rng = np.random.default_rng(1)
    key = jax.random.key(0)
    # One jit per config for the whole run: the page size is data, so every page layout of a context
    # reuses one compiled kernel (and one pair of device-timing chains).
    ours_jits = {}
    for ctx in contexts:
        table_width = ctx // 8          # the engine's table width: enough for the smallest page
        num_slots = B * ctx
        k1, k2, k3, key = jax.random.split(key, 4)
        k_pool = jax.random.normal(k1, (Hkv, num_slots, D), jnp.bfloat16)
        v_pool = jax.random.normal(k2, (Hkv, num_slots, D), jnp.bfloat16)
        q = jax.random.normal(k3, (B, Hq, D), jnp.bfloat16)
        lengths = jnp.full((B,), ctx, jnp.int32)
        kv_bytes = 2 * B * Hkv * ctx * D * 2
        io_bytes = kv_bytes + 2 * q.nbytes
        configs = [] if a.triton_only or "paged" not in kernel_names else (
            parse_configs(a.configs, D) if a.configs else
            [default_config(D)] if a.default_only else sweep_configs(D, table_width, a.quick, a.short_sweep))
        # (kernel name, config) pairs, the paged kernel's first; ours_jits is keyed by the pair.
        ctx_swapped = parse_swapped_configs(a.swapped_configs, D, max_context=ctx) if swapped_cfgs else []
        runs = [("paged", c) for c in configs] + ([] if a.triton_only else [("swapped", c) for c in ctx_swapped])
        xla_time = None
        for page in pages:
            sizes = batch_page_sizes(B, page)
            starts_np, _ = page_layout(rng, B, ctx, sizes, table_width)
            starts = jnp.asarray(starts_np)
            psz = jnp.asarray(sizes, jnp.int32)
            kd = dense_from_pages(k_pool, starts_np, sizes, ctx)
            vd = dense_from_pages(v_pool, starts_np, sizes, ctx)
            ref = np.asarray(xla_decode_attention(q.astype(jnp.float32), kd.astype(jnp.float32),
                                                  vd.astype(jnp.float32), lengths, scale=scale))
            rec = dict(context=ctx, page=page, kv_bytes=kv_bytes, io_bytes=io_bytes, ours=[], triton=[])

            def metrics(times):
                """The first --timing method's figures at top level (what the table and plot read), every
                method's under "timing"."""
                for method in timings:      # times also holds "profile" and "gpu_clocks", which carry no seconds
                    rec_t = times[method]
                    t = rec_t["seconds"]
                    rec_t.update(ms=t * 1e3, tbps=io_bytes / t / 1e12, pct_copy=100 * io_bytes / t / 1e12 / copy["tbps"],
                                 pct_read=100 * io_bytes / t / 1e12 / read["tbps"])
                first = times[timings[0]]
                return dict(timing=times, **{k: first[k] for k in ("ms", "tbps", "pct_copy", "pct_read")})

            for kname, cfg in runs:
                r = dict(kernel=kname, config=dataclasses.asdict(cfg))
                try:
                    if (kname, cfg) not in ours_jits:
                        ours_jits[kname, cfg] = jax.jit(functools.partial(KERNEL_FNS[kname], config=cfg,
                                                                          interpret=interpret))
                    fn = ours_jits[kname, cfg]
                    args = (q, k_pool, v_pool, lengths, starts, psz)
                    got = np.asarray(fn(*args).astype(jnp.float32))
                    r["max_abs_err"] = float(np.abs(got - ref).max())
                    r.update(metrics(timed(fn, args)))
                except Exception as e:  # noqa: BLE001
                    r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    if "--verbose" in sys.argv:
                        traceback.print_exc()
                rec["ours"].append(r)
                print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} {kname} {cfg}: " + (
                    " ".join(f"{k} {r['timing'][k]['ms']:.4f} ms {r['timing'][k]['pct_read']:.1f}% of read"
                             for k in timings)
                    + f" err {r['max_abs_err']:.2g}" if "ms" in r else r["error"][:200]), flush=True)
            if triton is not None and page != MIXED:
                pps = ctx // page
                kp = k_pool.reshape(Hkv, num_slots // page, page, D)
                vp = v_pool.reshape(Hkv, num_slots // page, page, D)
                bt = jnp.asarray(starts_np[:, :pps] // page)
                q_scaled = (q.astype(jnp.float32) * scale).astype(q.dtype)   # Triton's kernel has no sm_scale
                for tc in triton_configs(pps, page):
                    r = dict(config=tc)
                    try:
                        fn = jax.jit(functools.partial(triton, **{k: v for k, v in tc.items() if k != "default"}))
                        args = (q_scaled, kp, vp, bt, lengths)
                        got = np.asarray(fn(*args).astype(jnp.float32))
                        r["max_abs_err"] = float(np.abs(got - ref).max())
                        r.update(metrics(timed(fn, args)))
                    except Exception as e:  # noqa: BLE001
                        r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                    rec["triton"].append(r)
                    print(f"  ctx={ctx} page={page} triton {tc}: " + (f"{r['ms']:.3f} ms {r['tbps']:.2f} TB/s err {r['max_abs_err']:.2g}"
                                                                     if "ms" in r else r["error"][:200]), flush=True)
            if xla_time is None and not interpret and not a.triton_only and not a.no_xla:
                fn = functools.partial(xla_decode_attention, scale=scale)
                r = dict(max_abs_err=float(np.abs(np.asarray(fn(q, kd, vd, lengths).astype(jnp.float32)) - ref).max()))
                xla_rec = dict(r, **metrics(timed(fn, (q, kd, vd, lengths))))
                xla_time = xla_rec["ms"]
            rec["xla_dense"] = xla_rec if xla_time is not None else None
            ok = [r for r in rec["ours"] if "ms" in r and r["max_abs_err"] <= 2e-2]
            rec["best_by_kernel"] = {k: min((r for r in ok if r["kernel"] == k), key=lambda r: r["ms"], default=None)
                                     for k in kernel_names}
            # "best" stays the paged kernel's (the table, the plot); the first kernel's when paged isn't run.
            rec["best"] = rec["best_by_kernel"]["paged" if "paged" in kernel_names else kernel_names[0]]
            okt = [r for r in rec["triton"] if "ms" in r and r["max_abs_err"] <= 2e-2]
            rec["triton_best"] = min(okt, key=lambda r: r["ms"]) if okt else None
            rec["triton_default"] = next((r for r in okt if r["config"].get("default")), None)
            result["shapes"].append(rec)
            save()
            del kd, vd
        del k_pool, v_pool

    # Table
    print(f"\n{meta['device']}  jax {meta['jax']}  {meta['date']}  B={B} Hq={Hq} Hkv={Hkv} D={D}  "
          f"copy {copy['tbps']:.2f} TB/s")
    print(f"{'ctx':>6} {'page':>6} | {'ours ms':>8} {'TB/s':>5} {'%copy':>6} | {'tri-def':>7} {'x':>5} | "
          f"{'tri-best':>8} {'x':>5} | {'xla ms':>7} {'x':>5} | best config")
    for rec in result["shapes"]:
        b, t, x = rec["best"], rec["triton_best"], rec["xla_dense"]
        td = rec.get("triton_default")
        if b is None:
            print(f"{rec['context']:>6} {rec['page']:>6} | FAILED")
            continue
        cfg = b["config"]
        print(f"{rec['context']:>6} {rec['page']:>6} | {b['ms']:8.3f} {b['tbps']:5.2f} {b['pct_copy']:5.1f}% | "
              f"{(td['ms'] if td else float('nan')):7.3f} {(td['ms'] / b['ms'] if td else float('nan')):5.2f} | "
              f"{(t['ms'] if t else float('nan')):8.3f} {(t['ms'] / b['ms'] if t else float('nan')):5.2f} | "
              f"{(x['ms'] if x else float('nan')):7.3f} {(x['ms'] / b['ms'] if x else float('nan')):5.2f} | "
              f"T={cfg['block_kv']} st={cfg['num_stages']} sp={cfg['num_splits']}")
    print(f"\nevery config, ms and % of the read ceiling ({read['tbps']:.2f} TB/s) per timing method "
          f"(device: chains of {chain_short} and {chain_long} calls)")
    for rec in result["shapes"]:
        for r in rec["ours"]:
            cfg = r["config"]
            cells = " | ".join(f"{k} {r['timing'][k]['ms']:7.4f} {r['timing'][k]['pct_read']:5.1f}%"
                               for k in timings if k in r.get("timing", {}))
            print(f"{rec['context']:>6} {rec['page']:>6} | {r['kernel']:>7} T={cfg['block_kv']} st={cfg['num_stages']} "
                  f"sp={cfg['num_splits']} | {cells or r.get('error', '')[:100]}")
    if len(kernel_names) > 1:
        print_kernel_comparison(result["shapes"], kernel_names, read["tbps"])
    save()
    if not any(rec["best"] for rec in result["shapes"]):
        print(f"wrote {out_path}; no kernel was timed (every run's error is in the JSON), so no plot")
        return 1
    plot(result, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
    return 0


def print_kernel_comparison(shapes, kernel_names, read_tbps):
    """Each kernel's best config per shape: ms, % of the read ceiling, and its time over the first kernel's."""
    base = kernel_names[0]
    print(f"\nbest config per kernel (ms, % of read {read_tbps:.2f} TB/s, time / {base}'s)")
    for rec in shapes:
        bests = rec.get("best_by_kernel", {})
        ref = bests.get(base)
        cells = []
        for k in kernel_names:
            b = bests.get(k)
            if b is None:
                cells.append(f"{k} FAILED")
                continue
            ratio = f" x{b['ms'] / ref['ms']:.2f}" if ref and k != base else ""
            cells.append(f"{k} {b['ms']:.4f} {b['pct_read']:5.1f}%{ratio} (T={b['config']['block_kv']} "
                         f"st={b['config']['num_stages']})")
        print(f"{rec['context']:>6} {rec['page']:>6} | " + " | ".join(cells))


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ctxs = sorted({r["context"] for r in result["shapes"]})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(5 * len(ctxs), 4), squeeze=False)
    copy = result["copy"]["tbps"]
    for ax, ctx in zip(axes[0], ctxs):
        recs = [r for r in result["shapes"] if r["context"] == ctx and r["page"] != MIXED]
        xs = [r["page"] for r in recs]
        ax.plot(xs, [r["best"]["tbps"] if r["best"] else np.nan for r in recs], "o-", label="this kernel (Mosaic GPU)")
        ax.plot(xs, [r["triton_best"]["tbps"] if r["triton_best"] else np.nan for r in recs], "s--", label="jax Triton, best config")
        ax.plot(xs, [r["triton_default"]["tbps"] if r.get("triton_default") else np.nan for r in recs], "v:",
                label="jax Triton, default config")
        xla = [r["xla_dense"]["tbps"] for r in recs if r.get("xla_dense")]
        if xla:
            ax.axhline(xla[0], color="gray", ls=":", label="XLA dense (no paging)")
        mixed = [r for r in result["shapes"] if r["context"] == ctx and r["page"] == MIXED and r["best"]]
        if mixed:
            ax.axhline(mixed[0]["best"]["tbps"], color="C0", ls="-.", lw=0.8, label="this kernel, mixed pages")
        ax.axhline(copy, color="k", lw=1, label=f"copy ceiling {copy:.2f} TB/s")
        ax.axhline(0.8 * copy, color="k", lw=0.5, ls="--", label="80% of copy")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("page size (tokens)")
        ax.set_ylabel("TB/s (KV + q + out bytes)")
        ax.set_title(f"context {ctx}")
        ax.set_ylim(0, copy * 1.1)
    axes[0][0].legend(fontsize=7, loc="lower left")
    m = result["meta"]
    fig.suptitle(f"paged decode attention, B={m['batch']} Hq={m['q_heads']} Hkv={m['kv_heads']} D={m['head_dim']} - "
                 f"{m['device']}, jax {m['jax']}, {m['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
