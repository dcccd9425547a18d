"""What bounds the swapped decode-attention kernel at a decode step's short context: HBM, or each CTA's chain?

For each head dim, context and SwappedConfig, the Pallas kernel's device time per call (a jax.profiler trace of
a chain of calls in one executable, `kernel_timing.kernel_profile`) over these layouts of the same batch:
  - hbm:      every row its own pages, placed at random in the pool: the K/V bytes come from HBM;
  - contiguous: the same bytes with every row's pages one after another and the rows one after another (a pool
              filled in order, as a prefill of whole prompts fills a fresh one): concurrent CTAs stream from
              addresses a fixed stride apart, which may load some HBM channels more than others;
  - l2:       every row's page table pointing at row 0's pages: the same tiles, copies, MMAs and softmax,
              but the bytes (one sequence's: a few MB) come from L2 after the first touch;
  - one-tile: every row one tile long (block_kv keys): a call's fixed cost (launch, page table, q, the first
              copies' latency, the epilogue) with almost no streaming;
  - engine:   the page tables the engine's allocator really gave e2e_decode.py's batch (--engine-tables, from
              benchmarks/engine_page_tables.py: prompts mostly in runs of pages, decode pages wherever the pool
              had room), each row cut to the context; its page size must be among --pages.
hbm close to l2 means the chain (copy issue, waits, MMAs, softmax, barriers) bounds the kernel, not the bytes;
l2 well under hbm means the bytes do. The one-tile time is what no streaming work hides.

--own-pools N (GPU only) adds *own-pools*: the hbm layout's kernel in a chain that cycles through N copies of the
pools, as a step's N layers each read their own (a chain of one batch re-reads pools that may be partly in L2
from the call before: 84 MB a call at llama-1b's shape against a 50 MB L2). own-pools against hbm says how much the
alone figure owes to L2.

--between MB (GPU only) adds a figure, *between*: the hbm layout's kernel timed interleaved with a
weight-streaming GEMM of about MB megabytes (`decode_matmul` of the batch's rows, the engine's config), the two
alternating as a decode step runs a GEMM between two attention calls (`kernel_timing.paired_profile`, medians). A
kernel alone in a chain runs after itself; in the step it runs after kernels that stream other bytes through L2 and
leave written lines there, and its time in the step was 11-13% above its time alone (BENCHMARKS.md #18 session 28):
between against hbm says how much of that a GEMM in between explains.

    python benchmarks/attention_bound.py                          # H200: llama-1b/8b shapes at e2e's context
    python benchmarks/attention_bound.py --dry-run                # CPU: tiny shapes in the interpreter

Prints a table; JSON to --out (default benchmarks/results/attention_bound_h200.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from config_flags import parse_overrides       # noqa: E402  (beside this script)
from kernel_timing import kernel_profile, paired_profile, read_ceiling   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.decode_matmul import decode_matmul   # noqa: E402
from pallas_kernels.swapped_decode_attention import (  # noqa: E402
    default_swapped_config, swapped_paged_attention, swapped_paged_attention_reference)
from pallas_kernels.paged_attention import PAGE_SIZES   # noqa: E402
from pallas_kernels.testing import random_paged_case   # noqa: E402
from stratum_jax.model.projection import kernel_config   # noqa: E402

LAYOUTS = ("hbm", "contiguous", "l2", "one-tile", "engine")
ENGINE_TABLES = ROOT / "benchmarks/results/engine_page_tables_b64_p512_c640.json"


def load_engine_tables(path) -> dict:
    """benchmarks/engine_page_tables.py's dump, checked: {num_slots, rows: [{length, page_size, page_starts}]}."""
    try:
        dump = json.loads(pathlib.Path(path).read_text())
        rows, num_slots = dump["rows"], int(dump["num_slots"])
        for r in rows:
            pages, size = r["page_starts"], r["page_size"]
            if len(pages) * size < r["length"] or min(pages) < 0 or max(pages) + size > num_slots:
                raise ValueError(f"a row's pages do not hold its {r['length']} keys inside {num_slots} slots")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"--engine-tables {path}: not a benchmarks/engine_page_tables.py dump ({e}); make one with "
                         "JAX_PLATFORMS=cpu python benchmarks/engine_page_tables.py") from e
    if len({r["page_size"] for r in rows}) != 1:
        raise SystemExit(f"--engine-tables {path}: the rows have several page sizes; the layout needs one")
    return dump


