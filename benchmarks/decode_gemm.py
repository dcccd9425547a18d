"""The decode step's projections: XLA's dot vs the weight-streaming Pallas kernel (pallas_kernels/decode_matmul.py).

For each projection of a preset (q/k/v fused, o, gate/up fused, down, LM head) at M token rows, times
y = x @ w.T by XLA (`jnp.einsum`, what the model's Linear runs) and by `decode_matmul` under each --configs
entry; part "gate_up_act" is gate/up with the MLP's activation, silu(gate) * up: XLA's dot and then the
activation (`projection.xla_gated`) against `decode_gated_matmul` (the activation in the GEMM's epilogue). All
as *device* time: every call's GPU kernels (the split-K partial sum and any padding included) summed
from a jax.profiler trace, divided by the calls. The calls cycle over enough distinct weight copies (>= 3x
the 50 MB L2) that each reads its weights from HBM, as a model's layers do (--weights-in-l2: one copy, so weights
that fit stay in L2). Bandwidth = weight bytes / time,
against the read ceiling `stratum_jax.bandwidth` measures (a large bf16 sum) in the same run.

    python benchmarks/decode_gemm.py --models llama-1b,llama-8b --rows 64 --out results/decode_gemm_h200.json
    python benchmarks/decode_gemm.py --dry-run        # CPU, the interpreter, tiny shapes: the checks only
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config_flags import parse_overrides  # noqa: E402  (beside this script)
from device_trace import kernels as trace_kernels, load_events, newest_trace  # noqa: E402  (beside this script)
from kernel_timing import kernel_breakdown  # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)
from pallas_kernels.decode_matmul import (TuningConfig, decode_gated_matmul,  # noqa: E402
                                          decode_gated_matmul_reference, decode_matmul, decode_matmul_reference,
                                          default_k_splits, supports)
from stratum_jax.bandwidth import measure_read_bandwidth_gbps  # noqa: E402
from stratum_jax.model.config import PRESETS  # noqa: E402
from stratum_jax.model.projection import xla_gated  # noqa: E402

L2_BYTES = 50 * 2**20


def projections(cfg) -> dict[str, tuple[int, int]]:
    """{name: (N, K)} of a decode step's GEMMs in the engine's fused layout (tp = 1)."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q_out + 2 * kv_out, cfg.hidden_size), "o": (cfg.hidden_size, q_out),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size),
            "lm_head": (cfg.vocab_size, cfg.hidden_size), "gate_up_act": (2 * cfg.intermediate_size, cfg.hidden_size)}


def parse_configs(spec: str) -> list[TuningConfig]:
    """'default;tile_n=64;num_stages=4,k_splits=2' -> TuningConfigs (field=value overrides of the default)."""
    return parse_overrides(spec, TuningConfig())


def device_us_per_call(fn, xs, ws, *, calls: int, trace_root: str) -> tuple[float, dict[str, float]]:
    """Mean device µs per call of fn(x, w) over `calls` calls cycling through ws, and µs per call by kernel
    name, from a jax.profiler trace (every GPU kernel of every call)."""
    for i in range(3):
        jax.block_until_ready(fn(xs, ws[i % len(ws)]))
    with tempfile.TemporaryDirectory(dir=trace_root) as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            out = None
            for i in range(calls):
                out = fn(xs, ws[i % len(ws)])
            jax.block_until_ready(out)
        ks = trace_kernels(load_events(newest_trace(d)), device="GPU")
    names = kernel_breakdown(ks, calls)["kernels"]
    return sum(names.values()), names


