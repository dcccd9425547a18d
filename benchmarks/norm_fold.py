"""Does folding a decode layer's residual adds and norms into its GEMMs shorten the layer? (#18)

A decode layer runs 8 kernels (benchmarks/l2_prefetch.py's sequence, the engine's own code paths). This script times
it against the folded layer of pallas_kernels/norm_fold.py, 6 kernels:

    unfused: residual add + norm (residual_rmsnorm, the down projection's partials) -> q/k/v GEMM (partials)
             -> RoPE + K/V write (rope_kv_write) -> attention -> o GEMM (partials) -> residual add + norm
             -> gate/up GEMM -> down GEMM (partials)
    fold:    q/k/v GEMM of the stream, with the rows' sums of squares (decode_matmul_partials_sumsq)
             -> RoPE + K/V write with the rows' norm scale (rope_kv_write's row_norm) -> attention
             -> o GEMM + its split-K summed in its cluster + the residual add (decode_matmul_residual)
             -> gate/up GEMM with the rows' norm scale (decode_gated_matmul_normed) -> down GEMM + residual add

with both norms' weights folded into q/k/v's and gate/up's weights. The attention kernel is the same code in both.
--layers layers, each with its own weights and pools, the variants alternating over --rounds so they share the GPU's
clock; each figure is device time from a jax.profiler trace of one call, per layer: by part, busy (the kernels' sum),
span (first start to last end), and the fold's span minus the unfused span of the same round ("vs unfused", median
over rounds). The fold's call starts with one XLA add (the pending partials the unfused layers take as input), under
"other".

    python benchmarks/norm_fold.py --models llama-1b,llama-8b            # the H200
    python benchmarks/norm_fold.py --dry-run                              # CPU: tiny shapes in the interpreter

The dry run checks that the fold computes the unfused layers: the K/V rows written and the stream after the last
layer, within bf16 roundings (the folded norms round in other places: norm_fold's docstring).
Prints a table; JSON to --out (default benchmarks/results/norm_fold_h200.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from l2_prefetch import (DRY_SHAPE, EPS, LayerStep, inputs, layer_shapes, layers_fn,  # noqa: E402
                         make_pools, make_weights, profile_layers)
from l2_prefetch import down_splits  # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.norm_fold import (EXCHANGES, decode_gated_matmul_normed, decode_matmul_partials_sumsq,  # noqa: E402
                                      decode_matmul_residual, fold_norm_weight)
from pallas_kernels.rope_kv_write import RowNorm, rope_kv_write   # noqa: E402
from pallas_kernels.paged_attention import PAGE_SIZES   # noqa: E402
from stratum_jax.attention import decode_attention   # noqa: E402
from stratum_jax.model.config import PRESETS   # noqa: E402
from stratum_jax.model.projection import (DecodeKernelMatmul, Unsummed, gated_kernel_config,  # noqa: E402
                                         kernel_config, residual_kernel_config)

VARIANTS = ("unfused", "fold")


def with_folded_weights(weights: list[dict]) -> list[dict]:
    """Each layer's weights plus q/k/v and gate/up with the norm before each folded in (as the engine would load them
    for the fold)."""
    return [{**w, "qkv_folded": fold_norm_weight(w["input_norm"], w["qkv"]),
             "gate_up_folded": fold_norm_weight(w["post_norm"], w["gate_up"])} for w in weights]


def fold_layers_fn(matmul: DecodeKernelMatmul, shape: dict, *, max_context: int, cluster_splits: int | None = None,
                   cluster_tile: int | None = None, cluster_stages: int | None = None,
                   exchange: str = "l2"):
    """f(x, pending, weights, pools, step) -> (x, None, pools): `l2_prefetch.layers_fn`'s arguments, the layers
    folded (module docstring). The stream enters with `pending` added (one XLA add a call, "other" in the parts) and
    leaves complete: the last down projection's residual add is in its kernel. o's and down's config is the engine's
    (`residual_kernel_config`: two-block clusters on narrowed tiles; one block when interpreted, as the engine runs
    it), unless cluster_splits forces their K split (a cluster's blocks) on the plain kernel's tile. cluster_tile
    and cluster_stages then override their column tile and ring depth (fewer stages let two CTAs share an SM).
    exchange: how the cluster's blocks read each other's partials (`decode_matmul_residual`)."""
    heads, head_dim, h, i = shape["heads"], shape["head_dim"], shape["hidden"], shape["intermediate"]
    qkv_rows = shape["q_out"] + 2 * shape["kv_out"]

    def need(result, what):
        if result is None:
            raise SystemExit(f"{what} does not run on the Pallas kernels at these shapes: pick other --rows or models")
        return result

    def cluster_config(rows, n, k):
        if cluster_splits is None:
            config = need(residual_kernel_config(rows, n, k, jnp.bfloat16, one_block=matmul.interpret),
                          f"the {n} x {k} projection with its residual")
        else:
            config = dataclasses.replace(need(kernel_config(rows, n, k), f"the {n} x {k} projection"),
                                         k_splits=cluster_splits)
        return dataclasses.replace(config, tile_n=cluster_tile or config.tile_n,
                                   num_stages=cluster_stages or config.num_stages)

    def run(x, pending, weights, pools, step: LayerStep):
        rows, tables = x.shape[0], step.tables
        qkv_config = need(kernel_config(rows, qkv_rows, h), "the q/k/v projection")
        o_config, down_config = cluster_config(rows, h, shape["q_out"]), cluster_config(rows, h, i)
        gate_up_config = need(gated_kernel_config(i, rows, h), "the gate/up projection")
        x = x + Unsummed(pending).summed(rows, x.dtype)
        new_pools = []
        for w, (k_pool, v_pool) in zip(weights, pools, strict=True):
            parts, sumsq = decode_matmul_partials_sumsq(x, w["qkv_folded"], config=qkv_config,
                                                        interpret=matmul.interpret)
            pad = parts.shape[1] - rows
            cos, sin = (jnp.pad(a, ((0, pad), (0, 0))) for a in (step.cos, step.sin))
            slots = jnp.pad(step.slots, (0, pad), constant_values=k_pool.shape[1])      # past the pool: not written
            q, k_pool, v_pool = rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=heads,
                                              num_kv_heads=shape["kv_heads"], row_norm=RowNorm(sumsq, h, EPS),
                                              interpret=matmul.interpret)
            new_pools.append((k_pool, v_pool))
            attn = decode_attention(q[:rows], tables.context_lens - 1, tables, k_pool, v_pool, backend="kernel",
                                    interpret=matmul.interpret, max_context=max_context)
            x = decode_matmul_residual(attn.reshape(rows, heads * head_dim), w["o"], x, config=o_config,
                                       exchange=exchange, interpret=matmul.interpret)
            act = decode_gated_matmul_normed(x, w["gate_up_folded"], eps=EPS, config=gate_up_config,
                                             interpret=matmul.interpret)
            x = decode_matmul_residual(act, w["down"], x, config=down_config, exchange=exchange,
                                       interpret=matmul.interpret)
        return x, None, new_pools
    return jax.jit(run, donate_argnums=(3,))


def variant_fns(matmul: DecodeKernelMatmul, shape: dict, *, max_context: int, cluster_splits=(None,),
                exchanges=("l2",)) -> dict:
    """{"unfused": ..., "fold": ... (the engine's clusters, the "l2" exchange), "fold[_dsmem][_s{S}[x{T}]][_st{D}]":
    ... (the "dsmem" exchange; o's and down's split forced to S, their column tile to T, their ring depth to D)}."""
    fns = {"unfused": layers_fn(matmul, shape, max_context=max_context)}
    for exchange in exchanges:
        for item in cluster_splits:
            splits, tile, stages = (*item, None, None)[:3] if isinstance(item, tuple) else (item, None, None)
            name = ("fold" + ("" if exchange == "l2" else f"_{exchange}") + ("" if splits is None else f"_s{splits}")
                    + ("" if tile is None else f"x{tile}") + ("" if stages is None else f"_st{stages}"))
            fns[name] = fold_layers_fn(matmul, shape, max_context=max_context, cluster_splits=splits,
                                       cluster_tile=tile, cluster_stages=stages, exchange=exchange)
    return fns


def dry_run() -> dict:
    """Interpreter, DRY_SHAPE, two layers, 8 rows of 100 keys in 32-token pages: the fold against the unfused layers."""
    shape, rows, context, layers = DRY_SHAPE, 8, 100, 2
    weights = with_folded_weights(make_weights(shape, layers))
    step, pools = make_pools(shape, layers, rows=rows, context=context, page=32)
    x, pending = inputs(shape, rows, down_splits(shape, rows))
    fns = variant_fns(DecodeKernelMatmul(interpret=True), shape, max_context=context)
    outs = {v: fns[v](x, pending, weights, jax.tree.map(jnp.copy, pools), step) for v in VARIANTS}
    (x_u, pend_u, pools_u), (x_f, _, pools_f) = outs["unfused"], outs["fold"]
    # The unfused layers leave the last down projection pending; the folded ones have added it.
    stream_u = np.asarray(x_u + Unsummed(pend_u).summed(rows, x_u.dtype), np.float32)
    stream_f = np.asarray(x_f, np.float32)
    diffs = [float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())
             for a, b in zip(jax.tree.leaves(pools_u), jax.tree.leaves(pools_f), strict=True)]
    result = dict(benchmark="norm_fold", dry_run=True, layers=layers, rows=rows, context=context,
                  pool_max_abs_diff=max(diffs), stream_max_abs_diff=float(np.abs(stream_u - stream_f).max()),
                  stream_scale=float(np.abs(stream_u).max()))
    print(f"dry run, {layers} layers: the K/V rows written differ by at most {result['pool_max_abs_diff']:.4f} and "
          f"the stream by {result['stream_max_abs_diff']:.4f} (its largest value {result['stream_scale']:.2f})")
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b", help="comma-separated presets")
    ap.add_argument("--rows", type=int, default=64, help="token rows (a decode step's batch), 1-128")
    ap.add_argument("--layers", type=int, default=8, help="layers in the timed call, each with its own weights")
    ap.add_argument("--context", type=int, default=640, help="keys a row attends to (e2e_decode's mean: 512 + 128)")
    ap.add_argument("--page", type=int, default=32, help="tokens a page (the adaptive rule's size at 768 tokens)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the two variants (alternating, same clock)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/norm_fold_h200.json"))
    ap.add_argument("--cluster-splits", default="auto", metavar="LIST",
                    help="comma-separated fold variants by o's and down's K split: auto (the engine's), 1, 2, 4, 8, "
                         "each optionally with a column tile and a ring depth: 2x32, 4x64:4, auto:3")
    ap.add_argument("--exchanges", default="l2", metavar="LIST",
                    help="comma-separated: how o's and down's cluster blocks exchange partials, dsmem and/or l2")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, correctness only")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    if not 1 <= a.rows <= 128:
        raise SystemExit(f"--rows must be in [1, 128] (the Pallas projections' rows), got {a.rows}")
    if a.layers < 1 or a.rounds < 1 or a.context < 1:
        raise SystemExit(f"--layers, --rounds and --context must be >= 1, got {a.layers}, {a.rounds}, {a.context}")
    if a.page not in PAGE_SIZES:
        raise SystemExit(f"--page must be one of {PAGE_SIZES}, got {a.page}")
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        raise SystemExit(f"--models: unknown presets {unknown}; choose from {sorted(PRESETS)}")
    splits = []
    for item in a.cluster_splits.split(","):
        m = re.fullmatch(r"(auto|1|2|4|8)(?:x(\d+))?(?::(\d+))?", item)
        if not m or (m[2] and int(m[2]) % 8) or (m[3] and int(m[3]) < 2):
            raise SystemExit(f"--cluster-splits: each item must be auto, 1, 2, 4 or 8, optionally with a column tile "
                             f"(a multiple of 8) and a ring depth >= 2 (4x64:4: split 4, 64-column tiles, 4 stages), "
                             f"got {item!r}")
        base = None if m[1] == "auto" else int(m[1])
        tile, stages = (int(m[2]) if m[2] else None), (int(m[3]) if m[3] else None)
        splits.append((base, tile, stages) if tile or stages else base)
    exchanges = [e for e in a.exchanges.split(",") if e]
    if not exchanges or any(e not in EXCHANGES for e in exchanges):
        raise SystemExit(f"--exchanges: each item must be one of {EXCHANGES}, got {a.exchanges!r}")
    if a.dry_run:
        out = dry_run()
    else:
        if jax.default_backend() != "gpu":
            raise SystemExit("the timed run needs an NVIDIA Hopper GPU; on CPU use --dry-run")
        rows_out = []
        for model in models:
            shape = layer_shapes(model)
            weights = with_folded_weights(make_weights(shape, a.layers))
            step, pools = make_pools(shape, a.layers, rows=a.rows, context=a.context, page=a.page)
            x, pending = inputs(shape, a.rows, down_splits(shape, a.rows))
            fns = variant_fns(DecodeKernelMatmul(), shape, max_context=a.context, cluster_splits=tuple(splits),
                              exchanges=tuple(exchanges))
            runs = {v: [] for v in fns}
            for _ in range(a.rounds):
                for v in list(fns):
                    try:
                        run, pools = profile_layers(fns[v], (x, pending, weights, pools, step), shape, a.layers)
                    except ValueError as e:       # a forced split the shapes refuse (traced before any donation)
                        print(f"{model:9s} {v:8s} skipped: {e}", flush=True)
                        del fns[v], runs[v]
                        continue
                    runs[v].append(run)
            for v in fns:
                best = min(runs[v], key=lambda r: r["span_us"])
                delta = float(np.median([r["span_us"] - b["span_us"]
                                         for r, b in zip(runs[v], runs["unfused"], strict=True)]))
                rows_out.append(dict(model=model, variant=v, rows=a.rows, context=a.context, page=a.page,
                                     layers=a.layers, rounds=runs[v], busy_us=best["busy_us"], span_us=best["span_us"],
                                     parts=best["parts"], span_delta_vs_unfused_us=delta))
                cells = "  ".join(f"{p} {us:6.2f}" for p, us in best["parts"].items())
                print(f"{model:9s} {v:12s} busy {best['busy_us']:7.2f} us/layer  span {best['span_us']:7.2f} "
                      f"({delta:+.2f} vs unfused)  | {cells}", flush=True)
            del weights, pools
        out = dict(provenance("norm_fold"), rows=rows_out)
    if a.out:
        save_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
