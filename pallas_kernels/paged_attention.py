"""Paged decode attention for adaptive (mixed-size) KV pages: a Pallas Mosaic GPU kernel for Hopper.

One decode query per sequence attends over that sequence's KV cache, which lives in one layer's slot
pool `k_pool/v_pool [num_kv_heads, num_slots, head_dim]`. A sequence owns pages of one size
P in {8, 16, 32, 64, 128, 256} tokens (its own choice; sizes mix freely within a batch); a page of
size P occupies slots [s, s + P) with s a multiple of P (a buddy allocator over 8-token base pages).
Token t of sequence b is at slot `page_starts[b, t // P_b] + t % P_b`.

Design
------
*Grid.* One CTA (one Pallas thread = one warpgroup) per (sequence b, kv head h, split k). The CTA
handles every q head of its kv-head group at once (GQA), so each K/V byte is read from HBM once.

*Mixed page sizes: static token tiles, per-page TMA copies.* The kernel walks the sequence in tiles
of a static `block_kv` = T tokens (64/128/256, a multiple of 64 because WGMMA wants it). Because a
page of size P starts at a multiple of P, a tile is always either
  - part of one page (P >= T): one TMA copy of T contiguous slots, or
  - exactly T / P whole pages (P < T): T / P TMA copies of P slots, into consecutive rows of the tile.
So the compute stage never sees pages at all: it always gets a dense [T, head_dim] K tile and V
tile in SMEM. The copy count per tile depends on the sequence's page size, which is a runtime value;
each copy arrives once on its stage barrier, and a barrier's arrival count is fixed when it is
allocated, so there is one barrier array per "copies per tile" group (T/8, T/16, ..., 1) and the
CTA branches (uniformly, a scalar `pl.when` chain) on its page-size class when it issues or awaits a
tile. The alternatives were worse: sorting the batch into per-size launches costs extra launches,
a gather and a scatter; a `lax.switch` over whole specialised loops multiplies code size by the
number of classes; always copying 8-token pieces issues 8-32x more TMA copies for big pages.
The copies that would run past the last page of the sequence (P < T, last tile) are clamped to
the last page (a cheap L2 re-read) rather than predicated off, so page-table entries beyond the
sequence are never read and the arrival count stays static.

*Pipeline (single warpgroup, software pipelined).* The page-table window of the CTA is brought
into SMEM with one bulk copy; q rows are brought in with one TMA copy. `num_stages` K/V tiles are
in flight in a ring of SMEM buffers; the loop awaits tile i, computes on it, and re-issues the
freed slot for tile i + num_stages. Per tile:
    fetch(tile, slot)      -> issue TMA copies (the KV format's, per page piece and per tile)
    materialize(slot)      -> bf16 K and V tiles in SMEM, ready for WGMMA (bf16 pages: zero V rows
                              past the end of the sequence, so stale/NaN slots can't poison P @ V)
    attend(state, K, V)    -> S = q K^T (WGMMA, fp32), soft cap, mask, online softmax (base 2),
                              acc += P V (WGMMA)
The q tile has 64 rows (WGMMA's M); rows beyond the group's q heads are don't-care rows.

*KV formats: the delta-KV kernel shares this pipeline.* What is copied per page and per tile, and how
the bf16 K/V tiles are made, is a static `KVFormat` (`_build_kernel(kv_format=...)`): `Bf16Pages`
here (one TMA copy per page, V rows past the end zeroed in place), `DeltaPages` in
delta_attention.py (fp16/fp8 delta pages plus their scale granules; K/V rebuilt as anchor + scale *
delta into bf16 tiles, or, with a mean anchor, f16 deltas fed to the MMAs as they are, with per-key
scales as `TileColumns`, f16 q/P (`mma_dtype`) and the anchor added in `finish`). Everything else
(grid, page-table window, ring, split-K, softmax, score statistics) is one code path, and so is the
causal-block prefill variant (`query_tokens` > 1, `prefill_attention_pipeline`: `paged_prefill_attention`
with Bf16Pages, `delta_prefill_attention` with DeltaPages); with
`Bf16Pages` the traced kernel is the same as before the split (its lowered text was compared; its
jaxpr again after the TileColumns/finish/mma_dtype hooks, 2026-12-01).

*Split-K (flash-decoding).* With few (sequence, kv head) pairs, the tiles of each sequence are split
over `num_splits` CTAs; each writes a normalised partial output and its log2-sum-exp, and a small
jnp combine (`combine_splits`) merges them.

*Score statistics (opt-in, `return_score_stats=True`).* For the page-size rule and the DMLP's
`attn_var5` feature the kernel can also return, per query row, the population variance of the
softmax inputs over the row's valid keys. Alongside the online softmax each row accumulates, in
fp32 and over its unmasked keys only, the sums of (s - c) and (s - c)^2, where the shift c is the
row max of the CTA's first tile (a value inside the score range, so the sums do not cancel the way
raw sums of s and s^2 do when the scores share a large offset). With 64-token tiles the sums stay
per (row, column) in registers and are reduced over columns once, after the loop. Each CTA writes
(c, sum, sum of squares) for its rows; the wrapper merges the splits (Chan et al.'s pairwise
update) and returns var = M2 / n. The flag is static: with it off, the traced kernel is exactly the
one without it. Measured on the H200 on 2026-11-30 (B=64, Hq=32, Hkv=8, D=128, default config,
pages 16/128/mixed, 1K and 4K context, jitted): the stats make the kernel 1.6-8.5% slower, about
+4 us at 1K and +4-13 us at 4K (benchmarks/score_stats_cost.py, results/score_stats_cost_h200.json).

Numerics: fp32 scores, fp32 online softmax in base 2 (exp2 with log2(e) folded into the scale),
fp32 accumulation, bf16 P for the second WGMMA (standard flash-attention practice). Rows with
length 0 produce zeros.

*Occupancy beats pipeline depth.* The default (block_kv=64, 2 stages, ~100 KB SMEM) lets two CTAs
share an SM, so one CTA's softmax overlaps the other's loads; on the H200 it beat 3-4-stage
single-CTA pipelines by 5-30%. Measured 2026-11-29 (B=64, Hq=32, Hkv=8, D=128, every page size):
4.1-4.2 TB/s at 16K context, 3.5-3.8 TB/s at 4K, 2.9-3.1 TB/s at 1K, against a 4.14 TB/s
device copy. Details and the sweep: benchmarks/KERNEL_NOTES.md. At head_dim 64 the same reasoning picks
128-token tiles (`default_config`: 64-token ones fit 3 CTAs an SM, two uneven waves at B=64).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.paged_tiles import (PAGE_SIZES, check_tile_pipeline, flat_table, issue_tile_copies, page_classes,
                                        sequence_scalars, split_tile_range, table_window, table_window_start,
                                        wait_page_class)
from pallas_kernels.split_k import combine_splits, score_variance_from_partials, split_key_counts

_LOG2E = math.log2(math.e)
_Q_ROWS = 64          # WGMMA M: the q tile has 64 rows, the first q_per_kv of which are real.
NUM_SMS_H100 = 132   # for the split heuristics only; H100 SXM and H200 both have 132 SMs.


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static knobs of the kernel (each distinct config compiles its own kernel).

    Attributes:
      block_kv: tokens per pipeline tile T (64, 128 or 256). A tile holds T/P whole pages for P < T,
        or a T-token piece of one page for P >= T.
      num_stages: K/V tiles in flight per CTA (SMEM ring depth), >= 2. SMEM per CTA is about
        num_stages * block_kv * head_dim * 4 bytes, plus 32-48 KB for the q and output tiles and
        the page-table window (see `smem_bytes`).
      num_splits: split-K factor (CTAs per (sequence, kv head)); None picks one from the grid size.
      approx_math: use the fast approximate exp2/tanh (MUFU) instructions.
      p_via_smem: stage the softmax probabilities P through SMEM for the P @ V WGMMA instead of
        feeding them from registers (always on in the interpreter, which lacks register operands).
      no_auto_barriers: drop the warpgroup barrier Pallas puts before every TMA issue (one per
        page copy); the kernel then syncs the warpgroup once per refilled tile instead.
    """

    block_kv: int = 64
    num_stages: int = 2
    num_splits: int | None = None
    approx_math: bool = True
    p_via_smem: bool = False
    no_auto_barriers: bool = True

    def __post_init__(self):
        check_tile_pipeline(self.block_kv, self.num_stages, self.num_splits)

    def smem_bytes(self, head_dim: int, max_pages: int, out_itemsize: int = 4) -> int:
        """Approximate SMEM footprint of one CTA, for picking configs that fit (227 KB max)."""
        ring = 2 * self.num_stages * self.block_kv * head_dim * 2
        q_o = _Q_ROWS * head_dim * (2 + out_itemsize) + _Q_ROWS * 4
        table = 4 * table_window(max_pages, self.num_splits or 1, self.block_kv)
        return ring + q_o + table + 1024


