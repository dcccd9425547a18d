"""The attention-score variance of the decode path (`attn_score_var`): the reference and kernel
backends agree, and both match a float64 recomputation from the model's own q and K.

Definition (stratum_jax/decode.py): for a query row, s_j = sm_scale * q . k_j over the keys it sees;
its variance is mean(s^2) - mean(s)^2; a step's per-row value is the mean over q heads and layers
(and, for a prefill chunk, over the row's last min(5, chunk) valid tokens).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.paged_attention as paged_attention_module
from stratum_jax.attention import AttentionMetadata, paged_attention_for_step, paged_attention_reference_chunked
from stratum_jax.decode import ATTN_VAR_LAST_TOKENS, StepOptions, decode_steps, last_valid_columns, model_step
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.sampling import SamplingArrays

NUM_SLOTS = 4096
MAX_PAGES = 8


def _model(dtype, head_dim, qk_gain=4.0):
    """The tiny preset, with q_proj/k_proj scaled up so the scores have a variance of order 1 (at
    N(0, 0.02) init they are nearly constant and every variance would be ~1e-3)."""
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=head_dim, dtype=dtype)
    params = llama.init_params(cfg, seed=1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * qk_gain if any(getattr(p, "key", None) in ("q_proj", "k_proj") for p in path) else x,
        params)
    return cfg, params


def _page_table(page_sizes):
    """Each row gets MAX_PAGES pages of its size at aligned, disjoint slots."""
    starts = np.zeros((len(page_sizes), MAX_PAGES), np.int32)
    nxt = 0
    for r, p in enumerate(page_sizes):
        nxt = -(-nxt // p) * p
        starts[r] = nxt + p * np.arange(MAX_PAGES)
        nxt += p * MAX_PAGES
    assert nxt <= NUM_SLOTS
    return starts, np.asarray(page_sizes, np.int32)


def _slot(starts, sizes, r, pos):
    return int(starts[r, pos // sizes[r]] + pos % sizes[r])


def _greedy(rows):
    return SamplingArrays(np.zeros(rows, np.float32), np.ones(rows, np.float32), np.zeros(rows, np.int32),
                          np.zeros(rows, np.uint32), np.zeros(rows, np.uint32), np.zeros(rows, np.int32))


def _prefill_inputs(prompts, starts, sizes, chunk):
    rows = len(prompts)
    tokens = np.zeros((rows, chunk), np.int32)
    slots = np.full((rows, chunk), NUM_SLOTS, np.int32)
    q_pos = np.full((rows, chunk), -1, np.int32)
    ctx = np.zeros(rows, np.int32)
    cols = np.zeros(rows, np.int32)
    for r, p in enumerate(prompts):
        n = len(p)
        tokens[r, :n] = p
        slots[r, :n] = [_slot(starts, sizes, r, t) for t in range(n)]
        q_pos[r, :n] = np.arange(n)
        ctx[r] = n
        cols[r] = max(n - 1, 0)
    meta = AttentionMetadata(q_pos, ctx, starts, sizes)
    return tokens, slots, meta, cols


PROMPTS = [list(range(3, 6)), list(range(40, 52)), [7, 9, 11] * 10, []]     # 3, 12, 30 tokens, padding
PAGES = [8, 16, 32, 8]


def _prefill(cfg, params, chunk=32, max_context=64, **opt_kw):
    starts, sizes = _page_table(PAGES)
    tokens, slots, meta, cols = _prefill_inputs(PROMPTS, starts, sizes, chunk)
    cache = llama.init_kv_cache(cfg, NUM_SLOTS)
    opts = StepOptions(max_context=max_context, **opt_kw)
    res, cache = model_step(params, cache, tokens, slots, meta, cols, _greedy(len(PROMPTS)),
                            np.full_like(tokens, -1), cfg=cfg, opts=opts)
    return res, cache, (tokens, slots, meta, starts, sizes)


def _float64_prefill_var(cfg, params, tokens, slots, meta, starts, sizes):
    """Runs the model eagerly, recording each layer's q (after RoPE) and K pool, then recomputes the
    per-row value in float64 numpy: per (layer, head, token) the variance of scale * K_visible @ q,
    averaged over heads, layers and the row's last <= 5 valid tokens. Also returns the mean over
    all valid tokens (a plausible wrong definition, to show the check discriminates)."""
    rows, chunk = tokens.shape
    recorded = []

    def attend(layer, q, k_pool, v_pool):
        recorded.append((np.asarray(q, np.float64), np.asarray(k_pool.astype(jnp.float32), np.float64)))
        out = paged_attention_reference_chunked(q.reshape(rows, chunk, *q.shape[1:]), k_pool, v_pool, meta,
                                                max_context=64)
        return out.reshape(q.shape)

    llama.forward(params, cfg, jnp.asarray(tokens.reshape(-1)), jnp.asarray(np.maximum(meta.q_positions, 0).reshape(-1)),
                  llama.init_kv_cache(cfg, NUM_SLOTS), jnp.asarray(slots.reshape(-1)), attend)
    group = cfg.num_heads // cfg.num_kv_heads
    last5, every = np.zeros(rows), np.zeros(rows)
    for r in range(rows):
        n = int(np.sum(meta.q_positions[r] >= 0))
        if n == 0:
            continue
        per_tok = np.zeros(n)
        for q, k_pool in recorded:
            for j in range(n):
                p = int(meta.q_positions[r, j])
                ks = k_pool[:, [_slot(starts, sizes, r, t) for t in range(p + 1)]]       # [Hkv, p+1, D]
                for h in range(cfg.num_heads):
                    s = ks[h // group] @ q[r * chunk + j, h] * cfg.head_dim ** -0.5
                    per_tok[j] += s.var() / (cfg.num_heads * len(recorded))
        last5[r] = per_tok[-min(ATTN_VAR_LAST_TOKENS, n):].mean()
        every[r] = per_tok.mean()
    return last5, every


def test_prefill_attn_score_var_matches_float64_recomputation():
    """model_step (reference backend, fp32 tiny model): StepResult.attn_score_var [rows] equals the
    float64 recomputation from the model's q/K, layer- and head-averaged over the last 5 tokens."""
    cfg, params = _model("float32", 32)
    res, _, (tokens, slots, meta, starts, sizes) = _prefill(cfg, params)
    var = np.asarray(res.attn_score_var)
    assert var.shape == (len(PROMPTS),) and var.dtype == np.float32
    want, every = _float64_prefill_var(cfg, params, tokens, slots, meta, starts, sizes)
    assert var[3] == 0.0                                           # the padding row
    assert want[1] > 0.05                                         # non-trivial values
    np.testing.assert_allclose(var, want, rtol=1e-4, atol=1e-6)
    # The check is sharp enough to tell "last 5 tokens" from "all tokens" in the longer rows.
    assert np.all(np.abs(every[1:3] - want[1:3]) > 1e-2 * want[1:3])
    # attn_stats=False: the same tokens, zeros for the stats.
    off, _, _ = _prefill(cfg, params, attn_stats=False)
    assert np.array_equal(np.asarray(off.tokens), np.asarray(res.tokens))
    assert np.all(np.asarray(off.attn_score_var) == 0)