def engine_case(tables: dict, *, batch, context, head_dim, q_heads, kv_heads) -> dict:
    """The engine layout: the dump's first `batch` rows' tables, each row cut to `context` keys, over a pool of
    the dump's slot count."""
    rows = tables["rows"][:batch]
    if len(rows) < batch or any(r["length"] < context for r in rows):
        raise SystemExit(f"the engine tables hold {len(tables['rows'])} rows of at least "
                         f"{min(r['length'] for r in tables['rows'])} keys: --batch {batch} and --contexts {context} "
                         "must fit (dump them again with benchmarks/engine_page_tables.py)")
    page = rows[0]["page_size"]
    width = -(-context // page)
    case = random_paged_case(0, lengths=[context] * batch, page_sizes=[page] * batch, num_q_heads=q_heads,
                             num_kv_heads=kv_heads, head_dim=head_dim, num_slots=tables["num_slots"],
                             nan_outside=False)
    case["page_starts"] = jnp.asarray([r["page_starts"][:width] for r in rows], jnp.int32)
    return case


def make_case(layout: str, *, batch, context, page, head_dim, block_kv, q_heads, kv_heads, tables=None):
    """The kernel's arguments for one layout (module docstring). Every row has the same length, as a batch
    admitted together has in benchmarks/e2e_decode.py. tables: `load_engine_tables`' dump (the engine layout)."""
    if layout == "engine":
        return engine_case(tables, batch=batch, context=context, head_dim=head_dim, q_heads=q_heads,
                           kv_heads=kv_heads)
    length = block_kv if layout == "one-tile" else context
    case = random_paged_case(0, lengths=[length] * batch, page_sizes=[page] * batch, num_q_heads=q_heads,
                             num_kv_heads=kv_heads, head_dim=head_dim, nan_outside=False)
    if layout == "l2":
        case["page_starts"] = jnp.broadcast_to(case["page_starts"][:1], case["page_starts"].shape)
    if layout == "contiguous":     # row b's page i at slot (b * pages + i) * page: rows at a fixed stride
        width = case["page_starts"].shape[1]
        case["page_starts"] = jnp.asarray(
            (np.arange(batch)[:, None] * (width - 1) + np.arange(width)[None, :]) * page, jnp.int32)
    return case


def kv_bytes(case) -> int:
    """K and V bytes the call reads: every row's keys, each kv head, both pools."""
    kv_heads, _, head_dim = case["k_pool"].shape
    return int(case["lengths"].sum()) * kv_heads * head_dim * 2 * case["k_pool"].dtype.itemsize


def between_weight(megabytes: float, batch: int, k: int):
    """The GEMM of --between: a [N, k] bf16 weight of about `megabytes` MB (N a multiple of 64), and
    f(y [batch, Hq, D], w) -> y plus 0 times the product's first column (so the next attention call depends on it)."""
    n = max(64, int(megabytes * 2 ** 20 / (2 * k)) // 64 * 64)
    w = jax.random.normal(jax.random.key(7), (n, k), jnp.bfloat16) * 0.02
    config = kernel_config(batch, n, k)

    def gemm(y, w):
        x = y.reshape(batch, -1)[:, :k].astype(jnp.bfloat16)
        col = decode_matmul(x, w, config=config)[:, :1].astype(y.dtype)
        return y + 0 * col[:, :, None]
    return w, gemm


def own_pools_time(fn, args, copies: int, *, calls: int) -> dict:
    """fn's Pallas kernel a call when each of `copies` consecutive calls reads its own copy of the K/V pools (args[1],
    args[2]), as a step's layers do: {us, copies, busy_us}. The copies are device-side sums (distinct buffers, the
    same tables)."""
    q, k_pool, v_pool, *tables = args
    ks = tuple(k_pool + jnp.asarray(i, k_pool.dtype) for i in range(copies))
    vs = tuple(v_pool + jnp.asarray(i, v_pool.dtype) for i in range(copies))

    def layers(x, ks, vs, *tables):
        for k, v in zip(ks, vs):
            x = fn(x, k, v, *tables).astype(x.dtype)
        return x
    prof = kernel_profile(layers, [q, ks, vs, *tables], calls=max(1, calls // copies))
    return dict(us=prof["pallas_us"] / copies, copies=copies, busy_us=prof["busy_us"] / copies)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--contexts", default="640,2048", help="keys per row (e2e_decode's batch 64 x prompt 512 "
                                                           "+ 256 new tokens averages 640)")
    ap.add_argument("--pages", default="32", help="comma-separated page sizes (the engine's adaptive rule gives 32 "
                                                  "at 768 expected tokens)")
    ap.add_argument("--configs", default="default",
                    help="SwappedConfigs, ';'-separated, each 'default' (default_swapped_config(head_dim, context)) "
                         "or field=value overrides of it, e.g. 'default;num_stages=4'")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--calls", type=int, default=20, help="chained calls in the traced executable")
    ap.add_argument("--own-pools", type=int, default=0, metavar="N",
                    help="GPU: also time the hbm layout cycling through N copies of its pools (docstring)")
    ap.add_argument("--between", type=float, default=0.0, metavar="MB",
                    help="GPU: also time the hbm layout interleaved with a GEMM streaming this many MB (docstring)")
    ap.add_argument("--engine-tables", default=str(ENGINE_TABLES),
                    help="the engine layout's page tables (benchmarks/engine_page_tables.py's JSON)")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes in the Mosaic GPU interpreter (CPU)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/attention_bound_h200.json"))
    a = ap.parse_args(argv)
    layouts = [x.strip() for x in a.layouts.split(",") if x.strip()]
    if not layouts or any(x not in LAYOUTS for x in layouts):
        ap.error(f"--layouts: give some of {','.join(LAYOUTS)}, got {a.layouts!r}")
    if a.between and (a.dry_run or "hbm" not in layouts):
        ap.error("--between times the hbm layout on a GPU: not with --dry-run, and --layouts must include hbm")
    if a.own_pools and (a.dry_run or "hbm" not in layouts or a.own_pools < 2):
        ap.error("--own-pools N times the hbm layout on a GPU over N >= 2 pools: not with --dry-run, and --layouts "
                 "must include hbm")
    extra = (["own-pools"] if a.own_pools else []) + (["between"] if a.between else [])
    if a.dry_run:     # one small call a layout, checked against the reference
        a.batch, a.q_heads, a.kv_heads, a.head_dims, a.contexts, a.calls = 2, 8, 2, "64", "96", 1
    head_dims = [int(x) for x in a.head_dims.split(",")]
    contexts = [int(x) for x in a.contexts.split(",")]
    pages = [int(x) for x in a.pages.split(",")]
    if any(p not in PAGE_SIZES for p in pages):
        ap.error(f"--pages: each must be one of {PAGE_SIZES}, got {a.pages!r}")
    tables = load_engine_tables(a.engine_tables) if "engine" in layouts else None
    engine_page = tables["rows"][0]["page_size"] if tables else None
    if tables and engine_page not in pages:
        ap.error(f"--layouts engine: its tables are in {engine_page}-token pages; add {engine_page} to --pages")
    meta = dict(provenance("attention_bound"), batch=a.batch, q_heads=a.q_heads, kv_heads=a.kv_heads, pages=pages,
                calls=a.calls, dry_run=a.dry_run, engine_tables=a.engine_tables if tables else None)
    if not a.dry_run:
        meta["read_ceiling"] = read_ceiling(1 << 31, reps=10)
    read_tbps = meta.get("read_ceiling", {}).get("tbps")
    print(json.dumps(meta), flush=True)
    rows = []
    print(f"{'D':>4} {'ctx':>5} {'page':>4} {'config':<36} "
          + " ".join(f"{x:>15}" for x in layouts + extra))
    for head_dim, context, page in itertools.product(head_dims, contexts, pages):
        for config in parse_overrides(a.configs, default_swapped_config(head_dim, context)):
            row = dict(head_dim=head_dim, context=context, page=page, config=repr(config), layouts={})
            for layout in layouts:
                if layout == "engine" and page != engine_page:
                    row["layouts"][layout] = None      # the engine's tables are in one page size
                    continue
                case = make_case(layout, batch=a.batch, context=context, page=page, head_dim=head_dim,
                                 block_kv=config.block_kv, q_heads=a.q_heads, kv_heads=a.kv_heads, tables=tables)

                def fn(q, k_pool, v_pool, lengths, page_starts, page_sizes, config=config):
                    return swapped_paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes,
                                                   config=config, max_context=context, interpret=a.dry_run)
                args = [case[k] for k in ("q", "k_pool", "v_pool", "lengths", "page_starts", "page_sizes")]
                if a.dry_run:
                    err = float(jnp.max(jnp.abs(fn(*args).astype(jnp.float32) - swapped_paged_attention_reference(
                        *args).astype(jnp.float32))))
                    if not err < 2e-2:
                        raise SystemExit(f"{layout}: the kernel's output differs from the reference by {err}")
                prof = kernel_profile(fn, args, calls=a.calls)
                us = prof["pallas_us"] if prof["pallas_us"] else prof["busy_us"]
                nbytes = kv_bytes(case)
                row["layouts"][layout] = dict(us=us, kv_bytes=nbytes, busy_us=prof["busy_us"],
                                              tbps=nbytes / us / 1e6 if us else None)
                if layout == "hbm" and a.own_pools:
                    own = own_pools_time(fn, args, a.own_pools, calls=a.calls)
                    row["layouts"]["own-pools"] = dict(own, kv_bytes=nbytes, tbps=nbytes / own["us"] / 1e6)
                if layout == "hbm" and a.between:
                    w, gemm = between_weight(a.between, a.batch, a.q_heads * head_dim)
                    pair = paired_profile(fn, args, gemm, [args[0], w], calls=a.calls)
                    row["layouts"]["between"] = dict(us=pair["base_pallas_us"], gemm_us=pair["pallas_us"],
                                                     gemm_bytes=w.size * 2, kv_bytes=nbytes,
                                                     tbps=nbytes / pair["base_pallas_us"] / 1e6)
            rows.append(row)
            cells = []
            for layout in layouts + extra:
                r = row["layouts"][layout]
                if r is None:
                    cells.append("-")
                    continue
                pct = f" {100 * r['tbps'] / read_tbps:3.0f}%" if read_tbps and r["tbps"] else ""
                cells.append(f"{r['us']:9.1f}us{pct}" if layout == "hbm" else f"{r['us']:14.1f}us")
            short = ",".join(f"{k}={getattr(config, k)}" for k in ("block_kv", "num_stages", "num_splits")
                             if getattr(config, k) is not None)
            print(f"{head_dim:>4} {context:>5} {page:>4} {short:<36} " + " ".join(f"{c:>15}" for c in cells),
                  flush=True)
    result = dict(meta=meta, rows=rows)
    print(f"wrote {save_json(a.out, result)}")
    return result


if __name__ == "__main__":
    main()
