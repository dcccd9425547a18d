"""End-to-end decode throughput of the engine for a preset and batch size, beside its roofline.

    python benchmarks/e2e_decode.py --model llama-1b --batch 64 --prompt-len 512 --new-tokens 256
    python benchmarks/e2e_decode.py --model llama-70b --batch 32 --prompt-len 512 --new-tokens 128 \
        --tensor-parallel 2 --attention kernel
    python benchmarks/e2e_decode.py --model llama-8b --batch 64 --prompt-len 3840 --new-tokens 256 \
        --attention kernel --kv-precision bf16 fp8-delta      # DKVC (issue #12): one run per precision

Prefill and decode are timed apart (the engine reports each step's kind and wall time). A step the engine
could not time (read back after it finished, with the host elsewhere: time 0) is left out of every rate and
median, and counted as `untimed_steps`. The roofline is
the bytes a decode step must read, weights plus the KV of every running sequence, over a device-to-device
copy bandwidth measured in the same run; with --tensor-parallel N it is the bytes one device holds and
reads (its weight shards, replicated ones whole, and its KV heads) over one device's bandwidth, the N
devices reading in parallel. With a delta --kv-precision (DKVC) the KV bytes per token are the deltas and
scales the cache really holds (stratum_jax/kv/precision.py `kv_bytes_per_slot`), and the JSON records the
precision the engine really ran (after any fallback) and its attention backend: with --attention kernel a
DKVC cache decodes through pallas_kernels/delta_attention.py. --profile-dir DIR also traces a few
full-batch decode calls after the timed pass, each inside a TraceAnnotation, and writes which calls those
were beside the trace (benchmarks/tp_profile_split.py splits their device time into compute and
communication per decode step). --collective-variant NAME sets the XLA flags / NCCL environment of one of
COLLECTIVE_VARIANTS (the small-message all-reduce options to compare at batch 1) before jax starts its
backend. Prints a short
table; writes JSON under benchmarks/results/.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from jax._src import xla_bridge   # backends_are_initialized: no public equivalent in jax 0.11.2

from stratum_jax.config import (DECODE_KERNELS, FP8_SCALES, KV_PRECISIONS, PROJECTION_BACKENDS, SCHEDULERS,
                                TP_EMBEDDINGS, RuntimeConfig)
from stratum_jax.distributed import init_distributed
from stratum_jax.engine import Engine
from stratum_jax.kv.precision import kv_bytes_per_slot
from stratum_jax.model.loader import load_model
from stratum_jax.bandwidth import measure_device_peaks
from stratum_jax.request import SamplingParams
from stratum_jax.tensor_parallel import make_tensor_parallel
from gpu_clocks import ClockSampler  # noqa: E402  (benchmarks/, this script's directory)
from tp_profile_split import WINDOW_FILE  # noqa: E402  (benchmarks/, this script's directory)

WINDOW_ANNOTATION = "e2e_decode_call"   # the TraceAnnotation around each profiled decode call
HLO_FILE = "decode_step.hlo.txt"        # the greedy decode executable's optimized HLO, beside the trace

# Options for tensor-parallel decode at small batches, where each layer's two all-reduces move one
# [rows, hidden] activation and cost latency, not bandwidth. Each is (XLA flags, environment); all exist
# in jaxlib 0.11.2's XLA (`strings libjax_common.so`). The two all-reduces of a layer depend on one
# another, so the combiner thresholds have nothing to combine and are not among them.
COLLECTIVE_VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    "default": ([], {}),
    # XLA's own one-shot all-reduce kernel within one host (each GPU reads its peers' buffers over
    # NVLink and reduces) instead of an NCCL call.
    "one-shot": (["--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE"], {}),
    # Collectives recorded into the CUDA graphs XLA already builds for fusions and custom calls, so a
    # layer's kernels launch as one graph rather than being split at each all-reduce.
    "cmdbuf-collectives": (["--xla_gpu_enable_command_buffer=+COLLECTIVES"], {}),
    # All-reduces run synchronously on the compute stream: no cross-stream events around a tiny message.
    "sync-all-reduce": (["--xla_gpu_disable_async_collectives=ALLREDUCE"], {}),
    # NCCL's low-latency protocol for every message (NCCL normally picks it by size; forced here).
    "nccl-ll": ([], {"NCCL_PROTO": "LL"}),
    # The first two together: one-shot kernels inside the command buffers.
    "one-shot+cmdbuf": (["--xla_gpu_experimental_use_collective_kernels=ALL_REDUCE",
                         "--xla_gpu_enable_command_buffer=+COLLECTIVES"], {}),
}


def apply_collective_variant(name: str, environ=os.environ) -> dict:
    """Sets variant `name`'s XLA flags (appended to XLA_FLAGS) and NCCL variables in `environ`; must run
    before jax initialises its backend. Returns what it set, for the results JSON."""
    if name not in COLLECTIVE_VARIANTS:
        raise ValueError(f"--collective-variant must be one of {sorted(COLLECTIVE_VARIANTS)}, got {name!r}")
    flags, env = COLLECTIVE_VARIANTS[name]
    # XLA reads XLA_FLAGS and NCCL its variables once, when jax first starts the backend: set later, the
    # variant would silently not apply and the comparison would be void.
    if (flags or env) and xla_bridge.backends_are_initialized():
        raise RuntimeError(f"--collective-variant {name}: jax's backend is already initialised; set it first")
    if flags:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", ""), *flags]).strip()
    environ.update(env)
    return {"collective_variant": name, "xla_flags": environ.get("XLA_FLAGS", ""), "env": dict(env)}


def profile_decode_calls(engine, prompts, sp, args) -> None:
    """Traces --profile-calls full-batch decode calls into --profile-dir, each in a WINDOW_ANNOTATION
    TraceAnnotation, and writes WINDOW_FILE there: the annotation's name and each traced call's kind,
    decode steps, wall seconds and the running rows' mean context before it (what tp_profile_split.py and
    profile_decode.py need to count per decode step), and HLO_FILE, the decode program's optimized HLO."""
    for p in prompts:
        engine.add_request([3] + p[1:], sp)
    # Past every prefill and mixed step of these requests, so the traced calls are decode calls of the whole
    # batch. The first step() only dispatches (with async scheduling nothing is read yet, and last_step is
    # still the timed pass's final decode call): look at last_step only from the second on.
    engine.step()
    while engine.has_unfinished():
        engine.step()
        if engine.last_step.kind == "decode" and engine.last_step.num_seqs == args.batch:
            break
    # Then on to where the traced calls straddle the timed pass's median decode context, the context of its median
    # step (the wall time profile_decode.py sets the traced busy time against). Traced from the first full-batch
    # call, at 512 + 256 tokens they read ~94 tokens of context less a row than that step: 0.05 ms of KV a step at
    # llama-1b and 0.19 ms at 8b, which profile_decode.py then reported as host gap (session 26).
    traced_steps = args.profile_calls * args.decode_steps
    target = min(args.prompt_len + (args.new_tokens - traced_steps) / 2,
                 args.prompt_len + args.new_tokens - traced_steps - 1)
    while engine.has_unfinished() and statistics.fmean(engine.running_contexts() or [0]) < target:
        engine.step()
    # With async scheduling a step is read in the next call: drain it, and read each traced step inside
    # its own annotation, so a window holds exactly one step's dispatch, device work and read.
    engine.drain()
    calls = []
    with jax.profiler.trace(args.profile_dir, create_perfetto_trace=True):
        for _ in range(args.profile_calls):
            if not engine.has_unfinished():
                break
            contexts = engine.running_contexts()
            with jax.profiler.TraceAnnotation(WINDOW_ANNOTATION):
                engine.step()
                engine.drain()
            t = engine.last_step
            calls.append({"kind": t.kind, "steps": t.num_tokens // max(t.num_seqs, 1), "seconds": t.seconds,
                          "mean_context": statistics.fmean(contexts) if contexts else 0.0})
    pathlib.Path(args.profile_dir, WINDOW_FILE).write_text(
        json.dumps({"annotation": WINDOW_ANNOTATION, "calls": calls}, indent=2))
    # The compiled decode program, whose op metadata names the model part of each kernel (profile_decode.py).
    pathlib.Path(args.profile_dir, HLO_FILE).write_text(engine.runner.compiled_text(engine.kv_cache))
    while engine.has_unfinished():
        engine.step()


