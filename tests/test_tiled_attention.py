"""The packed step's attention against float64 numpy: `tiled_paged_attention` (prefill tiles) and
`decode_attention` (reference backend, and the Pallas kernel in interpret mode), on random ragged
batches: every page size 8..256 mixed in one batch, several tiles per row, padding tiles and padding
queries, contexts many key blocks long, NaN in every cache slot no row owns (a masked key that still
reaches P @ V, or a gather through a stale table entry, would show as NaN), GQA groups 1, 2 and 4.
The score variance these functions also return is tested in test_attention_stats.py.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attention_cases import float64_truth, per_query_case, tiled_case
from pallas_kernels.testing import float64_attention, random_paged_case
from stratum_jax.attention import KEY_BLOCK, RowTables, decode_attention, tiled_paged_attention

# fp32 pools: the only error is fp32 rounding (measured ~1e-6); bf16 pools: P is cast to bf16 for P @ V.
FP32_TOL, BF16_TOL = 2e-5, 2e-2
GROUPS = [(2, 2), (4, 2), (8, 2)]           # (num_heads, num_kv_heads): GQA group 1, 2, 4

# Rows: every page size, contexts from 1 token to many key blocks, chunks that start at 0 and past 0
# (the prefix already cached), a chunk that ends mid-tile, and a row with context 0.
CONTEXTS = [1, 15, 33, 70, 130, 300, 0]
PAGE_SIZES = [8, 16, 32, 64, 128, 256, 8]
CHUNK_STARTS = [0, 0, 20, 61, 0, 290, 0]


def check(out, want, tol):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32), np.float64)
    assert out.shape == want.shape, (out.shape, want.shape)
    assert not np.isnan(out).any(), "NaN in the output"
    err = np.abs(out - want).max()
    assert err <= tol, f"max abs err {err:.3g} > {tol}"


@functools.partial(jax.jit, static_argnames="key_block")
def _tiled(q, q_positions, tile_rows, tables, k_pool, v_pool, key_block=KEY_BLOCK):
    return tiled_paged_attention(q, q_positions, tile_rows, tables, k_pool, v_pool, key_block=key_block)


@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS)
def test_tiled_matches_float64(num_heads, num_kv_heads):
    """fp32 pools, key_block 16 (300 keys = 19 loop iterations), tiles of 8."""
    tile = 8
    args, case = tiled_case(num_heads, contexts=CONTEXTS, page_sizes=PAGE_SIZES, chunk_starts=CHUNK_STARTS,
                            tile=tile, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                            pad_tiles_after=(1, 4), zero_rows=(6,))
    q, q_positions, tile_rows = args[:3]
    assert q.shape[0] > 25 and (np.asarray(tile_rows) == -1).sum() == 2
    out = _tiled(*args, key_block=16)
    want, _ = float64_truth(case)
    check(out.reshape(want.shape), want, FP32_TOL)
    padding = np.asarray((q_positions < 0) | (tile_rows[:, None] < 0)).reshape(-1)
    assert padding.sum() > tile and np.all(np.asarray(out).reshape(want.shape)[padding] == 0)


def test_tiled_bf16_pools_default_key_block():
    """bf16 q and pools (the serving dtype), key blocks of 128 over contexts of up to 5 blocks, tiles of
    16; page sizes in another order than above."""
    contexts = [600, 17, 260, 129, 3, 64]
    args, case = tiled_case(7, contexts=contexts, page_sizes=[8, 256, 16, 128, 64, 32],
                            chunk_starts=[560, 0, 200, 100, 0, 48], tile=16, num_heads=8, num_kv_heads=2,
                            head_dim=64, pad_tiles_after=(0,), pool_dtype=jnp.bfloat16)
    assert max(contexts) > 4 * 128
    out = _tiled(*args, key_block=128)
    assert out.dtype == jnp.bfloat16
    want, _ = float64_truth(case)
    check(out.reshape(want.shape), want, BF16_TOL)


def _decode_case(seed, contexts, page_sizes, num_heads, num_kv_heads, head_dim, dtype):
    """One query per row at position context - 1 (-1 for a row with context 0)."""
    case = random_paged_case(seed, lengths=contexts, page_sizes=page_sizes, num_q_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=dtype)
    case = {**case, "k_pool": case["k_pool"].astype(dtype), "v_pool": case["v_pool"].astype(dtype)}
    positions = jnp.asarray(contexts, jnp.int32) - 1
    # decode_attention takes the row's context from its position: give the tables a context_lens that
    # would be wrong if it were read.
    tables = RowTables(jnp.zeros(len(contexts), jnp.int32), case["page_starts"], case["page_sizes"])
    return case, positions, tables


@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS)
def test_decode_attention_reference_matches_float64(num_heads, num_kv_heads):
    contexts = [1, 15, 33, 129, 300, 0, 520]
    case, positions, tables = _decode_case(num_heads, contexts, [8, 16, 32, 64, 128, 256, 8], num_heads,
                                           num_kv_heads, 32, jnp.float32)
    out = jax.jit(functools.partial(decode_attention, backend="reference"))(
        case["q"], positions, tables, case["k_pool"], case["v_pool"])
    check(out, float64_attention(case), FP32_TOL)
    assert np.all(np.asarray(out)[5] == 0)                       # the row with no decode token


def test_decode_attention_kernel_matches_float64(two_splits):
    """The Pallas kernel (Mosaic GPU interpreter) through decode_attention, on a small case."""
    case, positions, tables = _decode_case(3, [1, 20, 0], [8, 16, 32], 2, 1, 64, jnp.bfloat16)
    out = decode_attention(case["q"], positions, tables, case["k_pool"], case["v_pool"], backend="kernel",
                           interpret=True)
    check(out, float64_attention(case), BF16_TOL)
    assert np.all(np.asarray(out.astype(jnp.float32))[2] == 0)


def test_per_query_case_lengths():
    """The truth helper's own bookkeeping: a query sees min(position + 1, context) keys, padding none."""
    case = per_query_case(np.zeros((5, 1, 8)), None, None, query_rows=[0, 0, 1, -1, 1], positions=[0, 9, 3, 2, -1],
                          context_lens=[4, 6], page_starts=[[0], [8]], page_sizes=[8, 8])
    assert case["lengths"].tolist() == [1, 4, 4, 0, 0]
    assert case["page_starts"].tolist() == [[0], [0], [8], [0], [8]]
