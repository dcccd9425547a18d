"""Inputs for the packed step's attention (stratum_jax/attention.py) and their float64 truths.

The truths reuse pallas_kernels/testing.py: every query becomes a one-query "sequence" whose length is
the number of keys it sees (min(position + 1, its row's context), 0 for padding), so
`float64_attention` / `float64_score_variance` compute its output and score variance in float64.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.testing import float64_attention, float64_score_variance, random_paged_case
from stratum_jax.attention import RowTables


def per_query_case(q, k_pool, v_pool, query_rows, positions, context_lens, page_starts, page_sizes) -> dict:
    """q [Nq, num_heads, head_dim]; query_rows, positions [Nq] int (row -1 or position -1: padding
    query); context_lens [rows], page_starts [rows, W], page_sizes [rows] -> a pallas_kernels.testing
    case over Nq one-query sequences (lengths [Nq]: the keys each query sees)."""
    query_rows, positions = np.asarray(query_rows), np.asarray(positions)
    ctx, starts, sizes = (np.asarray(a) for a in (context_lens, page_starts, page_sizes))
    row = np.maximum(query_rows, 0)
    valid = (query_rows >= 0) & (positions >= 0)
    lengths = np.where(valid, np.minimum(positions + 1, ctx[row]), 0).astype(np.int32)
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, lengths=lengths, page_starts=starts[row],
                page_sizes=sizes[row])


def float64_truth(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """(out [Nq, num_heads, head_dim], score variance [Nq, num_heads]), float64, zeros for padding."""
    return float64_attention(case), float64_score_variance(case)


def tiled_case(seed, *, contexts, page_sizes, chunk_starts, tile, num_heads, num_kv_heads, head_dim,
               pad_tiles_after=(), zero_rows=(), pool_dtype=jnp.float32):
    """A random packed prefill: row r has contexts[r] tokens in pages of page_sizes[r] (random buddy
    placement, NaN in every slot no row owns, garbage table entries past each row's pages) and
    queries at positions chunk_starts[r] .. contexts[r] - 1, in tiles of `tile` (the last one padded
    with position -1). A padding tile (row -1) follows the tiles of each row in pad_tiles_after; each
    row in zero_rows has context 0 and one tile of padding queries.

    Returns (args, case): args = (q [tiles, tile, H, D], q_positions [tiles, tile], tile_rows [tiles],
    RowTables, k_pool, v_pool) for tiled_paged_attention; case = per_query_case over the tiles'
    queries in order (truth index = tile * `tile` + query)."""
    paged = random_paged_case(seed, lengths=list(contexts), page_sizes=list(page_sizes), num_q_heads=num_heads,
                              num_kv_heads=num_kv_heads, head_dim=head_dim)
    positions, tile_rows = [], []
    for r, (n, start) in enumerate(zip(contexts, chunk_starts)):
        if r in zero_rows:
            assert n == 0
            positions.append(np.full(tile, -1))
            tile_rows.append(r)
        for t0 in range(start, n, tile):
            pos = np.arange(t0, t0 + tile)
            positions.append(np.where(pos < n, pos, -1))
            tile_rows.append(r)
        if r in pad_tiles_after:
            positions.append(np.full(tile, -1))
            tile_rows.append(-1)
    q_positions = np.asarray(positions, np.int32)
    tile_rows = np.asarray(tile_rows, np.int32)
    rng = np.random.default_rng(seed + 1)
    q = (rng.standard_normal((len(tile_rows), tile, num_heads, head_dim)) * 1.5).astype(np.float32)
    q = jnp.asarray(q, pool_dtype)
    k_pool, v_pool = paged["k_pool"].astype(pool_dtype), paged["v_pool"].astype(pool_dtype)
    tables = RowTables(paged["lengths"], paged["page_starts"], paged["page_sizes"])
    case = per_query_case(q.reshape(-1, num_heads, head_dim), k_pool, v_pool, np.repeat(tile_rows, tile),
                          q_positions.reshape(-1), tables.context_lens, tables.page_starts, tables.page_sizes)
    return (q, jnp.asarray(q_positions), jnp.asarray(tile_rows), tables, k_pool, v_pool), case
