"""Attention over the paged KV cache, for a batch of query chunks, and the backend switch.

The engine calls one function per step, `paged_attention_for_step`, with queries laid out as
[seqs, chunk] (chunk = 1 for decode). The reference path gathers each sequence's context out of the pool
and applies a causal mask by absolute position: simple, exact, and the thing the Pallas kernels are
tested against. The kernel path serves decode steps (chunk == 1) with the Mosaic GPU kernel.

Score statistics. With `return_score_stats=True` both paths also return, for every query row (one q
head of one query token), the attention-score variance: with s_j = sm_scale * q . k_j the softmax
input for key j, the population variance of s_j over the keys j the query sees (causal and
j < context_len): mean(s^2) - mean(s)^2, float32, 0 for a query that sees no key. It feeds the
page-size rule and the DMLP's `attn_var5` feature (see stratum_jax/decode.py for the per-row means).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device arrays describing one step's sequences. A registered pytree, so it can cross jit.

    q_positions:  [seqs, chunk] int32, absolute position of each query token (-1 for padding)
    context_lens: [seqs] int32, tokens in each sequence's cache after this step's writes (0 = padding row)
    page_starts:  [seqs, max_pages] int32, first slot of each page of the sequence
    page_sizes:   [seqs] int32, the page size of each sequence (8..256)
    """

    q_positions: jax.Array
    context_lens: jax.Array
    page_starts: jax.Array
    page_sizes: jax.Array


jax.tree_util.register_dataclass(
    AttentionMetadata, data_fields=["q_positions", "context_lens", "page_starts", "page_sizes"],
    meta_fields=[])


def context_slots(meta: AttentionMetadata, max_context: int) -> jax.Array:
    """Slot of every context position of every sequence: [seqs, max_context] int32 (clamped, masked later)."""
    pos = jnp.arange(max_context, dtype=jnp.int32)[None, :]
    ps = meta.page_sizes[:, None]
    page_idx = jnp.minimum(pos // jnp.maximum(ps, 1), meta.page_starts.shape[1] - 1)
    starts = jnp.take_along_axis(meta.page_starts, page_idx, axis=1)
    return starts + pos % jnp.maximum(ps, 1)


def paged_attention_reference_chunked(q, k_pool, v_pool, meta: AttentionMetadata, *, max_context: int,
                                      sm_scale: float | None = None, return_score_stats: bool = False,
                                      stats_columns: jax.Array | None = None):
    """Causal attention of query chunks over their sequences' paged context.

    q: [seqs, chunk, num_heads, head_dim]; k_pool, v_pool: [num_kv_heads, num_slots, head_dim].
    max_context is a static bound on context_lens (the gather width). Returns [seqs, chunk, num_heads,
    head_dim] in q.dtype; padding queries (position -1) and rows with context 0 give zeros.
    With return_score_stats (static) it returns (out, score_var), score_var float32 [seqs, chunk,
    num_heads]: each query row's score variance over its visible keys (module docstring), from the
    scores computed anyway, in one pass of sums of (s - row max) and their squares (the shift keeps
    fp32 from cancelling when the scores share a large offset). stats_columns [seqs, K] int32 (chunk
    columns) limits the statistics to those queries, and score_var is then [seqs, K, num_heads]: a
    long prefill chunk pays for K columns instead of all of them.
    """
    seqs, chunk, num_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    group = num_heads // num_kv_heads
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    slots = context_slots(meta, max_context)                              # [S, L]
    k = k_pool[:, slots].astype(jnp.float32)                              # [Hkv, S, L, D]
    v = v_pool[:, slots].astype(jnp.float32)
    qg = q.astype(jnp.float32).reshape(seqs, chunk, num_kv_heads, group, head_dim)
    scores = jnp.einsum("scngd,nsld->sngcl", qg, k) * scale               # [S, Hkv, G, C, L]
    pos = jnp.arange(max_context, dtype=jnp.int32)
    visible = ((pos[None, None, :] <= meta.q_positions[:, :, None])
               & (pos[None, None, :] < meta.context_lens[:, None, None]))  # [S, C, L]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    max_s = jnp.max(scores, axis=-1, keepdims=True)
    max_s = jnp.where(jnp.isfinite(max_s), max_s, 0.0)
    p = jnp.where(visible[:, None, None], jnp.exp(scores - max_s), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("sngcl,nsld->scngd", p / jnp.where(denom > 0, denom, 1.0), v)
    out = out.reshape(seqs, chunk, num_heads, head_dim).astype(q.dtype)
    if not return_score_stats:
        return out
    if stats_columns is not None:                                         # keep K query columns
        cols = stats_columns.astype(jnp.int32)
        visible = jnp.take_along_axis(visible, cols[:, :, None], axis=1)              # [S, K, L]
        scores = jnp.take_along_axis(scores, cols[:, None, None, :, None], axis=3)    # [S, Hkv, G, K, L]
        max_s = jnp.take_along_axis(max_s, cols[:, None, None, :, None], axis=3)
    vis = visible[:, None, None]                                          # [S, 1, 1, K, L]
    n = jnp.sum(visible, axis=-1, dtype=jnp.float32)[:, None, None]       # [S, 1, 1, K]
    d = jnp.where(vis, scores - max_s, 0.0)
    mean_d = jnp.sum(d, axis=-1) / jnp.maximum(n, 1.0)
    var = jnp.where(n > 0, jnp.maximum(jnp.sum(d * d, axis=-1) / jnp.maximum(n, 1.0) - mean_d * mean_d, 0.0), 0.0)
    return out, var.transpose(0, 3, 1, 2).reshape(seqs, visible.shape[1], num_heads)  # [S, K, Hkv * G]


def paged_attention_for_step(q, k_pool, v_pool, meta: AttentionMetadata, *, max_context: int,
                             backend: str, interpret: bool = False, return_score_stats: bool = False,
                             stats_columns: jax.Array | None = None):
    """The engine's attention entry: [seqs, chunk, heads, head_dim] queries -> same-shaped outputs.

    With return_score_stats (static): (out, score_var float32 [seqs, chunk, heads]), each query row's
    attention-score variance (module docstring); with stats_columns [seqs, K] only those chunk
    columns' ([seqs, K, heads]; a decode step, chunk 1, takes K = 1, column 0). The kernel computes
    it alongside its online softmax (`paged_attention(..., return_score_stats=True)`); without the
    flag the kernel call is unchanged.
    """
    if backend == "kernel" and q.shape[1] == 1:
        from pallas_kernels.paged_attention import paged_attention
        res = paged_attention(q[:, 0], k_pool, v_pool, meta.context_lens, meta.page_starts,
                              meta.page_sizes, interpret=interpret, return_score_stats=return_score_stats)
        if return_score_stats:
            out, var = res
            return out[:, None], var[:, None]
        return res[:, None]
    return paged_attention_reference_chunked(q, k_pool, v_pool, meta, max_context=max_context,
                                             return_score_stats=return_score_stats, stats_columns=stats_columns)
