"""Does folding the post-attention residual add and norm into the GEMMs around it shorten a decode layer? (#18)

A decode layer runs 8 kernels (benchmarks/l2_prefetch.py's sequence, the engine's own code paths). This script times
it against the layer with its MLP half folded (pallas_kernels/norm_fold.py):

    unfused: ... attention -> o GEMM (partials) -> residual add + norm (residual_rmsnorm) -> gate/up GEMM -> down ...
    fold:    ... attention -> o GEMM + split-K sum in its cluster + residual add (decode_matmul_residual)
                 -> gate/up GEMM with the norm's row scale (decode_gated_matmul_normed, the norm weight folded into
                    gate/up's weight) -> down ...

so the fold runs 7 kernels a layer. The rest of the layer (the input norm with the down projection's partials, the
q/k/v GEMM, the fused RoPE + K/V write, the attention kernel) is the same code in both. --layers layers, each with its
own weights and pools, the variants alternating over --rounds so they share the GPU's clock; each figure is device
time from a jax.profiler trace of one call, per layer: by part, busy (the kernels' sum), span (first start to last
end), and the fold's span minus the unfused span of the same round ("vs unfused", median over rounds).

    python benchmarks/norm_fold.py --models llama-1b,llama-8b            # the H200
    python benchmarks/norm_fold.py --dry-run                              # CPU: tiny shapes in the interpreter

The dry run checks that the fold computes the unfused layer: the residual stream and the K/V pools bit for bit, the
down projection's partials within bf16 roundings (the folded norm rounds in other places: norm_fold's docstring).
Prints a table; JSON to --out (default benchmarks/results/norm_fold_h200.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from l2_prefetch import (DRY_SHAPE, EPS, LayerStep, inputs, layer_shapes, layers_fn,  # noqa: E402
                         make_pools, make_weights, profile_layers)
from l2_prefetch import down_splits  # noqa: E402
from pallas_kernels.norm_fold import (decode_gated_matmul_normed, decode_matmul_residual,  # noqa: E402
                                      fold_norm_weight)
from pallas_kernels.paged_attention import PAGE_SIZES   # noqa: E402
from stratum_jax.attention import decode_attention   # noqa: E402
from stratum_jax.model.config import PRESETS   # noqa: E402
from stratum_jax.model.projection import (DecodeKernelMatmul, RopeKVWrite, Unsummed, gated_kernel_config,  # noqa: E402
                                         kernel_config)

VARIANTS = ("unfused", "fold")


def with_folded_weights(weights: list[dict]) -> list[dict]:
    """Each layer's weights plus gate_up with the post-attention norm's weight folded in (as the engine would load
    them for the fold)."""
    return [{**w, "gate_up_folded": fold_norm_weight(w["post_norm"], w["gate_up"])} for w in weights]


def fold_layers_fn(matmul: DecodeKernelMatmul, shape: dict, *, max_context: int):
    """`l2_prefetch.layers_fn`'s signature and sequence (no prefetch), with the MLP half folded (module docstring)."""
    heads, head_dim, h, i = shape["heads"], shape["head_dim"], shape["hidden"], shape["intermediate"]

    def need(result, what):
        if result is None:
            raise SystemExit(f"{what} does not run on the Pallas kernels at these shapes: pick other --rows or models")
        return result

    def run(x, pending, weights, pools, step: LayerStep):
        rows, tables = x.shape[0], step.tables
        o_config = dataclasses.replace(need(kernel_config(rows, h, shape["q_out"]), "the o projection"),
                                       k_splits=None)
        gate_up_config = need(gated_kernel_config(i, rows, h), "the gate/up projection")
        new_pools = []
        for w, (k_pool, v_pool) in zip(weights, pools, strict=True):
            x, h_in = need(matmul.residual_rmsnorm(x, Unsummed(pending), w["input_norm"], EPS), "the input norm")
            q, k_pool, v_pool = need(matmul.rope_kv_write(
                h_in, w["qkv"], RopeKVWrite(step.cos, step.sin, step.slots, k_pool, v_pool), heads),
                "the fused q/k/v write")
            new_pools.append((k_pool, v_pool))
            attn = decode_attention(q, tables.context_lens - 1, tables, k_pool, v_pool, backend="kernel",
                                    interpret=matmul.interpret, max_context=max_context)
            x = decode_matmul_residual(attn.reshape(rows, heads * head_dim), w["o"], x, config=o_config,
                                       interpret=matmul.interpret)
            act = decode_gated_matmul_normed(x, w["gate_up_folded"], eps=EPS, config=gate_up_config,
                                             interpret=matmul.interpret)
            pending = need(matmul.unsummed(act, w["down"]), "the down projection").parts
        return x, pending, new_pools
    return jax.jit(run, donate_argnums=(3,))