def default_config(head_dim: int) -> TuningConfig:
    """`paged_attention`'s config when the caller gives none (num_splits is then picked from the grid):
    128-token tiles at head_dim 64, 64-token tiles otherwise.

    Why 128 at D=64: one CTA per (sequence, kv head), all with the same work (512 CTAs at B=64, Hkv=8).
    With 64-token tiles a D=64 CTA uses 146 registers a thread (ptxas) and ~50 KB of SMEM, so 3 fit an SM
    (inferred, not read back): 396 CTAs run in a first wave and 116 in a second, where most SMs hold one
    CTA and too few bytes are in flight to stream at full rate. With 128-token tiles (230 registers) 2
    fit: two even waves of 264, and twice the bytes per copy round. On the H200 that streamed faster at
    1K, 4K and 16K context, every page size (device time; BENCHMARKS.md, "Paged decode attention kernel").
    At D=128, 128-token tiles leave room for one CTA an SM, and 64-token tiles stream at 80-105% of the
    read ceiling from 1K up. The delta kernel keeps TuningConfig() at every head_dim (its 128-token tiles
    at D=64 are unmeasured)."""
    return TuningConfig(block_kv=128) if head_dim == 64 else TuningConfig()


def default_num_splits(batch: int, num_kv_heads: int) -> int:
    """Split-K factor: enough CTAs to fill about two waves of the GPU's SMs."""
    ctas = batch * num_kv_heads
    if ctas >= NUM_SMS_H100:
        return 1
    return int(min(16, -(-2 * NUM_SMS_H100 // ctas)))


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def paged_attention_reference(q, k_pool, v_pool, lengths, page_starts, page_sizes, *,
                              sm_scale=None, soft_cap=None, return_score_stats: bool = False):
    """Pure-jnp paged decode attention with fp32 math (same contract as `paged_attention`).

    Gathers each sequence's tokens to a dense [batch, num_kv_heads, max_tokens, head_dim] view, where
    max_tokens = max_pages * max(PAGE_SIZES), so it is for tests and small shapes, not for speed.
    With `return_score_stats=True` it returns `(out, score_var)`, score_var as in `paged_attention`
    (computed here in two passes: mean, then mean squared deviation).
    """
    _check_inputs(q, k_pool, v_pool, lengths, page_starts, page_sizes)
    _, slot, valid = reference_token_slots(lengths, page_starts, page_sizes, k_pool.shape[1])
    k = k_pool[:, slot].astype(jnp.float32)                                      # [Hkv, B, T, D]
    v = v_pool[:, slot].astype(jnp.float32)
    return reference_attend(q, k, v, valid, sm_scale=sm_scale, soft_cap=soft_cap,
                            return_score_stats=return_score_stats)


def reference_token_slots(lengths, page_starts, page_sizes, num_slots):
    """The references' gather indices: (t [T] int32 token positions, slot [B, T] int32 pool slot of
    token t of sequence b (0 where invalid), valid [B, T] bool), T = max_pages * max(PAGE_SIZES)."""
    max_pages = page_starts.shape[1]
    n_tok = max_pages * max(PAGE_SIZES)
    t = jnp.arange(n_tok, dtype=jnp.int32)
    psz = jnp.maximum(page_sizes.astype(jnp.int32), 1)[:, None]                   # [B, 1]
    page_idx = jnp.minimum(t[None, :] // psz, max_pages - 1)                      # [B, T]
    slot = jnp.take_along_axis(page_starts.astype(jnp.int32), page_idx, axis=1) + t[None, :] % psz
    valid = t[None, :] < jnp.minimum(lengths.astype(jnp.int32)[:, None], max_pages * psz)
    slot = jnp.where(valid, jnp.clip(slot, 0, num_slots - 1), 0)
    return t, slot, valid


def reference_attend(q, k, v, valid, *, sm_scale=None, soft_cap=None, return_score_stats=False):
    """The references' fp32 attention: q [B, Hq, D], k/v [Hkv, B, T, D] fp32 gathered keys/values,
    valid [B, T] bool (keys outside it, even NaN, are ignored). Returns [B, Hq, D] in q.dtype (and
    score_var [B, Hq] with return_score_stats)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    qf = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_dim)
    s = jnp.einsum("bhgd,hbtd->bhgt", qf, k) * scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(valid[:, None, None, :], jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(valid[None, :, :, None], v, 0.0)    # stale slots may hold NaN; 0 * NaN = NaN
    o = jnp.einsum("bhgt,hbtd->bhgd", p, v) / jnp.where(l == 0, 1.0, l)
    o = o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
    if not return_score_stats:
        return o
    return o, score_variance(s, valid[:, None, None, :]).reshape(batch, num_q_heads)


def score_variance(s, valid):
    """Population variance of the scores `s` over the last axis where `valid` (broadcastable to s),
    in fp32, two-pass (mean, then mean squared deviation). Rows with no valid entry give 0; entries
    outside `valid` (even NaN or -inf) contribute nothing."""
    valid = jnp.broadcast_to(valid, s.shape)
    n = jnp.sum(valid, axis=-1, dtype=jnp.float32)
    n_safe = jnp.maximum(n, 1.0)
    s = s.astype(jnp.float32)
    mean = jnp.sum(jnp.where(valid, s, 0.0), axis=-1) / n_safe
    dev = jnp.where(valid, s - mean[..., None], 0.0)
    return jnp.where(n > 0, jnp.sum(dev * dev, axis=-1) / n_safe, 0.0)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def _check_inputs(q, k_pool, v_pool, lengths, page_starts, page_sizes):
    check_pools_and_tables("paged_attention", q, ("k_pool", k_pool), ("v_pool", v_pool), lengths, page_starts,
                           page_sizes)
    if k_pool.dtype != jnp.bfloat16 or v_pool.dtype != jnp.bfloat16:
        raise ValueError(f"paged_attention: k_pool/v_pool must be bfloat16, got {k_pool.dtype}/{v_pool.dtype}")


def check_pools_and_tables(name, q, k, v, lengths, page_starts, page_sizes):
    """Entry checks shared by the paged and delta kernels (not dtypes of the pools): q [batch,
    num_q_heads, head_dim] bf16/fp32, k = (k_name, k_pool) and v = (v_name, v_pool) of the same shape
    [num_kv_heads, num_slots, head_dim], and the page tables. Raises ValueError("{name}: ...") on the
    first problem, saying what to fix."""
    def fail(msg):
        raise ValueError(f"{name}: {msg}")
    (k_name, k_pool), (v_name, v_pool) = k, v
    if q.ndim != 3:
        fail(f"q must be [batch, num_q_heads, head_dim], got shape {q.shape}")
    if k_pool.ndim != 3 or v_pool.shape != k_pool.shape:
        fail(f"{k_name} and {v_name} must both be [num_kv_heads, num_slots, head_dim], got {k_pool.shape} "
             f"and {v_pool.shape}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_slots, kv_dim = k_pool.shape
    if kv_dim != head_dim:
        fail(f"head_dim mismatch: q has {head_dim}, {k_name}/{v_name} have {kv_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        fail(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if num_slots % 256:
        fail(f"num_slots ({num_slots}) must be a multiple of 256 (the largest page)")
    if q.dtype not in (jnp.bfloat16, jnp.float32):
        fail(f"q must be bfloat16 or float32, got {q.dtype}")
    if lengths.shape != (batch,) or page_sizes.shape != (batch,):
        fail(f"lengths and page_sizes must be [batch={batch}], got {lengths.shape} and {page_sizes.shape}")
    if page_starts.ndim != 2 or page_starts.shape[0] != batch or page_starts.shape[1] < 1:
        fail(f"page_starts must be [batch={batch}, max_pages>=1], got {page_starts.shape}")
    for name, a in (("lengths", lengths), ("page_starts", page_starts), ("page_sizes", page_sizes)):
        if a.dtype != jnp.int32:
            fail(f"{name} must be int32, got {a.dtype}")


def paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes, *,
                    sm_scale: float | None = None, soft_cap: float | None = None,
                    config: TuningConfig | None = None, interpret: bool = False,
                    return_score_stats: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention over a paged KV pool with per-sequence page sizes (Mosaic GPU kernel).

    Args:
      q: [batch, num_q_heads, head_dim], bf16 or fp32 (fp32 is rounded to bf16 for the MMA).
      k_pool, v_pool: [num_kv_heads, num_slots, head_dim] bf16, one layer's KV slot pool.
      lengths: [batch] int32 context length per sequence; 0 marks a padding row (output zeros).
      page_starts: [batch, max_pages] int32, first slot of each page of each sequence; entries past
        a sequence's last page are never read.
      page_sizes: [batch] int32, each sequence's page size, one of PAGE_SIZES.
      sm_scale: score scale, default 1/sqrt(head_dim).
      soft_cap: if set, scores become soft_cap * tanh(scores / soft_cap).
      config: TuningConfig; None gives `default_config(head_dim)`: at head_dim 128 block_kv=64, 2 stages,
        split from the grid size (the fastest swept config, or within 7% of it, at every measured H200
        shape, KERNEL_NOTES.md); at head_dim 64 the same with block_kv=128.
      interpret: run the kernel in the Mosaic GPU interpreter on CPU (tests).
      return_score_stats: static; also return each query row's attention-score variance (below).
        Off (the default), the traced kernel is exactly the kernel without this feature.

    Returns:
      [batch, num_q_heads, head_dim] in q.dtype. GQA: q head j uses kv head j // (num_q_heads //
      num_kv_heads). Head dims 64 and 128 are supported; num_q_heads // num_kv_heads <= 64.
      With return_score_stats: `(out, score_var)`, score_var float32 [batch, num_q_heads]. For the
      query row (b, j), the score of key t is s_t = sm_scale * q[b, j] . k_t (then the soft cap, if
      set), i.e. the softmax input; score_var[b, j] is the population variance of s_t over the
      valid keys t < lengths[b]: mean(s^2) - mean(s)^2 (>= 0; 0 for a row with length 0). It is
      accumulated in fp32 from the same fp32 scores (bf16 q and K) the softmax uses, with the
      kernel's approximate tanh when a soft cap is set.
    """
    _check_inputs(q, k_pool, v_pool, lengths, page_starts, page_sizes)
    config, scale, cap = kernel_static_args("paged_attention", q, k_pool.shape[0], sm_scale, soft_cap,
                                            config or default_config(q.shape[-1]))
    stats = bool(return_score_stats)
    if interpret:
        with mosaic_gpu_interpret():
            return _paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes,
                                    scale=scale, soft_cap=cap, config=config, p_via_smem=True,
                                    score_stats=stats)
    # `interpret_mode_active()` is also a static jit argument so interpreted and compiled traces
    # never share a cache entry.
    return _paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes, scale=scale,
                            soft_cap=cap, config=config, p_via_smem=interpret_mode_active(),
                            score_stats=stats)


def kernel_static_args(name, q, num_kv_heads, sm_scale, soft_cap, config):
    """Checks the decode kernels' static arguments (head_dim 64/128, GQA group <= 64, soft_cap and
    sm_scale > 0) and returns (config with num_splits filled in, scale, soft_cap as float or None)."""
    head_dim = q.shape[2]
    if head_dim not in (64, 128):
        raise ValueError(f"{name}: head_dim must be 64 or 128, got {head_dim}")
    group = q.shape[1] // num_kv_heads
    if group > _Q_ROWS:
        raise ValueError(f"{name}: num_q_heads // num_kv_heads = {group} > {_Q_ROWS} is not supported")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"{name}: soft_cap must be > 0, got {soft_cap}")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{name}: sm_scale must be > 0, got {sm_scale}")
    # The delta kernel's default stays 64-token tiles at every head_dim: `default_config`'s 128-token
    # tiles at D=64 were measured for the bf16 pages only.
    config = config or TuningConfig()
    if config.num_splits is None:
        config = dataclasses.replace(config, num_splits=default_num_splits(q.shape[0], num_kv_heads))
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    return config, scale, None if soft_cap is None else float(soft_cap)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "config", "p_via_smem", "score_stats"))
def _paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes, *, scale, soft_cap, config,
                     p_via_smem, score_stats=False):
    return decode_attention_pipeline(q, (k_pool, v_pool), lengths, page_starts, page_sizes, kv_format=BF16_PAGES,
                                     num_kv_heads=k_pool.shape[0], scale=scale, soft_cap=soft_cap, config=config,
                                     p_via_smem=p_via_smem, score_stats=score_stats)


