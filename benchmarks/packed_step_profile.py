"""Packed-step time on an H200 at long contexts: where a mixed step's time goes (llama-1b, 64 rows,
1,920 prefill tokens). Prints one line per case; its 2026-11-30 output is transcribed in
benchmarks/results/packed_step_profile_h200.json.

Caveat: the key-block and "attention skipped" cases patch a module global and re-jit the same
function, and jax reuses the first trace, so they run the baseline: their lines are not valid (a
correct version would pass the variant through a static argument).
"""
import time
import numpy as np, jax, jax.numpy as jnp
import stratum_jax.decode as D
import stratum_jax.attention as A
from stratum_jax.attention import RowTables
from stratum_jax.model.loader import load_model
from stratum_jax.model import llama

m = load_model("llama-1b", dtype="bfloat16", seed=0)
cfg = m.config
R, W, TILE = 64, 32768 // 8, 128
PAGE = 256
num_slots = 1 << 20
kv = llama.init_kv_cache(cfg, num_slots)

def tables(ctx_rows):
    starts = np.zeros((R, W), np.int32); sizes = np.full(R, PAGE, np.int32)
    for r in range(R):
        n = -(-32768 // PAGE)
        starts[r, :n] = (r * 16384 + PAGE * np.arange(n)) % num_slots
    return starts, sizes

def packed(decode_ctx, prefill_rows, chunk, prefill_ctx):
    P = 1920
    T = R + P
    starts, sizes = tables(None)
    tok = np.ones(T, np.int32); pos = np.full(T, -1, np.int32); slots = np.full(T, num_slots, np.int32)
    w = np.zeros(T, np.float32); nxt = np.full(T, -1, np.int32); tile_rows = np.full(P // TILE, -1, np.int32)
    ctx = np.zeros(R, np.int32); si = np.zeros(R, np.int32)
    nd = R - prefill_rows
    for r in range(nd):
        pos[r] = decode_ctx - 1; ctx[r] = decode_ctx; si[r] = r
        slots[r] = starts[r, pos[r] // PAGE] + pos[r] % PAGE
    off = R
    for i in range(prefill_rows):
        r = nd + i; start = prefill_ctx - chunk
        p = np.arange(start, prefill_ctx)
        pos[off:off + chunk] = p; slots[off:off + chunk] = starts[r, p // PAGE] + p % PAGE
        tile_rows[(off - R) // TILE:(off - R + chunk) // TILE] = r
        ctx[r] = prefill_ctx; si[r] = off + chunk - 1; off += chunk
    return D.PackedBatch(tok, pos, slots, w, nxt, tile_rows, RowTables(ctx, starts, sizes), si)

geo = D.StepGeometry(rows=R, table_width=W, prefill_tile=TILE, decode_steps=8, backend="kernel")

def timeit(fn, *args, **kw):
    global kv
    out, kv = fn(m.params, kv, *args, **kw); jax.block_until_ready(out)
    ts = []
    for _ in range(5):
        t = time.perf_counter(); out, kv = fn(m.params, kv, *args, **kw); jax.block_until_ready(out); ts.append(time.perf_counter() - t)
    return np.median(ts) * 1e3

def variant(key_block=None, skip_prefill_attn=False):
    orig = A.tiled_paged_attention
    def tiled(q, *a, **k):
        if skip_prefill_attn and q.shape[1] > 1:
            return (jnp.zeros_like(q), jnp.zeros(q.shape[:3], jnp.float32)) if k.get("return_score_stats") else jnp.zeros_like(q)
        if key_block: k["key_block"] = key_block
        return orig(q, *a, **k)
    D.tiled_paged_attention = tiled
    fn = jax.jit(D.packed_step.__wrapped__, static_argnames=("cfg", "geo"), donate_argnames=("kv_cache",))
    return fn

for name, kb, skip, args in [
        ("decode64@12K + 3x640 prefill@12K", None, False, (12288, 3, 640, 12288)),
        ("same, prefill attention skipped", None, True, (12288, 3, 640, 12288)),
        ("decode64@12K + 3x640 prefill@1K", None, False, (12288, 3, 640, 1024)),
        ("decode64@1K + 3x640 prefill@12K", None, False, (1024, 3, 640, 12288)),
        ("decode64@12K + 3x640 prefill@12K, key block 8192", 8192, False, (12288, 3, 640, 12288)),
        ("decode64@12K + 3x640 prefill@12K, key block 512", 512, False, (12288, 3, 640, 12288)),
        ("decode64@12K + 15x128 prefill@12K", None, False, (12288, 15, 128, 12288))]:
    fn = variant(kb, skip)
    print(f"{name:55s} {timeit(fn, packed(*args), cfg=cfg, geo=geo):8.2f} ms", flush=True)
