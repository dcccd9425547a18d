"""Where the swapped kernel on float8 pools departs from float64 on the GPU (diagnostic for the failing
`test_gpu_reduced_pools_match_float64[float8-*]`): the test's case (B=64, Hq=32, Hkv=8, ~1K, every page size,
lengths 0 and 1, NaN in stale slots), several configs, each run twice (a race shows as run-to-run
differences), the worst rows by error, and the same values as bf16 pools through the bf16 kernel."""
from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.swapped_decode_attention import SwappedConfig, default_swapped_config, swapped_paged_attention
from pallas_kernels.testing import float64_attention, ragged_decode_case


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    res = []
    fp8 = jnp.float8_e4m3fn
    for head_dim, batch, seed in ((128, 64, 3), (64, 64, 3), (128, 4, 4)):
        case = ragged_decode_case(batch, head_dim, 1024, seed)
        c8 = {**case, "k_pool": case["k_pool"].astype(fp8), "v_pool": case["v_pool"].astype(fp8)}
        want = float64_attention(c8)
        lengths, sizes = np.asarray(case["lengths"]), np.asarray(case["page_sizes"])
        base = default_swapped_config(head_dim, None, fp8)
        configs = {"default": None, "k1": dataclasses.replace(base, num_splits=1),
                   "k2": dataclasses.replace(base, num_splits=2), "q3": dataclasses.replace(base, fp8_q_terms=3),
                   "S3": dataclasses.replace(base, num_stages=3)}
        for name, cfg in configs.items():
            try:
                o1 = np.asarray(swapped_paged_attention(**c8, config=cfg).astype(jnp.float32))
                o2 = np.asarray(swapped_paged_attention(**c8, config=cfg).astype(jnp.float32))
                err = np.abs(o1 - want)
                row_err = np.nan_to_num(err, nan=1e9).max(axis=(1, 2))
                worst = np.argsort(-row_err)[:6]
                r = dict(head_dim=head_dim, batch=batch, config=name, max_err=float(np.nan_to_num(err, nan=1e9).max()),
                         nan=int(np.isnan(o1).sum()), rerun_max_diff=float(np.nan_to_num(np.abs(o1 - o2), nan=1e9).max()),
                         worst=[dict(b=int(b), length=int(lengths[b]), page=int(sizes[b]), err=float(row_err[b]),
                                     heads=[int(h) for h in np.nonzero(np.nan_to_num(err[b], nan=1e9).max(axis=1) > 2e-2)[0][:8]])
                                for b in worst])
            except Exception as e:  # noqa: BLE001
                r = dict(head_dim=head_dim, batch=batch, config=name, error=f"{type(e).__name__}: {str(e)[:300]}")
            res.append(r)
            print(json.dumps(r), flush=True)
        cb = {**case, "k_pool": c8["k_pool"].astype(jnp.bfloat16), "v_pool": c8["v_pool"].astype(jnp.bfloat16)}
        ob = np.asarray(swapped_paged_attention(**cb).astype(jnp.float32))
        r = dict(head_dim=head_dim, batch=batch, config="bf16 pools, same values",
                 max_err=float(np.nan_to_num(np.abs(ob - want), nan=1e9).max()))
        res.append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