def q_row_blocks(q, num_kv_heads: int):
    """The decode kernels' q rows: q [batch, num_q_heads, head_dim] -> (q2 [rows, head_dim], rows_per_b,
    rows_per_h, copy_rows). A CTA TMA-copies the 8-row-aligned block of `copy_rows` rows of q2 that holds
    its group's rows: row b * rows_per_b + h * rows_per_h is the first q head of (sequence b, kv head h),
    at (that row % 8) inside the block. When the group's rows can't sit inside such a block (the group
    neither divides nor is a multiple of 8, or batch * num_q_heads isn't a multiple of 8), each group is
    padded to 8k rows (rows_per_h = copy_rows = 8k)."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    if (group % 8 == 0 or 8 % group == 0) and (batch * num_q_heads) % 8 == 0:
        return q.reshape(batch * num_q_heads, head_dim), num_q_heads, group, max(8, group)
    gp = -(-group // 8) * 8
    q2 = jnp.pad(q.reshape(batch * num_kv_heads, group, head_dim), ((0, 0), (0, gp - group), (0, 0)))
    return q2.reshape(-1, head_dim), num_kv_heads * gp, gp, gp


def decode_attention_pipeline(q, kv_inputs, lengths, page_starts, page_sizes, *, kv_format, num_kv_heads, scale,
                              soft_cap, config, p_via_smem, score_stats=False):
    """The decode kernel's wrapper for any KV format (traced inside a jit): lays q out in 8-row blocks,
    flattens the page table, runs `_build_kernel` with `kv_format` over `kv_inputs` (the format's GMEM
    arrays, in `kv_format`'s order), merges split-K partials and score statistics. q [batch,
    num_q_heads, head_dim]; returns [batch, num_q_heads, head_dim] in q.dtype (and score_var
    [batch, num_q_heads] float32 with score_stats)."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    splits = config.num_splits
    out_dtype = q.dtype

    q2, rows_per_b, rows_per_h, copy_rows = q_row_blocks(q.astype(kv_format.mma_dtype), num_kv_heads)

    max_pages = page_starts.shape[1]
    table = flat_table(page_starts, splits, config.block_kv)

    kernel = _build_kernel(
        batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, group=group, max_pages=max_pages,
        table_len=table.shape[0], rows_per_b=rows_per_b,
        rows_per_h=rows_per_h, copy_rows=copy_rows, out_dtype=jnp.dtype(out_dtype if splits == 1 else jnp.float32),
        scale=scale, soft_cap=soft_cap, config=config, p_via_smem=p_via_smem or config.p_via_smem,
        score_stats=score_stats, kv_format=kv_format)
    res = kernel(lengths, page_sizes, table, q2, *kv_inputs)

    def group_rows(x):
        """[B * S, Hkv, cols] row vectors (lse, score stats) -> the group's rows [B, S, Hkv, G]. The
        rows start at the 8-aligned q row block; the group's rows start at row_off (static)."""
        rows = np.arange(batch)[:, None] * rows_per_b + np.arange(num_kv_heads)[None, :] * rows_per_h
        idx = (rows % 8)[:, None, :, None] + np.arange(group)[None, None, None, :]     # [B, 1, Hkv, G]
        return jnp.take_along_axis(x.reshape(batch, splits, num_kv_heads, -1),
                                   jnp.asarray(np.broadcast_to(idx, (batch, splits, num_kv_heads, group))), axis=3)

    if score_stats:
        res, stats = res[:-3], res[-3:]
        n = split_key_counts(lengths, page_sizes, max_pages=max_pages, block_kv=config.block_kv, splits=splits)
        score_var = score_variance_from_partials(*(group_rows(x) for x in stats),
                                                  n[:, :, None, None]).reshape(batch, num_q_heads)

    if splits == 1:
        out = res[0].reshape(batch, num_kv_heads, rows_per_h, head_dim)[:, :, :group]
        out = out.reshape(batch, num_q_heads, head_dim)
    else:
        o_part, lse = res
        o_part = o_part.reshape(batch, splits, num_kv_heads, rows_per_h, head_dim)[:, :, :, :group]
        out = combine_splits(o_part, group_rows(lse)).reshape(batch, num_q_heads, head_dim).astype(out_dtype)
    if score_stats:
        return out, score_var
    return out


