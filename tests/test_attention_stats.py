"""The attention-score variance (`attn_score_var`, stratum_jax/decode.py) against float64 recomputations.

Definition: for a query row (one q head of one token), s_j = sm_scale * q . k_j over the keys it sees;
its variance is mean(s^2) - mean(s)^2; a token's value is the mean over q heads and layers; a row's value
in a step is its decode token's value (prompt tokens are not measured: 0 for a row that only prefills).

Three levels: packed_step on batches packed by the engine's own ModelRunner (so the host's weights are
tested too), the attention functions' per-query variance, and decode_steps with both backends.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import float64_truth, per_query_case, tiled_case
from packing_cases import NUM_SLOTS, ROWS, TILE, packing_runner, packing_sequences
from pallas_kernels.testing import float64_score_variance, random_paged_case
from stratum_jax.attention import RowTables, decode_attention, tiled_paged_attention
from stratum_jax.decode import SamplerVariant, decode_steps, packed_step
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.scheduler.base import ScheduledBatch

# Per-query variance: fp32 scores of the same values the float64 truth uses, summed after a shift,
# measured ~1e-6 relative; one key too many or too few moves a variance by ~var / n (> 1e-3 here).
VAR_RTOL, VAR_ATOL = 2e-4, 1e-5


def _model(dtype, head_dim, qk_gain=4.0):
    """The tiny preset, with q_proj/k_proj scaled up so the scores have a variance of order 1 (at
    N(0, 0.02) init they are nearly constant and every variance would be ~1e-3)."""
    cfg = dataclasses.replace(PRESETS["tiny"], head_dim=head_dim, dtype=dtype)
    params = llama.init_params(cfg, seed=1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * qk_gain if any(getattr(p, "key", None) in ("q_proj", "k_proj") for p in path) else x,
        params)
    return cfg, params


def _advance(batch: ScheduledBatch, tokens):
    """What the engine does with a step's results: chunks are computed; a row that reached the end of its
    prompt, or decoded, gets its sampled token."""
    for seq, n in zip(batch.prefill, batch.chunk_lens):
        seq.num_computed += n
    for r, seq in enumerate(batch.seqs):
        if r < len(batch.decode):
            seq.num_computed = seq.num_tokens
        if seq.num_computed == seq.num_tokens:
            seq.output_ids.append(int(tokens[r]))


def _token_rows(batch_arrays, tile):
    """Row of every packed token: [T] (decode tokens: their index; prefill tokens: their tile's row)."""
    rows = batch_arrays.sample_index.shape[0]
    return np.concatenate([np.arange(rows), np.repeat(np.asarray(batch_arrays.tile_rows), tile)])


def _float64_token_var(cfg, params, cache, packed, tile):
    """Runs the model eagerly on the packed tokens, with attention computed in float64 from each
    layer's q (after RoPE) and pools: returns per token [T] the score variance averaged over heads and
    layers, in float64 (0 for padding tokens)."""
    token_rows = _token_rows(packed, tile)
    tables = packed.tables
    layer_vars = []

    def attend(layer, q, k_pool, v_pool):
        case = per_query_case(q, k_pool, v_pool, token_rows, packed.positions, tables.context_lens,
                              tables.page_starts, tables.page_sizes)
        out, var = float64_truth(case)
        layer_vars.append(var.mean(axis=-1))
        return jnp.asarray(out, q.dtype)

    llama.forward(params, cfg, jnp.asarray(packed.token_ids), jnp.asarray(np.maximum(packed.positions, 0)),
                  jax.tree.map(jnp.copy, cache), jnp.asarray(packed.write_slots), attend)
    return np.mean(layer_vars, axis=0)


def _greedy_step(runner, params, cfg, cache, batch, prefill_tokens, geo=None):
    packed, _ = runner._packed_inputs(batch, prefill_tokens)
    res, new_cache = packed_step(params, jax.tree.map(jnp.copy, cache), packed, cfg=cfg, geo=geo or runner.geo)
    return jax.device_get(res), new_cache, packed


def test_packed_step_attn_score_var_matches_float64():
    """Two packed steps on the fp32 tiny model: (1) prefill of three prompts, one of them chunked (22 of
    30 tokens), plus a padding row and a padding tile; (2) a mixed step: two decode rows and the rest of
    the chunked prompt (a chunk that starts at position 22). A decode row's attn_score_var equals the
    float64 recomputation of its token's variance; prompt tokens are not measured (decode.py), so a row
    that only prefilled reads 0; with attn_stats off, the same tokens and zero stats."""
    cfg, params = _model("float32", 32)
    runner = packing_runner()
    a, b, c = packing_sequences()
    cache = llama.init_kv_cache(cfg, NUM_SLOTS)
    steps = [ScheduledBatch([], [], [b, c, a], [3, 12, 22]),
             ScheduledBatch([b, c], [1, 1], [a], [8])]
    # 7 tiles: 6 (step 1) or 1 (step 2) hold chunks, the rest are padding tiles; one shape, one compile.
    prefill_tokens = 7 * TILE
    for i, batch in enumerate(steps):
        res, new_cache, packed = _greedy_step(runner, params, cfg, cache, batch, prefill_tokens)
        var = res.attn_score_var
        assert var.shape == (ROWS,) and var.dtype == np.float32
        if i == 0:
            assert np.all(var == 0)                                  # prompt tokens only: not measured
        else:
            token_var = _float64_token_var(cfg, params, cache, packed, TILE)
            want = np.where(np.arange(ROWS) < 2, token_var[:ROWS], 0.0)   # rows 0-1 decode, 2 prefills, 3 pads
            assert np.all(want[:2] > 0.05)                           # non-trivial values
            np.testing.assert_allclose(var, want, rtol=1e-4, atol=1e-6)
            # attn_stats=False: the same tokens, zeros for the stats.
            off, _, _ = _greedy_step(runner, params, cfg, cache, batch, prefill_tokens,
                                     geo=dataclasses.replace(runner.geo, attn_stats=False))
            assert np.array_equal(off.tokens, res.tokens)
            assert np.all(off.attn_score_var == 0)
        _advance(batch, res.tokens)
        cache = new_cache
    assert a.num_computed == 30 and len(b.output_ids) == len(c.output_ids) == 2


# ---------------------------------------------------------------------------------------------------
# The attention functions' per-query variance
# ---------------------------------------------------------------------------------------------------

def check_var(var, want):
    var = np.asarray(var)
    assert var.dtype == np.float32 and var.shape == want.shape, (var.dtype, var.shape)
    assert np.isfinite(var).all() and (var >= 0).all()
    np.testing.assert_allclose(var, want, rtol=VAR_RTOL, atol=VAR_ATOL)


@functools.partial(jax.jit, static_argnames=("key_block", "return_score_stats"))
def _tiled(q, q_positions, tile_rows, tables, k_pool, v_pool, key_block, return_score_stats):
    return tiled_paged_attention(q, q_positions, tile_rows, tables, k_pool, v_pool, key_block=key_block,
                                 return_score_stats=return_score_stats)


@pytest.mark.parametrize("key_offset", [0.0, 300.0])
def test_tiled_score_var(key_offset):
    """Prefill tiles (causal chunks of 8, starting at 0 and past 0), a row with context 0, a padding tile,
    key_block 16 so the sums run over many blocks. key_offset adds a constant to every key: each query's
    scores then share an offset of hundreds, which a shift-free mean(s^2) - mean(s)^2 in float32 would
    cancel away (the variance itself does not change). Outputs with stats equal outputs without."""
    args, case = tiled_case(11, contexts=[1, 15, 70, 0, 130], page_sizes=[8, 16, 64, 8, 256],
                            chunk_starts=[0, 0, 50, 0, 100], tile=TILE, num_heads=4, num_kv_heads=2, head_dim=32,
                            pad_tiles_after=(2,), zero_rows=(3,))
    if key_offset:
        k_pool = args[4] + key_offset
        args = (*args[:4], k_pool, args[5])
        case = {**case, "k_pool": k_pool}
    out, var = _tiled(*args, key_block=16, return_score_stats=True)
    want = float64_score_variance(case)
    assert want.max() > 0.5                                               # non-trivial values
    check_var(var.reshape(want.shape), want)
    plain = _tiled(*args, key_block=16, return_score_stats=False)
    assert np.array_equal(np.asarray(out), np.asarray(plain))


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_decode_attention_score_var(backend, two_splits):
    """One token per row, bf16 pools, every kind of row: length 1, several pages, length 0, pages of 8
    to 256. The kernel runs in the Mosaic GPU interpreter (shapes kept small: it simulates every thread)."""
    contexts, sizes = [1, 37, 0, 70, 9], [8, 16, 32, 8, 256]
    case = random_paged_case(5, lengths=contexts, page_sizes=sizes, num_q_heads=4, num_kv_heads=2, head_dim=64)
    positions = jnp.asarray(contexts, jnp.int32) - 1
    tables = RowTables(jnp.zeros(len(contexts), jnp.int32), case["page_starts"], case["page_sizes"])
    def call(return_score_stats=False):
        attend = jax.jit(functools.partial(decode_attention, backend=backend, interpret=backend == "kernel",
                                           return_score_stats=return_score_stats))
        return attend(case["q"], positions, tables, case["k_pool"], case["v_pool"])

    out, var = call(return_score_stats=True)
    want = float64_score_variance(case)
    assert want.max() > 0.5
    check_var(var, want)
    assert np.all(np.asarray(var)[2] == 0)
    if backend == "reference":   # (the kernel's stats-off output is compared in test_paged_attention.py)
        assert np.array_equal(np.asarray(out, np.float32), np.asarray(call(), np.float32))


# ---------------------------------------------------------------------------------------------------
# decode_steps, both backends
# ---------------------------------------------------------------------------------------------------

def test_decode_steps_kernel_matches_reference_and_float64(two_splits):
    """decode_steps on a bf16, head_dim-64 tiny model after a prefill: DecodeResult.attn_score_var
    [2 steps, rows] is the same from the kernel (interpret mode) and the reference backend, 0 for rows
    that are not running; the reference's step-0 value equals the float64 recomputation."""
    cfg, params = _model("bfloat16", 64)
    runner = packing_runner()
    a, b, c = packing_sequences()
    prefill = ScheduledBatch([], [], [b, c, a], [3, 12, 30])
    res, cache, _ = _greedy_step(runner, params, cfg, llama.init_kv_cache(cfg, NUM_SLOTS), prefill, 56)
    _advance(prefill, res.tokens)
    batch = ScheduledBatch([b, c, a], [2, 2, 1], [], [])
    inputs = runner._decode_inputs(batch)
    allowed = inputs[2]
    assert allowed.tolist() == [2, 2, 1, 0]
    results = {}
    for backend in ("reference", "kernel"):
        geo = dataclasses.replace(runner.geo, backend=backend, interpret=backend == "kernel", attn_stats=True)
        results[backend], _ = decode_steps(params, jax.tree.map(jnp.copy, cache), *inputs, cfg=cfg, geo=geo,
                                           variant=SamplerVariant())
    ref, ker = (np.asarray(results[b].attn_score_var) for b in ("reference", "kernel"))
    assert ref.shape == ker.shape == (2, ROWS) and ker.dtype == np.float32
    running = np.arange(2)[:, None] < allowed[None, :]
    assert np.all(ref[~running] == 0) and np.all(ker[~running] == 0)
    assert np.all(ref[running] > 0.01)
    # bf16 P in the kernel's P @ V changes later layers' inputs a little: 2% covers it.
    np.testing.assert_allclose(ker, ref, rtol=2e-2, atol=1e-4)

    # Step 0 from scratch: the same decode tokens as one packed step, through the model eagerly, float64.
    packed, _ = runner._packed_inputs(ScheduledBatch([b, c, a], [1, 1, 1], [], []), 0)
    want = _float64_token_var(cfg, params, cache, packed, TILE)
    # The reference path takes q in the pools' dtype (bf16: 2^-8 relative), which moves a variance by up
    # to a few 1e-3 of its value; a wrong definition (e.g. all tokens instead of the last 5) is off by > 1e-2.
    np.testing.assert_allclose(ref[0], want, rtol=3e-3, atol=1e-5)