def test_last_valid_columns():
    q_pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 6, -1], [10, 11, -1, -1, -1, -1, -1, -1], [-1] * 8])
    cols, ok = last_valid_columns(q_pos)
    assert cols.shape == ok.shape == (3, ATTN_VAR_LAST_TOKENS)
    cols, ok = np.asarray(cols), np.asarray(ok)
    assert sorted(cols[0][ok[0]]) == [2, 3, 4, 5, 6]
    assert sorted(cols[1][ok[1]]) == [0, 1] and not ok[2].any()
    cols, ok = last_valid_columns(jnp.asarray([[3, -1, 7]]).T)      # decode: chunk 1
    assert np.asarray(cols).tolist() == [[0], [0], [0]] and np.asarray(ok)[:, 0].tolist() == [True, False, True]


def _random_step_case(seed, lengths, page_sizes, num_heads=4, num_kv_heads=2, head_dim=64, chunk=1):
    rng = np.random.default_rng(seed)
    starts, sizes = _page_table(page_sizes)
    k = rng.standard_normal((num_kv_heads, NUM_SLOTS, head_dim)).astype(np.float32)
    v = rng.standard_normal((num_kv_heads, NUM_SLOTS, head_dim)).astype(np.float32)
    q = rng.standard_normal((len(lengths), chunk, num_heads, head_dim)).astype(np.float32) * 2
    lengths = np.asarray(lengths, np.int32)
    q_pos = np.where(lengths[:, None] > 0, lengths[:, None] - chunk + np.arange(chunk)[None, :], -1)
    q_pos = np.where(q_pos >= 0, q_pos, -1).astype(np.int32)
    meta = AttentionMetadata(q_pos, lengths, starts, sizes)
    return (jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16), meta)