# The causal-block variant's default: 128-token tiles were the fastest swept config for llama-1b
# (BENCHMARKS.md, prefill attention; 3 stages of 128 do not fit SMEM at head_dim 128).
PREFILL_KERNEL_CONFIG = TuningConfig(block_kv=128, num_stages=2, num_splits=1)


def paged_prefill_attention_reference(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *,
                                      sm_scale=None, return_score_stats: bool = False):
    """Pure-jnp causal attention of query blocks over paged KV (same contract as
    `paged_prefill_attention`), via the decode reference with one row per query token. For tests."""
    rows_q, rows_len, rows_starts, rows_sizes = prefill_token_rows(q, q_starts, lengths, page_starts, page_sizes)
    res = paged_attention_reference(rows_q, k_pool, v_pool, rows_len, rows_starts, rows_sizes, sm_scale=sm_scale,
                                    return_score_stats=return_score_stats)
    return prefill_rows_to_blocks(res, q.shape, return_score_stats)


def prefill_token_keys(q_starts, lengths, tokens: int):
    """Keys each query token of a causal block sees: [blocks, tokens] int32, min(q_start + i + 1, length)
    for token i (a negative start counts as 0), 0 for every token of a padding block (length 0). The one
    place this bookkeeping lives: the references, the kernels' score-statistics counts and the tests'
    per-token views all read it from here."""
    q_starts = jnp.maximum(q_starts.astype(jnp.int32), 0)
    seen = jnp.minimum(q_starts[:, None] + jnp.arange(1, tokens + 1, dtype=jnp.int32)[None, :], lengths[:, None])
    return jnp.where(lengths[:, None] > 0, jnp.maximum(seen, 0), 0).astype(jnp.int32)


def prefill_token_rows(q, q_starts, lengths, page_starts, page_sizes):
    """A causal-block problem as a decode problem with one row per query token (for the references):
    q [blocks, tokens, Hq, D] -> (q [blocks * tokens, Hq, D], lengths [blocks * tokens] (each token's
    visible keys, `prefill_token_keys`), page_starts [blocks * tokens, max_pages], page_sizes
    [blocks * tokens])."""
    blocks, tokens, num_q_heads, head_dim = q.shape
    rep = lambda a: jnp.repeat(a, tokens, axis=0)
    return (q.reshape(blocks * tokens, num_q_heads, head_dim),
            prefill_token_keys(q_starts, lengths, tokens).reshape(-1), rep(page_starts), rep(page_sizes))


def prefill_rows_to_blocks(res, q_shape, score_stats: bool):
    """A decode reference's result over `prefill_token_rows` back in block shape: out [blocks, tokens, Hq,
    D] (and score_var [blocks, tokens, Hq] with score_stats)."""
    if score_stats:
        return res[0].reshape(q_shape), res[1].reshape(q_shape[:3])
    return res.reshape(q_shape)


def prefill_block_tokens(num_q_heads: int, num_kv_heads: int) -> int | None:
    """Query tokens per block of `paged_prefill_attention` (its q tile is 64 rows = tokens x the GQA
    group), or None when the group is not a power of 2 <= 64 (the kernel does not take that model)."""
    group = num_q_heads // max(num_kv_heads, 1)
    if group < 1 or group > _Q_ROWS or group & (group - 1):
        return None
    return _Q_ROWS // group


def check_prefill_blocks(name, q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *,
                         most_tokens: int | None, q_rows: int,
                         pool_dtypes=(jnp.bfloat16,)) -> tuple[int, int, int, int]:
    """Entry checks shared by the causal-block prefill kernels over plain pools (`paged_prefill_attention`,
    the warp-specialised `ws_prefill_attention`, which also takes float16 pools: `pool_dtypes`): the pools
    and tables as `paged_attention` checks them, then `check_prefill_query`. Returns (blocks, tokens,
    num_q_heads, head_dim)."""
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [blocks, tokens, num_q_heads, head_dim], got {q.shape}")
    check_pools_and_tables(name, q[:, 0], ("k_pool", k_pool), ("v_pool", v_pool), lengths, page_starts, page_sizes)
    if k_pool.dtype not in pool_dtypes or v_pool.dtype != k_pool.dtype:
        names = " or ".join(f"both {jnp.dtype(d).name}" for d in pool_dtypes)
        raise ValueError(f"{name}: k_pool/v_pool must be {names}, got {k_pool.dtype}/{v_pool.dtype}")
    return check_prefill_query(name, q, k_pool.shape[0], q_starts, most_tokens=most_tokens, q_rows=q_rows)


