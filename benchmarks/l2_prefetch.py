"""Does prefetching into L2 from the kernel before each of a decode layer's big kernels shorten the layer? (#18)

The decode step runs 8 kernels a layer back to back, and each weight-streaming GEMM (and the attention kernel) waits on
HBM for its first tiles while the kernel before it leaves HBM idle: a small one (the residual add and norm, the fused
q/k/v write: under a megabyte each) all along, a streaming one (attention, the gate/up GEMM) in its grid's drain. With
`--l2-prefetch-mb MB` those kernels also issue TMA prefetches (pallas_kernels/l2_prefetch.py): the norms of the first
MB of q/k/v's and gate/up's weights, the attention kernel of o's, the gate/up GEMM of down's, and the fused q/k/v
write of each row's first 64 keys and values (attention's first tile). This script times a decode layer on the
engine's own code paths (`DecodeKernelMatmul`, `attention.decode_attention`; 64 token rows of --context keys in
--page-token pages by default):

    input norm (residual_rmsnorm of the last down projection's partials) -> q/k/v GEMM (partials)
    -> fused q/k/v sum, RoPE and K/V write (rope_kv_write; the pools donated, updated in place)
    -> decode attention (the swapped kernel) -> o GEMM (partials) -> post-attention norm
    -> gate/up GEMM with the activation -> down GEMM (partials) -> the next layer

over --layers layers, each with its own weights and pools (far more than the 50 MB L2, as in the model), once per
--budgets variant (MB of prefetch ahead of each GEMM, 0 = none; "8:qkv" prefetches ahead of q/k/v only, to say
which prefetch gains what; target "attention" is the first-tile prefetch), the variants alternating over --rounds so
they share the GPU's clock. Each figure is device time from a jax.profiler trace of one call of the jitted layers,
per layer: every kernel by part (norms, kv_write, attention, each GEMM, other), their sum ("busy") and first start to
last end ("span"), and the span's change against no prefetch ("vs none": the median over rounds of the difference
to the budget-0 variant of the same round, which ran at the same clock).

    python benchmarks/l2_prefetch.py --models llama-1b,llama-8b --budgets 0,8,16,8:qkv,8:o,8:attention
    python benchmarks/l2_prefetch.py --dry-run        # CPU: tiny shapes in the interpreter, the bits checked

Prints a table; JSON to --out (default benchmarks/results/l2_prefetch_h200.json).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys
import tempfile
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from device_trace import (PALLAS_KIND, kernel_kind, kernels as trace_kernels, load_events,  # noqa: E402
                          newest_trace)
from pallas_kernels.decode_matmul import default_k_splits   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.l2_prefetch import WeightPrefetch   # noqa: E402
from pallas_kernels.paged_attention import PAGE_SIZES   # noqa: E402
from pallas_kernels.testing import random_paged_case   # noqa: E402
from pallas_kernels.rope_kv_write import FirstTiles   # noqa: E402
from stratum_jax.attention import RowTables, decode_attention   # noqa: E402
from stratum_jax.model.config import PRESETS   # noqa: E402
from stratum_jax.model.projection import (DecodeKernelMatmul, NextWeight, RopeKVWrite, Unsummed,  # noqa: E402
                                         unsummed_kernel_config)

EPS = 1e-5
FIRST_TILE_KEYS = 64     # what the fused q/k/v write prefetches of each row (DecodeKernelMatmul.rope_kv_write)
# A tiny layer the kernels all take (hidden a multiple of 256, head dim 64) for the dry run.
DRY_SHAPE = dict(hidden=256, q_out=256, kv_out=128, intermediate=512, heads=4, kv_heads=2, head_dim=64)


def layer_shapes(model: str) -> dict:
    cfg = PRESETS[model]
    return dict(hidden=cfg.hidden_size, q_out=cfg.num_heads * cfg.head_dim, kv_out=cfg.num_kv_heads * cfg.head_dim,
                intermediate=cfg.intermediate_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim)


def make_weights(shape: dict, layers: int, seed: int = 0) -> list[dict]:
    """Each layer's bf16 weights in the engine's fused layout: qkv [q_out + 2 kv_out, H], o [H, q_out],
    gate_up [2 I, H], down [H, I], and both norms' [H]."""
    h, i = shape["hidden"], shape["intermediate"]
    qkv_rows = shape["q_out"] + 2 * shape["kv_out"]
    out = []
    for layer in range(layers):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), layer), 6)
        dense = {name: (jax.random.normal(k, dims, jnp.float32) * dims[1] ** -0.5).astype(jnp.bfloat16)
                 for name, k, dims in (("qkv", keys[0], (qkv_rows, h)), ("o", keys[1], (h, shape["q_out"])),
                                       ("gate_up", keys[2], (2 * i, h)), ("down", keys[3], (h, i)))}
        norms = {name: (1.0 + 0.1 * jax.random.normal(k, (h,), jnp.float32)).astype(jnp.bfloat16)
                 for name, k in (("input_norm", keys[4]), ("post_norm", keys[5]))}
        out.append({**dense, **norms})
    return out


