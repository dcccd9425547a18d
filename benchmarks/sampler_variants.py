"""Decode-step time of design variants on an H200 (llama-1b, 64 rows, 8 steps per call): data-dependent vs
static loop, sampling under lax.cond vs static greedy/sampled variants, top-20 logprobs on/off. Chose
stratum_jax/decode.py's SamplerVariant and static decode loop. Prints one line per variant; its
2026-11-30 output is transcribed in benchmarks/results/sampler_variants_h200.json."""
import time
import numpy as np, jax, jax.numpy as jnp
from jax import lax
import stratum_jax.decode as D
from stratum_jax.attention import RowTables
from stratum_jax.model.loader import load_model
from stratum_jax.model import llama
from stratum_jax.sampling import sample, token_logprobs, SamplingArrays, MAX_TOP_LOGPROBS

m = load_model("llama-1b", dtype="bfloat16", seed=0)
cfg = m.config
R, CTX, STEPS = 64, 640, 8
W = 4096 // 8
num_slots = R * 1024
kv = llama.init_kv_cache(cfg, num_slots)
starts = np.zeros((R, W), np.int32)
for r in range(R):
    starts[r, :1024 // 64] = r * 1024 + 64 * np.arange(1024 // 64)
sizes = np.full(R, 64, np.int32)
tables = RowTables(np.zeros(R, np.int32), starts, sizes)
last = np.ones(R, np.int32); pos = np.full(R, 512, np.int32); allowed = np.full(R, STEPS, np.int32)
def samp(t):
    return SamplingArrays(np.full(R, t, np.float32), np.ones(R, np.float32), np.zeros(R, np.int32),
                          np.zeros(R, np.uint32), np.arange(R, dtype=np.uint32), np.zeros(R, np.int32))

def make(mode):
    def sample_rows(params, cfg, h, s):
        logits = llama.compute_logits(params, cfg, h)
        if mode["sampler"] == "cond":
            t = lax.cond(jnp.any(s.temperature > 0), lambda: sample(logits, s, greedy_only=False), lambda: sample(logits, s, greedy_only=True))
        elif mode["sampler"] == "greedy":
            t = sample(logits, s, greedy_only=True)
        else:
            t = sample(logits, s, greedy_only=False)
        if mode["lp"]:
            return (t, *token_logprobs(logits, t, top_k=MAX_TOP_LOGPROBS))
        z = jnp.zeros((h.shape[0], MAX_TOP_LOGPROBS))
        return t, token_logprobs(logits, t, top_k=0)[0], z.astype(jnp.int32), z
    D._sample_rows = sample_rows
    geo = D.StepGeometry(rows=R, table_width=W, prefill_tile=64, decode_steps=STEPS, backend="kernel")
    if mode["loop"] == "fori":
        src = D.decode_steps.__wrapped__
        def fori_version(params, kv_cache, last_tokens, positions, steps_allowed, tables, sampling, *, cfg, geo):
            # same body, static trip count
            old = lax.while_loop
            def wl(cond, body, init):
                return lax.fori_loop(0, geo.decode_steps, lambda i, c: body(c), init)
            D.lax.while_loop = wl
            try:
                return src(params, kv_cache, last_tokens, positions, steps_allowed, tables, sampling, cfg=cfg, geo=geo)
            finally:
                D.lax.while_loop = old
        fn = jax.jit(fori_version, static_argnames=("cfg", "geo"), donate_argnames=("kv_cache",))
    else:
        fn = jax.jit(D.decode_steps.__wrapped__, static_argnames=("cfg", "geo"), donate_argnames=("kv_cache",))
    return fn, geo

modes = [dict(loop="while", sampler="cond", lp=True), dict(loop="fori", sampler="cond", lp=True),
         dict(loop="fori", sampler="greedy", lp=True), dict(loop="fori", sampler="greedy", lp=False),
         dict(loop="fori", sampler="full", lp=False), dict(loop="while", sampler="greedy", lp=False)]
for mode in modes:
    fn, geo = make(mode)
    for temp in (0.0, 0.7) if mode["sampler"] in ("cond",) else (0.0,):
        s = samp(temp)
        out, kv = fn(m.params, kv, last, pos, allowed, tables, s, cfg=cfg, geo=geo); jax.block_until_ready(out)
        ts = []
        for _ in range(10):
            t = time.perf_counter(); out, kv = fn(m.params, kv, last, pos, allowed, tables, s, cfg=cfg, geo=geo); jax.device_get(out.tokens); ts.append(time.perf_counter() - t)
        print(mode, "temp", temp, "ms/step %.3f" % (np.median(ts) * 1e3 / STEPS), flush=True)