def _float64_step_var(q, k_pool, meta):
    q = np.asarray(q.astype(jnp.float32), np.float64)
    k = np.asarray(k_pool.astype(jnp.float32), np.float64)
    rows, chunk, heads, d = q.shape
    group = heads // k.shape[0]
    out = np.zeros((rows, chunk, heads))
    for r in range(rows):
        for c in range(chunk):
            p = int(meta.q_positions[r, c])
            if p < 0:
                continue
            ks = k[:, [_slot(meta.page_starts, meta.page_sizes, r, t) for t in range(p + 1)]]
            for h in range(heads):
                out[r, c, h] = (ks[h // group] @ q[r, c, h] * d ** -0.5).var()
    return out


@pytest.fixture
def two_splits(monkeypatch):
    """The kernel's default split for these tiny grids is 16 CTAs per (row, kv head), which the
    interpreter runs slowly; 2 splits still exercise the split-K merge of the stats."""
    monkeypatch.setattr(paged_attention_module, "default_num_splits", lambda batch, num_kv_heads: 2)


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_paged_attention_for_step_score_var(backend, two_splits):
    """Directly constructed decode step (and a causal chunk for the reference): per-row, per-head
    score variance against float64; the reference's outputs are the same as with the stats off."""
    q, k, v, meta = _random_step_case(0, [1, 70, 0, 200, 9, 33], [8, 16, 32, 64, 256, 8])
    kw = dict(max_context=256, backend=backend, interpret=backend == "kernel")
    out, var = paged_attention_for_step(q, k, v, meta, return_score_stats=True, **kw)
    assert var.shape == (6, 1, 4) and var.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(var), _float64_step_var(q, k, meta), rtol=2e-4, atol=1e-5)
    if backend == "reference":   # (the kernel's stats-off output is compared in test_paged_attention.py)
        plain = paged_attention_for_step(q, k, v, meta, **kw)
        assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
        q, k, v, meta = _random_step_case(1, [1, 70, 0, 20], [8, 16, 32, 64], chunk=6)
        out, var = paged_attention_for_step(q, k, v, meta, return_score_stats=True, **kw)
        assert var.shape == (4, 6, 4)
        want = _float64_step_var(q, k, meta)
        np.testing.assert_allclose(np.asarray(var), want, rtol=2e-4, atol=1e-5)
        cols = np.asarray([[5, 1], [0, 4], [3, 3], [2, 5]], np.int32)     # stats for 2 chosen columns
        _, sub = paged_attention_for_step(q, k, v, meta, return_score_stats=True, stats_columns=cols, **kw)
        np.testing.assert_allclose(np.asarray(sub), np.take_along_axis(want, cols[:, :, None], axis=1),
                                   rtol=2e-4, atol=1e-5)


def test_decode_steps_kernel_matches_reference_and_float64(two_splits):
    """decode_steps on a bf16, head_dim-64 tiny model after a prefill: DecodeResult.attn_score_var
    [num_steps, rows] is the same from the kernel (interpret mode) and the reference backend, 0 for
    rows that are not running; the reference's step-0 value equals the float64 recomputation."""
    cfg, params = _model("bfloat16", 64)
    pre, cache, (_, _, _, starts, sizes) = _prefill(cfg, params)
    rows = len(PROMPTS)
    last = np.asarray(pre.tokens, np.int32)
    pos = np.asarray([len(p) for p in PROMPTS], np.int32)
    allowed = np.asarray([2, 2, 1, 0], np.int32)
    results = {}
    for backend in ("reference", "kernel"):
        opts = StepOptions(max_context=64, backend=backend, interpret=backend == "kernel")
        c = jax.tree.map(jnp.copy, cache)
        results[backend], _ = decode_steps(params, c, last, pos, allowed, starts, sizes, _greedy(rows),
                                           cfg=cfg, opts=opts, num_steps=2)
    ref, ker = (np.asarray(results[b].attn_score_var) for b in ("reference", "kernel"))
    assert ref.shape == ker.shape == (2, rows) and ker.dtype == np.float32
    running = np.arange(2)[:, None] < allowed[None, :]
    assert np.all(ref[~running] == 0) and np.all(ker[~running] == 0)
    assert np.all(ref[running] > 0.01)
    # bf16 P in the kernel's P @ V changes later layers' inputs a little: 2% covers it.
    np.testing.assert_allclose(ker, ref, rtol=2e-2, atol=1e-4)

    # Step 0 from scratch: one decode token per running row, through the model eagerly, float64.
    tokens = last[:, None]
    slots = np.asarray([[_slot(starts, sizes, r, int(pos[r]))] if allowed[r] else [NUM_SLOTS] for r in range(rows)],
                       np.int32)
    q_pos = np.where(allowed > 0, pos, -1)[:, None].astype(np.int32)
    meta = AttentionMetadata(q_pos, np.where(allowed > 0, pos + 1, 0).astype(np.int32), starts, sizes)
    recorded = []

    def attend(layer, q, k_pool, v_pool):
        recorded.append((q[:, None], k_pool))
        return paged_attention_reference_chunked(q[:, None], k_pool, v_pool, meta, max_context=64)[:, 0]

    llama.forward(params, cfg, jnp.asarray(tokens[:, 0]), jnp.asarray(np.maximum(q_pos[:, 0], 0)), cache,
                  jnp.asarray(slots[:, 0]), attend)
    want = np.mean([_float64_step_var(q, k, meta)[:, 0].mean(axis=-1) for q, k in recorded], axis=0)
    np.testing.assert_allclose(ref[0], want, rtol=1e-3, atol=1e-5)
