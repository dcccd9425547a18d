"""The swapped decode kernel on float8_e4m3fn pools (the fixed-scale fp8-delta fold, #12) against the bf16 paged
kernel (#12's bar: <= 0.6x its time) and the swapped kernel on bf16 pools, over SwappedConfigs (overrides of
`default_swapped_config(head_dim, context, float8_e4m3fn)`; 'auto' splits: `fp8_default_splits`), in one run
with its read ceiling. The kernel alone (no fold wrapper: `benchmarks/kernels.py --delta` times the engine's
whole folded path); q is split into `fp8_q_terms` e4m3 parts inside the timed call, as the engine's path does.

    python benchmarks/fp8_fold_sweep.py --contexts 4096,16384 --pages 16,64,mixed \
        --configs 'default;fp8_q_terms=3;num_stages=3;num_splits=4' --out results/x.json
    python benchmarks/fp8_fold_sweep.py --dry-run      # tiny shapes in the Mosaic GPU interpreter (CPU)

--fold times each config on the engine's whole fold call instead (stratum_jax/attention.py: the per-head scales
s_k into q, s_v and the mean anchor's V onto the output, bf16 out), so configs that move the fold's XLA work into
kernels (`fp8_q_kernel`, `out_affine_in_kernel`) are compared on what the engine runs; s_k, s_v, a_v random per
kv head, the check is the bf16 swapped kernel on q * s_k, times s_v, plus a_v.

Each config's fp8 output is checked against the bf16 swapped kernel on the same values (e4m3 -> bf16 is exact);
a config that fails to compile or misses 3e-2 is recorded, not raised. Prints a table, writes JSON."""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from config_flags import parse_overrides       # noqa: E402  (beside this script)
from gpu_clocks import ClockSampler            # noqa: E402
from kernel_timing import bench, read_ceiling   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from paged_layout import MIXED, batch_page_sizes, page_layout   # noqa: E402
from pallas_kernels.paged_attention import paged_attention   # noqa: E402
from pallas_kernels.swapped_decode_attention import (   # noqa: E402
    default_swapped_config, swapped_paged_attention)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--contexts", default="4096,16384")
    p.add_argument("--pages", default="16,64,mixed")
    p.add_argument("--configs", default="default")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fold", action="store_true", help="time the whole fold call per config (see above)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/fp8_fold_sweep_h200.json"))
    a = p.parse_args(argv)
    interpret = a.dry_run
    if a.dry_run:
        a.batch, a.q_heads, a.kv_heads, a.head_dim = 2, 4, 1, 64
        a.contexts, a.pages, a.reps, a.inner, a.rounds = "512", "64", 1, 1, 1
    B, Hq, Hkv, D = a.batch, a.q_heads, a.kv_heads, a.head_dim
    meta = dict(provenance("fp8_fold_sweep"), batch=B, q_heads=Hq, kv_heads=Hkv, head_dim=D, reps=a.reps,
                inner=a.inner, rounds=a.rounds, dry_run=a.dry_run, fold=a.fold)
    print(json.dumps(meta), flush=True)
    out_path = pathlib.Path(a.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(meta=meta, read=read_ceiling(64 << 20 if a.dry_run else 4 << 30, reps=a.reps, rounds=a.rounds),
                  shapes=[])
    read = result["read"]["tbps"]
    print(f"read ceiling (bf16 sum): {read:.3f} TB/s", flush=True)
    rng = np.random.default_rng(1)
    key = jax.random.key(0)
    # --fold: the fold's per-kv-head scales and anchor V (random; powers of two not required), from their own
    # generator so the page layouts are the ones a run without --fold draws
    group = Hq // Hkv
    fold_rng = np.random.default_rng(2)
    s_k = jnp.asarray(fold_rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    s_v = jnp.asarray(fold_rng.uniform(0.5, 2.0, Hkv), jnp.float32)
    a_v = jnp.asarray(fold_rng.standard_normal((Hkv, D)), jnp.float32)
    fold_kw = dict(q_scale=jnp.repeat(s_k, group), out_scale=s_v, out_bias=a_v, out_dtype=jnp.bfloat16) if a.fold \
        else {}
    jits = {}
    rows = []
    for ctx in (int(c) for c in a.contexts.split(",")):
        configs = parse_overrides(a.configs, default_swapped_config(D, ctx, jnp.float8_e4m3fn))
        keys = jax.random.split(key, 4)
        key = keys[0]
        shape = (Hkv, B * ctx, D)
        k8 = (jax.random.normal(keys[1], shape, jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        v8 = (jax.random.normal(keys[2], shape, jnp.float32) * 8).astype(jnp.float8_e4m3fn)
        kb, vb = k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16)
        q = jax.random.normal(keys[3], (B, Hq, D), jnp.float32) * 0.05
        lengths = jnp.full((B,), ctx, jnp.int32)
        bf16_io, fp8_io = 2 * B * Hkv * ctx * D * 2, 2 * B * Hkv * ctx * D
        for page in (p if p == MIXED else int(p) for p in a.pages.split(",")):
            sizes = batch_page_sizes(B, page)
            starts, _ = page_layout(rng, B, ctx, sizes, ctx // 8)
            starts, psz = jnp.asarray(starts), jnp.asarray(sizes, jnp.int32)

            def timed(name, fn, args, io):
                with ClockSampler() as clocks:     # the SM clock moves between configs at the power cap
                    t = bench(fn, args, reps=a.reps, inner=a.inner, rounds=a.rounds)
                return dict(name=name, ms=t * 1e3, pct_read=100 * io / t / 1e12 / read, gpu_clocks=clocks.summary())
            paged = jits.setdefault("paged", jax.jit(lambda *x: paged_attention(*x, interpret=interpret)))
            qb = q.astype(jnp.bfloat16)
            rec = dict(context=ctx, page=page, paged=timed("paged bf16", paged, (qb, kb, vb, lengths, starts, psz),
                                                          bf16_io), runs=[])
            swapped = jits.setdefault(("swapped", ctx), jax.jit(
                lambda *x: swapped_paged_attention(*x, max_context=ctx, interpret=interpret)))
            rec["swapped_bf16"] = timed("swapped bf16", swapped, (q, kb, vb, lengths, starts, psz), bf16_io)
            if a.fold:    # s_v * attention(q * s_k) + a_v, on the bf16 kernel
                q_k = q * jnp.repeat(s_k, group)[None, :, None]
                want = (np.asarray(swapped(q_k, kb, vb, lengths, starts, psz), np.float32)
                        * np.repeat(np.asarray(s_v), group)[None, :, None] + np.repeat(np.asarray(a_v), group, 0)[None])
            else:
                want = np.asarray(swapped(q, kb, vb, lengths, starts, psz), np.float32)
            for cfg in configs:
                r = dict(config=dataclasses.asdict(cfg))
                try:
                    fn = jits.setdefault((cfg, ctx), jax.jit(
                        lambda *x, cfg=cfg: swapped_paged_attention(*x, config=cfg, interpret=interpret, **fold_kw)))
                    got = np.asarray(fn(q, k8, v8, lengths, starts, psz), np.float32)
                    r["max_abs_err_vs_bf16"] = float(np.abs(got - want).max())
                    r["ok"] = bool(r["max_abs_err_vs_bf16"] <= 3e-2 * max(1.0, float(np.abs(want).max())))
                    r.update(timed("fp8", fn, (q, k8, v8, lengths, starts, psz), fp8_io))
                    r["x_paged"] = r["ms"] / rec["paged"]["ms"]
                except Exception as e:     # one config must not kill the run
                    r.update(ok=False, error=f"{type(e).__name__}: {e}"[:800])
                    traceback.print_exc()
                rec["runs"].append(r)
                print(f"  [{time.strftime('%H:%M:%S')}] ctx={ctx} page={page} {cfg}: "
                      + (f"{r['ms']:.3f} ms x{r['x_paged']:.2f} err {r['max_abs_err_vs_bf16']:.2g}"
                         if "ms" in r else r.get("error", "")[:200]), flush=True)
            result["shapes"].append(rec)
            save_json(out_path, result)
            for r in rec["runs"]:
                c = r["config"]
                rows.append((ctx, page, rec["paged"]["ms"], rec["paged"]["pct_read"], rec["swapped_bf16"]["ms"],
                             f"T{c['block_kv']} S{c['num_stages']} k{c['num_splits'] or 'auto'} "
                             f"q{c['fp8_q_terms']}{'' if c['fp8_q_stacked'] else 'x'}{' sh' if c['shared_smem'] else ''}"
                             f"{' R' if c['refill_under_pv'] else ''}{' Qk' if c['fp8_q_kernel'] else ''}"
                             f"{' Qi' if c['fp8_q_in_kernel'] else ''}{' Ak' if c['out_affine_in_kernel'] else ''}"
                             f"{' L%d' % c['split_first_percent'] if c.get('split_first_percent') else ''}",
                             r.get("ms", float("nan")), r.get("x_paged", float("nan")), r.get("pct_read", float("nan")),
                             (r.get("gpu_clocks") or {}).get("sm_mhz_median")))
    print(f"{meta['device']}  jax {meta['jax']}  B={B} Hq={Hq} Hkv={Hkv} D={D}  read {read:.2f} TB/s")
    print(f"{'ctx':>6} {'page':>6} | {'paged ms':>8} {'%read':>6} | {'swp bf16':>8} | {'fp8 config':<24} "
          f"{'ms':>7} {'x paged':>7} {'%read':>6} {'SM MHz':>6}")
    for ctx, page, pms, ppct, sms, name, ms, x, pct, mhz in rows:
        print(f"{ctx:>6} {page!s:>6} | {pms:8.3f} {ppct:5.1f}% | {sms:8.3f} | {name:<24} {ms:7.3f} {x:7.2f} "
              f"{pct:5.1f}% {'-' if mhz is None else f'{mhz:.0f}':>6}")
    return result


if __name__ == "__main__":
    main()
