"""Prefill attention at long context: the Pallas causal-block kernels against the tiled jnp path.

    PYTHONPATH=$PWD python3 benchmarks/prefill_attention.py --out $OUT/prefill_attention.json   # GPU
    python3 benchmarks/prefill_attention.py --tiny --interpret --out /tmp/p.json                # CPU smoke run
    # split-K for a short chunk over a long context (the host-tier recall tail; unmeasured as of 2026-12-02):
    PYTHONPATH=$PWD python3 benchmarks/prefill_attention.py --models llama-8b --contexts 8192,32768 --chunk 256 \
        --chunks 1 --kernel-configs ws/128:2,ws/128:2:2,ws/128:2:auto,ws/64:2:3 --out $OUT/ws_splits.json

One call of `stratum_jax.attention.prefill_attention` as the packed step makes it for one layer: the
step's prefill tiles (128 tokens each) hold `--chunks` chunks of `--chunk` tokens, each the newest
tokens of its own sequence at context `ctx` (so the chunk attends causally to ctx - chunk cached
tokens plus itself). Pages are mixed sizes (16/64/256) at random aligned slots, the step's block tables
are engine-shaped ([rows = 64, --max-context / 8]). For each model shape and context it checks every
--kernel-configs kernel (variant ws, the warp-specialised kernel, or single, the decode kernel's
pipeline, each with its TuningConfig) against the tiled path (max |diff|, all compiled) and times them
all and the tiled path; the best kernel is reported (median of --reps samples of --inner calls, jitted). It reports ms per call, prompt tokens per second for one layer, and the
attention FLOP rate (4 * q_heads * head_dim per visible (query, key) pair).
"""
from __future__ import annotations

import argparse
import functools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from benchmarks.score_stats_cost import timed                    # noqa: E402  (one timing loop for kernel benchmarks)
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.paged_attention import TuningConfig           # noqa: E402
from stratum_jax.attention import RowTables, prefill_attention   # noqa: E402

SHAPES = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128), "tiny": (4, 1, 64)}
TILE = 128


