"""Delta-KV kernel benchmarks, the `--delta` and `--delta-prefill` modes of benchmarks/kernels.py (run them through it).

`--delta` times instead the delta-KV kernel (pallas_kernels/delta_attention.py) with fp16 and fp8
deltas (a mean anchor, i.e. the folded path unless $STRATUM_DKVC_FOLD_MEAN_ANCHOR=0, and/or a 256-row
position-aligned anchor, the rebuild path; a few configs that fit SMEM, best kept) beside
the bf16 paged kernel's default config on the same page layout, and a read-only ceiling measured in
the same run (a large bf16 sum). Each delta output is checked against XLA dense attention over the
K/V rebuilt in fp32. With a mean anchor the engine's decode path is timed too (`measure_fold`: the swapped kernel on
the deltas, "fold": fp16's unit scales or fp8's per-granule scales, what `--kv-precision` runs by default; for fp8 also
"fold head", the fixed per-head scales of `--fp8-scale head`, shown beside the bar and not counted). Reported: time,
the delta/paged time ratio (#12 asks fp8 <= 0.6x and fp16 <= 1.1x at 4K and 16K), bytes/s over the bytes each kernel
must read, and the paged kernel's % of the read ceiling (#12 asks >= 80% at 1K for every page size:
`paged_targets`). `--bars-only` keeps a run to what those bars count (one run for all of them, in as short a time as
it can): at 4K and more the engine's decode paths (the delta kernel's default config and the fold; not "fold head"),
below 4K the bf16 kernels alone (the paged kernel and the engine's swapped kernel, which the bar judges), on every
page size (`PAGED_BAR_PAGES`, whatever --pages says). The delta kernels take the scales packed, as the engine's
cache stores and passes them (`with_packed_scales`). JSON: --out (default
benchmarks/results/delta_kernels_h200.json). `--timing` applies here too (`seconds_per_call`; --delta's default is
`both`): with `device` both sides of each ratio are device times per call (the chain slope), as a decoder layer
inside the engine's step sees them; host timing can carry the host's per-call dispatch (a call with every length 0
takes 45-62 us), which, wherever it is not hidden behind the kernels, pulls a ratio toward 1 (most at 4K). The bars
are judged on device time where the run has it (`VERDICT_TIMING`, why beside it); the host ("headline") and
Pallas-kernel verdicts are printed and saved beside it, each target marked "verdict" true or false.

`--delta-prefill` times the causal-block prefill kernels instead: `delta_prefill_attention` (fp16/fp8
deltas, --anchor-lens) beside `paged_prefill_attention` on bf16 pools (PREFILL_KERNEL_CONFIG, what the
engine's "single" prefill variant runs), both at their default configs, on --prefill-batch sequences
whose last --prefill-tokens positions of a --contexts context (default 4K and 16K) are the query blocks
(blocks of prefill_block_tokens(Hq, Hkv) tokens, every block seeing its causal prefix). Each delta output
is checked against the paged prefill kernel over the same K/V rebuilt and rounded to bf16. Reported: time
and the delta/paged time ratio. Beside them, the warp-specialised kernels (pallas_kernels/prefill_attention.py,
what the engine's default "ws" variant runs) on the same query tokens in blocks of 128 // group tokens:
`ws_prefill_attention` on the bf16 pools ("ws_paged": ms) and, for a mean anchor (A=1),
`ws_delta_prefill_attention` ("ws" in each delta entry: ms, x_ws_paged = its time / ws_paged's, checked
against the same reference). JSON: --out (default benchmarks/results/delta_prefill_kernels_h200.json).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from config_flags import parse_overrides
from kernel_timing import bench, copy_ceiling, paired_profile, read_ceiling, seconds_per_call
from run_record import provenance, save_json
from paged_layout import MIXED, batch_page_sizes, page_layout, xla_decode_attention
from pallas_kernels.paged_attention import (
    PREFILL_KERNEL_CONFIG, TuningConfig, paged_attention, paged_prefill_attention, prefill_block_tokens)
from pallas_kernels.delta_attention import (
    DELTA_DTYPES, default_fold_mean_anchor, delta_attention, delta_prefill_attention, delta_smem_bytes,
    pack_granule_scales, rebuild_reference)
from pallas_kernels.prefill_attention import ws_delta_prefill_attention, ws_prefill_attention, ws_prefill_block_tokens
from pallas_kernels.swapped_decode_attention import default_swapped_config, swapped_paged_attention


def delta_configs(head_dim, dtype, anchor_len, table_width, quick):
    """The delta kernel's candidates: the default, 3 stages, 128-token tiles (those that fit SMEM)."""
    cands = [TuningConfig(), TuningConfig(num_stages=3), TuningConfig(block_kv=128)]
    if quick:
        cands = cands[:1]
    fold = anchor_len == 1 and default_fold_mean_anchor()
    return [c for c in cands if delta_smem_bytes(c, head_dim, dtype, fold=fold, max_pages=table_width) <= 227 * 1024]