# What a prefetch can run ahead of: the q/k/v and gate/up GEMMs (by the norms), down (by gate/up), o (by attention),
# and attention's first K/V tiles (by the fused q/k/v write).
TARGETS = ("qkv", "o", "gate_up", "down", "attention")


def parse_variants(text: str) -> list[tuple[float, tuple[str, ...]]]:
    """'0,8,8:qkv,16:gate_up+down' -> [(MB, targets)]: a budget, and the GEMMs it prefetches for (default all)."""
    out = []
    for item in (t for t in text.split(",") if t):
        mb, _, targets = item.partition(":")
        try:
            budget = float(mb)
        except ValueError:
            raise SystemExit(f"--budgets: {item!r} is not MB[:target+target...]") from None
        names = tuple(targets.split("+")) if targets else TARGETS
        if not 0 <= budget <= 50:
            raise SystemExit(f"--budgets: every budget must be in [0, 50] MB (the L2 holds 50), got {item!r}")
        if any(n not in TARGETS for n in names):
            raise SystemExit(f"--budgets: {item!r}: targets must be among {TARGETS}")
        out.append((budget, names))
    if not out:
        raise SystemExit("--budgets: give at least one budget")
    return out


def variant_label(budget: float, targets: tuple[str, ...]) -> str:
    return f"{budget:g}" + ("" if targets == TARGETS or not budget else ":" + "+".join(targets))


def layers_fn(matmul: DecodeKernelMatmul, shape: dict, targets: tuple[str, ...] = TARGETS, *, max_context: int):
    """f(x [R, H], pending parts [S, R, H], weights, pools, step) -> (x, pending, pools) after every layer (module
    docstring's sequence), prefetching (matmul.l2_prefetch_mb) ahead of the kernels in `targets` only. The pools are
    donated (the fused q/k/v write updates them in place, as in the engine's step): feed the returned ones back."""
    heads, head_dim = shape["heads"], shape["head_dim"]

    def ahead(name, weight, gated=False):
        return NextWeight(weight, gated) if name in targets else None

    def fused(result, what):
        if result is None:
            raise SystemExit(f"{what} does not run on the Pallas kernels at these shapes: pick other --rows or models")
        return result

    def run(x, pending, weights, pools, step: LayerStep):
        rows, tables = x.shape[0], step.tables
        first_tiles = (FirstTiles(tables.page_starts, tables.page_sizes, tables.context_lens)
                       if "attention" in targets else None)
        new_pools = []
        for w, (k_pool, v_pool) in zip(weights, pools, strict=True):
            x, h = fused(matmul.residual_rmsnorm(x, Unsummed(pending), w["input_norm"], EPS, ahead("qkv", w["qkv"])),
                         "the input norm")
            q, k_pool, v_pool = fused(matmul.rope_kv_write(
                h, w["qkv"], RopeKVWrite(step.cos, step.sin, step.slots, k_pool, v_pool, first_tiles=first_tiles),
                heads), "the fused q/k/v write")
            new_pools.append((k_pool, v_pool))
            o_plan = ahead("o", w["o"])
            plan = None if o_plan is None else matmul.prefetch_plan(rows, o_plan)
            attn = decode_attention(q, tables.context_lens - 1, tables, k_pool, v_pool, backend="kernel",
                                    interpret=matmul.interpret, max_context=max_context,
                                    prefetch=None if plan is None else WeightPrefetch(w["o"], plan))
            o = fused(matmul.unsummed(attn.reshape(rows, heads * head_dim), w["o"]), "the o projection")
            x, h = fused(matmul.residual_rmsnorm(x, o, w["post_norm"], EPS, ahead("gate_up", w["gate_up"], True)),
                         "the post-attention norm")
            act = matmul.gated(h, w["gate_up"], ahead("down", w["down"]))
            pending = fused(matmul.unsummed(act, w["down"]), "the down projection").parts
        return x, pending, new_pools
    return jax.jit(run, donate_argnums=(3,))


