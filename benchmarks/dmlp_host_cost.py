"""Where the engine thread's host time goes with the DMLP cache policy vs LRU, on a Mooncake replay that
evicts cached pages (issue #13: the DMLP server idled its GPU 23-24% of the time against LRU's 2-3%).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python3 benchmarks/dmlp_host_cost.py \\
        --checkpoint .carry/dmlp/ckpt/checkpoint --out benchmarks/results/dmlp_host_cost_cpu.json

Workload: the first `--num-requests` requests of the Mooncake conversation trace, lengths scaled by
`--length-scale` (a trace block of 512 tokens becomes ceil(512 x scale) tokens, the same tokens wherever
its hash id recurs, so requests that share leading ids share prefix pages), run closed-loop with at most
`--concurrency` requests in the engine, in a KV pool of `--kv-pool-tokens` (small enough that cached
pages are evicted). Greedy, ignore_eos, so every condition runs the same tokens.

Measured per condition: wall time, steps, evictions, prefix hits; the engine's host phases
(`Engine.phases`); the time the engine thread spends inside each cache-policy entry point; and for every
predictor call its rows, wall time, the policy method it came from, and whether a step was in flight
(dispatched and not yet read: the call's device work may queue behind it, and its read-back waits for it).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

POLICY_METHODS = ("observe_access", "choose_victims", "page_size_for", "prefetch_order", "forget",
                  "note_evictions", "tick")


def trace_prompts(path: str, count: int, length_scale: float, max_prompt: int, max_new: int, vocab: int,
                  seed: int) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_tokens) per trace request; a hash id is the same block of tokens everywhere."""
    block = math.ceil(512 * length_scale)
    blocks: dict[int, list[int]] = {}

    def block_tokens(h: int) -> list[int]:
        if h not in blocks:
            rng = random.Random(seed * 1_000_003 + h)
            blocks[h] = [rng.randrange(3, min(vocab, 256)) for _ in range(block)]
        return blocks[h]

    out = []
    with open(path) as f:
        for _, line in zip(range(count), f):
            d = json.loads(line)
            n_in = min(max_prompt, max(1, round(d["input_length"] * length_scale)))
            ids = [t for h in d["hash_ids"] for t in block_tokens(h)][:n_in]
            n_out = min(max_new, max(1, round(d["output_length"] * length_scale)))
            out.append((ids, n_out))
    return out


def _policy_caller(frame, depth: int = 7) -> str:
    """The nearest policy entry point among the `depth` frames from `frame` up. It reads only code names:
    `inspect.stack()` (used before) reads every frame's source lines, and took about 70 ms a call under the
    profiler, inside the phases this benchmark measures (it was most of the DMLP's postprocess time)."""
    for _ in range(depth):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in POLICY_METHODS or name in ("_score_ghost", "_curves_of", "rank"):
            return name
        frame = frame.f_back
    return "?"


