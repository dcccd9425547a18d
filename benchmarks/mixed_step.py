"""Step time of the packed step: pure decode vs decode plus prefill chunks, at short and long context.

    PYTHONPATH=$PWD python3 benchmarks/mixed_step.py --out $OUT/mixed_step.json            # GPU, llama-1b
    python3 benchmarks/mixed_step.py --model tiny --max-context 1024 --out /tmp/m.json      # CPU smoke run
    ... --kv-precision fp16-delta                                                           # on a DKVC cache

Times the engine's executables directly (stratum_jax/decode.py; no scheduler, no host packing), jitted
as the engine compiles them, with `--max-batch-size` rows whose block tables span `--max-context`:
  - "decode": `decode_steps` (the engine's decode-only call), per step;
  - "decode+prefill": `packed_step` with every row decoding and `chunks` x `chunk` prefill tokens of
    other sequences (each chunk the newest tokens of a sequence at context `prefill_ctx`), padded to
    the engine's bucket.
Both are timed as the engine's async scheduling runs them (`--pipeline` calls dispatched back to back,
so host dispatch overlaps device work); `--pipeline 1` times one call at a time.
The issue #10 target is "decode64 + one 256-token chunk <= 1.3 x a pure decode step". Pages are 256
tokens at distinct slots. Prints a table and writes JSON (median of --reps samples after 2 warm-ups).
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax                                     # noqa: E402
import jax.numpy as jnp                        # noqa: E402
import numpy as np                             # noqa: E402

from stratum_jax import decode as D            # noqa: E402
from stratum_jax.attention import RowTables    # noqa: E402
from stratum_jax.config import FP8_SCALES, KV_PRECISIONS   # noqa: E402
from stratum_jax.kv.precision import start_kv_cache  # noqa: E402
from stratum_jax.kv.slot_write import padding_slots  # noqa: E402
from stratum_jax.model.fused import fuse_projections  # noqa: E402
from stratum_jax.model.loader import load_model  # noqa: E402
from stratum_jax.sampling import SamplingArrays  # noqa: E402
from stratum_jax.step_shapes import MAX_PREFILL_TILE  # noqa: E402
from device_trace import by_kind_us, kernels, load_events, newest_trace  # noqa: E402  (beside this script)
from device_trace import top_kernels as top_kernels_of  # noqa: E402
from run_record import provenance, save_json  # noqa: E402  (beside this script)

PAGE = 256


def tables(rows, width, max_context):
    """Every row owns max_context slots of distinct 256-token pages: starts [rows, width], sizes [rows]."""
    starts = np.zeros((rows, width), np.int32)
    n = max_context // PAGE
    for r in range(rows):
        starts[r, :n] = r * max_context + PAGE * np.arange(n)
    return starts, np.full(rows, PAGE, np.int32)


def packed_batch(geo, decode_ctx, chunks, chunk, prefill_ctx, starts, sizes, num_slots):
    """Rows [0, rows - chunks) decode at decode_ctx; rows [rows - chunks, rows) prefill their newest
    `chunk` tokens at prefill_ctx (one tile-aligned chunk each)."""
    R, tile = geo.rows, geo.prefill_tile
    per = -(-chunk // tile) * tile
    P = max(tile, chunks * per)
    P = 1 << (P - 1).bit_length() if P > tile else P       # the engine's power-of-2 bucket
    T = R + P
    tok = np.ones(T, np.int32); pos = np.full(T, -1, np.int32)
    slots = padding_slots(num_slots, np.arange(T, dtype=np.int32))
    ctx = np.zeros(R, np.int32); si = np.zeros(R, np.int32); tile_rows = np.full(P // tile, -1, np.int32)
    for r in range(R - chunks):
        pos[r] = decode_ctx - 1; ctx[r] = decode_ctx; si[r] = r
        slots[r] = starts[r, pos[r] // PAGE] + pos[r] % PAGE
    off = R
    for i in range(chunks):
        r = R - chunks + i
        p = np.arange(prefill_ctx - chunk, prefill_ctx)
        pos[off:off + chunk] = p; slots[off:off + chunk] = starts[r, p // PAGE] + p % PAGE
        tile_rows[(off - R) // tile:(off - R + per) // tile] = r
        ctx[r] = prefill_ctx; si[r] = off + chunk - 1; off += per
    return D.PackedBatch(*(jnp.asarray(a) for a in (tok, pos, slots, np.zeros(T, np.float32), np.full(T, -1, np.int32),
                                                   tile_rows)),
                         RowTables(jnp.asarray(ctx), jnp.asarray(starts), jnp.asarray(sizes)), jnp.asarray(si))


def top_kernels(trace_dir, call, top=30):
    """Trace one call with jax.profiler (perfetto JSON); print and return the device time summed per
    kernel name and per kind (device_trace.py KINDS): {"busy_ms", "by_class_ms", "top_ms"}."""
    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        call(); jax.block_until_ready(jax.numpy.zeros(1))
        jax.effects_barrier()
    ks = kernels(load_events(newest_trace(trace_dir)), "GPU")
    busy = sum(k.us for k in ks)
    by_class = {kind: us for kind, us in by_kind_us(ks).items() if us > 0}
    ranked = top_kernels_of(ks, top)
    print(f"  device busy {busy / 1e3:.3f} ms; by class: "
          + ", ".join(f"{c} {us / 1e3:.3f}" for c, us in sorted(by_class.items(), key=lambda kv: -kv[1])))
    for t in ranked[:12]:
        print(f"    {t['us'] / 1e3:7.3f} ms  {t['name'][:90]}")
    return {"busy_ms": round(busy / 1e3, 4), "by_class_ms": {c: round(us / 1e3, 4) for c, us in by_class.items()},
            "top_ms": {t["name"]: round(t["us"] / 1e3, 4) for t in ranked}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--max-context", type=int, default=32768)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--attention", default="auto", choices=["auto", "kernel", "reference"])
    ap.add_argument("--cases", default="1024:1:256:256,1024:1:256:8192,1024:3:640:12288,12288:1:256:256,"
                                       "12288:3:640:12288,12288:15:128:12288",
                    help="decode_ctx:chunks:chunk:prefill_ctx,...")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--pipeline", type=int, default=8,
                    help="calls dispatched back to back per timing sample (1: one call at a time)")
    ap.add_argument("--profile", default="", help="also trace each case once with jax.profiler into this directory "
                                                  "and print its top device kernels")
    ap.add_argument("--kv-precision", default="bf16", choices=KV_PRECISIONS,
                    help="the KV cache the steps run on (DKVC: the anchor from the engine's warm-up run)")
    ap.add_argument("--fp8-scale", default="granule", choices=FP8_SCALES,
                    help="fp8-delta's scale rule (the server's --fp8-scale)")
    ap.add_argument("--layout", default="fused", choices=["fused", "hf"],
                    help="weights as the engine runs them (q/k/v and gate/up fused, model/fused.py) or HF's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    m = load_model(args.model, dtype="bfloat16" if args.model != "tiny" else None, seed=0)
    if args.layout == "fused":
        fuse_projections(m)
    cfg = m.config
    backend = args.attention
    if backend == "auto":
        backend = "kernel" if jax.default_backend() == "gpu" else "reference"
    R, W = args.max_batch_size, args.max_context // 8
    geo = D.StepGeometry(rows=R, table_width=W, prefill_tile=MAX_PREFILL_TILE, decode_steps=args.decode_steps,
                         backend=backend)
    num_slots = R * args.max_context
    starts, sizes = tables(R, W, args.max_context)
    precision, kv, _ = start_kv_cache(args.kv_precision, m, num_slots, fp8_scale=args.fp8_scale)
    if precision != args.kv_precision:
        print(f"--kv-precision {args.kv_precision} fell back to {precision} (see the log)", flush=True)
    state = {"kv": kv}

    def timed(call):
        """ms per call: median over --reps samples of --pipeline calls dispatched back to back (each
        call's KV cache the previous one's output), as the engine's async scheduling runs steps: the
        host's dispatch of call n+1 overlaps call n on the device. --pipeline 1 is one call at a time
        (dispatch and the host round trip included)."""
        for _ in range(2):
            out, state["kv"] = call(state["kv"]); jax.block_until_ready(out)
        ts = []
        for _ in range(args.reps):
            t = time.perf_counter()
            for _ in range(args.pipeline):
                out, state["kv"] = call(state["kv"])
            jax.block_until_ready((out, state["kv"]))
            ts.append((time.perf_counter() - t) / args.pipeline)
        return statistics.median(ts) * 1e3

    zf, zi, zu = jnp.zeros((R,), jnp.float32), jnp.zeros((R,), jnp.int32), jnp.zeros((R,), jnp.uint32)
    sampling = SamplingArrays(temperature=zf, top_p=zf + 1, top_k=zi, seed_hi=zu, seed_lo=zu, token_index=zi)
    rows = []
    decode_ms = {}
    print(f"{'case':42} {'ms':>8} {'x decode':>9}")
    for spec in args.cases.split(","):
        dctx, chunks, chunk, pctx = (int(x) for x in spec.split(":"))
        if dctx not in decode_ms:
            last = jnp.ones((R,), jnp.int32)
            pos = jnp.full((R,), dctx - 1, jnp.int32)
            allowed = jnp.full((R,), args.decode_steps, jnp.int32)
            t = RowTables(jnp.zeros((R,), jnp.int32), jnp.asarray(starts), jnp.asarray(sizes))
            ms = timed(lambda kv: D.decode_steps(m.params, kv, last, pos, allowed, t, sampling, cfg=cfg, geo=geo,
                                                 variant=D.SamplerVariant()))
            decode_ms[dctx] = ms / args.decode_steps
            profile = None
            if args.profile:   # one call = --decode-steps steps
                profile = top_kernels(pathlib.Path(args.profile) / f"decode_{dctx}", lambda: state.update(
                    kv=D.decode_steps(m.params, state["kv"], last, pos, allowed, t, sampling, cfg=cfg, geo=geo,
                                      variant=D.SamplerVariant())[1]))
            rows.append(dict(case=f"decode{R}@{dctx}", decode_ctx=dctx, ms=decode_ms[dctx],
                             profile_one_call=profile, steps_per_call=args.decode_steps))
            print(f"{rows[-1]['case']:42} {decode_ms[dctx]:8.2f} {1.0:9.2f}")
        batch = packed_batch(geo, dctx, chunks, chunk, pctx, starts, sizes, num_slots)
        # compiled as the engine compiles it (model_runner: packed_step_compiler_options)
        packed = D.packed_step.lower(m.params, state["kv"], batch, cfg=cfg, geo=geo).compile(
            D.packed_step_compiler_options(jax.default_backend()))
        ms = timed(lambda kv: packed(m.params, kv, batch))
        name = f"decode{R - chunks}@{dctx} + {chunks}x{chunk} prefill@{pctx}"
        profile = None
        if args.profile:
            profile = top_kernels(pathlib.Path(args.profile) / spec.replace(":", "_"),
                                  lambda: state.update(kv=packed(m.params, state["kv"], batch)[1]))
        rows.append(dict(case=name, decode_ctx=dctx, chunks=chunks, chunk=chunk, prefill_ctx=pctx, ms=ms,
                         profile_one_call=profile,
                         prefill_tokens=int(batch.tile_rows.shape[0] * geo.prefill_tile),
                         ratio_to_decode=ms / decode_ms[dctx]))
        print(f"{name:42} {ms:8.2f} {ms / decode_ms[dctx]:9.2f}")
    save_json(args.out, dict(provenance("mixed_step"), backend=backend, kv_precision=precision, args=vars(args),
                             rows=rows))


if __name__ == "__main__":
    main()