class LayerStep(NamedTuple):
    """A decode step's per-row inputs every layer shares: the page tables, each row's RoPE cos/sin [R, D/2] and the
    slot its new token's K/V goes to [R] (the row's last key, inside its pages)."""
    tables: RowTables
    cos: jax.Array
    sin: jax.Array
    slots: jax.Array


def span_delta_vs_none(runs: dict, variant) -> float | None:
    """The median over rounds of variant's span a layer minus the no-prefetch variant's in the same round (the
    rounds alternate the variants, so each pair ran at the same clock); None without a budget-0 variant."""
    base = next((runs[v] for v in runs if v[0] == 0), None)
    if base is None:
        return None
    return float(np.median([r["span_us"] - b["span_us"] for r, b in zip(runs[variant], base, strict=True)]))


def make_pools(shape: dict, layers: int, *, rows: int, context: int, page: int, seed: int = 2):
    """One step's rows for every layer (as the engine's step has: `LayerStep`, `rows` rows of `context` keys in
    `page`-token pages at random buddy-allocated places, each writing its last key) and each layer's own K/V pools
    [(k_pool, v_pool)] bf16 [Hkv, slots, D]."""
    case = random_paged_case(seed, lengths=[context] * rows, page_sizes=[page] * rows, num_q_heads=shape["heads"],
                             num_kv_heads=shape["kv_heads"], head_dim=shape["head_dim"], nan_outside=False)
    tables = RowTables(case["lengths"], case["page_starts"], case["page_sizes"])
    last = context - 1
    slots = case["page_starts"][:, last // page] + last % page
    angles = jax.random.uniform(jax.random.key(seed + 1), (rows, shape["head_dim"] // 2), jnp.float32, 0, 6.3)
    step = LayerStep(tables, jnp.cos(angles), jnp.sin(angles), slots.astype(jnp.int32))
    pool_shape = case["k_pool"].shape
    pools = []
    for layer in range(layers):
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), layer))
        pools.append(tuple(jax.random.normal(k, pool_shape, jnp.float32).astype(jnp.bfloat16) for k in keys))
    return step, pools


def part_of(name: str, shape: dict) -> str:
    """A kernel's part in the layer, from its name (the Pallas GEMMs are named decode_matmul_{N}x{K}; the norm-fold
    variants decode_matmul_residual_{N}x{K} and decode_gated_matmul_normed_{N}x{K}, benchmarks/norm_fold.py)."""
    name = re.sub(r"matmul_(residual|normed)_", "matmul_", name)
    h, i = shape["hidden"], shape["intermediate"]
    qkv_rows = shape["q_out"] + 2 * shape["kv_out"]
    gemms = {f"decode_matmul_{qkv_rows}x{h}": "qkv", f"decode_matmul_{h}x{shape['q_out']}": "o",
             f"decode_gated_matmul_{i}x{h}": "gate_up", f"decode_matmul_{h}x{i}": "down"}
    for prefix, part in gemms.items():
        if name.startswith(prefix):
            return part
    if "rmsnorm" in name:
        return "norms"
    if "rope_kv_write" in name:
        return "kv_write"
    return "attention" if kernel_kind(name) == PALLAS_KIND else "other"