class CallLog:
    """Predictor calls: rows, seconds, caller (the policy method), step in flight at the call."""

    def __init__(self):
        self.calls: list[dict] = []

    def wrap_predictor(self, predictor, engine) -> None:
        """Logs `predict` (synchronous: the caller waits for the result) and `dispatch` calls made
        outside `predict` (score-ahead: the caller does not wait)."""
        inner_predict, inner_dispatch = predictor.predict, predictor.dispatch
        inside = [False]

        def logged(kind, fn, raw):
            step = engine.inflight.step
            ready = step is not None and step.is_ready()
            caller = _policy_caller(sys._getframe(2))
            t = time.perf_counter()
            out = fn(raw)
            self.calls.append({"kind": kind, "rows": len(raw), "s": time.perf_counter() - t, "caller": caller,
                               "in_flight": step is not None, "ready": ready})
            return out

        def predict(raw):
            inside[0] = True
            try:
                return logged("sync", inner_predict, raw)
            finally:
                inside[0] = False

        def dispatch(raw):
            return inner_dispatch(raw) if inside[0] else logged("dispatch", inner_dispatch, raw)
        predictor.predict, predictor.dispatch = predict, dispatch

    def summary(self) -> dict:
        return {kind: self._summary([x for x in self.calls if x["kind"] == kind]) for kind in ("sync", "dispatch")}

    @staticmethod
    def _summary(c: list[dict]) -> dict:
        if not c:
            return {"calls": 0}
        rows = sorted(x["rows"] for x in c)
        return {"calls": len(c), "rows_total": sum(rows), "rows_p50": rows[len(rows) // 2], "rows_max": rows[-1],
                "seconds": sum(x["s"] for x in c), "ms_per_call": 1e3 * sum(x["s"] for x in c) / len(c),
                "in_flight": sum(x["in_flight"] for x in c),
                "in_flight_not_done": sum(x["in_flight"] and not x["ready"] for x in c),
                "by_caller": dict(collections.Counter(x["caller"] for x in c))}


def time_methods(obj, names) -> dict:
    """Wraps obj's methods to sum the calling thread's seconds in each; returns {name: [s, calls]}."""
    spent = {}
    for name in names:
        inner = getattr(obj, name, None)
        if inner is None:
            continue
        spent[name] = [0.0, 0]

        def timed(*a, _inner=inner, _acc=spent[name], **kw):
            t = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                _acc[0] += time.perf_counter() - t
                _acc[1] += 1
        setattr(obj, name, timed)
    return spent


def run_condition(name: str, config, model, prompts, concurrency: int) -> dict:
    from stratum_jax.dmlp.policy import DmlpPolicy
    from stratum_jax.engine import Engine
    from stratum_jax.request import SamplingParams

    engine = Engine(config, model=model)
    engine.warmup(progress=False)
    policy = engine.cache_policy
    log = CallLog()
    policy_s = {}
    if isinstance(policy, DmlpPolicy):
        log.wrap_predictor(policy.predictor, engine)
        policy_s = time_methods(policy, POLICY_METHODS)
        if policy.guard is not None:
            policy_s.update({f"guard.{k}": v for k, v in time_methods(policy.guard, ("accessed", "forget")).items()})
    before = engine.phases.snapshot()
    todo = collections.deque(prompts)
    live: set[str] = set()
    steps = 0
    t0 = time.perf_counter()
    while todo or live or engine.has_unfinished():
        while todo and len(live) < concurrency:
            ids, n_out = todo.popleft()
            live.add(engine.add_request(ids, SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
        steps += 1
    wall = time.perf_counter() - t0
    st = engine.stats()
    phases = engine.phases.since(before)
    row = {"wall_s": wall, "engine_steps": steps, "device_steps": st.steps, "evictions": engine.pool.evictions,
           "prefix_hits": st.prefix_cache_hits, "prefix_queries": st.prefix_cache_queries,
           "phases_s": phases, "phases_ms_per_step": {k: 1e3 * v / steps for k, v in phases.items()},
           "policy_s": {k: {"s": v[0], "calls": v[1]} for k, v in policy_s.items()},
           "predict": log.summary(), "compiles_after_warmup": engine.compiles.total}
    if isinstance(policy, DmlpPolicy):
        row["score_stats"] = dataclasses.asdict(policy.score_stats)
    if isinstance(policy, DmlpPolicy) and policy.guard is not None:
        row["guard"] = {"active_at_end": policy.guard.active, "trips": policy.guard.trips}
    engine.close()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, ".carry/dmlp/ckpt/checkpoint"))
    ap.add_argument("--trace", default="/work/shared/traces/mooncake_conversation.jsonl")
    ap.add_argument("--num-requests", type=int, default=80)
    ap.add_argument("--length-scale", type=float, default=0.05)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kv-pool-tokens", type=int, default=4096)
    ap.add_argument("--conditions", default="lru,dmlp",
                    help="comma list of lru, dmlp, dmlp-lazy (no score-ahead: the policy before it), dmlp-cpu "
                         "(--dmlp-device cpu), dmlp-noguard")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for flag, v in (("--num-requests", args.num_requests), ("--concurrency", args.concurrency),
                    ("--max-new-tokens", args.max_new_tokens)):
        if v <= 0:
            ap.error(f"{flag} must be > 0, got {v}")
    if not 0 < args.length_scale <= 1:
        ap.error(f"--length-scale must lie in (0, 1], got {args.length_scale}")

    import jax

    from stratum_jax.config import RuntimeConfig
    from stratum_jax.model.loader import load_model

    model = load_model(args.model, dtype="float32", seed=0)
    max_context = 2048
    prompts = trace_prompts(args.trace, args.num_requests, args.length_scale, max_context - args.max_new_tokens,
                            args.max_new_tokens, model.config.vocab_size, seed=0)
    base = dict(model=args.model, dtype="float32", attention="reference", max_batch_size=args.concurrency,
                max_context=max_context, max_tokens_cap=args.max_new_tokens, kv_pool_tokens=args.kv_pool_tokens,
                max_queue=args.num_requests + 8, max_num_batched_tokens=1024, prefill_chunk=1024)
    dmlp = dict(base, cache_policy="dmlp", dmlp_checkpoint=args.checkpoint)
    configs = {"lru": RuntimeConfig(**base), "dmlp": RuntimeConfig(**dmlp),
               "dmlp-lazy": RuntimeConfig(**dmlp, dmlp_score_ahead=False), "dmlp-cpu": RuntimeConfig(**dmlp, dmlp_device="cpu"),
               "dmlp-noguard": RuntimeConfig(**dmlp, dmlp_guard=False)}
    names = [c for c in args.conditions.split(",") if c]
    unknown = [n for n in names if n not in configs]
    if unknown:
        ap.error(f"--conditions: unknown {unknown}; choose from {sorted(configs)}")
    result = {"date": datetime.date.today().isoformat(), "jax": jax.__version__, "backend": jax.default_backend(),
              "args": vars(args), "prompt_tokens": sum(len(p) for p, _ in prompts), "conditions": {}}
    for name in names:
        row = run_condition(name, configs[name], model, prompts, args.concurrency)
        result["conditions"][name] = row
        p = row["predict"]
        print(f"\n== {name}: wall {row['wall_s']:.2f} s, {row['engine_steps']} engine steps, "
              f"{row['evictions']} evictions, prefix hits {row['prefix_hits']}/{row['prefix_queries']}")
        print("   phases ms/step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(row["phases_ms_per_step"].items())))
        if row["policy_s"]:
            print("   policy s (calls): " + ", ".join(f"{k} {v['s']:.3f} ({v['calls']})"
                                                     for k, v in row["policy_s"].items() if v["calls"]))
        if "score_stats" in row:
            print(f"   scoring: {row['score_stats']}")
        for kind, q in p.items():
            if q["calls"]:
                print(f"   predict {kind}: {q['calls']} calls, {q['rows_total']} rows (p50 {q['rows_p50']}, max "
                      f"{q['rows_max']}), {q['seconds']:.3f} s = {q['ms_per_call']:.2f} ms/call, {q['in_flight']} with "
                      f"a step in flight ({q['in_flight_not_done']} not done), by caller {q['by_caller']}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
