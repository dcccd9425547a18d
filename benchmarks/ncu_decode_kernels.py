"""Runs the 1B decode step's Pallas kernels a few times each, for Nsight Compute (ncu) to profile one launch.

The kernels at the llama-1b e2e shapes (batch 64, context 642 = the e2e run's median, 32-token pages, head_dim 64;
M = 64 token rows): the swapped decode attention kernel, the o projection (2048 x 2048) and the down projection
(2048 x 8192) on `decode_matmul`, each called twice in that order. On the H200 (ncu is in /usr/local/cuda/bin):

    ncu -k regex:mosaic_gpu_kernel --launch-count 6 --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats python3 benchmarks/ncu_decode_kernels.py
    ncu --set full --import-source no -k regex:body_mosaic --launch-count 1 -f -o /tmp/att \\
        python3 benchmarks/ncu_decode_kernels.py
    ncu -i /tmp/att.ncu-rep --page source --csv --print-source sass > att_sass.csv    # stall samples a SASS line

ncu's default clock control locks the SM clock to its base (it ran at 1.35 GHz on the H200, session 26; its
`--clock-control none` was not tried), so its durations are longer than a run's (1.98 GHz): compare kernels
within one ncu run. BENCHMARKS.md #18 session 26 has the findings.
--interpret --small runs the same calls at small shapes in the Mosaic GPU interpreter (CPU; the test).
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

from pallas_kernels.decode_matmul import TuningConfig, decode_matmul, decode_matmul_reference  # noqa: E402
from pallas_kernels.swapped_decode_attention import (swapped_paged_attention,  # noqa: E402
                                                     swapped_paged_attention_reference)
from pallas_kernels.testing import random_paged_case  # noqa: E402
from stratum_jax.model.projection import KERNEL_CONFIG  # noqa: E402


def shapes(small: bool) -> dict:
    """The calls' shapes: llama-1b's, or small ones for the interpreter."""
    if small:
        return dict(batch=2, context=100, page=32, head_dim=64, rows=64, projections=[(128, 256), (128, 512)])
    return dict(batch=64, context=642, page=32, head_dim=64, rows=64, projections=[(2048, 2048), (2048, 8192)])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2, help="calls of each kernel")
    ap.add_argument("--interpret", action="store_true", help="the Mosaic GPU interpreter (CPU)")
    ap.add_argument("--small", action="store_true", help="small shapes (with --interpret)")
    args = ap.parse_args(argv)
    s = shapes(args.small)
    case = random_paged_case(0, lengths=[s["context"]] * s["batch"], page_sizes=[s["page"]] * s["batch"],
                             num_q_heads=32, num_kv_heads=8, head_dim=s["head_dim"])
    operands = [case[k] for k in ("q", "k_pool", "v_pool", "lengths", "page_starts", "page_sizes")]
    attention = jax.jit(lambda *a: swapped_paged_attention(*a, max_context=768, interpret=args.interpret))
    out = None
    for _ in range(args.calls):
        out = jax.block_until_ready(attention(*operands))
    ref = swapped_paged_attention_reference(*operands)
    errors = {"attention": float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))}
    rng = np.random.default_rng(0)
    config = TuningConfig(tile_n=64) if args.small else KERNEL_CONFIG       # the engine's config
    matmul = jax.jit(lambda x, w: decode_matmul(x, w, config=config, interpret=args.interpret))
    for n, k in s["projections"]:
        x = jnp.asarray(rng.standard_normal((s["rows"], k)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
        for _ in range(args.calls):
            y = jax.block_until_ready(matmul(x, w))
        errors[f"matmul_{n}x{k}"] = float(jnp.max(jnp.abs(y.astype(jnp.float32)
                                                          - decode_matmul_reference(x, w).astype(jnp.float32))))
    print("max |kernel - reference|: " + ", ".join(f"{name} {e:.3g}" for name, e in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