def variant_fns(matmul: DecodeKernelMatmul, shape: dict, *, max_context: int) -> dict:
    return {"unfused": layers_fn(matmul, shape, max_context=max_context),
            "fold": fold_layers_fn(matmul, shape, max_context=max_context)}


def dry_run() -> dict:
    """Interpreter, DRY_SHAPE, two layers, 8 rows of 100 keys in 32-token pages: the fold against the unfused layers."""
    shape, rows, context, layers = DRY_SHAPE, 8, 100, 2
    weights = with_folded_weights(make_weights(shape, layers))
    step, pools = make_pools(shape, layers, rows=rows, context=context, page=32)
    x, pending = inputs(shape, rows, down_splits(shape, rows))
    fns = variant_fns(DecodeKernelMatmul(interpret=True), shape, max_context=context)
    outs = {v: fns[v](x, pending, weights, jax.tree.map(jnp.copy, pools), step) for v in VARIANTS}
    (x_u, pend_u, pools_u), (x_f, pend_f, pools_f) = outs["unfused"], outs["fold"]
    pools_same = all(np.array_equal(np.asarray(a), np.asarray(b))
                     for a, b in zip(jax.tree.leaves(pools_u), jax.tree.leaves(pools_f), strict=True))
    # Layer 0's pools and the first layer's stream are computed before any folded op; later ones are downstream of
    # the fold, so they differ only by its roundings.
    first_pools_same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(pools_u[0], pools_f[0]))
    down_u = np.asarray(Unsummed(pend_u).summed(rows, jnp.float32))
    down_f = np.asarray(Unsummed(pend_f).summed(rows, jnp.float32))
    scale = float(np.abs(down_u).max())
    result = dict(benchmark="norm_fold", dry_run=True, layers=layers, rows=rows, context=context,
                  first_layer_pools_same_bits=first_pools_same, all_pools_same_bits=pools_same,
                  stream_max_abs_diff=float(np.abs(np.asarray(x_u, np.float32) - np.asarray(x_f, np.float32)).max()),
                  down_max_abs_diff=float(np.abs(down_u - down_f).max()), down_scale=scale)
    print(f"dry run: layer 0's K/V pools {'equal' if first_pools_same else 'DIFFER'}; after {layers} layers the "
          f"stream differs by at most {result['stream_max_abs_diff']:.4f} and the last down projection by "
          f"{result['down_max_abs_diff']:.4f} (its largest value {scale:.3f})")
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
            fns = variant_fns(DecodeKernelMatmul(), shape, max_context=a.context)
            runs = {v: [] for v in VARIANTS}
            for _ in range(a.rounds):
                for v in VARIANTS:
                    run, pools = profile_layers(fns[v], (x, pending, weights, pools, step), shape, a.layers)
                    runs[v].append(run)
            for v in VARIANTS:
                best = min(runs[v], key=lambda r: r["span_us"])
                delta = float(np.median([r["span_us"] - b["span_us"]
                                         for r, b in zip(runs[v], runs["unfused"], strict=True)]))
                rows_out.append(dict(model=model, variant=v, rows=a.rows, context=a.context, page=a.page,
                                     layers=a.layers, rounds=runs[v], busy_us=best["busy_us"], span_us=best["span_us"],
                                     parts=best["parts"], span_delta_vs_unfused_us=delta))
                cells = "  ".join(f"{p} {us:6.2f}" for p, us in best["parts"].items())
                print(f"{model:9s} {v:8s} busy {best['busy_us']:7.2f} us/layer  span {best['span_us']:7.2f} "
                      f"({delta:+.2f} vs unfused)  | {cells}", flush=True)
            del weights, pools
        out = dict(benchmark="norm_fold", device=jax.devices()[0].device_kind, jax=jax.__version__,
                   date=datetime.date.today().isoformat(), command=" ".join(sys.argv), rows=rows_out)
    if a.out:
        pathlib.Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