DELTA_BARS = {"fp8-delta": 0.6, "fp16-delta": 1.1}     # #12: delta kernel time / bf16 paged kernel time
DELTA_BAR_MIN_CONTEXT = 4096      # #12 judges the delta kernels at 4K and 16K; shorter contexts judge the paged one
PAGED_READ_BAR = 80.0             # #12: the paged kernel's % of the read ceiling at 1K, every page size
PAGED_BAR_PAGES = (8, 16, 32, 64, 128, 256, MIXED)     # --bars-only's layouts below DELTA_BAR_MIN_CONTEXT


TIMINGS = ("headline", "device", "pallas")     # `delta_targets`' methods
# The method whose figures decide a bar (`verdict_targets`). #12's bars are on the kernel's time, and the chain slope
# is that time: it follows the traced GPU span of the chain (benchmarks/chain_overhead.py), while a host-timed call
# also carries the host's dispatch and sync, which moves from run to run by more than the kernels differ
# (BENCHMARKS.md #12, session 39). Host and Pallas figures are shown beside.
VERDICT_TIMING = "device"


def x_paged_by(run: dict, paged: dict, method: str) -> float | None:
    """A delta run's time over the paged kernel's by one method: "headline" (the run's `x_paged`), "device"
    (the chain slopes, `device_time`) or "pallas" (the Pallas kernels alone: `paired_profile`'s x_pallas where
    the run has it, else the ratio of the two `kernel_profile`s); None when the run lacks that method's figures."""
    if method == "headline":
        return run.get("x_paged")
    if method == "pallas" and "paired" in run.get("timing", {}):
        return run["timing"]["paired"]["x_pallas"]
    key, field = ("device", "seconds") if method == "device" else ("profile", "pallas_us")
    mine, theirs = run.get("timing", {}).get(key), paged.get("timing", {}).get(key)
    return mine[field] / theirs[field] if mine and theirs and theirs[field] > 0 else None


def delta_targets(shapes, method: str = "headline"):
    """#12's speed bars per (precision, anchor_len, context >= 4K): the worst over the page layouts of that
    context of the best ok run's delta/paged time ratio by `method` (`x_paged_by`; a layout with no ok run
    counts as infinitely slow). Only what the engine runs counts: a run with engine_default False (a fold config
    from --fold-configs) is left out. A context none of whose runs has the method's figures gives no target."""
    worst = {}
    for rec in shapes:
        if rec["context"] < DELTA_BAR_MIN_CONTEXT:
            continue
        for d in rec["delta"]:
            key = (d["precision"], d["anchor_len"], rec["context"])
            xs = [x_paged_by(r, rec["paged"], method) for r in d["runs"]
                  if r.get("ok") and "ms" in r and r.get("engine_default", True)]
            if xs and all(x is None for x in xs):
                continue
            worst[key] = max(worst.get(key, 0.0), min((x for x in xs if x is not None), default=math.inf))
    return [dict(precision=p, anchor_len=A, context=c, timing=method, worst_x_paged=x, bar=DELTA_BARS[p],
                 met=x <= DELTA_BARS[p]) for (p, A, c), x in sorted(worst.items())]


def paged_targets(shapes, read_tbps: float) -> list[dict]:
    """#12's paged bar per context below DELTA_BAR_MIN_CONTEXT (1K) and bf16 decode kernel (rec["paged"]:
    `paged_attention`; rec["swapped"], where timed: `swapped_paged_attention`, the engine's bf16 decode kernel): the
    worst over the context's page layouts of the kernel's % of the read ceiling (read_tbps, measured in the same
    run), by the host-timed headline and by device time (the chain slope). One target per context is the verdict:
    the engine's kernel where the run timed it, by device time where the run has it (as `verdict_targets` judges
    the delta bars); the others are shown beside. Per layout the figures are kept in "by_page". A kernel whose
    output failed its check (ok False) gives no figure."""
    by_key: dict[tuple[int, str, str], dict] = {}
    for rec in shapes:
        if rec["context"] >= DELTA_BAR_MIN_CONTEXT:
            continue
        for kernel in ("paged", "swapped"):
            run = rec.get(kernel)
            if not run or "io_bytes" not in run or not run.get("ok", True):     # a wrong output is not timed
                continue
            pcts = {"headline": run["pct_read"]}
            if device := run.get("timing", {}).get("device"):
                pcts["device"] = 100 * run["io_bytes"] / device["seconds"] / 1e12 / read_tbps
            for method, pct in pcts.items():
                by_key.setdefault((rec["context"], kernel, method), {})[str(rec["page"])] = pct

    def verdict(c, kernel, method):
        kernels = {k for cc, k, _ in by_key if cc == c}
        methods = {m for cc, k, m in by_key if cc == c and k == kernel}
        return (kernel == ("swapped" if "swapped" in kernels else "paged")
                and method == (VERDICT_TIMING if VERDICT_TIMING in methods else "headline"))

    return [dict(context=c, kernel=k, timing=m, worst_pct_read=min(pages.values()), by_page=pages,
                 bar=PAGED_READ_BAR, met=min(pages.values()) >= PAGED_READ_BAR, verdict=verdict(c, k, m))
            for (c, k, m), pages in sorted(by_key.items())]