def make_step(seed, *, heads, kv_heads, head_dim, ctx, chunk, chunks, max_context, rows=64):
    """(q [tiles, 128, Hq, D], q_positions, tile_rows, RowTables, k_pool, v_pool): `chunks` sequences
    at context ctx, each with its last `chunk` tokens as this step's prefill."""
    rng = np.random.default_rng(seed)
    sizes = [(16, 64, 256)[i % 3] for i in range(chunks)]
    blocks = -(-ctx // 256)
    num_slots = chunks * blocks * 256
    order = rng.permutation(chunks * blocks)
    width = max_context // 8
    starts = np.zeros((rows, width), np.int32)
    page_sizes = np.full(rows, 16, np.int32)
    context = np.zeros(rows, np.int32)
    for s in range(chunks):
        p = sizes[s]
        own = order[s * blocks:(s + 1) * blocks] * 256                   # this sequence's 256-slot blocks
        pages = [int(b) + i * p for b in own for i in range(256 // p)]
        pages = rng.permutation(pages)[: -(-ctx // p)]
        starts[s, :len(pages)] = pages
        page_sizes[s], context[s] = p, ctx
    per_chunk = -(-chunk // TILE)
    tiles = chunks * per_chunk
    pos = np.full((tiles, TILE), -1, np.int32)
    tile_rows = np.zeros(tiles, np.int32)
    for s in range(chunks):
        for t in range(per_chunk):
            first = ctx - chunk + t * TILE
            n = min(TILE, ctx - first)
            pos[s * per_chunk + t, :n] = np.arange(first, first + n)
            tile_rows[s * per_chunk + t] = s
    k = jnp.asarray(rng.standard_normal((kv_heads, num_slots, head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((kv_heads, num_slots, head_dim)), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((tiles, TILE, heads, head_dim)), jnp.bfloat16)
    tables = RowTables(jnp.asarray(context), jnp.asarray(starts), jnp.asarray(page_sizes))
    return q, jnp.asarray(pos), jnp.asarray(tile_rows), tables, k, v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama-1b,llama-8b")
    ap.add_argument("--contexts", default="1024,4096,12288,32768")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--kernel-configs", default="ws/128:2,single/128:2",
                    help="[variant/]block_kv:num_stages[:splits],... kernels to time (the first is checked against "
                         "the tiled path); variant ws (warp-specialised, the engine's default) or single (the "
                         "decode kernel's pipeline; the default variant); splits (ws only): prefill_attention's "
                         "prefill_splits, an int or auto (split-K over the context; off by default)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--interpret", action="store_true", help="run the kernel in the Mosaic GPU interpreter")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.tiny:
        args.models, args.contexts, args.chunk, args.chunks, args.max_context = "tiny", "256", 128, 2, 512
        args.reps = args.inner = 1
    rows = []
    print(f"{'model':9} {'ctx':>6} {'kernel ms':>10} {'tiled ms':>9} {'speed-up':>8} {'kernel TF/s':>11} "
          f"{'max |diff|':>10}")
    for model in args.models.split(","):
        heads, kv_heads, head_dim = SHAPES[model]
        for ctx in (int(c) for c in args.contexts.split(",")):
            q, pos, tile_rows, tables, k, v = make_step(0, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ctx=ctx,
                                                       chunk=args.chunk, chunks=args.chunks,
                                                       max_context=args.max_context)
            configs = {}
            for spec in args.kernel_configs.split(","):
                variant, rest = spec.split("/") if "/" in spec else ("single", spec)
                bkv, stages, *split = rest.split(":")
                splits = None if not split else split[0] if split[0] == "auto" else int(split[0])
                configs[spec] = (variant, TuningConfig(block_kv=int(bkv), num_stages=int(stages), num_splits=1),
                                 splits)
            fns = {b: jax.jit(functools.partial(prefill_attention, backend=b, interpret=args.interpret,
                                                max_context=args.max_context))
                   for b in ("reference",)}
            fns.update({c: jax.jit(functools.partial(prefill_attention, backend="kernel", interpret=args.interpret,
                                                     max_context=args.max_context, kernel_config=tc,
                                                     kernel_variant=variant, prefill_splits=splits))
                        for c, (variant, tc, splits) in configs.items()})
            out_r = np.asarray(fns["reference"](q, pos, tile_rows, tables, k, v), np.float32)
            valid = np.asarray(pos) >= 0
            diff_by_config = {c: float(np.max(np.abs(np.asarray(fns[c](q, pos, tile_rows, tables, k, v), np.float32)
                                                     - out_r)[valid])) for c in configs}
            diff = max(diff_by_config.values())
            by_config = {c: timed(lambda c=c: fns[c](q, pos, tile_rows, tables, k, v), reps=args.reps,
                                  inner=args.inner) * 1e3 for c in configs}
            best = min(by_config, key=by_config.get)
            t_k = by_config[best] / 1e3
            t_r = timed(lambda: fns["reference"](q, pos, tile_rows, tables, k, v), reps=args.reps, inner=args.inner)
            pairs = args.chunks * sum(ctx - args.chunk + i + 1 for i in range(args.chunk))
            flops = 4.0 * heads * head_dim * pairs
            row = dict(model=model, context=ctx, chunk=args.chunk, chunks=args.chunks, kernel_ms=t_k * 1e3,
                       kernel_ms_by_config=by_config, best_config=best, max_abs_diff_by_config=diff_by_config,
                       tiled_ms=t_r * 1e3, speedup=t_r / t_k, kernel_tflops=flops / t_k / 1e12,
                       prompt_tok_per_s_one_layer=args.chunks * args.chunk / t_k, max_abs_diff=diff)
            rows.append(row)
            print(f"{model:9} {ctx:6d} {t_k*1e3:10.3f} {t_r*1e3:9.3f} {t_r/t_k:8.1f} {row['kernel_tflops']:11.1f} "
                  f"{diff:10.2e}  " + " ".join(f"{c}={ms:.3f}" for c, ms in by_config.items()))
    save_json(args.out, dict(provenance("prefill_attention"), args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
