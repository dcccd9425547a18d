"""Split-K partials of the attention kernels (paged_attention.py's "Split-K (flash-decoding)"), merged in XLA: the
keys each split covered, the outputs from each split's normalised output and base-2 log-sum-exp, and the score
variance from each split's score sums (for the page-size rule and the DMLP)."""
from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from pallas_kernels.paged_tiles import split_tile_range

_LOG2E = math.log2(math.e)


def split_key_counts(lengths, page_sizes, *, max_pages, block_kv, splits, first_split_percent=None):
    """Valid keys each split of each sequence covers: [batch, splits] float32. The same length clamp
    and tile partition (`split_tile_range`) as the kernel's prologue."""
    log2_p = 3 + sum((page_sizes > (8 << c)).astype(jnp.int32) for c in range(5))
    length = jnp.clip(lengths, 0, max_pages * jnp.left_shift(1, log2_p))
    n_tiles = (length + block_kv - 1) // block_kv
    shape = (lengths.shape[0], splits)
    tile_lo, tile_hi = split_tile_range(jnp.broadcast_to(n_tiles[:, None], shape),
                                        jnp.broadcast_to(jnp.arange(splits, dtype=jnp.int32)[None, :], shape),
                                        splits, first_split_percent)
    n = jnp.minimum(length[:, None], tile_hi * block_kv) - tile_lo * block_kv
    return jnp.maximum(n, 0).astype(jnp.float32)


def score_variance_from_partials(shift, s1, s2, n):
    """Merge the kernel's per-split score sums into the population variance of each row's scores.

    shift, s1, s2: [B, S, ...] fp32 in the kernel's base-2 units (scores times log2(e)): the split's
    shift c, sum(s - c) and sum((s - c)^2) over the split's valid keys; n: the count of those keys,
    float32, broadcastable to them. Returns [B, ...] fp32, in natural units, >= 0, and 0 where the row
    has no valid key.
    """
    splits = shift.shape[1]
    has = n > 0
    n_safe = jnp.maximum(n, 1.0)
    # Per split: mean and M2 (sum of squared deviations from the split's own mean).
    mean = jnp.where(has, shift + s1 / n_safe, 0.0)
    m2 = jnp.where(has, jnp.maximum(s2 - s1 * (s1 / n_safe), 0.0), 0.0)
    if splits > 1:   # Chan et al.: M2 = sum M2_i + sum n_i (mean_i - mean)^2
        n_tot = jnp.sum(n, axis=1)
        mean_tot = jnp.sum(n * mean, axis=1) / jnp.maximum(n_tot, 1.0)
        dev = jnp.where(has, mean - mean_tot[:, None], 0.0)
        m2 = jnp.sum(m2 + n * dev * dev, axis=1)
        n = n_tot
    else:
        m2, n = m2[:, 0], n[:, 0]
    var = m2 / jnp.maximum(n, 1.0) * (1.0 / (_LOG2E * _LOG2E))
    return jnp.where(n > 0, jnp.maximum(var, 0.0), 0.0)


def combine_splits(o_part, lse):
    """Merge split-K partials. o_part [B, S, Hkv, G, D] fp32 (normalised per split), lse [B, S, Hkv, G]
    base-2 log-sum-exp (-inf for an empty split). Returns [B, Hkv, G, D] fp32 (zeros if all empty).
    Up to `UNROLLED_COMBINE_SPLITS` splits the merge is written split by split, elementwise only: XLA then
    fuses it into one kernel (with its consumer's elementwise work) where reductions over S would take three
    (max, sum, weighted sum; about 5 us a layer on the H200, launch-bound)."""
    splits = o_part.shape[1]
    if splits > UNROLLED_COMBINE_SPLITS:
        m = jnp.max(lse, axis=1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w = jnp.exp2(lse - m)                                            # [B, S, Hkv, G], 0 for empty
        denom = jnp.sum(w, axis=1)
        o = jnp.sum(w[..., None] * jnp.where(w[..., None] > 0, o_part, 0.0), axis=1)
        return o / jnp.where(denom == 0, 1.0, denom)[..., None]
    m = functools.reduce(jnp.maximum, [lse[:, s] for s in range(splits)])
    m = jnp.where(jnp.isfinite(m), m, 0.0)                               # [B, Hkv, G]
    denom, o = 0.0, 0.0
    for s in range(splits):
        w = jnp.exp2(lse[:, s] - m)                                      # 0 for an empty split
        denom = denom + w
        o = o + w[..., None] * jnp.where(w[..., None] > 0, o_part[:, s], 0.0)
    return o / jnp.where(denom == 0, 1.0, denom)[..., None]


# The most split-K partials `combine_splits` merges without reductions (the decode kernels' split rule gives
# at most 132 / (batch * kv heads), so 16 covers batch 1 with 8 kv heads and up).
UNROLLED_COMBINE_SPLITS = 16