def verdict_targets(targets: list[dict]) -> list[dict]:
    """`delta_targets` over every method, each marked "verdict": True where its method decides that (precision,
    anchor_len, context) bar: VERDICT_TIMING's where the run has its figures, else the headline's (a host-only
    run)."""
    decided = {(t["precision"], t["anchor_len"], t["context"]) for t in targets if t["timing"] == VERDICT_TIMING}
    return [dict(t, verdict=t["timing"] == VERDICT_TIMING or (
        t["timing"] == "headline" and (t["precision"], t["anchor_len"], t["context"]) not in decided))
        for t in targets]


def fold_configs(a, head_dim, context, dtype) -> list:
    """--fold-configs: [(the overrides as given, SwappedConfig)] over `default_swapped_config(head_dim, context,
    dtype)`, ';'-separated (`config_flags.parse_overrides`); empty: none."""
    specs = [x.strip() for x in (a.fold_configs or "").split(";") if x.strip()]
    if not specs:
        return []
    base = default_swapped_config(head_dim, context, dtype)
    return list(zip(specs, parse_overrides(";".join(specs), base)))


def delta_context(key, num_slots, num_kv_heads, head_dim, anchor_lens):
    """Random inputs of one context for the delta benchmarks: (the next key, 12 keys (keys[3] for q, keys[8:10]
    for the deltas), pool shape [Hkv, num_slots, D], bf16 k_pool and v_pool, k/v granule scales [Hkv,
    num_slots // 8] f32, {anchor_len: (anchor_k, anchor_v) [Hkv, anchor_len, D] bf16})."""
    keys = jax.random.split(key, 12)
    shape = (num_kv_heads, num_slots, head_dim)
    k_pool = jax.random.normal(keys[1], shape, jnp.bfloat16)
    v_pool = jax.random.normal(keys[2], shape, jnp.bfloat16)
    scales = [jax.random.uniform(k, (num_kv_heads, num_slots // 8), jnp.float32, 0.005, 0.02) for k in keys[4:6]]
    anchors = {A: [jax.random.normal(k, (num_kv_heads, A, head_dim), jnp.bfloat16) for k in keys[6:8]]
               for A in anchor_lens}
    return keys[0], keys, shape, k_pool, v_pool, scales, anchors


def measure_variant(build, args, ref, paged_ms, a, *, label, io_bytes=None, baseline=None) -> dict:
    """One delta kernel variant: fn = build() run on args, its max error against `ref` (ok within 3e-2 of
    ref's scale) and its time (ms, x_paged against paged_ms, and TB/s of io_bytes when given). With
    --profile-kernels and baseline (paged_fn, paged_args) also timing["paired"]: `paired_profile` of the
    baseline and fn interleaved in one executable. A failing variant is recorded (ok False, error), not raised:
    one must not kill the run. Prints one line."""
    r = {}
    try:
        fn = build()
        got = np.asarray(fn(*args).astype(jnp.float32))
        r["max_abs_err"] = float(np.abs(got - ref).max())
        r["ok"] = bool(r["max_abs_err"] <= 3e-2 * max(1.0, float(np.abs(ref).max())))
        t, timing = seconds_per_call(fn, args, a)
        if a.profile_kernels and baseline is not None and jax.default_backend() == "gpu":
            try:
                timing["paired"] = paired_profile(*baseline, fn, args, calls=a.chain_lengths[0])
            except ValueError as e:     # a variant with more than one Pallas kernel a call: no pairing
                print(f"  paired profile: {e}", flush=True)
        r.update(ms=t * 1e3, x_paged=t * 1e3 / paged_ms, timing=timing)
        if io_bytes is not None:
            r["tbps"] = io_bytes / t / 1e12
    except Exception as e:  # noqa: BLE001
        r.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
    print(f"  [{time.strftime('%H:%M:%S')}] {label}: " +
          (f"{r['ms']:.3f} ms x{r['x_paged']:.2f} of paged, err {r['max_abs_err']:.2g}{sm_clock(r['timing'])}"
           if "ms" in r else r.get("error", "")[:300]), flush=True)
    return r


def sm_clock(timing: dict) -> str:
    """', SM <median> MHz' from a seconds_per_call record's gpu_clocks, or '' (no nvidia-smi)."""
    mhz = (timing.get("gpu_clocks") or {}).get("sm_mhz_median")
    return f", SM {mhz:.0f} MHz" if mhz is not None else ""


def delta_truth(q, ak, av, k_scale, v_scale, kd, vd, slot, lengths, scale) -> np.ndarray:
    """XLA dense attention over the K/V of a delta cache rebuilt in fp32 (slot [B, ctx]: token t's pool slot)."""
    t = jnp.arange(slot.shape[1])
    kr = jnp.swapaxes(rebuild_reference(ak, k_scale, kd, slot, t), 0, 1)
    vr = jnp.swapaxes(rebuild_reference(av, v_scale, vd, slot, t), 0, 1)
    return np.asarray(xla_decode_attention(q.astype(jnp.float32), kr, vr, lengths, scale=scale))


def with_packed_scales(kernel, **kw):
    """kernel (`delta_attention`, `delta_prefill_attention`, `ws_delta_prefill_attention`) called as the engine calls
    it (stratum_jax/attention.py): args (q, k_delta, v_delta, packed scales [Hkv, S // 8, 4], *rest) -> kernel(q,
    k_delta, v_delta, None, None, *rest, packed_scales=..., **kw). The scales are packed once, outside the timed
    call, as the cache stores them; two arrays would be packed inside it."""
    def call(q, k_delta, v_delta, packed, *rest):
        return kernel(q, k_delta, v_delta, None, None, *rest, packed_scales=packed, **kw)
    return call


def measure_fold(jitted, q, kd, vd, ak, av, lengths, starts, psz, slot, scale, paged_ms, a, *, io, interpret,
                 label, head_scales=None, granule_scales=None, baseline=None, config=None,
                 overrides: str = "") -> dict:
    """The engine's folded decode path (stratum_jax/attention.py `_swapped_fold`: the swapped kernel on the
    deltas, then the mean anchor's V added) on a DeltaKV with the unit scales an fp16-delta cache keeps; with
    granule_scales ((k, v) [Hkv, S // 8] f32) an fp8-delta cache's per-granule scales (the default, `--fp8-scale
    granule`: the kernel reads them, packed as the cache stores them, with the pages); or with head_scales ((k, v)
    [Hkv] f32) an fp8-delta cache's fixed per-head scales (`--fp8-scale head`: s_k into q, s_v onto the output).
    Checked against XLA attention over anchor + scale x delta. Its run is marked config "fold" (unit or granule
    scales: what the engine runs by default, counted for the bars) or "fold head" (engine_default False: shown
    beside the bar, not counted for it, `delta_targets`); with config (a `SwappedConfig` for decode_attention's
    swapped_config, from --fold-configs' overrides) "fold <overrides>", also engine_default False."""
    from stratum_jax.attention import RowTables, decode_attention
    from stratum_jax.kv.delta_cache import DeltaKV
    fixed = head_scales is not None
    if granule_scales is None:
        floors = head_scales if fixed else (jnp.ones((kd.shape[0],), jnp.float32),) * 2
        # what the cache holds: every granule its head's scale
        granule_scales = tuple(jnp.broadcast_to(f[:, None], (kd.shape[0], kd.shape[1] // 8)) for f in floors)
    else:
        floors = (jnp.ones((kd.shape[0],), jnp.float32),) * 2      # a granule cache's floors: not read in decode
    ref = delta_truth(q, ak, av, *granule_scales, kd, vd, slot, lengths, scale)

    # The scales are arguments, not closure constants: the jit is kept for every context of the run. They are
    # packed before the timed call, as the cache stores them.
    def fold(q, kd, vd, ak, av, lengths, starts, psz, k_floor, v_floor, scales):
        cache = DeltaKV(anchor_k=ak, anchor_v=av, k_delta=kd, v_delta=vd, scales=scales, k_floor=k_floor,
                        v_floor=v_floor, fixed_scales=fixed)
        return decode_attention(q, lengths - 1, RowTables(lengths, starts, psz), cache, None, backend="kernel",
                                interpret=interpret, max_context=starts.shape[1] * 8, swapped_config=config)
    fold_args = (q, kd, vd, ak, av, lengths, starts, psz, *floors, pack_granule_scales(*granule_scales))
    r = measure_variant(lambda: jitted(("fold", kd.dtype, fixed, config), fold), fold_args, ref,
                        paged_ms, a, label=label, io_bytes=io, baseline=baseline)
    name = "fold head" if fixed else "fold"
    if config is None:
        return dict(config=name, **r) if not fixed else dict(config=name, engine_default=False, **r)
    return dict(config=f"{name} {overrides}", engine_default=False, swapped_config=dataclasses.asdict(config), **r)


def print_pallas_table(shapes) -> None:
    """--profile-kernels: per shape and delta run, device us per call of the Pallas kernels alone and of
    everything the call launched (busy), each profiled on its own beside the paged kernel's (and the ratios);
    then, where timed, the paired profile's (`paired_profile`: both interleaved in one executable) medians."""
    print(f"\n{'ctx':>6} {'page':>6} | {'paged us':>8} | {'run':<20} {'pallas us':>9} {'busy':>6} {'x pallas':>8} "
          f"{'x busy':>6} | paired: {'paged':>6} {'run':>6} {'x pallas':>8} {'x busy':>6}")
    for rec in shapes:
        pp = rec["paged"].get("timing", {}).get("profile")
        for d in rec["delta"]:
            for r in d["runs"]:
                rp, pair = r.get("timing", {}).get("profile"), r.get("timing", {}).get("paired")
                if not (pp and rp):
                    continue
                name = f"{d['precision']} A={d['anchor_len']} " + (r["config"] if isinstance(r["config"], str)
                                                                  else f"T{r['config'].get('block_kv')}")
                x_pallas = f"{rp['pallas_us'] / pp['pallas_us']:8.3f}" if pp["pallas_us"] > 0 else f"{'-':>8}"
                paired = (f"{pair['base_pallas_us']:6.1f} {pair['pallas_us']:6.1f} {pair['x_pallas']:8.3f} "
                          f"{pair['x_busy']:6.3f}" if pair else "-")
                print(f"{rec['context']:>6} {rec['page']!s:>6} | {pp['pallas_us']:8.1f} | {name:<20} "
                      f"{rp['pallas_us']:9.1f} {rp['busy_us']:6.1f} {x_pallas} "
                      f"{rp['busy_us'] / max(pp['busy_us'], 1e-9):6.3f} |         {paired}")


def run_delta(a):
    """fp16/fp8-delta kernel vs the bf16 paged kernel (default configs) at each context and page size."""
    interpret = a.dry_run
    if a.dry_run:
        a.batch, a.q_heads, a.kv_heads, a.head_dim = 2, 4, 1, 64
        a.contexts, a.reps, a.inner, a.rounds, a.quick, a.pages, a.anchor_lens = "512", 1, 1, 1, True, "64", "1"
    B, Hq, Hkv, D = a.batch, a.q_heads, a.kv_heads, a.head_dim
    contexts = [int(c) for c in a.contexts.split(",")]
    pages = [p if p == MIXED else int(p) for p in a.pages.split(",")]
    precisions = a.precisions.split(",")
    anchor_lens = [int(x) for x in a.anchor_lens.split(",")]
    dev = jax.devices()[0]
    meta = dict(provenance("kernels"), platform=dev.platform, batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                reps=a.reps, inner=a.inner, rounds=a.rounds, dry_run=a.dry_run, mode="delta", timing=a.timing,
                chain=list(a.chain_lengths) if a.timing != "host" else None,
                fold_mean_anchor=default_fold_mean_anchor())
    print(json.dumps(meta), flush=True)
    out_path = pathlib.Path(a.out)
    result = dict(meta=meta, read=None, copy=None, shapes=[])

    def save():
        save_json(out_path, result)

    result["read"] = read_ceiling(64 << 20 if a.dry_run else 4 << 30, reps=a.reps, rounds=a.rounds)
    result["copy"] = copy_ceiling(64 << 20 if a.dry_run else 2 << 30, reps=a.reps, rounds=a.rounds)
    read = result["read"]["tbps"]
    print(f"read ceiling (bf16 sum): {read:.3f} TB/s; copy ceiling {result['copy']['tbps']:.3f} TB/s", flush=True)
    save()
    scale = 1.0 / math.sqrt(D)
    rng = np.random.default_rng(1)
    key = jax.random.key(0)
    # One jit per kernel variant for the whole run: every page size of a context has the same shapes (the
    # page size is data), so the kernel is lowered and compiled once per context, not once per page size
    # (a delta kernel's Mosaic GPU lowering takes ~30 s of host time on a 2-core CPU).
    jits = {}

    def jitted(name, f):
        return jits.setdefault(name, jax.jit(f))

    for ctx in contexts:
        table_width = ctx // 8
        key, keys, shape, k_pool, v_pool, scales, anchors = delta_context(key, B * ctx, Hkv, D, anchor_lens)
        packed = pack_granule_scales(*scales)      # the delta kernels' scales, as the cache stores them
        q = jax.random.normal(keys[3], (B, Hq, D), jnp.bfloat16)
        lengths = jnp.full((B,), ctx, jnp.int32)
        paged_io = 2 * B * Hkv * ctx * D * 2 + 2 * q.nbytes
        paged_only = a.bars_only and ctx < DELTA_BAR_MIN_CONTEXT     # the paged kernel's bar at this context
        for page in (PAGED_BAR_PAGES if paged_only and not a.dry_run else pages):
            sizes = batch_page_sizes(B, page)
            starts_np, _ = page_layout(rng, B, ctx, sizes, table_width)
            starts, psz = jnp.asarray(starts_np), jnp.asarray(sizes, jnp.int32)
            rec = dict(context=ctx, page=page, paged=None, delta=[])
            fn = jitted("paged", functools.partial(paged_attention, interpret=interpret))
            baseline = (fn, (q, k_pool, v_pool, lengths, starts, psz))
            t, timing = seconds_per_call(*baseline, a)
            rec["paged"] = dict(ms=t * 1e3, io_bytes=paged_io, tbps=paged_io / t / 1e12,
                                pct_read=100 * paged_io / t / 1e12 / read, timing=timing)
            print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} paged: {t * 1e3:.3f} ms "
                  f"{rec['paged']['pct_read']:.1f}% of read{sm_clock(timing)}", flush=True)
            if paged_only:      # beside it the engine's bf16 decode kernel, checked against the paged kernel
                swapped = jitted(("swapped", ctx), functools.partial(swapped_paged_attention, max_context=ctx,
                                                                     interpret=interpret))
                err = float(jnp.abs(swapped(*baseline[1]).astype(jnp.float32)
                                    - fn(*baseline[1]).astype(jnp.float32)).max())
                t, timing = seconds_per_call(swapped, baseline[1], a)
                rec["swapped"] = dict(ms=t * 1e3, io_bytes=paged_io, tbps=paged_io / t / 1e12,
                                      pct_read=100 * paged_io / t / 1e12 / read, max_abs_err_vs_paged=err,
                                      ok=err <= 3e-2, timing=timing)
                print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} swapped: {t * 1e3:.3f} ms "
                      f"{rec['swapped']['pct_read']:.1f}% of read, err vs paged {err:.2g}{sm_clock(timing)}",
                      flush=True)
                result["shapes"].append(rec)
                save()
                continue
            t_np = np.arange(ctx)
            slot = jnp.asarray(np.stack([starts_np[b, t_np // P] + t_np % P for b, P in enumerate(sizes)]))
            for prec in precisions:
                dt = DELTA_DTYPES[prec]
                kd = (jax.random.normal(keys[8], shape, jnp.bfloat16) * 8).astype(dt)
                vd = (jax.random.normal(keys[9], shape, jnp.bfloat16) * 8).astype(dt)
                # Bytes it must read: the deltas and packed scale granules (16 bytes each) of every live token,
                # q, the output.
                io = 2 * B * Hkv * ctx * D * dt.itemsize + B * Hkv * (ctx // 8) * 16 + 2 * q.nbytes
                for A in anchor_lens:
                    ak, av = anchors[A]
                    args = (q, kd, vd, packed, ak, av, lengths, starts, psz)
                    ref = delta_truth(q, ak, av, scales[0], scales[1], kd, vd, slot, lengths, scale)
                    runs = []
                    for cfg in delta_configs(D, dt, A, table_width, a.quick):
                        r = dict(config=dataclasses.asdict(cfg), **measure_variant(
                            lambda: jitted((prec, A, cfg), with_packed_scales(delta_attention, config=cfg,
                                                                              interpret=interpret)),
                            args, ref, rec["paged"]["ms"], a, io_bytes=io, baseline=baseline,
                            label=f"ctx={ctx} page={page} {prec} A={A} {cfg}"))
                        runs.append(r)
                    if A == 1:   # fp16: unit scales; fp8: per-granule scales (the default) and fixed per-head ones
                        fp8 = prec == "fp8-delta"
                        fold_kw = dict(io=io, interpret=interpret, baseline=baseline,
                                       granule_scales=(scales[0], scales[1]) if fp8 else None)
                        runs.append(measure_fold(jitted, q, kd, vd, ak, av, lengths, starts, psz, slot, scale,
                                                 rec["paged"]["ms"], a, label=f"ctx={ctx} page={page} {prec} A={A} "
                                                 "fold", **fold_kw))
                        if fp8 and not a.bars_only:     # --fp8-scale head, beside the bar
                            runs.append(measure_fold(
                                jitted, q, kd, vd, ak, av, lengths, starts, psz, slot, scale, rec["paged"]["ms"], a,
                                label=f"ctx={ctx} page={page} {prec} A={A} fold head", io=io, interpret=interpret,
                                baseline=baseline, head_scales=(scales[0][:, 0], scales[1][:, 0])))
                        for overrides, cfg in fold_configs(a, D, ctx, dt):
                            runs.append(measure_fold(jitted, q, kd, vd, ak, av, lengths, starts, psz, slot, scale,
                                                     rec["paged"]["ms"], a, label=f"ctx={ctx} page={page} {prec} "
                                                     f"A={A} fold {overrides}", config=cfg, overrides=overrides,
                                                     **fold_kw))
                    ok = [r for r in runs if r.get("ok") and "ms" in r and r.get("engine_default", True)]
                    rec["delta"].append(dict(precision=prec, anchor_len=A, io_bytes=io, runs=runs,
                                             best=min(ok, key=lambda r: r["ms"]) if ok else None))
                del kd, vd
            result["shapes"].append(rec)
            save()
        del k_pool, v_pool

    print(f"\n{meta['device']}  jax {meta['jax']}  {meta['date']}  B={B} Hq={Hq} Hkv={Hkv} D={D}  "
          f"read {read:.2f} TB/s")
    cols = next(([(d["precision"], d["anchor_len"]) for d in rec["delta"]] for rec in result["shapes"]
                 if rec["delta"]), [])
    print(f"{'ctx':>6} {'page':>6} | {'paged ms':>8} {'%read':>6} | " +
          " | ".join(f"{p[:4]} A={A:<4} ms  x" for p, A in cols))
    for rec in result["shapes"]:
        cells = []
        for d in rec["delta"]:
            b = d["best"]
            cells.append(f"{b['ms']:7.3f} {b['x_paged']:4.2f}" if b else f"{'FAILED':>12}")
        print(f"{rec['context']:>6} {rec['page']:>6} | {rec['paged']['ms']:8.3f} {rec['paged']['pct_read']:5.1f}% | "
              + " | ".join(f"{c:>16}" for c in cells))
    extra = [(rec, d, r) for rec in result["shapes"] for d in rec["delta"] for r in d["runs"]
             if not r.get("engine_default", True)]
    if extra:      # --fold-configs: beside the table, not in its best
        print("\n--fold-configs (not the engine's default, not counted for the bars):")
        for rec, d, r in extra:
            print(f"{rec['context']:>6} {rec['page']!s:>6} | {d['precision']} {r['config']}: "
                  + (f"{r['ms']:.3f} ms x{r['x_paged']:.2f}" if "ms" in r else r.get("error", "failed")[:120]))
    if a.profile_kernels:
        print_pallas_table(result["shapes"])
    result["targets"] = verdict_targets([t for method in TIMINGS for t in delta_targets(result["shapes"], method)])
    for t in result["targets"]:
        print(f"target {t['precision']} A={t['anchor_len']} ctx={t['context']} ({t['timing']} timing"
              f"{', the verdict' if t['verdict'] else ', shown'}): worst {t['worst_x_paged']:.3f}x of paged "
              f"(bar <= {t['bar']}): {'met' if t['met'] else 'MISSED'}")
    result["paged_targets"] = paged_targets(result["shapes"], read)
    for t in result["paged_targets"]:
        print(f"target {t['kernel']} ctx={t['context']} ({t['timing']} timing"
              f"{', the verdict' if t['verdict'] else ', shown'}): worst {t['worst_pct_read']:.1f}% of read over "
              f"pages {','.join(t['by_page'])} "
              f"(bar >= {t['bar']:.0f}%): {'met' if t['met'] else 'MISSED'}")
    save()
    print(f"wrote {out_path}")
    return 0


def run_delta_prefill(a):
    """fp16/fp8-delta prefill kernel vs the bf16 paged prefill kernel (default configs) at each context and
    page size: --prefill-batch sequences, each with its last --prefill-tokens positions as query blocks."""
    interpret = a.dry_run
    if a.dry_run:
        a.q_heads, a.kv_heads, a.head_dim, a.prefill_batch, a.prefill_tokens = 4, 1, 64, 1, 32
        a.contexts, a.reps, a.inner, a.rounds, a.pages, a.anchor_lens = "256", 1, 1, 1, "64", "1"
    B, Hq, Hkv, D, n_q = a.prefill_batch, a.q_heads, a.kv_heads, a.head_dim, a.prefill_tokens
    tokens = prefill_block_tokens(Hq, Hkv)
    ws_tokens = ws_prefill_block_tokens(Hq, Hkv)
    if tokens is None or n_q % ws_tokens:
        raise SystemExit(f"--prefill-tokens ({n_q}) must be a multiple of the WS kernel's {ws_tokens}-token blocks "
                         f"(128 // the GQA group, a power of 2)")
    contexts = [int(c) for c in a.contexts.split(",")]
    pages = [p if p == MIXED else int(p) for p in a.pages.split(",")]
    precisions, anchor_lens = a.precisions.split(","), [int(x) for x in a.anchor_lens.split(",")]
    dev = jax.devices()[0]
    meta = dict(provenance("kernels"), platform=dev.platform, batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D,
                prefill_tokens=n_q,
                block_tokens=tokens, reps=a.reps, inner=a.inner, rounds=a.rounds, dry_run=a.dry_run,
                mode="delta-prefill", fold_mean_anchor=default_fold_mean_anchor(),
                paged_config=dataclasses.asdict(PREFILL_KERNEL_CONFIG))
    print(json.dumps(meta), flush=True)
    out_path = pathlib.Path(a.out)
    result = dict(meta=meta, shapes=[])
    save = lambda: save_json(out_path, result)
    jits = {}     # one jit per kernel variant (page sizes are data: one compile per context)
    jitted = lambda name, f: jits.setdefault(name, jax.jit(f))
    rng = np.random.default_rng(2)
    key = jax.random.key(0)
    per_seq = n_q // tokens
    for ctx in contexts:
        table_width = ctx // 8
        key, keys, shape, k_pool, v_pool, scales, anchors = delta_context(key, B * ctx, Hkv, D, anchor_lens)
        packed = pack_granule_scales(*scales)      # the delta kernels' scales, as the cache stores them
        q = jax.random.normal(keys[3], (B * per_seq, tokens, Hq, D), jnp.bfloat16)
        q_starts = jnp.asarray(np.tile(ctx - n_q + tokens * np.arange(per_seq), B), jnp.int32)
        lengths = q_starts + tokens
        for page in pages:
            sizes = batch_page_sizes(B, page)
            starts_np, _ = page_layout(rng, B, ctx, sizes, table_width)
            starts = jnp.asarray(np.repeat(starts_np, per_seq, axis=0))
            psz = jnp.asarray(np.repeat(sizes, per_seq), jnp.int32)
            rec = dict(context=ctx, page=page, paged=None, delta=[])
            paged = jitted("paged", functools.partial(paged_prefill_attention, config=PREFILL_KERNEL_CONFIG,
                                                      interpret=interpret))
            t = bench(paged, (q, k_pool, v_pool, q_starts, lengths, starts, psz), reps=a.reps, inner=a.inner,
                      rounds=a.rounds)
            rec["paged"] = dict(ms=t * 1e3)
            print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} paged prefill: {t * 1e3:.3f} ms", flush=True)
            ws_blocks = _ws_blocks(q, q_starts, starts, psz, ws_tokens)     # the same tokens, 128-row blocks
            ws_paged = jitted("ws_paged", functools.partial(ws_prefill_attention, interpret=interpret))
            t = bench(ws_paged, (ws_blocks[0], k_pool, v_pool, *ws_blocks[1:]), reps=a.reps, inner=a.inner,
                      rounds=a.rounds)
            rec["ws_paged"] = dict(ms=t * 1e3)
            print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} ws paged prefill: {t * 1e3:.3f} ms",
                  flush=True)
            t_np = np.arange(ctx)
            slot = np.stack([starts_np[b, t_np // P] + t_np % P for b, P in enumerate(sizes)])      # [B, ctx]
            for prec in precisions:
                dt = DELTA_DTYPES[prec]
                kd = (jax.random.normal(keys[8], shape, jnp.bfloat16) * 8).astype(dt)
                vd = (jax.random.normal(keys[9], shape, jnp.bfloat16) * 8).astype(dt)
                for A in anchor_lens:
                    ak, av = anchors[A]
                    args = (q, kd, vd, packed, ak, av, q_starts, lengths, starts, psz)
                    # Check: the bf16 paged prefill kernel over the same K/V rebuilt (fp32, then bf16).
                    pools = []
                    for anc, sc, dl in ((ak, scales[0], kd), (av, scales[1], vd)):
                        rebuilt = rebuild_reference(anc, sc, dl, jnp.asarray(slot), jnp.arange(ctx))   # [Hkv, B, ctx, D]
                        pools.append(jnp.zeros(shape, jnp.bfloat16).at[:, slot.reshape(-1)].set(
                            rebuilt.reshape(Hkv, -1, D).astype(jnp.bfloat16)))
                    ref = np.asarray(paged(q, *pools, q_starts, lengths, starts, psz).astype(jnp.float32))
                    del pools
                    r = measure_variant(
                        lambda: jitted((prec, A), with_packed_scales(delta_prefill_attention, interpret=interpret)),
                        args, ref, rec["paged"]["ms"], a, label=f"ctx={ctx} page={page} {prec} A={A}")
                    if A == 1:      # the WS delta kernel (folded mean anchor only), output back in q's blocks
                        ws_args = (ws_blocks[0], kd, vd, packed, ak, av, *ws_blocks[1:])
                        r["ws"] = measure_variant(
                            lambda: _as_blocks(jitted(("ws", prec), with_packed_scales(
                                ws_delta_prefill_attention, interpret=interpret)), q.shape),
                            ws_args, ref, rec["ws_paged"]["ms"], a, label=f"ctx={ctx} page={page} {prec} A=1 ws")
                        if "x_paged" in r["ws"]:
                            r["ws"]["x_ws_paged"] = r["ws"].pop("x_paged")
                    rec["delta"].append(dict(precision=prec, anchor_len=A, **r))
                del kd, vd
            result["shapes"].append(rec)
            save()
        del k_pool, v_pool
    print(f"\n{meta['device']}  jax {meta['jax']}  {meta['date']}  B={B} Hq={Hq} Hkv={Hkv} D={D} "
          f"{n_q} query tokens per sequence")
    for rec in result["shapes"]:
        cells = [f"{d['precision'][:4]} A={d['anchor_len']}: " + (f"{d['ms']:.3f} ms x{d['x_paged']:.2f}"
                                                                   if d.get("ok") else "FAILED") +
                 ("" if "ws" not in d else f", ws {d['ws']['ms']:.3f} ms x{d['ws']['x_ws_paged']:.2f}"
                  if d["ws"].get("ok") else ", ws FAILED") for d in rec["delta"]]
        print(f"{rec['context']:>6} {rec['page']:>6} | paged {rec['paged']['ms']:.3f} ms, ws paged "
              f"{rec['ws_paged']['ms']:.3f} ms | " + " | ".join(cells))
    save()
    print(f"wrote {out_path}")
    return 0


def _ws_blocks(q, q_starts, page_starts, page_sizes, ws_tokens):
    """The single-pipeline benchmark's query blocks (q [blocks, tokens, Hq, D], consecutive blocks of a sequence
    in order) as the WS kernel's blocks of ws_tokens = 2 x tokens: (q, q_starts, lengths, page_starts,
    page_sizes), every token at the same position and seeing the same causal prefix."""
    blocks, tokens = q.shape[:2]
    per = ws_tokens // tokens
    q_ws = q.reshape(blocks // per, ws_tokens, *q.shape[2:])
    starts = q_starts[::per]
    return q_ws, starts, starts + ws_tokens, page_starts[::per], page_sizes[::per]


def _as_blocks(fn, q_shape):
    """fn's [blocks / 2, 2 x tokens, Hq, D] output reshaped to the single-pipeline blocks q_shape (for the check)."""
    return lambda *args: fn(*args).reshape(q_shape)