def check_prefill_query(name, q, num_kv_heads: int, q_starts, *, most_tokens: int | None,
                        q_rows: int) -> tuple[int, int, int, int]:
    """The causal-block kernels' checks of the query side (any KV format; the caller checks its pools with
    q[:, 0] as the decode q): q [blocks, tokens, Hq, D] whose tokens x GQA group fit a `q_rows`-row q
    tile (most_tokens: the kernel's bound, None when the group does not fit at all), int32 q_starts
    [blocks], head_dim 64/128. Returns (blocks, tokens, num_q_heads, head_dim)."""
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [blocks, tokens, num_q_heads, head_dim], got {q.shape}")
    blocks, tokens, num_q_heads, head_dim = q.shape
    if q_starts.shape != (blocks,) or q_starts.dtype != jnp.int32:
        raise ValueError(f"{name}: q_starts must be int32 [blocks={blocks}], got {q_starts.dtype} {q_starts.shape}")
    group = num_q_heads // num_kv_heads
    if most_tokens is None:
        raise ValueError(f"{name}: a GQA group of {group} (num_q_heads // num_kv_heads) does not fit the {q_rows}-row "
                         f"q tile: the group must be a power of 2 <= {q_rows} (use the tiled jnp path for this model)")
    if tokens > most_tokens:
        raise ValueError(f"{name}: {tokens} tokens x a GQA group of {group} do not fit the {q_rows}-row q tile "
                         f"(tokens <= {most_tokens})")
    if head_dim not in (64, 128):
        raise ValueError(f"{name}: head_dim must be 64 or 128, got {head_dim}")
    return blocks, tokens, num_q_heads, head_dim


def prefill_static_args(name, head_dim: int, sm_scale, config: TuningConfig | None) -> tuple[TuningConfig, float]:
    """The causal-block kernels' static arguments (`paged_prefill_attention`, `delta_prefill_attention`):
    (config with num_splits 1, scale). Causal blocks are never split, so a config asking for splits is
    refused; `config` is the caller's, its default already filled in."""
    if config.num_splits not in (None, 1):
        raise ValueError(f"{name}: causal blocks are not split, got num_splits={config.num_splits}")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{name}: sm_scale must be > 0, got {sm_scale}")
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    return dataclasses.replace(config, num_splits=1), scale


def paged_prefill_attention(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *,
                            sm_scale: float | None = None, config: TuningConfig | None = None,
                            interpret: bool = False, return_score_stats: bool = False):
    """Causal attention of blocks of consecutive query tokens over a paged KV pool (the prefill path;
    the decode kernel with a 64-row q tile of `tokens` tokens x the GQA group).

    Args:
      q: [blocks, tokens, num_q_heads, head_dim] bf16/fp32, tokens = prefill_block_tokens(...) (or
        fewer; a power of 2 keeps the q tile full). Token i of block b is at position q_starts[b] + i.
      k_pool, v_pool: [num_kv_heads, num_slots, head_dim] bf16 (the decode kernel's pools; the block's
        own keys must already be written).
      q_starts: [blocks] int32, the position of each block's first token (>= 0; negative counts as 0).
      lengths: [blocks] int32, the keys the block may see: min(q_starts + tokens, the sequence's
        context); 0 marks a padding block (output zeros). Keys >= length are never read as values,
        so stale or NaN slots there are harmless.
      page_starts: [blocks, max_pages] int32 and page_sizes: [blocks] int32, each block's sequence's
        block table, as in `paged_attention`.
      config: TuningConfig with num_splits None or 1 (causal blocks are never split).
    Returns [blocks, tokens, num_q_heads, head_dim] in q.dtype: token i attends to the keys at positions
    < min(q_starts + i + 1, lengths). With return_score_stats also score_var [blocks, tokens,
    num_q_heads] float32, each row's score variance over those keys (as in `paged_attention`).
    """
    blocks, tokens, num_q_heads, head_dim = check_prefill_blocks(
        "paged_prefill_attention", q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes,
        most_tokens=prefill_block_tokens(num_q_heads=q.shape[2] if q.ndim == 4 else 0,
                                         num_kv_heads=k_pool.shape[0]), q_rows=_Q_ROWS)
    config, scale = prefill_static_args("paged_prefill_attention", head_dim, sm_scale, config or TuningConfig())
    args = (q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes)
    kw = dict(scale=scale, config=config, score_stats=bool(return_score_stats))
    if interpret:
        with mosaic_gpu_interpret():
            return _paged_prefill_attention(*args, p_via_smem=True, **kw)
    return _paged_prefill_attention(*args, p_via_smem=interpret_mode_active(), **kw)


@functools.partial(jax.jit, static_argnames=("scale", "config", "p_via_smem", "score_stats"))
def _paged_prefill_attention(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *, scale, config,
                             p_via_smem, score_stats):
    return prefill_attention_pipeline(q, (k_pool, v_pool), q_starts, lengths, page_starts, page_sizes,
                                      kv_format=BF16_PAGES, num_kv_heads=k_pool.shape[0], scale=scale, config=config,
                                      p_via_smem=p_via_smem, score_stats=score_stats)


def prefill_attention_pipeline(q, kv_inputs, q_starts, lengths, page_starts, page_sizes, *, kv_format,
                               num_kv_heads, scale, config, p_via_smem, score_stats=False):
    """The causal-block kernel's wrapper for any KV format (traced inside a jit; the prefill twin of
    `decode_attention_pipeline`): lays each (block, kv head)'s q rows out token-major in a 64-row tile,
    runs `_build_kernel` with query_tokens = tokens and `kv_format` over `kv_inputs`, and puts the rows
    back. q [blocks, tokens, Hq, D]; returns [blocks, tokens, Hq, D] in q.dtype (and score_var [blocks,
    tokens, Hq] float32 with score_stats)."""
    blocks, tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = tokens * group
    # q tile of (block b, kv head h): rows token-major (row = token * group + g), padded to 64 rows, in the
    # format's MMA dtype (bf16; f16 for the delta kernel's folded path).
    q2 = q.astype(kv_format.mma_dtype).reshape(blocks, tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q2 = jnp.pad(q2.reshape(blocks, num_kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, _Q_ROWS - rows), (0, 0)))
    max_pages = page_starts.shape[1]
    table = flat_table(page_starts, 1, config.block_kv)
    kernel = _build_kernel(
        batch=blocks, num_kv_heads=num_kv_heads, head_dim=head_dim, group=group, max_pages=max_pages,
        table_len=table.shape[0], rows_per_b=num_kv_heads * _Q_ROWS, rows_per_h=_Q_ROWS, copy_rows=_Q_ROWS,
        out_dtype=jnp.dtype(q.dtype), scale=scale, soft_cap=None, config=config,
        p_via_smem=p_via_smem or config.p_via_smem, score_stats=score_stats, query_tokens=tokens,
        kv_format=kv_format)
    # A negative start would leave a row no key at all (its online softmax would be NaN, not zeros).
    res = kernel(lengths, page_sizes, jnp.maximum(q_starts, 0), table, q2.reshape(-1, head_dim), *kv_inputs)

    def to_tokens(x):
        """[blocks, Hkv, 64, ...] rows -> [blocks, tokens, Hq, ...]."""
        x = x[:, :, :rows].reshape(blocks, num_kv_heads, tokens, group, *x.shape[3:])
        return jnp.moveaxis(x, 1, 2).reshape(blocks, tokens, num_q_heads, *x.shape[4:])

    out = to_tokens(res[0].reshape(blocks, num_kv_heads, _Q_ROWS, head_dim))
    if not score_stats:
        return out
    shift, s1, s2 = (to_tokens(x.reshape(blocks, num_kv_heads, _Q_ROWS)) for x in res[-3:])
    # Keys each row saw: its causal end, clamped to the block's length (0 for padding blocks).
    n = prefill_token_keys(q_starts, lengths, tokens).astype(jnp.float32)[:, :, None]
    return out, score_variance_from_partials(shift[:, None], s1[:, None], s2[:, None], n[:, None])


