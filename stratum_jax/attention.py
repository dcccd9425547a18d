"""Attention over the paged KV cache for one packed step, and the backend switch.

The step (stratum_jax/decode.py) calls `decode_attention` for its decode tokens (one query per row: the
Pallas Mosaic GPU kernel, or the tiled jnp path) and `prefill_attention` for its prefill tiles (query
tiles of one row each, causal by absolute position: the kernel's causal-block variant, or the tiled
jnp path). The tiled path is an online softmax over
blocks of keys gathered through each row's block table; it is exact, and the kernels' tests compare
against float64 truths (pallas_kernels/testing.py, tests/test_tiled_attention.py).

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
from jax import lax

from pallas_kernels.l2_prefetch import WeightPrefetch
from stratum_jax.config import DECODE_KERNELS
from stratum_jax.kv.delta_cache import DeltaKV


@dataclasses.dataclass(frozen=True)
class RowTables:
    """Per-row block tables of one packed step (a registered pytree).

    context_lens: [rows] int32, tokens in the row's cache after this step's writes (0: no such row)
    page_starts:  [rows, table_width] int32, first slot of each page (table_width = max_context / 8)
    page_sizes:   [rows] int32, the row's page size (8..256)
    """

    context_lens: jax.Array
    page_starts: jax.Array
    page_sizes: jax.Array


jax.tree_util.register_dataclass(RowTables, data_fields=["context_lens", "page_starts", "page_sizes"],
                                 meta_fields=[])

# Keys per iteration of the tiled path's loop. Each iteration gathers [tiles, KEY_BLOCK] K/V slots.
KEY_BLOCK = 2048
# Up to this many key blocks in the context bound, the loop has a static trip count (see below).
STATIC_LOOP_MAX_BLOCKS = 4


def tiled_paged_attention(q, q_positions, tile_rows, tables: RowTables, k_pool, v_pool, *,
                          key_block: int = KEY_BLOCK, max_context: int | None = None,
                          return_score_stats: bool = False):
    """Causal attention of query tiles over their rows' paged context (the prefill path, and the
    decode path of the reference backend with one-token tiles).

    q: [tiles, tile, num_heads, head_dim]; q_positions: [tiles, tile] int32 absolute positions (-1:
    padding query); tile_rows: [tiles] int32, the row (into `tables`) every query of a tile belongs to
    (-1: padding tile). k_pool, v_pool: [num_kv_heads, num_slots, head_dim]; or, for a DKVC cache, k_pool
    a DeltaKV (stratum_jax/kv/delta_cache.py) and v_pool None: K/V are rebuilt block by block.
    A query at position p sees its row's keys at positions <= p and < context_len. The loop runs
    over blocks of `key_block` positions: all blocks up to `max_context` (the engine's --max-context, a
    config constant; default: what the tables can address with 256-token pages) when that is at most
    STATIC_LOOP_MAX_BLOCKS blocks, else up to the largest context in the step (a data-dependent trip
    count). Neither makes the context a compile axis. Scores and the online softmax are float32, the
    matmuls take the pools' dtype with float32 accumulation.
    Returns out [tiles, tile, num_heads, head_dim] in q.dtype (zeros for padding queries); with
    return_score_stats also score_var [tiles, tile, num_heads] float32: the population variance of the
    query's scores over its visible keys (module docstring), from sums of (s - shift) and their
    squares, shift = the row max of the first key block (which every valid query sees: it holds
    position 0), so float32 does not cancel when scores share a large offset.
    """
    tiles, tile, num_heads, head_dim = q.shape
    delta = k_pool if isinstance(k_pool, DeltaKV) else None
    num_kv_heads = delta.num_kv_heads if delta is not None else k_pool.shape[0]
    kv_dtype = delta.dtype if delta is not None else k_pool.dtype
    group = num_heads // num_kv_heads
    table_width = tables.page_starts.shape[1]
    scale = head_dim ** -0.5
    valid_tile = tile_rows >= 0
    rows = jnp.maximum(tile_rows, 0)
    ctx = jnp.where(valid_tile, tables.context_lens[rows], 0)                       # [N]
    page_size = jnp.maximum(tables.page_sizes[rows], 1)[:, None]                     # [N, 1]
    starts = tables.page_starts[rows]                                                # [N, W]
    # XLA on a GPU runs a loop whose trip count is data by reading its predicate on the host every
    # iteration (~0.8 ms each on an H200 inside the 16-layer llama-1b step: 93 vs 31 ms for 96 vs 16
    # iterations), while a static trip count stays on
    # the device but pays for every block up to the bound. So: a static loop over the whole bound when
    # it is a few blocks, else a loop to the largest context in the step. Measured on an H200, llama-1b,
    # the Mooncake trace at --max-context 32768: 12.8K prompt tok/s with the data-dependent loop, 8.3K
    # with the static one (BENCHMARKS.md, serving).
    bound = max_context if max_context is not None else table_width * 256
    static_blocks = -(-bound // key_block)
    need = jnp.minimum(ctx, jnp.max(q_positions, axis=1) + 1)                        # keys a tile needs
    dynamic_blocks = (jnp.max(need, initial=0) + key_block - 1) // key_block
    qg = q.reshape(tiles, tile, num_kv_heads, group, head_dim).astype(kv_dtype)
    neg = jnp.float32(-jnp.inf)
    acc_shape = (tiles, num_kv_heads, group, tile)

    def body(b, carry):
        m, l, acc, shift, s1, s2, n = carry
        pos = b * key_block + jnp.arange(key_block, dtype=jnp.int32)                 # [K]
        page = jnp.minimum(pos[None, :] // page_size, table_width - 1)
        slots = jnp.take_along_axis(starts, page, axis=1) + pos[None, :] % page_size  # [N, K]
        if delta is not None:                        # DKVC: anchor + scale * delta, rebuilt per block
            k, v = delta.gather(slots, pos)                                          # [Hkv, N, K, D]
        else:
            k = k_pool[:, slots]                                                     # [Hkv, N, K, D]
        # Zero V past the row's context: those slots (stale data, or whatever a table entry past the
        # row's pages points at) may hold NaN/inf, and P = 0 there does not stop 0 * NaN in P @ V.
        # (Masked scores need no such care: jnp.where below replaces them outright.)
        in_ctx = pos[None, :] < ctx[:, None]                                         # [N, K]
        v = jnp.where(in_ctx[None, :, :, None], v if delta is not None else v_pool[:, slots], 0)
        s = jnp.einsum("nqhgd,hnkd->nhgqk", qg, k, preferred_element_type=jnp.float32) * scale
        visible = ((pos[None, None, :] <= q_positions[:, :, None])
                   & (pos[None, None, :] < ctx[:, None, None]))                      # [N, Q, K]
        vis = visible[:, None, None]                                                 # [N, 1, 1, Q, K]
        s = jnp.where(vis, s, neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
        alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("nhgqk,hnkd->nhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        acc = acc * alpha[..., None] + pv
        if return_score_stats:
            shift = jnp.where(b == 0, m_safe, shift)
            d = jnp.where(vis, s - shift[..., None], 0.0)
            s1 = s1 + jnp.sum(d, axis=-1)
            s2 = s2 + jnp.sum(d * d, axis=-1)
            n = n + jnp.sum(visible, axis=-1, dtype=jnp.float32)[:, None, None]
        return m_new, l, acc, shift, s1, s2, n

    zeros = jnp.zeros(acc_shape, jnp.float32)
    init = (jnp.full(acc_shape, neg), zeros, jnp.zeros(acc_shape + (head_dim,), jnp.float32),
            zeros, zeros, zeros, jnp.zeros((tiles, 1, 1, tile), jnp.float32))
    if static_blocks <= STATIC_LOOP_MAX_BLOCKS:
        _, l, acc, _, s1, s2, n = lax.fori_loop(0, static_blocks, body, init)
    else:
        _, _, l, acc, _, s1, s2, n = lax.while_loop(lambda c: c[0] < dynamic_blocks,
                                                    lambda c: (c[0] + 1, *body(c[0], c[1:])), (jnp.int32(0), *init))
    out = acc / jnp.where(l > 0, l, 1.0)[..., None]                                  # [N, Hkv, G, Q, D]
    out = out.transpose(0, 3, 1, 2, 4).reshape(tiles, tile, num_heads, head_dim).astype(q.dtype)
    if not return_score_stats:
        return out
    mean = s1 / jnp.maximum(n, 1.0)
    var = jnp.where(n > 0, jnp.maximum(s2 / jnp.maximum(n, 1.0) - mean * mean, 0.0), 0.0)
    return out, var.transpose(0, 3, 1, 2).reshape(tiles, tile, num_heads)


def prefill_attention(q, q_positions, tile_rows, tables: RowTables, k_pool, v_pool, *, backend: str,
                      interpret: bool = False, max_context: int | None = None, return_score_stats: bool = False,
                      kernel_config=None, kernel_variant: str = "ws", prefill_splits: int | str | None = None):
    """The prefill tiles' attention: `tiled_paged_attention`'s contract (q [tiles, tile, num_heads,
    head_dim], a tile's valid queries a prefix of consecutive positions). backend "kernel": the Pallas
    kernel's causal-block variant (`paged_prefill_attention`: blocks of 64 // group tokens, each
    streaming its row's pages once for the whole GQA group; `delta_prefill_attention` for a DKVC DeltaKV,
    v_pool then None), where the model's group is a power of 2;
    otherwise, and for "reference", the tiled jnp path. kernel_variant "ws" (the default) runs the
    warp-specialised kernel (128-row CTAs, two compute warpgroups in ping-pong) where it applies, with no
    score statistics: `ws_prefill_attention` on bf16 pools (and on the f16 deltas of an fp16-delta DeltaKV with
    a mean anchor, plus the anchor: `_unit_scale_fold`), `ws_delta_prefill_attention` on another DeltaKV with a
    mean anchor that takes the folded path (`default_fold_mean_anchor()`); position-aligned anchors and
    "single" take the decode kernel's pipeline. kernel_config: the kernel's TuningConfig (default:
    `default_ws_config(head_dim)` / `default_ws_delta_config` / PREFILL_KERNEL_CONFIG /
    `default_delta_prefill_config`).
    prefill_splits: split-K over the context in the warp-specialised kernels (`TuningConfig.num_splits`): None
    (off, this function's default), an int S, or "auto" (`ws_prefill_splits` from the grid and max_context, else
    the table's width x 8 keys; the engine's default, --prefill-splits). For a short chunk over a long context (a
    recomputed tail after a host-tier recall: 64 CTAs on 132 SMs at llama-8b) it spreads each block's keys over S
    CTAs."""
    tiles, tile, num_heads, head_dim = q.shape
    from pallas_kernels.paged_attention import PREFILL_KERNEL_CONFIG, paged_prefill_attention, prefill_block_tokens
    from pallas_kernels.prefill_attention import ws_prefill_attention, ws_prefill_block_tokens
    if kernel_variant not in ("ws", "single"):
        raise ValueError(f"prefill_attention: kernel_variant must be 'ws' or 'single', got {kernel_variant!r}")
    delta = k_pool if isinstance(k_pool, DeltaKV) else None
    # DKVC: the warp-specialised kernel has the folded mean-anchor path only; the rebuild path (a position-aligned
    # anchor, or folding switched off) and score statistics take the single pipeline (`delta_prefill_attention`).
    use_ws = kernel_variant == "ws" and not return_score_stats and (delta is None or _folds_in_ws_kernel(delta))
    fold = use_ws and delta is not None and _unit_scale_fold(delta)
    num_kv_heads = delta.num_kv_heads if delta is not None else k_pool.shape[0]
    per_block = (ws_prefill_block_tokens if use_ws else prefill_block_tokens)(num_heads, num_kv_heads)
    if backend != "kernel" or per_block is None or tile % per_block:
        return tiled_paged_attention(q, q_positions, tile_rows, tables, k_pool, v_pool, max_context=max_context,
                                     return_score_stats=return_score_stats)
    blocks = tiles * (tile // per_block)
    rows = jnp.repeat(tile_rows, tile // per_block)                                  # [blocks]
    starts = q_positions.reshape(blocks, per_block)[:, 0]
    safe_rows = jnp.maximum(rows, 0)
    valid = (rows >= 0) & (starts >= 0)
    lengths = jnp.where(valid, jnp.minimum(starts + per_block, tables.context_lens[safe_rows]), 0)
    if use_ws and prefill_splits is not None:
        # The fp16-delta fold runs the bf16 kernel's code on f16 pools: its default config.
        kernel_config = _ws_split_config(kernel_config, prefill_splits, blocks=blocks, num_kv_heads=num_kv_heads,
                                         head_dim=head_dim, max_context=max_context, delta=None if fold else delta,
                                         max_pages=tables.page_starts.shape[1], interpret=interpret)
    if fold:
        # fp32 q gives the kernel's f16 output unrounded: the anchor is added before the one rounding to q's dtype.
        out = ws_prefill_attention(q.astype(jnp.float32).reshape(blocks, per_block, num_heads, head_dim),
                                   delta.k_delta, delta.v_delta, jnp.maximum(starts, 0), lengths.astype(jnp.int32),
                                   tables.page_starts[safe_rows], tables.page_sizes[safe_rows], interpret=interpret,
                                   config=kernel_config)
        return _add_mean_anchor_v(out, delta, lengths > 0).astype(q.dtype).reshape(q.shape)
    if use_ws and delta is not None:
        from pallas_kernels.prefill_attention import ws_delta_prefill_attention
        out = ws_delta_prefill_attention(q.reshape(blocks, per_block, num_heads, head_dim), delta.k_delta,
                                         delta.v_delta, None, None, delta.anchor_k, delta.anchor_v,
                                         jnp.maximum(starts, 0), lengths.astype(jnp.int32),
                                         tables.page_starts[safe_rows], tables.page_sizes[safe_rows],
                                         interpret=interpret, config=kernel_config, packed_scales=delta.scales)
        return out.reshape(q.shape)
    if use_ws:
        out = ws_prefill_attention(q.reshape(blocks, per_block, num_heads, head_dim), k_pool, v_pool,
                                   jnp.maximum(starts, 0), lengths.astype(jnp.int32), tables.page_starts[safe_rows],
                                   tables.page_sizes[safe_rows], interpret=interpret,
                                   config=kernel_config)
        return out.reshape(q.shape)
    block_args = (jnp.maximum(starts, 0), lengths.astype(jnp.int32), tables.page_starts[safe_rows],
                  tables.page_sizes[safe_rows])
    if delta is not None:
        from pallas_kernels.delta_attention import delta_prefill_attention
        res = delta_prefill_attention(q.reshape(blocks, per_block, num_heads, head_dim), delta.k_delta, delta.v_delta,
                                      None, None, delta.anchor_k, delta.anchor_v, *block_args,
                                      interpret=interpret, config=kernel_config,
                                      return_score_stats=return_score_stats, packed_scales=delta.scales)
    else:
        res = paged_prefill_attention(q.reshape(blocks, per_block, num_heads, head_dim), k_pool, v_pool, *block_args,
                                      interpret=interpret, config=kernel_config or PREFILL_KERNEL_CONFIG,
                                      return_score_stats=return_score_stats)
    if return_score_stats:
        return res[0].reshape(q.shape), res[1].reshape(tiles, tile, num_heads)
    return res.reshape(q.shape)


def _ws_split_config(config, prefill_splits, *, blocks: int, num_kv_heads: int, head_dim: int,
                     max_context: int | None, delta, max_pages: int, interpret: bool):
    """The WS kernel's TuningConfig (the given one or the kernel's default) with num_splits from
    `prefill_splits` (an int, or "auto": `ws_prefill_splits` over max_context keys, else the table's bound)."""
    import dataclasses
    from pallas_kernels.prefill_attention import default_ws_config, default_ws_delta_config, ws_prefill_splits
    if config is None:
        config = (default_ws_config(head_dim) if delta is None else
                  default_ws_delta_config(head_dim, delta.k_delta.dtype, max_pages, interpret))
    if prefill_splits == "auto":
        context = max_context if max_context is not None else max_pages * 8      # the table's width: context / 8
        splits = ws_prefill_splits(blocks, num_kv_heads, context, block_kv=config.block_kv)
    elif isinstance(prefill_splits, int) and prefill_splits >= 1:
        splits = prefill_splits
    else:
        raise ValueError(f"prefill_attention: prefill_splits must be None, an int >= 1 or 'auto', "
                         f"got {prefill_splits!r}")
    return dataclasses.replace(config, num_splits=splits)


def _folds_in_ws_kernel(delta: DeltaKV) -> bool:
    """Whether a DeltaKV's prefill can take the warp-specialised delta kernel: a mean anchor (anchor_len 1) on
    the folded path ($STRATUM_DKVC_FOLD_MEAN_ANCHOR, as the decode kernel reads it)."""
    from pallas_kernels.delta_attention import default_fold_mean_anchor
    return delta.anchor_k.shape[1] == 1 and default_fold_mean_anchor()


def _swapped_fold(delta: DeltaKV) -> bool:
    """Whether a DeltaKV's decode runs on the swapped kernel with its deltas as the pools (a mean anchor on the
    folded path): `_unit_scale_fold`'s fp16 deltas, or fp8 deltas. With K = a_k + s_k d_k and V = a_v + s_v d_v,
    q . K = q . a_k + s_k (q . d_k), and q . a_k is one value per query, which the softmax cancels, so the kernel
    attends over the fp8 deltas (fp8 score MMAs on q in e4m3 parts, V converted to f16 in the kernel:
    pallas_kernels/swapped_decode_attention.py `F8Pages`) and the output is a_v + (attention over s_v d_v):
      - fixed scales (`DeltaKV.fixed_scales`, one per layer and KV head): s_k goes into q (the kernel's q_scale)
        and s_v into the output (out_scale);
      - per-granule scales (the default): the kernel takes them beside the pools, as the cache packs them
        (`F8PackedGranulePages`: s_k on the scores of each key, s_v on P's entries)."""
    return _unit_scale_fold(delta) or (delta.k_delta.dtype == jnp.float8_e4m3fn and _folds_in_ws_kernel(delta))


def _per_q_head(x, num_q_heads: int):
    """[Hkv, ...] per kv head -> [Hq, ...] per q head (q head j reads kv head j // group), float32."""
    return jnp.repeat(x.astype(jnp.float32), num_q_heads // x.shape[0], axis=0)


def _unit_scale_fold(delta: DeltaKV) -> bool:
    """Whether a DeltaKV runs on the plain (bf16-pool) kernels with its float16 deltas as the pools: fp16
    deltas keep unit scales (stratum_jax/kv/delta_cache.py), so with a mean anchor K = a_k + d_k and
    V = a_v + d_v exactly. q . a_k is one value per query, which the softmax cancels, and the softmax weights
    sum to 1, so attention over (K, V) is a_v + attention over (d_k, d_v): the f16 deltas go through the
    kernels' f16 MMA path unchanged (no scale columns, no conversion) and a_v is added after (decode: the swapped
    kernel's out_bias; prefill: `_add_mean_anchor_v`). A
    score's variance is also unchanged by the per-query shift. The folding switch
    ($STRATUM_DKVC_FOLD_MEAN_ANCHOR) turns this off with the rest of the folded path."""
    return delta.k_delta.dtype == jnp.float16 and _folds_in_ws_kernel(delta)


def _add_mean_anchor_v(out, delta: DeltaKV, has_keys):
    """out [rows, ..., Hq, D] (attention over the deltas) + anchor_v per q head, in f32, where has_keys [rows]
    (a row with no key stays zeros, as the kernels give); returns out's dtype."""
    from pallas_kernels.swapped_decode_attention import apply_out_affine
    return apply_out_affine(out, has_keys, None, delta.anchor_v[:, 0]).astype(out.dtype)


def decode_attention(q, positions, tables: RowTables, k_pool, v_pool, *, backend: str, interpret: bool = False,
                     max_context: int | None = None, return_score_stats: bool = False,
                     kernel_variant: str = "swapped", prefetch: WeightPrefetch | None = None,
                     swapped_config=None):
    """One query token per row: q [rows, num_heads, head_dim], positions [rows] int32 (-1: the row has no
    decode token this step). The row's keys are positions 0..position (its context after the write).
    backend "kernel": a Pallas Mosaic GPU kernel: for bf16 pools kernel_variant "swapped"
    (`swapped_paged_attention`: keys on WGMMA's M, the GQA group on N) or "paged" (`paged_attention`: 64-row
    q blocks); for a DKVC DeltaKV (v_pool then None) with a mean anchor under "swapped" the swapped kernel on the
    deltas (and their scales) plus the anchor (`_swapped_fold`), otherwise the delta-KV kernel. "reference":
    the tiled jnp path with one-token tiles.
    prefetch: the next GEMM's weight and plan (the o projection's), which the bf16 swapped kernel prefetches into L2
    as its CTAs finish (pallas_kernels/l2_prefetch.py); the other paths ignore it.
    swapped_config: a `SwappedConfig` for the swapped kernel's paths (bf16 pools and the DKVC fold), None for its
    default (`default_swapped_config` for the pools and max_context); benchmarks/kernels.py times others with it.
    Returns out [rows, num_heads, head_dim] (and score_var [rows, num_heads] with return_score_stats).
    """
    if kernel_variant not in DECODE_KERNELS:
        raise ValueError(f"decode_attention: kernel_variant must be one of {DECODE_KERNELS}, "
                         f"got {kernel_variant!r}")
    rows = q.shape[0]
    lengths = jnp.where(positions >= 0, positions + 1, 0).astype(jnp.int32)
    if (backend == "kernel" and kernel_variant == "swapped" and isinstance(k_pool, DeltaKV)
            and _swapped_fold(k_pool)):
        # The deltas as the pools of the swapped kernel; its output's affine map (out_scale, out_bias) adds the
        # anchor's V (and with fixed fp8 scales multiplies by s_v first) in fp32 before the one rounding to q's
        # dtype. Fixed fp8 scales: s_k into q too (the kernel's q_scale, applied before q's fp8 split);
        # per-granule fp8 scales: the kernel reads them with the pages (the cache's packed scales).
        from pallas_kernels.swapped_decode_attention import swapped_paged_attention
        fp8 = k_pool.k_delta.dtype == jnp.float8_e4m3fn
        fixed = fp8 and k_pool.fixed_scales
        granules = fp8 and not fixed
        return swapped_paged_attention(
            q if fp8 else q.astype(jnp.float32), k_pool.k_delta, k_pool.v_delta, lengths, tables.page_starts,
            tables.page_sizes, max_context=max_context, interpret=interpret, return_score_stats=return_score_stats,
            q_scale=_per_q_head(k_pool.k_floor, q.shape[1]) if fixed else None, out_dtype=q.dtype,
            out_scale=k_pool.v_floor.astype(jnp.float32) if fixed else None,
            out_bias=k_pool.anchor_v[:, 0].astype(jnp.float32), config=swapped_config,
            packed_scales=k_pool.scales if granules else None)
    if backend == "kernel" and isinstance(k_pool, DeltaKV):      # DKVC: the delta-KV kernel
        from pallas_kernels.delta_attention import delta_attention
        d = k_pool
        return delta_attention(q, d.k_delta, d.v_delta, None, None, d.anchor_k, d.anchor_v, lengths,
                               tables.page_starts, tables.page_sizes, interpret=interpret,
                               return_score_stats=return_score_stats, packed_scales=d.scales)
    if backend == "kernel" and kernel_variant == "swapped":
        from pallas_kernels.swapped_decode_attention import swapped_paged_attention
        return swapped_paged_attention(q, k_pool, v_pool, lengths, tables.page_starts, tables.page_sizes,
                                       max_context=max_context, interpret=interpret,
                                       return_score_stats=return_score_stats, config=swapped_config,
                                       prefetch_weight=None if prefetch is None else prefetch.weight,
                                       prefetch=None if prefetch is None else prefetch.plan)
    if backend == "kernel":
        from pallas_kernels.paged_attention import paged_attention
        return paged_attention(q, k_pool, v_pool, lengths, tables.page_starts, tables.page_sizes,
                               interpret=interpret, return_score_stats=return_score_stats)
    own = RowTables(lengths, tables.page_starts, tables.page_sizes)
    res = tiled_paged_attention(q[:, None], positions[:, None], jnp.arange(rows, dtype=jnp.int32), own,
                                k_pool, v_pool, max_context=max_context, return_score_stats=return_score_stats)
    if return_score_stats:
        return res[0][:, 0], res[1][:, 0]
    return res[:, 0]


KERNEL_HEAD_DIMS = (64, 128)


def on_hopper_gpu() -> bool:
    """Whether jax's default device is a Hopper GPU (sm_90), the Mosaic GPU kernels' target."""
    # jax's CUDA devices report compute_capability ("9.0" on H100/H200); if a build does not, trust
    # the GPU to be one the kernels compile for (the compile then says so if not).
    cc = getattr(jax.devices()[0], "compute_capability", None)
    return jax.default_backend() == "gpu" and (cc is None or str(cc).startswith("9"))


def resolve_backend(config, model_config, on_hopper: bool | None = None) -> str:
    """The decode attention backend: --attention, with "auto" = the Pallas kernel where it runs (a Hopper
    GPU, bf16 KV, head_dim 64/128), else the jnp reference. An explicit "kernel" that cannot run is an
    error that says what to change. on_hopper: whether the step runs on a Hopper GPU (default: whether this
    process's device is one; benchmarks/gpu_preflight.py lowers for one from a CPU host)."""
    on_hopper = on_hopper_gpu() if on_hopper is None else on_hopper
    fits = model_config.dtype == "bfloat16" and model_config.head_dim in KERNEL_HEAD_DIMS
    if config.attention == "auto":
        return "kernel" if on_hopper and fits else "reference"
    if config.attention == "kernel":
        if not config.interpret_kernels and not on_hopper:
            raise ValueError("--attention kernel needs an NVIDIA Hopper GPU (sm_90); on CPU add "
                             "--interpret-kernels (slow, for tests) or use --attention reference")
        if model_config.dtype != "bfloat16":
            raise ValueError("--attention kernel reads bfloat16 KV pages; add --dtype bfloat16 "
                             f"(the model is {model_config.dtype})")
        if model_config.head_dim not in KERNEL_HEAD_DIMS:
            raise ValueError(f"--attention kernel supports head_dim {KERNEL_HEAD_DIMS}, the model has "
                             f"{model_config.head_dim}: use --attention reference")
    return config.attention