def measure_copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10, inner: int = 5) -> float:
    """Bytes read + written per second by a large device-to-device copy (`inner` back-to-back calls per
    timing, so the host's dispatch latency does not count)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 1)           # reads and writes every element once
    copy(x).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            y = copy(x)
        y.block_until_ready()
        times.append((time.perf_counter() - t) / inner)
    return 2 * x.nbytes / statistics.median(times)


def param_bytes(params) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))


def device_param_bytes(params) -> int:
    """Bytes of parameters on the first device: its shards (a replicated leaf counts whole)."""
    return sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(params))


def engine_config(args, attention: str, kv_precision: str = "bf16",
                  decode_kernel: str = RuntimeConfig.decode_kernel) -> RuntimeConfig:
    """The engine's config for one run of this script's flags (benchmarks/gpu_preflight.py lowers the same)."""
    ctx = args.prompt_len + args.new_tokens
    # Prefill steps of up to --prefill-tokens prompt tokens; decode timing counts only the calls with no
    # prefill at the full batch size, as a static-batch generate runs (a serving load mixes them instead).
    prefill_chunk = 1 << max(3, (args.prompt_len - 1).bit_length())
    return RuntimeConfig(model=args.model, max_batch_size=args.batch, max_context=max(ctx, 256),
                         kv_pool_tokens=args.batch * (ctx + 256), prefill_chunk=prefill_chunk,
                         max_num_batched_tokens=args.batch + args.prefill_tokens,
                         max_tokens_cap=args.new_tokens, attention=attention, page_size=args.page_size,
                         decode_kernel=decode_kernel,
                         decode_steps=args.decode_steps, tensor_parallel=args.tensor_parallel,
                         tp_embedding=args.tp_embedding, scheduler=args.scheduler,
                         coordinator=args.coordinator, num_processes=args.num_processes,
                         process_id=args.process_id, kv_precision=kv_precision,
                         fp8_scale=args.fp8_scale if kv_precision == "fp8-delta" else "granule",
                         interpret_kernels=args.interpret_kernels, async_scheduling=args.async_scheduling,
                         projections=args.projections, l2_prefetch_mb=args.l2_prefetch_mb,
                         fold_norms=args.fold_norms)


def run_combinations(args) -> list[tuple[str, str, str]]:
    """(attention, kv precision, decode kernel) of each run the flags ask for: every --attention x --kv-precision,
    and every --decode-kernel where it applies (the kernel attention on bf16 pools)."""
    return [(attention, prec, kernel) for attention in args.attention for prec in args.kv_precision
            for kernel in (args.decode_kernel if attention == "kernel" and prec == "bf16" else args.decode_kernel[:1])]


def run_one(model, args, attention: str, bw: float, kv_precision: str = "bf16",
            decode_kernel: str = RuntimeConfig.decode_kernel) -> dict:
    config = engine_config(args, attention, kv_precision, decode_kernel)
    engine = Engine(config, model=model)
    if engine.kv_precision != kv_precision:
        print(f"--kv-precision {kv_precision} fell back to {engine.kv_precision} (see the log)", flush=True)
    cfg = engine.model_config
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size - 1, args.prompt_len).tolist() for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    # Warm-up: a full pass compiles every bucket the timed pass touches. Distinct first tokens per
    # pass keep the prefix cache from serving the timed prompts.
    engine.generate([[1] + p[1:] for p in prompts], sp)
    for p in prompts:
        engine.add_request([2] + p[1:], sp)
    # The steps this pass reads back: engine.last_step is a new StepTiming for each, and is the warm-up's last call
    # until the pass reads its first step (with async scheduling the first step() only dispatches).
    timings, seen = [], engine.last_step
    t_all = packed_read_s = time.perf_counter()
    # The SM clock under load: a step bound by its kernels' instruction chains follows it, one bound by HBM does not.
    with ClockSampler() as clocks, tqdm.tqdm(total=args.batch * args.new_tokens, unit="tok",
                                             desc=f"{attention} {engine.kv_precision} decode",
                                             disable=not sys.stderr.isatty()) as bar:
        while engine.has_unfinished():
            outs = engine.step()
            bar.update(sum(len(o.new_token_ids) for o in outs))
            if engine.last_step is not seen:
                seen = engine.last_step
                timings.append(seen)
                if seen.kind in ("prefill", "mixed"):
                    packed_read_s = time.perf_counter()     # the latest packed step's results are on the host
    wall = time.perf_counter() - t_all
    stats = engine.stats()       # counted work over device time of the latest steps: the timed decode calls
    if args.profile_dir:      # after the timed pass: compiled and warm
        profile_decode_calls(engine, prompts, sp, args)
    # Steps the engine could not time carry 0 s (engine_stats.record_timing): out of the rates and medians, as
    # they are out of the engine's own (on a loaded CPU, most of a short run's decode calls can be such).
    if not any(t.kind == "decode" for t in timings):
        raise RuntimeError(f"no decode-only step ran ({len(timings)} steps, kinds "
                           f"{sorted({t.kind for t in timings})}): every step carried prefill; raise --new-tokens "
                           f"(now {args.new_tokens}) above --decode-steps ({args.decode_steps}) x a few")
    timed = [t for t in timings if t.seconds > 0]
    decode = [t for t in timed if t.kind == "decode"]
    prefill = [t for t in timed if t.kind in ("prefill", "mixed")]
    full_decode = [t for t in decode if t.num_seqs == args.batch]
    if not decode:
        print(f"no decode call was timed ({len(timings) - len(timed)} of {len(timings)} steps ran while the host was "
              "elsewhere): the decode rates are NaN", flush=True)
    decode_s = sum(t.seconds for t in decode)
    # A decode call runs up to --decode-steps steps; per-step time = call time / steps in the call.
    step_ms = (statistics.median(t.seconds / (t.num_tokens / t.num_seqs) for t in full_decode) * 1e3
               if full_decode else float("nan"))

    w_bytes = param_bytes(model.params)
    tp = args.tensor_parallel
    w_device = device_param_bytes(model.params)
    # KV heads on one device: the mesh's config has >= tp heads, split evenly (tensor_parallel.py).
    # Bytes per token the cache really holds: bf16 K/V, or a DKVC cache's deltas and scale pieces.
    kv_per_token = kv_bytes_per_slot(engine.kv_cache)
    kv_per_token_device = kv_per_token // tp
    mean_ctx = args.prompt_len + args.new_tokens / 2
    roofline_ms = (w_device + args.batch * mean_ctx * kv_per_token_device) / bw * 1e3
    return {
        "model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "attention": attention, "decode_kernel": (decode_kernel if engine.attention_backend == "kernel" and engine.kv_precision == "bf16"
                          else None),
        "attention_backend": engine.attention_backend, "projections": engine.projections,
        "l2_prefetch_mb": config.l2_prefetch_mb, "fold_norms": config.fold_norms,
        "norms_folded": engine.runner.geo.norms_folded,
        "kv_precision_requested": kv_precision, "kv_precision": engine.kv_precision,
        "fp8_scale": config.fp8_scale if engine.kv_precision == "fp8-delta" else None,
        "page_size": args.page_size or "adaptive", "tensor_parallel": tp,
        "tp_embedding": None if model.tp is None else ("vocab-parallel" if model.tp.splits_vocab() else "replicated"),
        "tp_embedding_flag": args.tp_embedding if tp > 1 else None, **args.variant,
        "processes": jax.process_count(), "devices": tp,
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
        "date": datetime.date.today().isoformat(),
        "decode_steps_per_call": args.decode_steps, "async_scheduling": args.async_scheduling,
        "untimed_steps": len(timings) - len(timed),
        # Every timed decode call, in order: where a rate and its median disagree, which call it was.
        "decode_calls": [dict(ms=t.seconds * 1e3, tokens=t.num_tokens, seqs=t.num_seqs) for t in decode],
        # Every timed packed step (prefill or mixed), in order: which step moves the prefill rate.
        "prefill_calls": [dict(kind=t.kind, ms=t.seconds * 1e3, tokens=t.num_tokens, prefill_tokens=t.prefill_tokens,
                               seqs=t.num_seqs) for t in prefill],
        "decode_tokens_per_s": sum(t.num_tokens for t in decode) / decode_s if decode_s > 0 else float("nan"),
        # Over the calls in which every one of the --batch rows decoded: the rate at that batch size, without the
        # calls at the start and end of the pass that run fewer rows (chunked prefill starts the rows apart).
        "decode_tokens_per_s_full_batch": (sum(t.num_tokens for t in full_decode) / sum(t.seconds for t in full_decode)
                                           if full_decode else float("nan")),
        "decode_step_ms_median": step_ms, "decode_steps": len(decode),
        "prefill_tokens": sum(t.prefill_tokens for t in prefill),
        "prefill_seconds": sum(t.seconds for t in prefill),
        # The same prompts over wall time, from the timed pass's start to the read-back of its last packed step
        # (host work and any decode rows of mixed steps included: a lower bound on the rate). Unlike the rate above
        # it cannot lose a step's device time to the host clock: a packed step whose dispatch returns only once
        # the device has run most of it is timed short (session 26: a first prefill step of 8,192 tokens timed
        # at 3.7-4.4 ms, with the time missing from the other steps).
        "prefill_wall_tokens": sum(t.prefill_tokens for t in timings if t.kind in ("prefill", "mixed")),
        "prefill_wall_seconds": packed_read_s - t_all,
        "wall_seconds": wall, "gpu_clocks": clocks.summary(),   # None without nvidia-smi
        "copy_bandwidth_gbps": bw / 1e9, "weight_bytes": w_bytes,
        "weight_bytes_per_device": w_device, "kv_bytes_per_token": kv_per_token,
        "kv_bytes_per_token_per_device": kv_per_token_device, "roofline_step_ms": roofline_ms,
        "roofline_tokens_per_s": args.batch / (roofline_ms / 1e3),
        "fraction_of_roofline": roofline_ms / step_ms if step_ms == step_ms else None,
        # stratum_hbm_bandwidth_utilization / stratum_gpu_compute_utilization as the server computes them:
        # counted bytes and FLOPs per device second of recent steps (step_work.py) over peaks measured here.
        "read_tbps": args.peaks.read_bytes_per_s / 1e12, "matmul_tflops": args.peaks.matmul_flops_per_s / 1e12,
        **dict(zip(("hbm_bandwidth_utilization", "gpu_compute_utilization"),
                   args.peaks.of_rates(stats.step_bytes_per_s, stats.step_flops_per_s))),
    }


def build_parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """This script's flags (benchmarks/profile_decode.py takes the same and adds its own)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--attention", nargs="+", default=["reference"], choices=["reference", "kernel"])
    ap.add_argument("--decode-kernel", nargs="+", default=[RuntimeConfig.decode_kernel], choices=DECODE_KERNELS,
                    help="the bf16 decode kernel(s) with --attention kernel: one run each")
    ap.add_argument("--kv-precision", nargs="+", default=["bf16"], choices=KV_PRECISIONS,
                    help="one run per precision (and per --attention); DKVC: fp16-delta, fp8-delta")
    ap.add_argument("--fp8-scale", default=RuntimeConfig.fp8_scale, choices=FP8_SCALES,
                    help="fp8-delta's scale rule (the server's --fp8-scale)")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"], help="default: the preset's")
    ap.add_argument("--interpret-kernels", action="store_true",
                    help="--attention kernel in the Pallas interpreter (CPU dry runs of this script; slow)")
    ap.add_argument("--page-size", type=int, default=None)
    ap.add_argument("--projections", default="auto", choices=PROJECTION_BACKENDS,
                    help="the decode step's q/k/v, o and down projections (RuntimeConfig.projections)")
    ap.add_argument("--l2-prefetch-mb", type=float, default=RuntimeConfig.l2_prefetch_mb, metavar="MB",
                    help="the norm kernels' L2 prefetch of the next projection's weight (RuntimeConfig.l2_prefetch_mb)")
    ap.add_argument("--fold-norms", action=argparse.BooleanOptionalAction, default=RuntimeConfig.fold_norms,
                    help="the decode layer with its norms folded into the GEMMs (RuntimeConfig.fold_norms)")
    ap.add_argument("--decode-steps", type=int, default=8, help="decode steps per device call")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="prompt tokens per prefill step")
    ap.add_argument("--copy-gb", type=float, default=4.0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_decode_<model>.json)")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split the model over N devices")
    ap.add_argument("--tp-embedding", default="auto", choices=TP_EMBEDDINGS)
    ap.add_argument("--collective-variant", default="default", choices=sorted(COLLECTIVE_VARIANTS),
                    help="XLA flags / NCCL environment for the all-reduces (COLLECTIVE_VARIANTS)")
    ap.add_argument("--scheduler", default="hab", choices=SCHEDULERS)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="dispatch each step before reading the previous one (the engine's default)")
    ap.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="multi-host (stratum_jax/distributed.py)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--profile-dir", default=None, help="trace --profile-calls decode calls here (perfetto)")
    ap.add_argument("--profile-calls", type=int, default=5)
    return ap


