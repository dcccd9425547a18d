"""Paged KV inputs for the attention benchmarks (kernels.py, delta_kernels.py, fp8_fold_sweep.py): where each
sequence's pages sit in the pool, the dense K/V in token order, and XLA's dense decode attention as the check.
Imported by bare name (found beside the scripts)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.paged_attention import PAGE_SIZES

MIXED = "mixed"     # the --pages value of a batch whose rows cycle through every page size


def batch_page_sizes(batch: int, page) -> list[int]:
    """Each row's page size: `page` (an int) for every row, or with MIXED the rows cycling through PAGE_SIZES."""
    return [PAGE_SIZES[b % len(PAGE_SIZES)] for b in range(batch)] if page == MIXED else [int(page)] * batch


def page_layout(rng, batch, context, page_sizes, table_width):
    """Random buddy-aligned placement of every sequence's pages over an exactly-full pool.

    Returns page_starts [B, table_width] (zeros past the end) and num_slots. Sequences with
    different page sizes get disjoint 256-slot blocks, so mixed batches place pages like the
    engine's buddy allocator would."""
    num_slots = batch * context
    blocks = rng.permutation(num_slots // 256)
    starts = np.zeros((batch, table_width), np.int32)
    per_seq_blocks = context // 256
    for b in range(batch):
        P = page_sizes[b]
        mine = blocks[b * per_seq_blocks:(b + 1) * per_seq_blocks]
        pages = (mine[:, None] * 256 + np.arange(0, 256, P)[None, :]).reshape(-1)
        starts[b, :len(pages)] = rng.permutation(pages)
    return starts, num_slots


def dense_from_pages(pool, page_starts, page_sizes, context):
    """[Hkv, S, D] pool -> [B, Hkv, context, D] in token order (for XLA and for the check)."""
    t = np.arange(context)
    slots = np.stack([page_starts[b, t // P] + t % P for b, P in enumerate(page_sizes)])   # [B, ctx]
    return jnp.swapaxes(pool[:, jnp.asarray(slots)], 0, 1)


@functools.partial(jax.jit, static_argnames=("scale",))
def xla_decode_attention(q, k, v, lengths, *, scale):
    """Dense decode attention in XLA: q [B, Hq, D], k/v [B, Hkv, T, D] bf16 -> [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bhgd,bhtd->bhgt", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(jnp.arange(T)[None, None, None, :] < lengths[:, None, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhgt,bhtd->bhgd", p.astype(k.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(B, Hq, D).astype(q.dtype)
