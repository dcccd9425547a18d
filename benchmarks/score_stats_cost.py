"""What `return_score_stats=True` costs the paged decode attention kernel.

    PYTHONPATH=$PWD python3 benchmarks/score_stats_cost.py --out $OUT/score_stats_cost.json   # GPU
    python3 benchmarks/score_stats_cost.py --interpret --tiny --out /tmp/s.json                # CPU smoke run

For each context (1K, 4K) and page layout (all sequences on 16-token pages, or a batch mixing every
page size 8..256) at B=64, Hq=32, Hkv=8, D=128 (the design's kernel shapes), it times the kernel with
the default TuningConfig with and without the score statistics, checks that `out` is bit-identical
either way and that the variance matches a dense fp32 computation, and prints ms and % slower. Timing: 3
warm-up calls, then the median over --reps samples of --inner back-to-back calls closed by
block_until_ready; --rounds interleaved rounds per variant, the best median kept. Both variants
are called under jax.jit, as the engine's step calls the kernel. `--tiny` shrinks the shapes (B=4, Hq=4, Hkv=1, D=64, context 256) and `--interpret`
runs the kernel in the Mosaic GPU interpreter, so the script can be tried on a CPU.
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from pallas_kernels.paged_attention import PAGE_SIZES, paged_attention   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)

MIXED = "mixed"


def timed(fn, *, reps, inner):
    for _ in range(3):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t) / inner)
    return statistics.median(samples)


def make_inputs(seed, *, batch, num_q_heads, num_kv_heads, head_dim, context, layout):
    """Full-context sequences whose pages sit at random page-aligned slots of an exactly-full pool
    (each sequence owns its own 256-slot blocks, as the buddy allocator would give it)."""
    rng = np.random.default_rng(seed)
    if layout == MIXED:
        sizes = np.asarray([PAGE_SIZES[b % len(PAGE_SIZES)] for b in range(batch)], np.int32)
    else:
        sizes = np.full(batch, int(layout), np.int32)
    blocks_per_seq = -(-context // 256)
    num_slots = batch * blocks_per_seq * 256
    blocks = rng.permutation(num_slots // 256)
    max_pages = -(-context // int(sizes.min()))
    starts = np.zeros((batch, max_pages), np.int32)
    for b in range(batch):
        p = int(sizes[b])
        mine = blocks[b * blocks_per_seq:(b + 1) * blocks_per_seq]
        pages = (mine[:, None] * 256 + np.arange(0, 256, p)[None, :]).reshape(-1)
        pages = rng.permutation(pages)[:-(-context // p)]
        starts[b, :len(pages)] = pages
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, num_q_heads, head_dim), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (num_kv_heads, num_slots, head_dim), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (num_kv_heads, num_slots, head_dim), jnp.float32).astype(jnp.bfloat16)
    lengths = np.full(batch, context, np.int32)
    return (q, k, v, jnp.asarray(lengths), jnp.asarray(starts), jnp.asarray(sizes))


def dense_score_var(q, k_pool, v_pool, lengths, page_starts, page_sizes, *, context):
    """Score variance of full-context rows from a dense gather of their tokens (fp32, two-pass).
    (`paged_attention_reference` would gather max_pages * 256 tokens per row: too big here.)"""
    t = jnp.arange(context)
    slots = jnp.take_along_axis(page_starts, t[None, :] // page_sizes[:, None], axis=1) + t[None, :] % page_sizes[:, None]
    k = k_pool[:, slots].astype(jnp.float32)                                       # [Hkv, B, T, D]
    batch, num_q_heads, head_dim = q.shape
    qg = q.astype(jnp.float32).reshape(batch, k.shape[0], -1, head_dim)
    s = jnp.einsum("bhgd,hbtd->bhgt", qg, k) / np.sqrt(head_dim)
    return jnp.var(s, axis=-1).reshape(batch, num_q_heads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "score_stats_cost.json"))
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--layouts", default=f"16,{MIXED}", help="page sizes and/or 'mixed', comma-separated")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU interpreter (CPU)")
    args = ap.parse_args(argv)

    shape = dict(batch=args.batch, num_q_heads=32, num_kv_heads=8, head_dim=128)
    contexts = [int(c) for c in args.contexts.split(",")]
    reps, inner = args.reps, args.inner
    if args.tiny:
        shape = dict(batch=4, num_q_heads=4, num_kv_heads=1, head_dim=64)
        contexts = [256]
        reps, inner, args.rounds = min(reps, 2), 1, 1
    layouts = args.layouts.split(",")
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, shape {shape}, "
          f"interpret={args.interpret}")

    rows = []
    for context in contexts:
        for layout in layouts:
            inputs = make_inputs(context, context=context, layout=layout, **shape)

            # Jitted as the engine's step calls it, so the Python wrapper's per-call work (input
            # checks, config) is not timed: at 1K context the kernel takes ~80 us, about what an
            # un-jitted call costs on the host.
            f_plain = jax.jit(functools.partial(paged_attention, interpret=args.interpret))
            f_stats = jax.jit(functools.partial(paged_attention, interpret=args.interpret, return_score_stats=True))

            def plain(inputs=inputs, f=f_plain):
                return f(*inputs)

            def with_stats(inputs=inputs, f=f_stats):
                return f(*inputs)

            out_plain = plain()
            out_stats, var = with_stats()
            same_out = bool(np.array_equal(np.asarray(out_plain, np.float32), np.asarray(out_stats, np.float32)))
            ref_var = np.asarray(dense_score_var(*inputs, context=context))
            var = np.asarray(var)
            var_err = float(np.max(np.abs(var - ref_var) / np.maximum(ref_var, 1e-3)))
            # Interleaved rounds, best median of each kept, so a drift in clocks hits both alike.
            t_plain, t_stats = float("inf"), float("inf")
            for _ in range(args.rounds):
                t_plain = min(t_plain, timed(plain, reps=reps, inner=inner))
                t_stats = min(t_stats, timed(with_stats, reps=reps, inner=inner))
            row = dict(context=context, layout=layout, ms_plain=t_plain * 1e3, ms_stats=t_stats * 1e3,
                       pct_slower=100.0 * (t_stats / t_plain - 1.0), out_identical=same_out,
                       var_max_rel_err_vs_dense=var_err, var_mean=float(var.mean()))
            rows.append(row)
            print(f"ctx {context:>5} pages {layout:>5}: {row['ms_plain']:8.3f} ms plain, {row['ms_stats']:8.3f} ms "
                  f"with stats ({row['pct_slower']:+5.1f}%), out identical: {same_out}, "
                  f"var max rel err vs dense fp32: {var_err:.2e}", flush=True)

    print()
    print(f"{'context':>8} {'pages':>6} {'plain ms':>10} {'stats ms':>10} {'slower':>8}")
    for r in rows:
        print(f"{r['context']:>8} {r['layout']:>6} {r['ms_plain']:>10.3f} {r['ms_stats']:>10.3f} "
              f"{r['pct_slower']:>+7.1f}%")
    result = dict(
        provenance("score_stats_cost"), platform=dev.platform, interpret=args.interpret,
        shape=shape, config="TuningConfig() (default)", reps=reps, inner=inner, rounds=args.rounds, rows=rows)
    print(f"wrote {save_json(args.out, result, indent=2)}")
    bad = [r for r in rows if not r["out_identical"] or not r["var_max_rel_err_vs_dense"] <= 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