# ---------------------------------------------------------------------------------------------
# KV formats: what the pipeline fetches per page / per tile and how it makes the bf16 K/V tiles
# ---------------------------------------------------------------------------------------------

# SMEM layout of every tile a WGMMA reads (bf16 rows of 64 elements = 128 bytes: 128-byte swizzle).
MMA_TRANSFORMS = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


@dataclasses.dataclass(frozen=True)
class TileContext:
    """What a KV format's hooks see inside the kernel body of one CTA (traced values are scalars).

    h: the CTA's kv head; inputs: the format's GMEM refs (its `num_inputs` kernel operands, in order);
    smem: the format's scratch refs (the pytree its `scratch_types` returned); block_kv, head_dim:
    static tile shape T x D; log2_p: log2 of the sequence's page size; n_pages: pages the sequence
    uses; page_entry(p): slot of the sequence's page p (p inside this CTA's page-table window);
    small_classes: static ((log2 P, T // P) for every page size P < T); wait_k(slot), wait_v(slot):
    await the stage barrier of a ring slot (for whatever page-size class the sequence has)."""
    h: object
    inputs: tuple
    smem: object
    block_kv: int
    head_dim: int
    log2_p: object
    n_pages: object
    page_entry: object
    small_classes: tuple
    wait_k: object
    wait_v: object


class KVFormat(Protocol):
    """How K/V are stored: the pipeline (`_build_kernel`) walks tiles of T tokens, split into page
    pieces (T / P whole pages for P < T, else one T-token piece of a page), and asks the format to

      fetch_page(ctx, src, row, n, slot, k_bar, v_bar): issue the async copies of the n slots
          [src, src + n) (n, row static; src a multiple of 8) into rows [row, row + n) of ring slot
          `slot`, each arriving once on k_bar (K side) or v_bar (V side): `copies_per_side` (K, V) of them;
      fetch_tile(ctx, t0, slot, k_bar, v_bar): copies once per tile whose first token is t0
          (`copies_per_tile` arrivals on each barrier; none for plain pages);
      materialize(ctx, state, slot, tile, n_valid) -> (k_ref, v_ref): await the slot (ctx.wait_k/wait_v)
          and return [T, D] bf16 SMEM refs in MMA_TRANSFORMS layout holding the tile's K and V, with
          the V rows >= n_valid finite (P = 0 there, but 0 * NaN = NaN inside the MMA), the stores
          committed to the async proxy (plgpu.commit_smem);
      prologue(ctx) / prologue_wait(ctx) -> state: once per CTA, before the first fetch / before the
          loop (resident data); `state` (e.g. values kept in registers) goes to every materialize;
      columns(ctx, state, slot, tile, n_valid) -> TileColumns | None: per-key factors of the tile (after
          materialize), for formats whose K/V rows are scale * stored row; None for plain pages;
      finish(ctx, state, o, l) -> o: the normalised output [64, D] f32 (rows with l == 0 are zeros), e.g.
          plus a per-head offset that the format left out of V;
      mma_dtype: the dtype of q, the K/V tiles and P in the MMAs ("bfloat16" or "float16").
    Implementations are frozen dataclasses (they are static jit arguments)."""

    num_inputs: int
    copies_per_side: tuple[int, int]
    copies_per_tile: int
    mma_dtype: str

    def scratch_types(self, *, stages: int, block_kv: int, head_dim: int) -> list: ...
    def prologue(self, ctx: TileContext) -> None: ...
    def prologue_wait(self, ctx: TileContext) -> object: ...
    def fetch_page(self, ctx: TileContext, src, row: int, n: int, slot, k_bar, v_bar) -> None: ...
    def fetch_tile(self, ctx: TileContext, t0, slot, k_bar, v_bar) -> None: ...
    def materialize(self, ctx: TileContext, state, slot, tile, n_valid) -> tuple: ...
    def columns(self, ctx: TileContext, state, slot, tile, n_valid) -> TileColumns | None: ...
    def finish(self, ctx: TileContext, state, o, l) -> jax.Array: ...


@dataclasses.dataclass(frozen=True)
class TileColumns:
    """Per-key factors of one tile: [T] f32 vectors in the WGMMA column layout, finite everywhere
    (a format masks the factors of keys past the length). The scores become score_scale * (q . k);
    P's columns are multiplied by value_scale before P @ V, and the softmax's running max is taken
    over s + log2_value_scale, so the scaled P that the MMA rounds is <= 1 with its largest entry 1."""
    score_scale: jax.Array
    value_scale: jax.Array
    log2_value_scale: jax.Array


@dataclasses.dataclass(frozen=True)
class Bf16Pages:
    """Plain pages (the paged kernel): inputs k_pool, v_pool [num_kv_heads, num_slots, D] in mma_dtype;
    one TMA copy per page straight into a ring of that dtype that WGMMA reads in place. bf16 is the paged
    kernel's pool; float16 (`F16_PAGES`, the swapped kernel only) is a DKVC fp16-delta pool read on the folded
    mean-anchor path (stratum_jax/attention.py: unit scales, so the deltas are the K/V up to a per-row shift)."""
    num_inputs: int = 2
    copies_per_side: tuple[int, int] = (1, 1)     # (K, V) copies per page piece: the rows
    copies_per_tile: int = 0
    mma_dtype: str = "bfloat16"

    def scratch_types(self, *, stages, block_kv, head_dim):
        ring = plgpu.SMEM((stages, block_kv, head_dim), jnp.dtype(self.mma_dtype), transforms=MMA_TRANSFORMS)
        return [ring, ring]

    def prologue(self, ctx):
        pass

    def prologue_wait(self, ctx):
        return None

    def fetch_page(self, ctx, src, row, n, slot, k_bar, v_bar):
        (k_ref, v_ref), (k_ring, v_ring) = ctx.inputs[:2], ctx.smem[:2]
        dst = (slot, pl.ds(row, n)) if n < ctx.block_kv else (slot,)
        plgpu.copy_gmem_to_smem(k_ref.at[ctx.h, pl.ds(src, n)], k_ring.at[dst], k_bar)
        plgpu.copy_gmem_to_smem(v_ref.at[ctx.h, pl.ds(src, n)], v_ring.at[dst], v_bar)

    def fetch_tile(self, ctx, t0, slot, k_bar, v_bar):
        pass

    def materialize(self, ctx, state, slot, tile, n_valid):
        k_ring, v_ring = ctx.smem
        ctx.wait_k(slot)
        ctx.wait_v(slot)
        zero_rows_past(v_ring, slot, n_valid)
        return k_ring.at[slot], v_ring.at[slot]

    def columns(self, ctx, state, slot, tile, n_valid):
        return None

    def finish(self, ctx, state, o, l):
        return o


BF16_PAGES = Bf16Pages()
F16_PAGES = Bf16Pages(mma_dtype="float16")


def zero_rows_past(ring, slot, n_valid) -> None:
    """In a kernel: zero the rows >= n_valid of ring slot `slot` ([stages, T, D] bf16 SMEM) when the tile is
    partial (n_valid < T), so stale or NaN slots past a sequence's end can't poison P @ V (P is 0 there, but
    0 * NaN = NaN inside the MMA); the stores are committed to the async proxy for WGMMA."""
    block_kv, head_dim = ring.shape[1:]

    @pl.when(n_valid < block_kv)
    def _():
        v = ring[slot]
        rows = plgpu.broadcasted_iota(jnp.int32, (block_kv, head_dim), 0, layout=plgpu.Layout.WGMMA)
        ring[slot] = jnp.where(rows < n_valid, v, jnp.zeros_like(v))
        plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------