def profile_layers(fn, args, shape: dict, layers: int) -> tuple[dict, list]:
    """Device µs per layer of one call of fn(x, pending, weights, pools, step) under jax.profiler: by part, busy (the
    kernels' sum), span; and the pools it returns (fn donates them: pass these to the next call)."""
    x, pending, weights, pools, step = args
    pools = fn(x, pending, weights, pools, step)[2]
    jax.block_until_ready(pools)
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            pools = fn(x, pending, weights, pools, step)[2]
            jax.block_until_ready(pools)
        ks = trace_kernels(load_events(newest_trace(d)), device="GPU")
    parts: dict[str, float] = {}
    for k in ks:
        parts[part_of(k.name, shape)] = parts.get(part_of(k.name, shape), 0.0) + k.us / layers
    return dict(parts=dict(sorted(parts.items())), busy_us=sum(parts.values()),
                span_us=(max(k.end_us for k in ks) - min(k.start_us for k in ks)) / layers), pools


def inputs(shape: dict, rows: int, splits: int, seed: int = 1):
    keys = jax.random.split(jax.random.key(seed), 2)
    x = jax.random.normal(keys[0], (rows, shape["hidden"]), jnp.float32).astype(jnp.bfloat16)
    pending = jax.random.normal(keys[1], (splits, rows, shape["hidden"]), jnp.float32)
    return x, pending


def down_splits(shape: dict, rows: int) -> int:
    """The down projection's split (its partials' leading dim), as the engine's kernel config picks it."""
    n, k = shape["hidden"], shape["intermediate"]
    config = unsummed_kernel_config(rows, n, k, jnp.bfloat16)
    if config is None:
        raise SystemExit(f"the down projection ({n} x {k}) does not run on the kernel at {rows} rows")
    return config.k_splits or default_k_splits(n, k, config.tile_n)


def prefetched_mb(budget: float, shape: dict, rows: int, targets: tuple[str, ...] = TARGETS,
                  context: int = 640) -> dict[str, float]:
    """MB prefetched ahead of each kernel under a budget: the plans DecodeKernelMatmul makes for q/k/v and gate/up (by
    the norms), o (by attention) and down (by the gate/up GEMM); attention's first tiles (by the fused q/k/v write:
    each row's first 64 keys and values, any budget > 0)."""
    h, i = shape["hidden"], shape["intermediate"]
    matmul = DecodeKernelMatmul(l2_prefetch_mb=budget)
    out = {}
    for part, dims, gated in (("qkv", (shape["q_out"] + 2 * shape["kv_out"], h), False),
                              ("o", (h, shape["q_out"]), False), ("gate_up", (2 * i, h), True),
                              ("down", (h, i), False)):
        plan = matmul.prefetch_plan(rows, NextWeight(jax.ShapeDtypeStruct(dims, jnp.bfloat16), gated))
        out[part] = 0.0 if plan is None or part not in targets else plan.nbytes / 2**20
    first = rows * min(context, FIRST_TILE_KEYS) * shape["kv_heads"] * shape["head_dim"] * 2 * 2
    out["attention"] = first / 2**20 if budget > 0 and "attention" in targets else 0.0
    return out


