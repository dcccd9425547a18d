"""Decode step time of the real engine under three cache policies: lru, dmlp, and dmlp with the online
fine-tuner running (target: dmlp-with-online at most 2% slower than lru); on request (`--conditions`)
also dmlp-lru-mode, the DMLP policy with its guard tripped from the start: eviction in LRU order while
the guard's ghost DMLP cache runs the model on every step's accesses and ranks its own evictions (what
the guard costs while it holds the DMLP off; the dmlp condition's guard, on by default, may or may not
trip on this load, and the report says whether it did); and dmlp-lru-mode-background, the same with the
ghost scoring each step's accesses on its worker thread instead of at its rankings on the engine thread
(`GhostDmlpCache.background`; each row records `ghost_background`).

    PYTHONPATH=$PWD python3 benchmarks/dmlp_engine_overhead.py                       # tiny, CPU
    PYTHONPATH=$PWD python3 benchmarks/dmlp_engine_overhead.py --model llama-1b --batch 32 \\
        --prompt-len 512 --new-tokens 128 --rounds 8 --online-cores 14,15 --out results.json

One model is loaded once and shared by three engines, one per condition. Each keeps `--batch`
requests running: a finished request is replaced at once by a new one whose prompt starts with one of
a few shared prefixes (so cached blocks are accessed again) and ends with fresh tokens, in a KV pool
sized to about 2x the running working set (so cached blocks are evicted all the time). The conditions
run in blocks, in the order A B C then C B A (and so on), so slow drifts of the machine hit all alike.

Measured per decode step: the wall time of the whole `engine.step()` call (scheduler, allocation and
eviction, the policy's batched scoring, the device step, postprocessing) - where the policy's cost
shows - and the engine's own per-token decode time (`stats().decode_step_ms`'s samples). Medians over
all the blocks of a condition; the % is relative to lru.

With no `--checkpoint`, a small default-width DMLP (1.2M parameters) is trained for one epoch on a
synthetic conversation trace into a temporary directory first. The online condition gets the
fine-tuner worker process (pinned to `--online-cores`) fed with enough examples up front that it is
taking optax steps (at its default CPU budget) during the whole measurement, plus what live traffic adds.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

H = (10.0, 50.0, 100.0, 200.0, 500.0)


def train_small_checkpoint(directory: str) -> str:
    """One epoch of the default-width DMLP on a synthetic trace (about a minute on a laptop CPU)."""
    from stratum_jax.dmlp.model import DEFAULT_HIDDEN
    from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, save_checkpoint
    from training.dataset import train_val_examples
    from training.synthetic import conversation_trace, write_jsonl
    from training.trainer import TrainConfig, train
    from training.traces import read_traces

    trace = os.path.join(directory, "trace.jsonl")
    write_jsonl(trace, conversation_trace(800, seed=3, rate_per_s=4.0, think_median_s=30.0))
    tr, va, _ = train_val_examples(read_traces([trace], "mooncake", 100.0), H, 0.25)
    res = train(tr, va, H, TrainConfig(epochs=1, hidden=DEFAULT_HIDDEN, batch_size=512))
    path = os.path.join(directory, "dmlp")
    save_checkpoint(path, DmlpCheckpoint(res.config, res.params, res.normalizer, {"benchmark": "synthetic"}))
    return path


class Stream:
    """Keeps `batch` requests running in one engine; prompts share a few prefixes."""

    def __init__(self, engine, args, seed: int):
        from stratum_jax.request import SamplingParams
        self.engine, self.args = engine, args
        self.rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        shared = max(8, args.prompt_len * 3 // 4)
        prefix_rng = random.Random(1234)           # the same prefixes in every engine
        self.prefixes = [[prefix_rng.randrange(3, vocab) for _ in range(shared)] for _ in range(args.prefixes)]
        self.params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
        self.vocab = vocab
        self.running: set[str] = set()

    def top_up(self) -> None:
        while len(self.running) < self.args.batch:
            prefix = self.rng.choice(self.prefixes)
            tail = [self.rng.randrange(3, self.vocab) for _ in range(self.args.prompt_len - len(prefix))]
            self.running.add(self.engine.add_request(prefix + tail, self.params))

    def step(self):
        """One engine step; returns (wall s, kind, engine per-token decode ms or None)."""
        self.top_up()
        e = self.engine
        t0 = time.perf_counter()
        outs = e.step()
        wall = time.perf_counter() - t0
        for o in outs:
            if o.finished:
                self.running.discard(o.request_id)
        kind = e.last_step.kind if e.last_step is not None else None
        per_token = e.recorder.recent_decode_ms[-1] if kind == "decode" and e.recorder.recent_decode_ms else None
        return wall, kind, per_token


def feed_tuner(tuner, n: int = 6000, seed: int = 0) -> None:
    """Random (features, labels) so the worker has enough examples to train from the start."""
    import numpy as np
    from stratum_jax.dmlp.features import FEATURE_NAMES
    rng = np.random.default_rng(seed)
    raw = rng.uniform(0, 1000, (n, len(FEATURE_NAMES))).astype(np.float32)
    rec = FEATURE_NAMES.index("recency_ms")
    labels = (raw[:, rec, None] <= np.array(H)[None, :]).astype(np.float32)
    for i in range(0, n, 200):
        tuner.observe(raw[i:i + 200], labels[i:i + 200])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--dtype", default=None, choices=[None, "float32", "bfloat16"])
    ap.add_argument("--attention", default="reference", choices=["reference", "kernel"])
    ap.add_argument("--batch", type=int, default=8, help="requests kept running")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefixes", type=int, default=6, help="distinct shared prompt prefixes")
    ap.add_argument("--rounds", type=int, default=6, help="blocks per condition")
    ap.add_argument("--block-steps", type=int, default=40, help="engine steps per block")
    ap.add_argument("--warmup-steps", type=int, default=60, help="unmeasured steps per engine first")
    ap.add_argument("--kv-pool-tokens", type=int, default=None,
                    help="default: about twice the running working set, so blocks are evicted")
    ap.add_argument("--checkpoint", default=None, help="DMLP checkpoint dir; default: train a small one")
    ap.add_argument("--online-cores", default=None, help="pin the fine-tuner to these cores, e.g. 14,15")
    ap.add_argument("--conditions", default="lru,dmlp,dmlp-online")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)

    import jax

    from stratum_jax.config import RuntimeConfig, parse_cores
    from stratum_jax.dmlp.policy import DmlpPolicy
    from stratum_jax.engine import Engine
    from stratum_jax.model.loader import load_model

    tmp = tempfile.mkdtemp(prefix="dmlp-overhead-")
    checkpoint = args.checkpoint
    if checkpoint is None:
        t = time.perf_counter()
        checkpoint = train_small_checkpoint(tmp)
        print(f"trained a small DMLP into {checkpoint} in {time.perf_counter() - t:.1f} s", flush=True)
    per_req = args.prompt_len + args.new_tokens
    max_context = 1 << max(8, (per_req - 1).bit_length())
    pool = args.kv_pool_tokens or max(max_context, 2 * args.batch * per_req)
    base = dict(model=args.model, dtype=args.dtype, attention=args.attention, max_batch_size=args.batch,
                max_context=max_context, max_tokens_cap=args.new_tokens, kv_pool_tokens=pool,
                max_queue=4 * args.batch)
    configs = {
        "lru": RuntimeConfig(**base),
        "dmlp": RuntimeConfig(**base, cache_policy="dmlp", dmlp_checkpoint=checkpoint),
        "dmlp-lru-mode": RuntimeConfig(**base, cache_policy="dmlp", dmlp_checkpoint=checkpoint),
        "dmlp-lru-mode-background": RuntimeConfig(**base, cache_policy="dmlp", dmlp_checkpoint=checkpoint),
        "dmlp-online": RuntimeConfig(**base, cache_policy="dmlp", dmlp_checkpoint=checkpoint, dmlp_online=True,
                                     dmlp_online_dir=os.path.join(tmp, "online"),
                                     dmlp_online_cores=parse_cores(args.online_cores)),
    }
    names = [c for c in args.conditions.split(",") if c]
    model = load_model(args.model, dtype=args.dtype, seed=0)
    engines, streams = {}, {}
    guard_time = {}       # condition -> [seconds, calls] the engine thread spent in its guard (ghost included)
    for i, name in enumerate(names):
        engines[name] = Engine(configs[name], model=model)
        engines[name].warmup()
        if name.startswith("dmlp-lru-mode"):
            engines[name].cache_policy.guard.trip()
        if name == "dmlp-lru-mode-background":      # the ghost scores on its worker thread (ghost.py)
            engines[name].cache_policy.guard.ghost.background = True
        if name.startswith("dmlp-lru-mode"):
            guard_time[name] = _time_calls(engines[name].cache_policy.guard)
        streams[name] = Stream(engines[name], args, seed=i)
        for _ in range(args.warmup_steps):
            streams[name].step()
    tuner = engines["dmlp-online"].dmlp_tuner if "dmlp-online" in engines else None
    if tuner is not None:
        feed_tuner(tuner)
        tuner.start()
        time.sleep(3.0)        # let the worker start and begin its rounds

    for spent in guard_time.values():      # count the measured blocks only
        spent[:] = [0.0, 0]
    walls = {n: [] for n in names}
    all_steps_s = {n: 0.0 for n in names}     # every measured step (admissions and prefill too), summed
    per_token = {n: [] for n in names}
    round_medians = {n: [] for n in names}     # step ms p50 of each block, for the paired comparison
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            block = []
            for _ in range(args.block_steps):
                wall, kind, tok = streams[name].step()
                all_steps_s[name] += wall
                if kind == "decode":
                    walls[name].append(wall * 1e3)
                    per_token[name].append(tok)
                    block.append(wall * 1e3)
            round_medians[name].append(statistics.median(block) if block else float("nan"))
        print(f"round {r + 1}/{args.rounds}, step ms p50 so far: " + "  ".join(
            f"{n} {statistics.median(walls[n]):.3f}" for n in names if walls[n]), flush=True)
        if args.out:        # the raw samples so far, so a run cut short by a time limit still leaves data
            _write(args.out, {"partial": True, "rounds_done": r + 1, "step_ms": walls, "decode_ms_per_token": per_token})
    updates = None
    if tuner is not None:
        updates = tuner.updates
        tuner.stop()

    result = {"model": args.model, "backend": jax.default_backend(), "device": str(jax.devices()[0]),
              "jax": jax.__version__, "date": datetime.date.today().isoformat(),
              "args": {k: v for k, v in vars(args).items()}, "kv_pool_tokens": pool, "conditions": {}}
    ref = statistics.median(walls[names[0]]) if walls[names[0]] else float("nan")
    ref_tok = statistics.median(per_token[names[0]]) if per_token[names[0]] else float("nan")
    print(f"\n{'condition':<12} {'step ms (p50)':>14} {'p90':>8} {'vs ' + names[0]:>9} "
          f"{'decode ms/tok':>14} {'vs ' + names[0]:>9} {'steps':>6} {'evictions':>10} {'hit rate':>9}")
    for name in names:
        e, w, t = engines[name], sorted(walls[name]), per_token[name]
        st = e.stats()
        med, tok = statistics.median(w), statistics.median(t)
        row = {"step_ms_p50": med, "step_ms_p90": w[int(0.9 * (len(w) - 1))], "decode_ms_per_token_p50": tok,
               "step_vs_first_pct": 100.0 * (med / ref - 1.0), "decode_vs_first_pct": 100.0 * (tok / ref_tok - 1.0),
               "decode_steps": len(w), "evictions": e.pool.evictions, "all_steps_s": all_steps_s[name],
               "all_steps_vs_first_pct": 100.0 * (all_steps_s[name] / all_steps_s[names[0]] - 1.0),
               "prefix_hit_rate": st.prefix_cache_hits / max(1, st.prefix_cache_queries)}
        guard = e.cache_policy.guard if isinstance(e.cache_policy, DmlpPolicy) else None
        if guard is not None:
            row["guard"] = {"active_at_end": guard.active, "trips": guard.trips, "returns": guard.returns,
                            "ghost_rankings": guard.ghost.rankings, "ghost_waits": guard.ghost.waits,
                            "ghost_background": guard.ghost.background}
            if name in guard_time:   # engine-thread time inside the guard's accessed() (ghost scoring included)
                row["guard"]["accessed_s"], row["guard"]["accessed_calls"] = guard_time[name]
        if name == "dmlp-online":
            row["online_updates"] = updates
            row["online_dropped"] = e.dmlp_tuner.dropped
        # Paired: each round's block median against the first condition's in the same round, so drifts
        # of the machine between rounds cancel; the median and spread of those per-round ratios.
        paired = sorted(100.0 * (a / b - 1.0) for a, b in zip(round_medians[name], round_medians[names[0]]))
        row["paired_step_vs_first_pct"] = {"median": statistics.median(paired), "min": paired[0],
                                           "max": paired[-1], "rounds": len(paired)}
        result["conditions"][name] = row
        print(f"{name:<12} {med:>14.3f} {row['step_ms_p90']:>8.3f} {row['step_vs_first_pct']:>+8.2f}% "
              f"{tok:>14.3f} {row['decode_vs_first_pct']:>+8.2f}% {len(w):>6} {e.pool.evictions:>10} "
              f"{row['prefix_hit_rate']:>9.3f}")
    result["samples"] = {"step_ms": walls, "decode_ms_per_token": per_token, "round_step_ms_p50": round_medians}
    for name in names[1:]:
        pr = result["conditions"][name]["paired_step_vs_first_pct"]
        print(f"paired per-round step time, {name} vs {names[0]}: median {pr['median']:+.2f}% "
              f"(range {pr['min']:+.2f}% .. {pr['max']:+.2f}% over {pr['rounds']} rounds)")
    if args.out:
        _write(args.out, result)
        print(f"wrote {args.out}")
    return 0


def _time_calls(guard) -> list:
    """Wraps `guard.accessed` (an instance attribute shadows the method) to add up the time the calling
    thread (the engine's) spends in it; returns the [seconds, calls] list it updates."""
    spent, inner = [0.0, 0], guard.accessed

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t
            spent[1] += 1
    guard.accessed = timed
    return spent


def _write(path: str, obj) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=1)


if __name__ == "__main__":
    sys.exit(main())
