"""Multi-turn conversations through an HBM pool too small for them: no host tier vs a host tier, with and
without prefetch. What a host tier buys is prompt tokens not recomputed; what it costs is copies.

    PYTHONPATH=$PWD python3 benchmarks/host_tier.py                                   # tiny, CPU, seconds
    PYTHONPATH=$PWD python3 benchmarks/host_tier.py --model llama-1b --dtype bfloat16 --conversations 96 \\
        --kv-pool-tokens 65536 --kv-host-tokens 524288 --out benchmarks/results/host_tier_h200.json

Workload (the same for every condition, greedy): `--conversations` chats, `--turns` turns each. Every
prompt starts with one shared system prompt; turn t+1's prompt is turn t's prompt, its answer and a new
user message. Turns go round-robin (all first turns, then all second turns, ...), at most `--batch`
requests running, so by the time a chat comes back its KV has usually been pushed out of the HBM pool
by the others: without a host tier its whole history is prefilled again.

`--recall-vs-recompute` measures instead what #12 asks of the tier: one `--context`-token prompt evicted
to the host tier and recalled, against recomputing it, and the raw pinned-host <-> device copy bandwidth:

    PYTHONPATH=$PWD python3 benchmarks/host_tier.py --recall-vs-recompute --model llama-8b --context 32768 \
        --out benchmarks/results/host_tier_recall_llama-8b_32k.json

(#12: recall >= 10x faster than recompute; host -> device copies >= 40 GB/s.) The HBM pool holds one
such prompt, so each prompt evicts the one before it to the host tier. Order: P0 (compiles), P1 and P2
(recomputed: the recompute times), then `--recalls` runs alternating P1 and P2 (recalled from the tier: the
recall times, the first of which may include compiling the copies' shapes and the tail's step; the fastest
and the median of the others are reported). A time is the request's
wall time to its first token (the tail of the prompt past its last full page is always prefilled).
Each run also counts how the other prompt's pages left HBM to make room: copied out (device -> host), or
returned to the tier with the host copy kept since their recall (no copy: from the second recall on, the
prompt being evicted was itself recalled; kv/host_tier.py). The recall time is the fastest recall run.

Each run's time is split into the engine's host phases (`Engine.phases`, stratum_jax/phase_times.py):
add_requests; schedule (of which schedule.match_prefix: hashing and lookups over every page size, and
schedule.acquire_prefix: recall booking, evictions); prefetch; transfers (of which offload_wait,
offload_start, upload = device_put + staging + wait, scatter); dispatch; collect (waiting for the device
and reading the token back); postprocess; and `other` = the wall time no phase covers (generate's loop).
`compile_s` is XLA compile time inside the run (jax.monitoring), already counted in the phase it fell in,
with the functions compiled. Device work shows up where the host waits for it (upload.wait, collect).
A random-weight preset whose max_position_embeddings is below --context is stretched to fit (said in the
output and the JSON): its weights do not depend on it, so only the rope positions go further.

Measured per condition: prompt tokens computed vs served from cache (HBM or host), host hits, prefetched
pages, bytes copied each way, wall time, output tokens/s, and time to first token (p50/p90) of the
turns after the first. Writes JSON (--out) and a PNG beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from run_record import provenance, save_json  # noqa: E402  (beside this script)


def run_condition(model, args, name: str, host_tokens: int, prefetch_pages: int) -> dict:
    import tqdm

    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.request import SamplingParams

    per_chat = args.system_len + args.turns * (args.user_len + args.answer_len)
    max_context = 1 << max(8, (per_chat - 1).bit_length())
    config = RuntimeConfig(model=args.model, dtype=args.dtype, max_batch_size=args.batch, max_context=max_context,
                           kv_pool_tokens=max(args.kv_pool_tokens, max_context), prefill_chunk=args.prefill_chunk,
                           max_tokens_cap=args.answer_len, max_queue=args.conversations + 8,
                           kv_host_tokens=host_tokens, kv_prefetch_pages=prefetch_pages,
                           attention=args.attention, scheduler=args.scheduler)
    engine = Engine(config, model=model)
    engine.pool.recall_choice.always_recall = args.recall == "always"
    engine.warmup()
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)                     # the same tokens in every condition
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    users = [[[rng.randrange(3, vocab) for _ in range(args.user_len)] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    history = [list(system) for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.answer_len, temperature=0.0, ignore_eos=True)
    ttft, computed, cached, out_tokens = [], 0, 0, 0
    s0 = engine.stats()
    t_start = time.perf_counter()
    bar = tqdm.tqdm(total=args.conversations * args.turns, desc=name, unit="turn", leave=False)
    for turn in range(args.turns):
        pending = {}
        for c in range(args.conversations):
            prompt = history[c] + users[c][turn]
            pending[engine.add_request(prompt, params)] = (c, prompt, time.perf_counter())
        answers = {}
        while engine.has_unfinished():
            for out in engine.step():
                c, prompt, t0 = pending[out.request_id]
                if out.new_token_ids and out.request_id not in answers:
                    if turn > 0:
                        ttft.append((time.perf_counter() - t0) * 1e3)
                    answers[out.request_id] = []
                answers.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    bar.update(1)
                    cached += out.cached_prompt_tokens
                    computed += out.prompt_tokens - out.cached_prompt_tokens
                    out_tokens += len(answers[out.request_id])
        for rid, (c, prompt, _) in pending.items():
            history[c] = prompt + answers[rid]
    wall = time.perf_counter() - t_start
    bar.close()
    st = engine.stats()
    ts = engine.transfers.stats
    q = statistics.quantiles(ttft, n=10) if len(ttft) >= 10 else [float("nan")] * 9
    return {
        "condition": name, "kv_host_tokens": host_tokens, "kv_prefetch_pages": prefetch_pages,
        "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
        "prompt_tokens_computed": computed, "prompt_tokens_cached": cached,
        "cached_share": cached / max(1, cached + computed),
        "ttft_ms_p50_later_turns": statistics.median(ttft) if ttft else float("nan"), "ttft_ms_p90_later_turns": q[8],
        "host_hit_pages": st.kv_host_hits - s0.kv_host_hits, "prefetched_pages": st.kv_prefetched_pages - s0.kv_prefetched_pages,
        "offloaded_pages": ts.offloaded_pages, "recalled_pages": ts.recalled_pages,
        "offloaded_gb": ts.offloaded_bytes / 1e9, "recalled_gb": ts.recalled_bytes / 1e9,
        "transfer_s": ts.seconds, "transfer_device_get_s": ts.device_get_s, "transfer_upload_s": ts.upload_s,
        "preemptions": st.preemptions - s0.preemptions,
        "recall_choices": st.kv_recall_choices - s0.kv_recall_choices,
        "recompute_choices": st.kv_recompute_choices - s0.kv_recompute_choices,
        "final_answers_digest": hash(tuple(tuple(h[-args.answer_len:]) for h in history)) & 0xFFFFFFFF,
    }


def pinned_copy_bandwidth(nbytes: int, repeats: int = 5) -> dict:
    """GB/s of direct copies between a pinned_host array and the device (jax.device_put with a sharding
    of that memory kind, kv/transfer.py's path), each way: the median of `repeats` timed copies."""
    import jax
    import numpy as np

    from stratum_jax.kv.transfer import host_memory_kind
    dev = jax.devices()[0]
    kind, why = host_memory_kind(dev)
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind=kind) if kind else None
    on_dev = jax.sharding.SingleDeviceSharding(dev)
    x_dev = jax.device_put(np.ones(nbytes // 2, np.uint16), on_dev)
    x_host = jax.device_put(x_dev, host) if host is not None else np.asarray(x_dev)
    out = {"memory_kind": kind, "why": why, "bytes": nbytes}
    for name, src, dst in (("host_to_device", x_host, on_dev), ("device_to_host", x_dev, host)):
        times = []
        for _ in range(repeats + 1):                # the first one warms up
            t = time.perf_counter()
            y = jax.device_put(src, dst) if dst is not None else np.asarray(src)
            jax.block_until_ready(y)
            times.append(time.perf_counter() - t)
            del y
        out[f"{name}_gbps"] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def recall_vs_recompute(model, args) -> dict:
    """One --context-token prompt recalled from the host tier vs recomputed (module docstring)."""
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.phase_times import top_level_total
    from stratum_jax.request import SamplingParams

    ctx, page = args.context, args.page_size
    max_context = ctx + page
    pool = -(-(ctx + 4 * page) // 256) * 256           # one prompt (and a little), never two
    config = RuntimeConfig(model=args.model, dtype=args.dtype, max_batch_size=1, max_context=max_context,
                           kv_pool_tokens=pool, prefill_chunk=args.prefill_chunk, max_tokens_cap=1,
                           kv_host_tokens=4 * ctx, kv_prefetch_pages=0, page_size=page, attention=args.attention,
                           kv_precision=args.kv_precision, prefill_splits=args.prefill_splits)
    t = time.perf_counter()
    engine = Engine(config, model=model)             # pins the tier's host memory (--kv-host-pin-at-start)
    engine_init_s = time.perf_counter() - t
    print(f"  engine start (KV pools, {config.kv_host_tokens}-token host tier pinned): {engine_init_s:.1f} s", flush=True)
    vocab = engine.model_config.vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(ctx)] for _ in range(3)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs = []
    order = [("compile", 0), ("recompute", 1), ("recompute", 2)] + [("recall", 1 + r % 2) for r in range(args.recalls)]
    for label, i in order:
        s0, u0 = engine.stats(), engine.transfers.stats.upload_s
        o0 = engine.transfers.stats.offloaded_bytes
        p0, c0, n0 = engine.phases.snapshot(), engine.compiles.seconds, dict(engine.compiles.by_function)
        t = time.perf_counter()
        [res] = engine.generate([prompts[i]], params)
        wall = time.perf_counter() - t
        st = engine.stats()
        phases = engine.phases.since(p0)
        compiled = {k: v - n0.get(k, 0) for k, v in engine.compiles.by_function.items() if v > n0.get(k, 0)}
        runs.append({"run": label, "prompt": i, "seconds": wall, "cached_prompt_tokens": res.cached_prompt_tokens,
                     "host_hit_pages": st.kv_host_hits - s0.kv_host_hits,
                     # The other prompt's pages evicted to make room: copied to the host, or back with the
                     # copy kept since their recall (no copy; kv/host_tier.py).
                     "offloaded_pages": st.kv_offloaded_pages - s0.kv_offloaded_pages,
                     "offloaded_gb": (engine.transfers.stats.offloaded_bytes - o0) / 1e9,
                     "reused_host_copies": st.kv_host_reused_pages - s0.kv_host_reused_pages,
                     "recall_upload_s": engine.transfers.stats.upload_s - u0,
                     "breakdown_s": dict(sorted(phases.items()), other=wall - top_level_total(phases)),
                     "compile_s": engine.compiles.seconds - c0, "compiled": compiled})
        print(f"  {label:<9} P{i}: {wall * 1e3:9.1f} ms  cached {res.cached_prompt_tokens:>6} tokens  host pages "
              f"{runs[-1]['host_hit_pages']:>4}  upload {runs[-1]['recall_upload_s'] * 1e3:7.1f} ms  evicted: "
              f"{runs[-1]['offloaded_pages']} copied out ({runs[-1]['offloaded_gb']:.2f} GB), "
              f"{runs[-1]['reused_host_copies']} with a kept copy", flush=True)
        print("      " + format_breakdown(runs[-1]), flush=True)
    recompute = min(r["seconds"] for r in runs if r["run"] == "recompute")
    recalls = [r for r in runs if r["run"] == "recall"]
    recall = min(r["seconds"] for r in recalls)
    warm = sorted(r["seconds"] for r in recalls[1:])      # the first recall may compile the copies' shapes
    ts = engine.transfers.stats
    return {
        "context": ctx, "page_size": page, "kv_pool_tokens": pool, "kv_precision": engine.kv_precision,
        "prefill_splits": args.prefill_splits,
        "host_memory": engine.transfers.memory_kind, "engine_init_s": engine_init_s, "runs": runs,
        "recompute_s": recompute, "recall_s": recall, "recompute_over_recall": recompute / recall,
        "recall_median_s": statistics.median(warm) if warm else None,
        "recompute_over_recall_median": recompute / statistics.median(warm) if warm else None,
        "all_recalled": all(r["cached_prompt_tokens"] >= ctx - page for r in recalls),
        # Over every recall, the first's compiles included (the old figure); the warm recalls' median below.
        "tier_upload_gbps": ts.recalled_bytes / ts.upload_s / 1e9 if ts.upload_s else None,
        "tier_upload_gbps_warm_median": statistics.median(
            ts.recalled_bytes / ts.recalled_pages * r["host_hit_pages"] / r["recall_upload_s"] / 1e9
            for r in recalls[1:]) if len(recalls) > 1 and ts.recalled_pages else None,
        "tier_recalled_gb": ts.recalled_bytes / 1e9,
        "recall_choices": {"recalled": engine.pool.recall_choice.recalled,
                           "recomputed": engine.pool.recall_choice.recomputed},
    }


def format_breakdown(run: dict) -> str:
    """One run's phases in ms, largest first (parts after their phase), and what compiled."""
    parts = run["breakdown_s"]
    tops = sorted((k for k in parts if "." not in k), key=lambda k: -parts[k])
    words = []
    for k in tops:
        subs = sorted((s for s in parts if s.startswith(k + ".")), key=lambda s: -parts[s])
        inner = ", ".join(f"{s[len(k) + 1:]} {parts[s] * 1e3:.1f}" for s in subs if parts[s] >= 5e-4)
        words.append(f"{k} {parts[k] * 1e3:.1f}" + (f" ({inner})" if inner else ""))
    out = "ms: " + "; ".join(words)
    if run["compiled"]:
        out += f" | compiling {run['compile_s'] * 1e3:.0f} ms: " + ", ".join(
            f"{k} x{v}" if v > 1 else k for k, v in sorted(run["compiled"].items()))
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["conditions"]
    names = [r["condition"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(12, 3.6))
    ax[0].bar(names, [r["prompt_tokens_computed"] / 1e3 for r in rows], label="computed")
    ax[0].bar(names, [r["prompt_tokens_cached"] / 1e3 for r in rows],
              bottom=[r["prompt_tokens_computed"] / 1e3 for r in rows], label="from cache")
    ax[0].set_ylabel("prompt tokens (K)")
    ax[0].legend()
    ax[1].bar(names, [r["wall_s"] for r in rows])
    ax[1].set_ylabel("wall time (s)")
    ax[2].bar(names, [r["ttft_ms_p50_later_turns"] for r in rows], label="p50")
    ax[2].plot(names, [r["ttft_ms_p90_later_turns"] for r in rows], "k^", label="p90")
    ax[2].set_ylabel("TTFT, turns 2+ (ms)")
    ax[2].legend()
    for a in ax:
        a.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"{result['model']} on {result['device']}: {result['args']['conversations']} chats x "
                 f"{result['args']['turns']} turns, HBM pool {result['args']['kv_pool_tokens']} tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    ap.add_argument("--attention", default="auto", choices=["auto", "reference", "kernel"])
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-len", type=int, default=64)
    ap.add_argument("--user-len", type=int, default=48)
    ap.add_argument("--answer-len", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4, help="requests running at once")
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--kv-pool-tokens", type=int, default=512, help="HBM pool, in tokens")
    ap.add_argument("--kv-host-tokens", type=int, default=8192, help="host tier, in tokens")
    ap.add_argument("--prefetch-pages", type=int, default=64)
    ap.add_argument("--conditions", default="no-host,host,host+prefetch")
    ap.add_argument("--scheduler", default="hab", choices=["hab", "fcfs"],
                    help="the engine's (hab: admissions follow measured step times, so counts such as preemptions "
                         "vary a little with the machine's load; fcfs: the same from run to run)")
    ap.add_argument("--recall", default="measured", choices=["measured", "always"],
                    help="host pages of a matched prefix: recall or recompute by measured cost (the engine's "
                         "choice), or always recall (a CPU run, whose prefill is cheap, then schedules like a GPU "
                         "run that recalls)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2,
                    help="run every condition this many times and report the last (the first ones compile)")
    ap.add_argument("--out", default=None, help="write JSON here (and a PNG beside it)")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the PNG of a result file")
    ap.add_argument("--recall-vs-recompute", action="store_true", help="the #12 measurement (module docstring)")
    ap.add_argument("--context", type=int, default=1024, help="with --recall-vs-recompute: prompt tokens")
    ap.add_argument("--page-size", type=int, default=256, help="with --recall-vs-recompute")
    ap.add_argument("--copy-mb", type=int, default=1024, help="with --recall-vs-recompute: pinned copy probe size")
    ap.add_argument("--recalls", type=int, default=5, help="with --recall-vs-recompute: recall runs, alternating "
                    "P1 and P2 (the first may compile; the median is over the others)")
    ap.add_argument("--prefill-splits", default="auto", metavar="{auto,off,N}",
                    help="with --recall-vs-recompute: split-K in the WS prefill kernel (the recomputed tail)")
    ap.add_argument("--kv-precision", default="bf16", choices=["bf16", "fp16-delta", "fp8-delta"], help="with --recall-vs-recompute (fp8-delta: half the bytes)")
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), os.path.splitext(args.replot)[0] + ".png")
        return 0
    for name in ("conversations", "turns", "user_len", "answer_len", "batch", "kv_pool_tokens", "kv_host_tokens",
                 "rounds"):
        if getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    known = {"no-host": (0, 0), "host": (args.kv_host_tokens, 0), "host+prefetch": (args.kv_host_tokens, args.prefetch_pages)}
    names = [c for c in args.conditions.split(",") if c]
    bad = [c for c in names if c not in known]
    if bad:
        ap.error(f"--conditions: unknown {bad}; choose from {list(known)}")

    from stratum_jax.model.config import PRESETS
    from stratum_jax.model.loader import load_model
    model = load_model(args.model, dtype=args.dtype, seed=0)
    stretched = None
    if args.recall_vs_recompute and model.config.max_position_embeddings < args.context + args.page_size:
        if args.model not in PRESETS:
            ap.error(f"--context {args.context} (+ a page) is past {args.model}'s max_position_embeddings "
                     f"{model.config.max_position_embeddings}: lower it")
        # A random preset's weights do not depend on it: only the positions go further.
        stretched = (model.config.max_position_embeddings, args.context + args.page_size)
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=stretched[1]))
        print(f"{args.model}: max_position_embeddings stretched from {stretched[0]} to {stretched[1]} (random weights)")
    result = {"model": args.model, **provenance("host_tier"), "args": vars(args), "conditions": []}
    if args.recall_vs_recompute:
        result.pop("conditions")
        result["max_position_stretched"] = stretched
        result["pinned_copy"] = pinned_copy_bandwidth(args.copy_mb << 20)
        c = result["pinned_copy"]
        print(f"pinned copies ({c['memory_kind']}): host->device {c['host_to_device_gbps']:.1f} GB/s, device->host "
              f"{c['device_to_host_gbps']:.1f} GB/s (#12 asks >= 40 GB/s host->device)", flush=True)
        result["recall_vs_recompute"] = r = recall_vs_recompute(model, args)
        print(f"{args.model} {r['context']} tokens ({r['kv_precision']}, pages of {r['page_size']}): recompute "
              f"{r['recompute_s'] * 1e3:.1f} ms, recall {r['recall_s'] * 1e3:.1f} ms -> {r['recompute_over_recall']:.1f}x "
              f"(#12 asks >= 10x; median of the warm recalls {(r['recall_median_s'] or 0) * 1e3:.1f} ms -> "
              f"{r['recompute_over_recall_median'] or 0:.1f}x); all recalled: {r['all_recalled']}; tier upload "
              f"{r['tier_upload_gbps_warm_median'] or 0:.1f} GB/s (median of the warm recalls)", flush=True)
        if args.out:
            print(f"wrote {save_json(args.out, result)}")
        return 0
    result["earlier_rounds"] = []
    for rnd in range(args.rounds):
        last = rnd == args.rounds - 1
        rows = []
        for name in names:
            r = run_condition(model, args, name, *known[name])
            rows.append(r)
            if last:
                result["conditions"] = rows
            print(f"[round {rnd + 1}/{args.rounds}] ", end="")
            print_row(r)
            if args.out:
                save_json(args.out, result)
        if not last:
            result["earlier_rounds"].append(rows)
    digests = {r["final_answers_digest"] for r in result["conditions"]}
    result["same_answers_in_every_condition"] = len(digests) == 1
    # bf16 prefill over a cached prefix and over the whole prompt round differently, so greedy answers may
    # legitimately differ between conditions there; with float32 they should not.
    print(f"same answers in every condition: {len(digests) == 1}")
    if args.out:
        print(f"wrote {save_json(args.out, result)}")
        try:
            plot(result, os.path.splitext(args.out)[0] + ".png")
        except ImportError:
            print(f"no matplotlib here: plot later with --replot {args.out}")
    return 0


def print_row(r: dict) -> None:
    name = r["condition"]
    print(f"{name:<14} wall {r['wall_s']:7.2f} s  computed {r['prompt_tokens_computed']:>8}  cached "
              f"{r['prompt_tokens_cached']:>8}  TTFT p50 {r['ttft_ms_p50_later_turns']:8.1f} ms  p90 "
              f"{r['ttft_ms_p90_later_turns']:8.1f}  host hits {r['host_hit_pages']:>6}  prefetched "
              f"{r['prefetched_pages']:>6}  copies {r['offloaded_gb']:.2f}/{r['recalled_gb']:.2f} GB "
              f"in {r['transfer_s']:.2f} s  preemptions {r['preemptions']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
