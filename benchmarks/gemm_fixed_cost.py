"""How a decode GEMM's time splits into a fixed cost and a streaming rate (#18).

The decode step's GEMMs sit 3-4.7 us over their byte floors whatever their size (KERNEL_NOTES.md, "The 1b step over
its byte floor"), an inference across projections of different shapes. This script measures it on one shape family
at a time: the Pallas kernel alone (`decode_matmul_partials`, no XLA sum; `decode_gated_matmul`) at a fixed grid
(the same CTAs, column tile and split) while K grows, so only the bytes each CTA streams change. A least-squares
line t = fixed + bytes / rate over the K points gives the fixed cost (us: ramp, drain, epilogue) and the rate at
which the grid streams once running (TB/s), against the read ceiling measured in the same run. Device time per call
from a jax.profiler trace over --calls calls cycling through weight copies of >= 3x the 50 MB L2 (each call reads
HBM, as a model's layers do).

Families (64 token rows): "down1b" N 2048 on 64-column tiles split 4 (llama-1b's o/down grid, 128 CTAs);
"down8b" N 4096 on 128-column tiles split 4 (llama-8b's down grid); "gated1b" I 8192 gated on 64-column tiles
(llama-1b's gate/up grid). --stages adds the same families with another ring depth (is the rate the ring's?).

    python benchmarks/gemm_fixed_cost.py                  # the H200
    python benchmarks/gemm_fixed_cost.py --dry-run        # CPU: the fit and the kernels' output, interpreter

Prints a table; JSON to --out (default benchmarks/results/gemm_fixed_cost_h200.json).
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from decode_gemm import L2_BYTES, device_us_per_call   # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.decode_matmul import (TuningConfig, decode_gated_matmul, decode_matmul_partials,  # noqa: E402
                                          decode_gated_matmul_reference, decode_matmul_reference)
from stratum_jax.bandwidth import measure_read_bandwidth_gbps  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Family:
    """One grid, swept over K: n output columns (gated: I), the kernel config, and the K values."""
    name: str
    n: int
    config: TuningConfig
    ks: tuple[int, ...]
    gated: bool = False

    def weight_shape(self, k: int) -> tuple[int, int]:
        return (2 * self.n if self.gated else self.n, k)


FAMILIES = (
    Family("down1b", 2048, TuningConfig(tile_n=64, k_splits=4), (1024, 2048, 4096, 8192, 16384)),
    Family("down8b", 4096, TuningConfig(tile_n=128, k_splits=4), (2048, 4096, 8192, 14336)),
    Family("gated1b", 8192, TuningConfig(tile_n=64, num_stages=6, k_splits=1), (512, 1024, 2048, 4096), gated=True),
)
ROWS = 64


def fit(nbytes, us) -> tuple[float, float]:
    """Least squares us = fixed + nbytes / rate: (fixed us, rate TB/s)."""
    slope, fixed = np.polyfit(np.asarray(nbytes, float), np.asarray(us, float), 1)
    return float(fixed), float(1.0 / slope / 1e6)


def op_for(family: Family, interpret: bool = False):
    cfg = family.config
    if family.gated:
        return lambda x, w: decode_gated_matmul(x, w, config=cfg, interpret=interpret)
    return lambda x, w: decode_matmul_partials(x, w, config=cfg, interpret=interpret)


def dry_run() -> dict:
    """Interpreter: a tiny family's outputs against the references, and the fit on exact synthetic points."""
    fixed, rate = fit([1e6, 2e6, 4e6], [3.0 + b / 4.4e6 for b in (1e6, 2e6, 4e6)])
    assert abs(fixed - 3.0) < 1e-6 and abs(rate - 4.4) < 1e-6, (fixed, rate)
    errors = {}
    for fam in (Family("tiny", 256, TuningConfig(tile_n=64, k_splits=2), (512,)),
                Family("tiny_gated", 256, TuningConfig(tile_n=64, k_splits=1), (256,), gated=True)):
        k = fam.ks[0]
        x = jax.random.normal(jax.random.key(0), (ROWS, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(1), fam.weight_shape(k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        got = op_for(fam, interpret=True)(x, w)
        got = got if fam.gated else got.sum(axis=0)
        ref = (decode_gated_matmul_reference(x, w) if fam.gated else decode_matmul_reference(x, w, out_dtype=jnp.float32))
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        errors[fam.name] = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"dry run: fit recovers 3 us + 4.4 TB/s; kernel errors {errors}")
    return dict(benchmark="gemm_fixed_cost", dry_run=True, errors=errors)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(f.name for f in FAMILIES), help="comma-separated families")
    ap.add_argument("--stages", default="", help="comma-separated extra ring depths to run each family with")
    ap.add_argument("--calls", type=int, default=48, help="traced calls a point")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gemm_fixed_cost_h200.json"))
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter: the kernels and the fit only")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    by_name = {f.name: f for f in FAMILIES}
    names = [n for n in a.families.split(",") if n]
    if not names or any(n not in by_name for n in names):
        raise SystemExit(f"--families: choose from {sorted(by_name)}, got {a.families!r}")
    try:
        stages = [int(s) for s in a.stages.split(",") if s]
    except ValueError:
        raise SystemExit(f"--stages: {a.stages!r} is not a comma-separated list of ints") from None
    if any(s < 2 for s in stages) or a.calls < 1:
        raise SystemExit("--stages must be >= 2 and --calls >= 1")
    if a.dry_run:
        out = dry_run()
    else:
        if jax.default_backend() != "gpu":
            raise SystemExit("the timed run needs an NVIDIA Hopper GPU; on CPU use --dry-run")
        read_tbps = measure_read_bandwidth_gbps() / 1e3
        print(f"read ceiling {read_tbps:.2f} TB/s")
        trace_root = tempfile.mkdtemp(prefix="gemm_fixed_cost_")
        families = [by_name[n] for n in names]
        families += [dataclasses.replace(f, name=f"{f.name}_st{s}", config=dataclasses.replace(f.config, num_stages=s))
                     for f in list(families) for s in stages]
        rows = []
        for fam in families:
            points = []
            for k in fam.ks:
                shape = fam.weight_shape(k)
                nbytes = shape[0] * shape[1] * 2
                copies = max(2, -(-3 * L2_BYTES // nbytes))
                key = jax.random.key(k)
                ws = [jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16) * 0.02 for i in range(copies)]
                x = jax.random.normal(jax.random.fold_in(key, 10_000), (ROWS, k), jnp.bfloat16)
                try:
                    us, kernels = device_us_per_call(jax.jit(op_for(fam)), x, ws, calls=a.calls, trace_root=trace_root)
                except Exception as e:        # a config that does not fit is a result, not a crash
                    points.append(dict(k=k, weight_bytes=nbytes, error=f"{type(e).__name__}: {str(e)[:200]}"))
                    print(f"{fam.name:12s} K={k:6d} failed: {str(e)[:120]}", flush=True)
                    continue
                points.append(dict(k=k, weight_bytes=nbytes, us=us, tbps=nbytes / us / 1e6, kernels=kernels))
                print(f"{fam.name:12s} K={k:6d} {nbytes / 2**20:7.1f} MB  {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s",
                      flush=True)
            ok = [p for p in points if "us" in p]
            fixed, rate = fit([p["weight_bytes"] for p in ok], [p["us"] for p in ok]) if len(ok) >= 2 else (None, None)
            rows.append(dict(family=fam.name, n=fam.n, gated=fam.gated, config=dataclasses.asdict(fam.config),
                             points=points, fixed_us=fixed, rate_tbps=rate))
            if fixed is not None:
                print(f"{fam.name:12s} fit: fixed {fixed:5.2f} us, rate {rate:5.2f} TB/s "
                      f"({rate / read_tbps:.0%} of the read ceiling)", flush=True)
        out = dict(provenance("gemm_fixed_cost"), rows_m=ROWS, read_tbps=read_tbps, calls=a.calls, families=rows)
    if a.out:
        save_json(a.out, out)
        print(f"wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