def dry_run(variants) -> dict:
    """Interpreter, DRY_SHAPE, one layer (all four prefetches), 8 rows of 100 keys in 32-token pages: each variant's
    outputs equal no prefetch's, bit for bit."""
    shape, rows, context = DRY_SHAPE, 8, 100
    weights = make_weights(shape, 1)
    step, pools = make_pools(shape, 1, rows=rows, context=context, page=32)
    x, pending = inputs(shape, rows, down_splits(shape, rows))
    results, base = [], None
    for budget, targets in [(0.0, TARGETS)] + [v for v in variants if v[0]]:
        matmul = DecodeKernelMatmul(interpret=True, l2_prefetch_mb=budget)
        run = layers_fn(matmul, shape, targets, max_context=context)
        x_out, pending_out, new_pools = run(x, pending, weights, jax.tree.map(jnp.copy, pools), step)
        out = [np.asarray(a, np.float32) for a in (x_out, pending_out, *jax.tree.leaves(new_pools))]
        base = out if base is None else base
        same = all(np.array_equal(a, b) for a, b in zip(out, base, strict=True))
        fetched = prefetched_mb(budget, shape, rows, targets, context)
        results.append(dict(variant=variant_label(budget, targets), budget_mb=budget, targets=list(targets),
                            prefetched_mb=fetched, same_bits_as_no_prefetch=same))
        cells = ", ".join(f"{part} {mb:.2f}" for part, mb in fetched.items())
        print(f"dry run {variant_label(budget, targets):>14s} MB ({cells} MB prefetched): outputs "
              f"{'equal' if same else 'DIFFER from'} no prefetch's")
    return dict(benchmark="l2_prefetch", dry_run=True, results=results)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b", help="comma-separated presets")
    ap.add_argument("--rows", type=int, default=64, help="token rows (a decode step's batch), 1-128")
    ap.add_argument("--layers", type=int, default=8, help="layers in the timed call, each with its own weights")
    ap.add_argument("--context", type=int, default=640, help="keys a row attends to (e2e_decode's mean: 512 + 128)")
    ap.add_argument("--page", type=int, default=32, help="tokens a page (the adaptive rule's size at 768 tokens)")
    ap.add_argument("--budgets", default="0,8,16,32,8:qkv,8:o,8:gate_up,8:down,8:attention",
                    help="comma-separated variants MB[:target+target...]: MB of prefetch ahead of each GEMM among "
                         f"the targets {TARGETS} (default all; 0: none)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the budgets (alternating, same clock)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/l2_prefetch_h200.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, bit checks only")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    variants = parse_variants(a.budgets)
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
        out = dry_run(variants)
    else:
        if jax.default_backend() != "gpu":
            raise SystemExit("the timed run needs an NVIDIA Hopper GPU; on CPU use --dry-run")
        rows_out = []
        for model in models:
            shape = layer_shapes(model)
            weights = make_weights(shape, a.layers)
            step, pools = make_pools(shape, a.layers, rows=a.rows, context=a.context, page=a.page)
            x, pending = inputs(shape, a.rows, down_splits(shape, a.rows))
            fns = {v: layers_fn(DecodeKernelMatmul(l2_prefetch_mb=v[0]), shape, v[1], max_context=a.context)
                   for v in variants}
            runs = {v: [] for v in variants}
            for _ in range(a.rounds):
                for v in variants:
                    run, pools = profile_layers(fns[v], (x, pending, weights, pools, step), shape, a.layers)
                    runs[v].append(run)
            for v in variants:
                best = min(runs[v], key=lambda r: r["busy_us"])
                delta = span_delta_vs_none(runs, v)
                rows_out.append(dict(model=model, variant=variant_label(*v), budget_mb=v[0], targets=list(v[1]),
                                     prefetched_mb=prefetched_mb(v[0], shape, a.rows, v[1], a.context), rows=a.rows,
                                     context=a.context, page=a.page, layers=a.layers, rounds=runs[v],
                                     busy_us=best["busy_us"], span_us=best["span_us"], parts=best["parts"],
                                     span_delta_vs_none_us=delta))
                cells = "  ".join(f"{p} {us:6.2f}" for p, us in best["parts"].items())
                gain = "" if delta is None else f" ({delta:+.2f} vs none)"
                print(f"{model:9s} prefetch {variant_label(*v):>14s}  busy {best['busy_us']:7.2f} us/layer  span "
                      f"{best['span_us']:7.2f}{gain}  | {cells}", flush=True)
            del weights, pools
        out = dict(provenance("l2_prefetch"), rows=rows_out)
    if a.out:
        save_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
