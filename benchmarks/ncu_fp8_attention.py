"""Runs one of #12's kernel-bar decode attention calls a few times, for Nsight Compute (ncu) to profile one launch.

The shapes of `kernels.py --delta`'s bar (B=64, Hq=32, Hkv=8, D=128, every row at --context keys, pages --page or
"mixed"; the pool placement of benchmarks/paged_layout.py): --kernel paged (the bf16 paged kernel, the bar's
denominator) or fp8 (the swapped kernel on float8_e4m3fn pools, the fixed-scale fp8-delta fold's Pallas kernel,
its default config, q's fp8 split in the kernel; ncu's `-k regex:mosaic` sees the Pallas kernel only).
--fold OVERRIDES runs the fp8 kernel through the fold's path (q and output scales, unit here, and a zero anchor)
with SwappedConfig field=value overrides of that default, to see the registers and CTAs an SM a config gets:
'num_splits=1,shared_smem=True,out_affine_in_kernel=True' is the whole fold in one launch without split-K,
'split_merge_in_kernel=True,out_affine_in_kernel=True' the split-K merge in the kernel. Each call is checked
against the other kernel's output over the same values (e4m3 -> bf16 is exact). On the GPU:

    for k in paged fp8; do for p in 16 64 mixed; do
      ncu -k regex:mosaic --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy \\
          --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
          python3 benchmarks/ncu_fp8_attention.py --kernel $k --page $p; done; done
    ncu --set full --import-source no -k regex:mosaic --launch-skip 1 --launch-count 1 -f -o /tmp/fp8 \\
        python3 benchmarks/ncu_fp8_attention.py --kernel fp8 --page 16
    ncu -i /tmp/fp8.ncu-rep --page source --csv --print-source sass > fp8_sass.csv    # stall samples a SASS line

ncu locks the SM clock to its base by default (1.35 GHz on the H200, #18 session 26): compare kernels within one
ncu run. --interpret --small runs the same calls at small shapes in the Mosaic GPU interpreter (CPU; the test).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config_flags import parse_overrides  # noqa: E402  (beside this script)
from paged_layout import MIXED, batch_page_sizes, page_layout  # noqa: E402
from pallas_kernels.paged_attention import PAGE_SIZES, paged_attention  # noqa: E402
from pallas_kernels.swapped_decode_attention import (  # noqa: E402
    default_swapped_config, swapped_paged_attention)


def shapes(small: bool) -> dict:
    """The bar's shapes, or small ones for the interpreter."""
    if small:
        return dict(batch=2, q_heads=4, kv_heads=1, head_dim=64, context=512)
    return dict(batch=64, q_heads=32, kv_heads=8, head_dim=128, context=4096)


def bar_inputs(B: int, Hq: int, Hkv: int, D: int, context: int, page: str):
    """The bar's operands: q [B, Hq, D] f32, the K and V pools [Hkv, slots, D] float8_e4m3fn (normal * 8, so
    e4m3 -> bf16 gives the paged kernel the same values), and (lengths [B], page_starts [B, pages], page_sizes
    [B]) int32 with every row at `context` keys in pages of `page` (a size or "mixed"), placed as
    benchmarks/paged_layout.py places them."""
    sizes = batch_page_sizes(B, page)
    starts, num_slots = page_layout(np.random.default_rng(1), B, context, sizes, context // 8)
    keys = jax.random.split(jax.random.key(0), 3)
    k8 = (jax.random.normal(keys[0], (Hkv, num_slots, D), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    v8 = (jax.random.normal(keys[1], (Hkv, num_slots, D), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    q = jax.random.normal(keys[2], (B, Hq, D), jnp.float32) * 0.05
    tables = (jnp.full((B,), context, jnp.int32), jnp.asarray(starts), jnp.asarray(sizes, jnp.int32))
    return q, k8, v8, tables


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=("paged", "fp8"), default="fp8")
    ap.add_argument("--page", default="16", help=f"a page size of {PAGE_SIZES} or {MIXED!r}")
    ap.add_argument("--context", type=int, default=None, help="keys a row (default 4096; --small 512)")
    ap.add_argument("--fold", default=None, metavar="OVERRIDES",
                    help="fp8: through the fold's path with these SwappedConfig overrides (see above)")
    ap.add_argument("--calls", type=int, default=2, help="calls of the kernel (ncu: skip the first)")
    ap.add_argument("--interpret", action="store_true", help="the Mosaic GPU interpreter (CPU)")
    ap.add_argument("--small", action="store_true", help="small shapes (with --interpret)")
    args = ap.parse_args(argv)
    s = shapes(args.small)
    B, Hq, Hkv, D = s["batch"], s["q_heads"], s["kv_heads"], s["head_dim"]
    ctx = args.context or s["context"]
    if args.page != MIXED and (not args.page.isdigit() or int(args.page) not in PAGE_SIZES):
        ap.error(f"--page must be one of {PAGE_SIZES} or {MIXED!r}, got {args.page!r}")
    if args.fold is not None and args.kernel != "fp8":
        ap.error("--fold is a way to run the fp8 kernel: add --kernel fp8")
    if ctx % 256:
        ap.error(f"--context must be a multiple of 256 (the layout's block), got {ctx}")
    q, k8, v8, tables = bar_inputs(B, Hq, Hkv, D, ctx, args.page)
    paged = jax.jit(lambda *x: paged_attention(*x, interpret=args.interpret))
    fold = {}
    if args.fold is not None:     # unit scales and a zero anchor: the plain call's values, through the fold's path
        (config,) = parse_overrides(args.fold, default_swapped_config(D, ctx, jnp.float8_e4m3fn))
        fold = dict(config=config, q_scale=jnp.ones((Hq,), jnp.float32), out_scale=jnp.ones((Hkv,), jnp.float32),
                    out_bias=jnp.zeros((Hkv, D), jnp.float32), out_dtype=jnp.bfloat16)
    fp8 = jax.jit(lambda *x: swapped_paged_attention(*x, max_context=ctx, interpret=args.interpret, **fold))
    paged_args = (q.astype(jnp.bfloat16), k8.astype(jnp.bfloat16), v8.astype(jnp.bfloat16), *tables)
    fp8_args = (q, k8, v8, *tables)
    fn, fn_args = (paged, paged_args) if args.kernel == "paged" else (fp8, fp8_args)
    out = None
    for _ in range(args.calls):
        out = jax.block_until_ready(fn(*fn_args))
    other = paged(*paged_args) if args.kernel == "fp8" else fp8(*fp8_args)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - other.astype(jnp.float32))))
    print(f"{args.kernel}{f' fold {args.fold}' if args.fold is not None else ''} B={B} Hq={Hq} Hkv={Hkv} D={D} context {ctx} "
          f"page {args.page}: max |{args.kernel} - other kernel| {err:.3g}")
    return 0 if err <= 3e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