def load(args):
    """The model of args (validated flags, jax.distributed started when asked) and the copy bandwidth
    measured now: (model, bytes per second)."""
    args.variant = apply_collective_variant(args.collective_variant)     # before jax starts its backend
    flags = RuntimeConfig(model=args.model, tensor_parallel=args.tensor_parallel, tp_embedding=args.tp_embedding,
                          scheduler=args.scheduler, coordinator=args.coordinator,
                          num_processes=args.num_processes, process_id=args.process_id)   # validates them
    init_distributed(flags)
    tp = make_tensor_parallel(args.tensor_parallel, embedding=args.tp_embedding)
    model = load_model(args.model, seed=0, tp=tp, dtype=args.dtype)
    # The peaks the utilization figures are taken against (the server's start-up measures the same).
    args.peaks = measure_device_peaks(args.tensor_parallel)
    return model, measure_copy_bandwidth(int(args.copy_gb * (1 << 30)))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    model, bw = load(args)
    suffix = f"_tp{args.tensor_parallel}" if args.tensor_parallel > 1 else ""
    out = pathlib.Path(args.out or f"benchmarks/results/e2e_decode_{args.model}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    runs, failed = [], []
    combos = run_combinations(args)
    for attention, prec, kernel in combos:
        try:
            runs.append(run_one(model, args, attention, bw, prec, kernel))
        except Exception as e:  # noqa: BLE001 - one failing precision (a kernel's first GPU compile) keeps the others
            if len(combos) == 1:
                raise
            failed.append({"attention": attention, "kv_precision": prec, "decode_kernel": kernel,
                           "error": f"{type(e).__name__}: {str(e)[:2000]}"})
            print(f"{attention} {prec} {kernel} FAILED: {failed[-1]['error'][:500]}", flush=True)
        # Free the finished engine's pools (reference cycles keep them until a collection) before the next one is
        # sized: on an 80 GB H100 the fp8-delta run after bf16 (llama-8b, 4K, B=64) found only 9.8 GiB free.
        gc.collect()
        if jax.process_index() == 0:       # every process ran the same steps; one writes them (each run)
            out.write_text(json.dumps(runs + failed, indent=2))
    print(f"{'model':10} {'tp':>3} {'batch':>5} {'attn':>9} {'kernel':>7} {'kv':>10} {'tok/s':>10} {'step ms':>8} {'roof ms':>8} {'of roof':>7} "
          f"{'prefill tok/s':>13} {'(wall)':>9} {'HBM util':>8} {'MMA util':>8}")
    for r in runs:
        print(f"{r['model']:10} {r['tensor_parallel']:3d} {r['batch']:5d} {r['attention']:>9} {r['decode_kernel'] or '-':>7} {r['kv_precision']:>10} {r['decode_tokens_per_s']:10.0f} "
              f"{r['decode_step_ms_median']:8.2f} {r['roofline_step_ms']:8.2f} {r['fraction_of_roofline'] or 0:7.1%} "
              f"{r['prefill_tokens'] / max(r['prefill_seconds'], 1e-9):13.0f} "
              f"{r['prefill_wall_tokens'] / max(r['prefill_wall_seconds'], 1e-9):9.0f} {r['hbm_bandwidth_utilization']:8.1%} "
              f"{r['gpu_compute_utilization']:8.1%}")
        if r.get("gpu_clocks"):
            c = r["gpu_clocks"]
            print(f"  {r['kv_precision']} decode: SM clock median {c['sm_mhz_median']} MHz (min {c['sm_mhz_min']}, "
                  f"max {c['max_sm_mhz']}), power median {c['power_w_median']} W of {c['power_limit_w']}, "
                  f"throttle reasons {c['throttle_reasons']} ({c['samples']} samples)")
    base = {r["attention"]: r for r in runs
            if r["kv_precision"] == "bf16" and r["decode_kernel"] in (None, args.decode_kernel[0])}
    for r in runs:
        if r["kv_precision"] != "bf16" and r["attention"] in base:
            b = base[r["attention"]]
            r["x_bf16_decode_tokens_per_s"] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
            r["x_bf16_decode_tokens_per_s_full_batch"] = (r["decode_tokens_per_s_full_batch"]
                                                          / b["decode_tokens_per_s_full_batch"])
            print(f"{r['attention']} {r['kv_precision']}: {r['x_bf16_decode_tokens_per_s']:.3f}x bf16 decode tok/s over "
                  f"every decode call, {r['x_bf16_decode_tokens_per_s_full_batch']:.3f}x over the calls with all "
                  f"{args.batch} rows (#12 asks >= 1.25x for fp8-delta, llama-8b b64 4K)")
    if jax.process_index() == 0:
        out.write_text(json.dumps(runs + failed, indent=2))
    if not runs:
        return 1
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {runs[0]['device']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