def _build_kernel(*, batch, num_kv_heads, head_dim, group, max_pages, table_len, rows_per_b,
                  rows_per_h, copy_rows, out_dtype, scale, soft_cap, config, p_via_smem,
                  score_stats=False, query_tokens=1, kv_format: KVFormat | None = None):
    """Returns f(lengths, page_sizes, table, q2, *kv_inputs) -> (o,) or (o_part, lse), followed
    by (shift, sum, sum of squares) score-stat rows when score_stats (see the module docstring).
    kv_inputs are `kv_format`'s GMEM arrays (default BF16_PAGES: k_pool, v_pool); the format decides
    what is copied per page and per tile, and how the bf16 K/V tiles WGMMA reads are made (`KVFormat`).

    query_tokens Q > 1 (prefill blocks, `paged_prefill_attention`): the q tile's 64 rows are Q
    consecutive query tokens x `group` q heads (row r is token r // group; group a power of 2), f takes
    q_starts [batch] int32 after page_sizes, and row r sees the keys < min(q_start + r // group + 1,
    length) (causal); every row's output (all 64) is written. Q = 1 is the decode kernel, unchanged. Any
    kv_format works with Q > 1 (the q tile is in its mma_dtype; `prefill_attention_pipeline` lays it out)."""
    T = config.block_kv
    stages = config.num_stages
    splits = config.num_splits
    window = table_window(max_pages, splits, T)
    # The lse of the q tile's first `copy_rows` rows (a multiple of 8, so a 16-byte-aligned bulk copy
    # from SMEM row 0) goes out; the wrapper picks the group's rows at row_off.
    lse_cols = copy_rows
    # Copy groups: copies per tile for each page-size class (P < T: T/P pages; P >= T: 1 piece).
    small_classes = page_classes(T)                                           # (log2 P, copies)
    groups = [n for _, n in small_classes] + [1]
    kv_format = BF16_PAGES if kv_format is None else kv_format
    # Stage-barrier arrivals (K, V): every copy the format issues for a tile arrives once.
    k_arrivals, v_arrivals = ([n * c + kv_format.copies_per_tile for n in groups] for c in kv_format.copies_per_side)
    # S is computed as fp32 q.k; fold the softmax scale and log2(e) into one multiply (exp2 below).
    qk_scale = scale * _LOG2E
    mma_transforms = MMA_TRANSFORMS
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    # Score stats: with 64-token tiles, keep the sums per (row, column) in two [64, T] fp32 register
    # tiles (32 registers each per thread) and reduce over columns once at the end, instead of two
    # extra cross-lane row reductions per tile (H200 A/B over six 1K/4K shapes: +1.6-8.5% vs
    # +1.7-17% over the plain kernel, and 2-3x smaller error). Larger tiles would need 64-128
    # registers per sum, so they reduce per tile.
    stats_per_column = score_stats and T == 64
    causal = query_tokens > 1
    log2_group = group.bit_length() - 1
    out_rows_per_h = _Q_ROWS if causal else group
    if causal and (1 << log2_group != group or query_tokens * group > _Q_ROWS or splits != 1):
        raise ValueError(f"prefill blocks need a power-of-2 group ({group}), query_tokens * group <= "
                         f"{_Q_ROWS} ({query_tokens} * {group}) and one split ({splits})")

    def body(lengths_ref, psizes_ref, *rest):
        if causal:
            qstart_ref, rest = rest[0], rest[1:]
        table_ref, q_ref, *rest = rest
        kv_refs, rest = tuple(rest[:kv_format.num_inputs]), rest[kv_format.num_inputs:]
        if splits == 1:
            (o_ref,), rest = rest[:1], rest[1:]
            lse_ref = None
        else:
            (o_ref, lse_ref), rest = rest[:2], rest[2:]
        if score_stats:
            stat_refs, rest = rest[:3], rest[3:]
        (table_smem, q_smem, kv_smem, o_smem, lse_smem, meta_bar, k_bars, v_bars, *extra) = rest
        if score_stats:
            stat_smem, extra = extra[:3], extra[3:]
        p_smem = extra[0] if extra else None
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        k_split = lax.axis_index("k") if splits > 1 else 0

        # --- per-sequence scalars -----------------------------------------------------------
        log2_p, page, length, n_pages, n_tiles = sequence_scalars(psizes_ref[b], lengths_ref[b],
                                                                  max_pages=max_pages, block_kv=T)
        tile_lo, tile_hi = split_tile_range(n_tiles, k_split, splits)
        num_steps = tile_hi - tile_lo
        if causal:
            # Row r's keys end at its own token's position (+1): a [64, T] bound, the same every tile.
            q_start = qstart_ref[b]
            row_tok = lax.shift_right_logical(
                plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, T), 0, layout=wgmma_layout), log2_group)
            row_end = jnp.minimum(q_start + row_tok + 1, length)

        def visible(tile, n_valid):
            """[64, T] bool: the keys of `tile` (n_valid = length - tile * T of them exist) each row sees."""
            cols = plgpu.broadcasted_iota(jnp.int32, (_Q_ROWS, T), 1, layout=wgmma_layout)
            if causal:
                return cols < row_end - tile * T
            return cols < n_valid

        # --- page-table window and q rows -> SMEM --------------------------------------------
        win_start = table_window_start(b, tile_lo, log2_p, max_pages=max_pages, block_kv=T, table_len=table_len,
                                       window=window)
        plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(win_start, window)], table_smem, meta_bar.at[0],
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        q_row = b * rows_per_b + h * rows_per_h
        q_row0 = pl.multiple_of(q_row - lax.rem(q_row, 8), 8)   # tiled TMA wants 8-row alignment
        row_off = q_row - q_row0                     # where the group's rows start in the q tile
        plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row0, copy_rows)], q_smem.at[pl.ds(0, copy_rows)],
                                meta_bar.at[1])
        plgpu.barrier_wait(meta_bar.at[0])

        def page_entry(p):   # slot of page p of this sequence (p must be in this CTA's window)
            return table_smem[b * max_pages + p - win_start]

        def wait(bars, slot):
            wait_page_class(bars, slot, log2_p, small_classes, T)

        ctx = TileContext(h=h, inputs=kv_refs, smem=kv_smem, block_kv=T, head_dim=head_dim, log2_p=log2_p,
                          n_pages=n_pages, page_entry=page_entry, small_classes=tuple(small_classes),
                          wait_k=functools.partial(wait, k_bars), wait_v=functools.partial(wait, v_bars))

        # --- fetch: TMA copies of one K and V tile -----------------------------------------
        def fetch(tile, slot):
            t0 = tile * T
            issue_tile_copies(
                t0, log2_p=log2_p, page=page, n_pages=n_pages, page_entry=page_entry, small_classes=small_classes,
                block_kv=T,
                piece=lambda gi, src, off, size: kv_format.fetch_page(ctx, src, off, size, slot, k_bars[gi].at[slot],
                                                                      v_bars[gi].at[slot]),
                after=lambda gi: kv_format.fetch_tile(ctx, t0, slot, k_bars[gi].at[slot], v_bars[gi].at[slot]))

        # --- attend: online softmax update with one tile ----------------------------------
        def attend(carry, k_tile, v_tile, tile, n_valid, cols=None):
            if score_stats:
                acc, m_i, l_i, c_i, s1_i, s2_i = carry
            else:
                acc, m_i, l_i = carry

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_tile.transpose((1, 0)))
                return acc_ref[...]
            s = pl.run_scoped(qk, plgpu.ACC((_Q_ROWS, T), jnp.float32))
            if cols is not None and soft_cap is not None:
                raise ValueError("per-key score scales (TileColumns) do not commute with the soft cap")
            if soft_cap is not None:
                s = jnp.tanh(s * (scale / soft_cap)) * (soft_cap * _LOG2E)
            elif cols is not None:
                s = s * lax.broadcast_in_dim(cols.score_scale * qk_scale, s.shape, [1])
            else:
                s = s * qk_scale
            seen = visible(tile, n_valid)
            s = jnp.where(seen, s, -jnp.inf)
            if cols is None:
                m_new = jnp.maximum(m_i, s.max(axis=1))
            else:   # the max of s + log2(value scale): P * value_scale below is <= 1 (TileColumns)
                m_new = jnp.maximum(m_i, (s + lax.broadcast_in_dim(cols.log2_value_scale, s.shape, [1])).max(axis=1))
            if score_stats:
                # Shift: the row max of the CTA's first tile (m_i is -inf only before it). Masked
                # keys (s = -inf, or NaN from free slots before the mask) contribute exactly 0.
                c_i = jnp.where(m_i == -jnp.inf, m_new, c_i)
                d = jnp.where(seen, s - lax.broadcast_in_dim(c_i, s.shape, [0]), 0.0)
                if stats_per_column:
                    s1_i = s1_i + d
                    s2_i = s2_i + d * d
                else:
                    s1_i = s1_i + d.sum(axis=1)
                    s2_i = s2_i + (d * d).sum(axis=1)
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)

            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            if cols is not None:
                p = p * lax.broadcast_in_dim(cols.value_scale, p.shape, [1])
            p16 = p.astype(kv_format.mma_dtype)
            if p_smem is None:
                # P is WGMMA's A operand straight from registers; accumulate in place.
                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_tile)
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            else:
                # Interpreter-friendly variant (no register A operand, no run_state): P goes through
                # a swizzled SMEM tile and the product into a fresh accumulator. Same math.
                p_smem[...] = p16
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_smem, v_tile)
                    return acc_ref[...]
                acc = acc + pl.run_scoped(pv, plgpu.ACC((_Q_ROWS, head_dim), jnp.float32))
            if score_stats:
                return acc, m_new, l_i, c_i, s1_i, s2_i
            return acc, m_new, l_i

        # --- pipeline ---------------------------------------------------------------------
        kv_format.prologue(ctx)
        for s_ in range(stages):
            pl.when(s_ < num_steps)(functools.partial(fetch, tile_lo + s_, s_))
        plgpu.barrier_wait(meta_bar.at[1])
        kv_state = kv_format.prologue_wait(ctx)

        def step(i, carry):
            slot = lax.rem(i, stages)
            tile = tile_lo + i
            n_valid = length - tile * T
            k_tile, v_tile = kv_format.materialize(ctx, kv_state, slot, tile, n_valid)
            cols = kv_format.columns(ctx, kv_state, slot, tile, n_valid)
            carry = attend(carry, k_tile, v_tile, tile, n_valid, cols)
            # attend() awaited its WGMMAs, so the slot is free: refill it. Each warp awaits only its
            # own share of a WGMMA, so all four must be past it before the TMA overwrites the slot;
            # Pallas' automatic barriers do that per copy, otherwise one sync per tile here.
            @pl.when(i + stages < num_steps)
            def _():
                if config.no_auto_barriers:
                    plgpu.commit_smem()
                fetch(tile + stages, slot)
            return carry

        acc0 = plgpu.layout_cast(jnp.zeros((_Q_ROWS, head_dim), jnp.float32), wgmma_layout)
        m0 = plgpu.layout_cast(jnp.full((_Q_ROWS,), -jnp.inf, jnp.float32), row_layout)
        l0 = plgpu.layout_cast(jnp.zeros((_Q_ROWS,), jnp.float32), row_layout)
        if score_stats:
            z = plgpu.layout_cast(jnp.zeros((_Q_ROWS,), jnp.float32), row_layout)
            if stats_per_column:
                zt = plgpu.layout_cast(jnp.zeros((_Q_ROWS, T), jnp.float32), wgmma_layout)
                acc, m_i, l_i, c_i, s1_i, s2_i = lax.fori_loop(0, num_steps, step, (acc0, m0, l0, z, zt, zt))
                s1_i, s2_i = s1_i.sum(axis=1), s2_i.sum(axis=1)
            else:
                acc, m_i, l_i, c_i, s1_i, s2_i = lax.fori_loop(0, num_steps, step, (acc0, m0, l0, z, z, z))
        else:
            acc, m_i, l_i = lax.fori_loop(0, num_steps, step, (acc0, m0, l0))

        # --- epilogue: normalise, write the group's rows ----------------------------------
        l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
        o = kv_format.finish(ctx, kv_state, acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), l_i)
        o_smem[...] = o.astype(out_dtype)
        if lse_ref is not None:
            lse_smem[...] = m_i + jnp.log2(l_i)      # -inf for an empty split
        if score_stats:
            for ref, val in zip(stat_smem, (c_i, s1_i, s2_i)):
                ref[...] = val
        plgpu.commit_smem()
        if splits == 1:
            out_row = q_row
        else:
            out_row = (b * splits + k_split) * rows_per_b + h * rows_per_h
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(row_off, out_rows_per_h)], o_ref.at[pl.ds(out_row, out_rows_per_h)])
        if lse_ref is not None:
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, lse_cols)], lse_ref.at[b * splits + k_split, h])
        if score_stats:
            for src, dst in zip(stat_smem, stat_refs):
                plgpu.copy_smem_to_gmem(src.at[pl.ds(0, lse_cols)], dst.at[b * splits + k_split, h])
        plgpu.wait_smem_to_gmem(0)

    out_rows = batch * rows_per_b * splits
    out_type = [jax.ShapeDtypeStruct((out_rows, head_dim), out_dtype)]
    if splits > 1:
        out_type.append(jax.ShapeDtypeStruct((batch * splits, num_kv_heads, lse_cols), jnp.float32))
    if score_stats:
        out_type += [jax.ShapeDtypeStruct((batch * splits, num_kv_heads, lse_cols), jnp.float32)] * 3
    scratch = [
        plgpu.SMEM((window,), jnp.int32),
        plgpu.SMEM((_Q_ROWS, head_dim), jnp.dtype(kv_format.mma_dtype), transforms=mma_transforms),
        kv_format.scratch_types(stages=stages, block_kv=T, head_dim=head_dim),
        plgpu.SMEM((_Q_ROWS, head_dim), out_dtype),
        plgpu.SMEM((_Q_ROWS,), jnp.float32),
        plgpu.Barrier(num_barriers=2),
        [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in k_arrivals],
        [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in v_arrivals],
    ]
    if score_stats:
        scratch += [plgpu.SMEM((_Q_ROWS,), jnp.float32) for _ in range(3)]
    if p_via_smem:
        scratch.append(plgpu.SMEM((_Q_ROWS, T), jnp.dtype(kv_format.mma_dtype), transforms=mma_transforms))
    grid, names = (batch, num_kv_heads), ("b", "h")
    if splits > 1:
        grid, names = (batch, num_kv_heads, splits), ("b", "h", "k")
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=names, scratch_types=scratch,
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math,
                                             unsafe_no_auto_barriers=config.no_auto_barriers))