def check(rows: int, n: int, k: int, config: TuningConfig, *, interpret: bool, seed: int = 0,
          gated: bool = False) -> float:
    """Max |kernel - reference| / max |reference| on random data (bf16 output); gated: `decode_gated_matmul`
    with w [n, k] as the gate_up weight."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    op, reference = (decode_gated_matmul, decode_gated_matmul_reference) if gated else (decode_matmul,
                                                                                       decode_matmul_reference)
    got = op(x, w, config=config, interpret=interpret).astype(jnp.float32)
    ref = reference(x, w).astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="llama-1b,llama-8b", help="comma-separated presets")
    ap.add_argument("--rows", default="64", help="comma-separated M (token rows), each in [1, 256]")
    ap.add_argument("--parts", default="qkv,o,gate_up,down,lm_head,gate_up_act", help="comma-separated projections "
                    "(gate_up_act: gate/up and the activation)")
    ap.add_argument("--configs", default="default", help="';'-separated TuningConfig overrides, e.g. "
                    "'default;tile_n=64;num_stages=4'")
    ap.add_argument("--calls", type=int, default=48, help="traced calls per method and shape")
    ap.add_argument("--weights-in-l2", action="store_true", help="one weight copy, reused by every call: the "
                    "weights stay in L2 where they fit (an upper bound for prefetching them ahead of the kernel)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes, checks only")
    return ap


def main(argv=None) -> dict:
    a = build_parser().parse_args(argv)
    configs = parse_configs(a.configs)
    try:
        rows_list = [int(r) for r in a.rows.split(",")]
    except ValueError:
        raise SystemExit(f"--rows: {a.rows!r} is not a comma-separated list of ints") from None
    if any(not 1 <= r <= 256 for r in rows_list):
        raise SystemExit(f"--rows: every M must be in [1, 256], got {a.rows}")
    if a.dry_run:
        results = []
        for rows, n, k, gated in ((64, 256, 512, False), (5, 128, 1024, False), (5, 512, 256, True)):
            for config in configs:
                cfg = dataclasses.replace(config, tile_n=min(config.tile_n, 128), k_splits=None if gated
                                          else config.k_splits)
                err = check(rows, n, k, cfg, interpret=True, gated=gated)
                results.append(dict(rows=rows, n=n, k=k, gated=gated, config=dataclasses.asdict(cfg), rel_err=err))
                print(f"dry run M={rows} N={n} K={k}{' gated' if gated else ''} {cfg}: rel err {err:.2e}")
        return dict(benchmark="decode_gemm", dry_run=True, results=results)

    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in PRESETS]
    if unknown:
        raise SystemExit(f"--models: unknown presets {unknown}; choose from {sorted(PRESETS)}")
    read_tbps = measure_read_bandwidth_gbps() / 1e3     # the server's own probe (chains of calls on a GPU)
    print(f"read ceiling {read_tbps:.2f} TB/s")
    trace_root = tempfile.mkdtemp(prefix="decode_gemm_")
    xla = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(x.dtype))
    results = []
    for model in models:
        shapes = projections(PRESETS[model])
        for part in [p for p in a.parts.split(",") if p]:
            if part not in shapes:
                raise SystemExit(f"--parts: unknown projection {part!r}; choose from {sorted(shapes)}")
            n, k = shapes[part]
            wbytes = n * k * 2
            copies = 1 if a.weights_in_l2 else max(2, -(-3 * L2_BYTES // wbytes))
            key = jax.random.key(0)
            ws = [jax.random.normal(jax.random.fold_in(key, i), (n, k), jnp.bfloat16) * 0.02 for i in range(copies)]
            for rows in rows_list:
                x = jax.random.normal(jax.random.fold_in(key, 10_000 + rows), (rows, k), jnp.bfloat16)
                row = dict(model=model, part=part, rows=rows, n=n, k=k, weight_bytes=wbytes, methods={})
                gated = part == "gate_up_act"
                base = jax.jit(xla_gated) if gated else xla
                us, names = device_us_per_call(base, x, ws, calls=a.calls, trace_root=trace_root)
                row["methods"]["xla"] = dict(us=us, tbps=wbytes / us / 1e6, kernels=names)
                ref = base(x, ws[0]).astype(jnp.float32)
                for config in configs:
                    label = "kernel " + ",".join(f"{f}={v}" for f, v in dataclasses.asdict(config).items()
                                                 if v != getattr(TuningConfig(), f))
                    if not supports(rows, n // 2 if gated else n, k, config, gated=gated):
                        row["methods"][label] = dict(error="shape not supported")
                        continue
                    op = decode_gated_matmul if gated else decode_matmul
                    fn = jax.jit(lambda x, w, c=config, op=op: op(x, w, config=c))
                    try:
                        got = fn(x, ws[0]).astype(jnp.float32)
                        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
                        us, names = device_us_per_call(fn, x, ws, calls=a.calls, trace_root=trace_root)
                    except Exception as e:   # a config that does not compile or fit is a result, not a crash
                        row["methods"][label] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                        continue
                    splits = 1 if gated else config.k_splits or default_k_splits(n, k, config.tile_n)
                    row["methods"][label] = dict(us=us, tbps=wbytes / us / 1e6, rel_err=err, k_splits=splits,
                                                 kernels=names)
                results.append(row)
                cells = "  ".join(f"{name} {m['us']:7.1f}us {100 * m['tbps'] / read_tbps:5.1f}%" if "us" in m
                                  else f"{name} {m['error'][:40]}" for name, m in row["methods"].items())
                print(f"{model:9s} {part:8s} M={rows:3d} N={n:6d} K={k:5d}  {cells}", flush=True)
            del ws
    out = dict(provenance("decode_gemm"), read_tbps=read_tbps, calls=a.calls, weights_in_l2=a.weights_in_l2,
               results=results)
    if a.out:
        save_json(a.out, out)
    return out


if __name__ == "__main__":
    main()
