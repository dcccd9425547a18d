"""Split-K's tile partition (`paged_tiles.split_tile_range`, even and longest-first), the page-table window that
bounds a split's pages (`table_window`) and the key counts XLA derives from the same partition
(`split_k.split_key_counts`): exhaustive over small tables, no kernel."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.paged_attention import PAGE_SIZES
from pallas_kernels.paged_tiles import split_tile_range, table_window
from pallas_kernels.split_k import split_key_counts

SPLITS = [(2, None), (3, None), (4, None), (2, 65), (2, 99), (3, 50), (4, 1), (2, 1)]


@pytest.mark.parametrize("splits,percent", SPLITS)
def test_the_splits_partition_every_sequence_in_order(splits, percent):
    """Splits k = 0..S-1 cover [0, n_tiles) in order, without overlap or gap (empty splits at the end allowed);
    longest-first: split 0 takes ceil(n * percent / 100) tiles."""
    n_tiles = jnp.arange(0, 200, dtype=jnp.int32)
    shape = (n_tiles.shape[0], splits)
    lo, hi = (np.asarray(x) for x in split_tile_range(
        jnp.broadcast_to(n_tiles[:, None], shape), jnp.broadcast_to(jnp.arange(splits, dtype=jnp.int32), shape),
        splits, percent))
    n = np.asarray(n_tiles)
    assert (lo[:, 0] == 0).all() and (hi[:, -1] == n).all()
    assert (hi >= lo).all() and (hi[:, :-1] == lo[:, 1:]).all()
    if percent is not None:
        np.testing.assert_array_equal(hi[:, 0], -(-n * percent // 100))
        sizes = hi[:, 1:] - lo[:, 1:]
        assert (sizes.max(axis=1) - sizes.min(axis=1) <= -(-(n - hi[:, 0]) // (splits - 1))).all()
    for k in range(splits):      # the in-kernel form (int32 scalars) is the same partition
        got = split_tile_range(jnp.int32(137), jnp.int32(k), splits, percent)
        assert (int(got[0]), int(got[1])) == (lo[137, k], hi[137, k])


@pytest.mark.parametrize("splits,percent", [(1, None)] + SPLITS)
@pytest.mark.parametrize("block_kv", [64, 128])
def test_the_window_holds_every_page_a_split_reads(splits, percent, block_kv):
    """A split's pages, from its window start aligned down to 4 entries, fit `table_window`, for every page size
    and length a table of max_pages entries addresses; the key counts add up to each length."""
    for max_pages in (16, 96, 512):
        window = table_window(max_pages, splits, block_kv, percent)
        assert window % 32 == 0
        for page in PAGE_SIZES:
            lengths = np.arange(0, max_pages * page + 1, max(1, page // 2), dtype=np.int32)
            n_tiles = -(-lengths // block_kv)
            for k in range(splits):
                lo, hi = (np.asarray(x) for x in split_tile_range(
                    jnp.asarray(n_tiles), jnp.full(n_tiles.shape, k, jnp.int32), splits, percent))
                live = hi > lo
                page_lo = np.minimum(lo * block_kv // page, max_pages - 1)
                page_hi = -(-np.minimum(hi * block_kv, lengths) // page)
                need = page_hi - (page_lo - page_lo % 4)
                assert (need[live] <= window).all(), (max_pages, page, k, need.max(), window)
            counts = split_key_counts(jnp.asarray(lengths), jnp.full(lengths.shape, page, jnp.int32),
                                      max_pages=max_pages, block_kv=block_kv, splits=splits,
                                      first_split_percent=percent)
            np.testing.assert_array_equal(np.asarray(counts).sum(axis=1), lengths)


def test_table_window_longest_first_is_the_larger_share():
    assert table_window(512, 2, 64) == 288                 # 256 + 16 + 5 -> 288
    assert table_window(512, 2, 64, 65) == 384             # ceil(512 * 0.65) = 333 + 21 -> 384
    assert table_window(512, 3, 64, 20) == 256             # the other two take 40% each: 205 + 21 -> 256
