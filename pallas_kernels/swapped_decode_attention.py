"""Paged decode attention with the operands swapped: keys on WGMMA's M, the GQA group on N (Mosaic GPU, Hopper).

Same contract as `paged_attention` (pallas_kernels/paged_attention.py): one decode query per sequence over its
KV pages (8..256 tokens, sizes mixed per batch) in one layer's slot pool.

Why
---
`paged_attention` computes S = q K^T with a 64-row q tile because WGMMA's M is fixed at 64, yet in decode only
the GQA group's rows are real (4 for llama-1b and llama-8b). The 60 padding rows still cost registers (S is a
64 x T fp32 tile, O a 64 x D one: 32-64 registers a thread each) and softmax work; ptxas reports 146-230
registers, so only 2-3 CTAs fit an SM and each tile's chain (MMA, softmax, MMA) is long. On the H200 that kernel
streams 48-68% of the read ceiling at head_dim 64 and 1K context (benchmarks/KERNEL_NOTES.md, "Device time").

Here the keys are the M side and the group is the N side, padded to N = 8 (or the group rounded up to 8):
    S^T [T, N] = K_tile [T, D] @ q^T [D, N]    A = the K ring slot (K-major, as TMA lands it),
                                               B = the group's q rows [N, D] in SMEM, viewed transposed;
    online softmax per column (query head) over the T rows;
    O^T [D, N] += V_tile^T [D, T] @ P^T [T, N] A = the V ring slot viewed transposed (MN-major A, allowed for
                                               16-bit types), B = P [N, T] in SMEM viewed transposed.
Per thread that is T*N/128 fp32 registers for S^T (8 at T=128, N=8) and D*N/128 for O^T (4-8), instead of
T/2 and D/2 for the 64-row tiles, so the register file no longer limits CTAs per SM; SMEM (the K/V ring) does.

Pools: bf16 (the engine's bf16 KV); float16 (`F16_PAGES`, a DKVC fp16-delta cache on the folded path); or
float8_e4m3fn (`F8Pages`, an fp8-delta cache with fixed per-head scales on the same path: the caller folds the
scales into q and the output; or an fp8-delta cache with a scale per 8-slot granule, the default: the kernel copies
the scales with the pages and applies them per key, to the scores and to P: `F8PackedGranulePages`, the cache's
packed scales, one copy a page piece; K's and V's scales given as two arrays are packed at the entry). Hopper's fp8
WGMMA needs both operands fp8 and K-major. S^T = K q^T meets that as it stands (A = the K ring slot, B = q^T with
q's rows contiguous along D), so q is split into e4m3 parts (`split_rows_fp8`: a power-of-two row scale, then each
part the rounding residual of the ones before) and S^T is the parts' fp8 products straight from the K ring (at N = 8
one MMA over the parts side by side, so the K tile is read from SMEM once), times the row's unscale. V^T is not
K-major (V's rows are contiguous along D), so each V tile is converted (e4m3 pairs -> f16x2, exact) into an f16
staging tile, rows past the length as zeros, while the S^T MMAs run, and P V is an f16 MMA.

Mosaic GPU capabilities this rests on (jax 0.11.2; each verified by lowering to Mosaic GPU on a CPU and by the
interpreter, see tests/test_swapped_decode_attention.py; ptxas and the hardware are the GPU tests' job):
  - WGMMA with M = T (64/128/256: one to four M groups) and N = 8/16/...; A and B must share one swizzle, so
    every MMA operand here is a bf16 tile with 64-element rows and the 128-byte swizzle (`MMA_TRANSFORMS`).
  - Column reductions (axis 0 of a WGMMA-layout array) cross warps through SMEM scratch
    (`CompilerParams.reduction_scratch_bytes`, 1 KB per 8 columns for all of them at once) and two warpgroup
    barriers; the column vectors have layout `WGMMA.reduce(0)` and broadcast back along dim 1.
  - P^T [T, N] leaves registers through a store into the *transposed view* of a swizzled [N, T] SMEM tile,
    which lowers to `stmatrix ... .trans` (layout = col). Storing P^T into a [T, N] tile would need N-wide
    swizzled rows (32 bytes at N = 16: swizzle 32), and WGMMA refuses mixed swizzles (the V ring has 128).
  - The epilogue stores O^T the same way into a transposed [N, D] view after a cast to the WGMMA_TRANSPOSED
    register layout (an f32 tile is not transferable otherwise), so the output TMA copy writes rows of
    [B * Hq, D] directly, as `paged_attention` does; no transpose in the wrapper.
  - The interpreter runs this exact kernel: nothing here needs `pl.run_state` or a register A operand (the
    PV product goes into a fresh accumulator that is added to the running one, as `paged_attention`'s
    interpreter variant does), so the GPU and CPU paths are one.

Softmax bookkeeping: the column max is reduced over the tile every tile (exp2 needs it); the column sum is
not: l stays a [T, N] tile, rescaled and accumulated elementwise (l_tile = l_tile * alpha + P), and is reduced
once after the loop, which drops one cross-warp reduction (two warpgroup barriers) per tile for T*N/128 more
registers.

Soft cap (`soft_cap`): s = soft_cap * tanh(sm_scale * q.k / soft_cap), elementwise on S^T before the mask, as
`paged_attention` does it (the MUFU tanh with approx_math).

Score statistics (opt-in, `return_score_stats=True`; `paged_attention`'s definition and its split merge): per
query head (a column of S^T), the population variance of the scaled (and capped) scores over the keys it sees.
Beside the online softmax each column accumulates, over its valid keys only, sum(s - c) and sum((s - c)^2), where
the shift c is the column max of the CTA's first tile (a score inside the column's range: raw sums of s and s^2
cancel in fp32 when the scores share a large offset). Like l, the two sums stay [T, N] tiles, added to
elementwise every tile (no rescaling: c is fixed after the first tile) and reduced over the rows (across warps)
once after the loop, so the stats add no cross-warp reduction, barrier or SMEM round trip to the loop; they cost
2 * T*N/128 registers a thread. Each CTA writes (c, sum, sum of squares) for its N columns, like lse; the wrapper
picks the group's columns, counts each split's keys (`split_key_counts`) and merges the splits with Chan et
al.'s update (`score_variance_from_partials`). The flags are static: with both off, the traced kernel is the one
from before they existed (the jaxpr's hash compared at both default configs, with and without split-K, and two
others, 2026-12-02). Not yet measured on a GPU.

*L2 prefetch (optional).* Given the next GEMM's weight (the o projection's) and an `L2Prefetch` plan, each CTA, after
its last tile, prefetches its share of the tiles that GEMM reads first (pallas_kernels/l2_prefetch.py): the grid's
drain, where HBM idles, starts on the next kernel's bytes. No value changes; off, the traced kernel is unchanged.

What is shared with `paged_attention` (imported, not copied): the page-size classes and their stage barriers,
the tile copy issue (`issue_tile_copies` with `Bf16Pages.fetch_page`), the V-tail zeroing (`zero_rows_past`),
the page-table window, the per-sequence scalars, the q row blocks, split-K's tile partition and merge, the score
statistics' key counts and merge. Not supported: the causal prefill variant.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.cluster_exchange import lse_row_floats, merge_attention_splits
from pallas_kernels.delta_attention import (F16_SAFE_MAX, GRANULE, SCALE_AREA, check_packed_scales, convert_to_f16,
                                            delta_ring_type, fetch_packed_granules, kernel_scales,
                                            packed_scale_areas_type, packed_tile_columns, rebuild_reference)
from pallas_kernels.fp8_q_split import (HEAD_DIMS as FP8_Q_SPLIT_HEAD_DIMS, ROW_BLOCK as FP8_Q_SPLIT_ROWS, fp8_q_split,
                                         split_block_in_kernel)
from pallas_kernels.l2_prefetch import L2Prefetch, check_prefetch_args, issue_prefetch
from pallas_kernels.paged_attention import (
    BF16_PAGES, F16_PAGES, MMA_TRANSFORMS, NUM_SMS_H100, Bf16Pages, TileContext, check_pools_and_tables,
    TileColumns, default_num_splits, paged_attention_reference, q_row_blocks, reference_attend,
    reference_token_slots, zero_rows_past)
from pallas_kernels.paged_tiles import (check_tile_pipeline, flat_table, issue_tile_copies, page_classes,
                                        sequence_scalars, split_tile_range, table_window, table_window_start,
                                        wait_page_class)
from pallas_kernels.split_k import combine_splits, score_variance_from_partials, split_key_counts

_LOG2E = math.log2(math.e)
_FP8 = jnp.dtype(jnp.float8_e4m3fn)
_COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)     # [N] vectors: one value per column (query head) of S^T / O^T
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)     # [D] / [T] vectors: one value per row of O^T (head dim) / S^T (key)
_SMEM_PER_SM = 228 * 1024                      # H100/H200: shared memory per SM ...
_SMEM_PER_CTA_RESERVED = 1024                  # ... of which the driver reserves 1 KB per resident CTA


@dataclasses.dataclass(frozen=True)
class F8Pages(Bf16Pages):
    """float8 e4m3 pools (a DKVC fp8-delta cache with one fixed scale per layer and KV head, read on the folded
    mean-anchor path: stratum_jax/attention.py scales q and the output by the head's scales and adds the
    anchor). TMA lands the fp8 rows in rings of half a bf16 ring's bytes.
    - S^T = K q^T runs as fp8 WGMMAs straight from the K ring (both operands K-major, as fp8 WGMMA needs): q is
      split into `SwappedConfig.fp8_q_terms` e4m3 parts per row, q ~ (q_1 + q_2 + ...) * unscale, each part the
      rounding residual of the ones before, after a power-of-two row scale that puts the row's largest |q| in
      [64, 128) (`split_rows_fp8`); S^T is the sum of the parts' products, then multiplied by the row's unscale
      (one column of S^T). Two parts keep about 8 significant bits of q (bf16's 8), at no conversion work on K.
      With N = 8 the parts sit side by side as one [terms * 8, D] B operand (`SwappedConfig.fp8_q_stacked`): one
      MMA of N = terms * 8 reads the K tile from SMEM once, and the parts' [T, 8] column blocks are added in
      registers (column j + 8t of the accumulator is in the same thread as column j); otherwise one MMA per
      part, each re-reading K, accumulates into S^T.
    - P V needs V^T as a K-major A operand, which V's rows are not (fp8 WGMMA allows no transposed view), so each
      V tile is converted (e4m3 pairs -> f16x2, exact, `convert_to_f16` with 4-byte loads) into one f16 staging
      tile that the f16 MMA reads, rows past the length as zeros (masked on a sequence's last tile only).
      scratch_types: [k ring, v ring, v staging]."""
    mma_dtype: str = "float16"

    def scratch_types(self, *, stages, block_kv, head_dim):
        ring = delta_ring_type(stages, block_kv, head_dim, _FP8)
        staging = plgpu.SMEM((block_kv, head_dim), jnp.float16, transforms=MMA_TRANSFORMS)
        return [ring, ring, staging]

    def q_smem_type(self, terms: int, n_cols: int, head_dim: int, stacked: bool = False):
        """SMEM of the q parts [terms, N, D] e4m3 (stacked: [terms * N, D], one B operand), in the K ring's
        layout (WGMMA wants one swizzle)."""
        swizzle = min(128, head_dim)
        shape = (terms * n_cols, head_dim) if stacked else (terms, n_cols, head_dim)
        return plgpu.SMEM(shape, _FP8,
                          transforms=(plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle)))


def split_rows_fp8(x, terms: int):
    """x [rows, D] float32 -> (parts [terms, rows, D] float8_e4m3fn, unscale [rows] float32) with
    x ~ sum(parts) * unscale[:, None]. Each row is first scaled by a power of two (exact) that puts its largest
    |x| in [64, 128); each part is the e4m3 rounding of what the parts before it left. Relative to the row's
    largest |x| the error is about 2^-(4 * terms + 1).

    The rounding is `lax.reduce_precision` to e4m3's 4 exponent and 3 mantissa bits, not a round trip through
    float8: XLA's GPU pipeline (excess precision allowed, its default) folds convert(convert(x, f8), f32) into x,
    which made every part after the first zero on the H200 (the fp8 fold's scores then saw q to 4 bits;
    `test_gpu_reduced_pools_match_float64`). reduce_precision has IEEE semantics, whose largest finite value with
    4 exponent bits is 240 where e4m3fn reaches 448 (hence rows scaled into [64, 128), not [128, 256)), and it
    flushes what is under e4m3's smallest normal (2^-6) to zero, which the later parts then carry; the last part is
    a plain cast, which keeps e4m3's subnormals.

    The unscale is 2^(e - 7) for a row whose largest |x| is in [2^(e-1), 2^e): the largest over the row of
    |x| with its mantissa bits cleared, times 2^-6, clipped to [2^-100, 2^100] (a zero row gets 2^-100 and
    stays zero). Each of these maps is monotone, so they commute with the max: they are applied elementwise
    before it, and the row reduction's output is the unscale itself. XLA fuses elementwise producers into a
    reduction but ran a clip after it as a kernel of its own (the H200's decode program, session 20: about
    1 us a layer), as frexp / ldexp of the row max did before; the parts then use 1 / unscale, exact for a
    power of two."""
    exponent_bits = lax.bitcast_convert_type(jnp.abs(x), jnp.int32) & 0x7F800000
    pow2_floor = lax.bitcast_convert_type(exponent_bits, jnp.float32)          # 2^floor(log2|x|), 0 if tiny
    unscale = jnp.max(jnp.clip(pow2_floor * 2.0 ** -6, 2.0 ** -100, 2.0 ** 100), axis=-1)
    rest = x * (1.0 / unscale)[:, None]
    parts = []
    for _ in range(terms - 1):
        part = lax.reduce_precision(rest, exponent_bits=4, mantissa_bits=3)   # exactly representable in e4m3fn
        parts.append(part.astype(_FP8))
        rest = rest - part          # reduce_precision flushes |x| < 2^-6 to 0: those stay here for the next part
    parts.append(rest.astype(_FP8))     # the last part needs no f32 value back: a plain cast, e4m3's subnormals kept
    return jnp.stack(parts), unscale


def fp8_q_split_takes(q2, rows_per_b: int, num_q_heads: int) -> bool:
    """Whether `fp8_q_split` takes q's row blocks q2 [rows, D] (`q_row_blocks`) with the per-head scale as its
    row scale: unpadded rows (row = b * Hq + head, so row r's head is r % Hq) with Hq a multiple of 8, and a head dim
    the kernel takes."""
    return (rows_per_b == num_q_heads and num_q_heads % FP8_Q_SPLIT_ROWS == 0 and q2.shape[0] % FP8_Q_SPLIT_ROWS == 0
            and q2.shape[1] in FP8_Q_SPLIT_HEAD_DIMS)


def stacks_q_parts(config: "SwappedConfig", n_cols: int) -> bool:
    """Whether the kernel takes q's fp8 parts stacked (`SwappedConfig.fp8_q_stacked`, N = 8 only)."""
    return config.fp8_q_stacked and n_cols == 8


def stack_q_parts(parts):
    """parts [terms, rows, D] (rows a multiple of 8) -> [rows * terms, D]: each 8-row block's parts one after
    the other, so a CTA's block of 8 rows is the contiguous rows [8 * terms * (row0 // 8), + 8 * terms), and its
    [terms * 8, D] SMEM copy is one B operand whose column block t is part t."""
    terms, rows, d = parts.shape
    return parts.reshape(terms, rows // 8, 8, d).transpose(1, 0, 2, 3).reshape(rows * terms, d)


F8_PAGES = F8Pages()


@dataclasses.dataclass(frozen=True)
class F8PackedGranulePages(F8Pages):
    """float8 e4m3 pools with a scale per 8-slot granule per kv head beside them (a DKVC fp8-delta cache as it is
    written by default, `--fp8-scale granule`), both sides' scales packed per granule (`pack_granule_scales`:
    [Hkv, S // 8, 4] f32, K scale, V scale and 2 unused floats, so every granule starts on a 16-byte boundary): the
    key in slot s of kv head h is packed[h, s // 8, 0] * k_pool[h, s], the value packed[h, s // 8, 1] *
    v_pool[h, s]. F8Pages' MMAs as they are (q in e4m3 parts, V converted to f16), plus:
    - per page piece one more TMA copy, of the piece's scale granules (on the V barrier: the scales are read after
      the V wait), each granule landing at a static place of the piece's area (`fetch_packed_granules`), so the
      tile's scale vectors need no page-table read (`packed_scale_index`);
    - the tile's T per-key scales as [T] row vectors of S^T (`packed_tile_columns` in the WGMMA row layout, built
      while the score MMA runs; a granule with no live key gets score scale 0 and value scale 1: stale scales may
      be NaN);
    - the scores times the K scales; the column max taken over s + log2(V scale) and P^T's rows times the V
      scales before P V, so the P the f16 MMA reads is <= 1 with its largest entry 1 and f16's smallest normal is
      never the bound (scales of fp8 deltas are ~amax / 448); l sums P without the V scale, in fp32. The same
      rule as the delta kernel's per-key `TileColumns`, on S^T's rows instead of S's columns.
    inputs: k_pool, v_pool, packed scales [Hkv, S // 8 * 4]; scratch_types: [k ring, v ring, v staging, scales]."""
    num_inputs: int = 3
    copies_per_side: tuple[int, int] = (1, 2)     # K rows; V rows + the packed scales

    def scratch_types(self, *, stages, block_kv, head_dim):
        return (super().scratch_types(stages=stages, block_kv=block_kv, head_dim=head_dim)
                + [packed_scale_areas_type(stages, block_kv)])

    def fetch_page(self, ctx, src, row, n, slot, k_bar, v_bar):
        super().fetch_page(ctx, src, row, n, slot, k_bar, v_bar)     # the rows (ctx's first 2 inputs / rings)
        fetch_packed_granules(ctx.inputs[2].at[ctx.h], src, row, n, ctx.smem[2].at[slot], v_bar)

    def key_scales(self, ctx, slot, tile, n_valid) -> TileColumns:
        """The tile's per-key factors as [T] f32 vectors in the row layout of S^T (after both waits of the slot)."""
        del tile      # a granule's place is the same in every tile
        return packed_tile_columns(ctx.smem[2], slot, ctx.log2_p, n_valid, ctx.block_kv, layout=_ROW_LAYOUT)


F8_PACKED_GRANULE_PAGES = F8PackedGranulePages()


@dataclasses.dataclass(frozen=True)
class SwappedConfig:
    """Static knobs of the swapped kernel (each distinct config compiles its own kernel).

    Attributes:
      block_kv: keys per pipeline tile T (64, 128 or 256): WGMMA's M, so T/64 M groups per MMA.
      num_stages: K/V tiles in flight per CTA (SMEM ring depth), >= 2.
      num_splits: split-K factor (CTAs per (sequence, kv head)); None picks one from the grid size
        (`default_num_splits`, as `paged_attention` does: 1 when batch * num_kv_heads >= 132).
      approx_math: fast approximate exp2 (MUFU).
      no_auto_barriers: drop Pallas' warpgroup barrier before every TMA issue; the kernel syncs once per
        refilled tile instead (as `paged_attention` does).
      fp8_q_terms: float8 pools only: the e4m3 parts q is split into for the fp8 score MMAs (`F8Pages`); the
        error relative to a row's largest |q| is about 2^-(4 * terms + 1): 2 is bf16's rounding, 3 f16's.
      shared_smem: the loop's buffers (K/V ring, staging, P) and the epilogue's (output, lse, score sums) in two
        run_scoped regions that share their SMEM, instead of all allocated for the whole kernel: a few KB less a
        CTA, so more CTAs may fit an SM (`smem_bytes`; 4 for the float8 default at head_dim 128 with
        `fp8_default_splits`); the epilogue then starts with a warpgroup barrier. Off in every default: not yet
        timed on a GPU (the defaults keep the traced program they were timed with).
      fp8_q_stacked: float8 pools whose q block has N = 8 columns (GQA groups up to 8): the q parts as one
        [fp8_q_terms * 8, D] B operand, so one fp8 MMA a tile reads the K tile from SMEM once (`F8Pages`); off,
        one MMA per part. Ignored for other pools and for N > 8.
      refill_under_pv: float8 pools: issue the ring slot's next copies while the P V MMA runs (between its issue
        and its wait) instead of after it. With V converted into the staging tile, neither ring slot is read
        after the softmax's warpgroup sync, so the copies (one per page piece: 16 a tile for 8-token pages) can
        start a P V MMA earlier and their issue overlaps the MMA. Ignored for other pools (P V reads the V slot).
      fp8_q_kernel: float8 pools: q's scale (`q_scale`), its fp8 split and the parts' layout in one Pallas kernel
        before the attention kernel (pallas_kernels/fp8_q_split.py, bit for bit the same parts and unscales)
        instead of XLA's ops (three kernels on the H200); used where q's 8-row blocks hold whole heads (num_q_heads
        a multiple of 8, the group dividing 8 or a multiple of it). Off in the defaults: not yet timed on a GPU.
      fp8_q_in_kernel: float8 pools: q's scale, fp8 split and layout inside the attention kernel (each CTA splits
        its own 8-row q block after issuing its first K/V copies: `fp8_q_split.split_block_in_kernel`), so no
        kernel runs before it; where `fp8_q_split_takes` and the parts are stacked, else XLA's ops. Bit for bit the
        same parts and unscales. On in the float8 default (`default_swapped_config`): it removes XLA's three
        kernels before the attention kernel and their launch gaps, though every CTA of split-K 2's 2.6 waves
        pays the split.
      out_affine_in_kernel: with the output affine map (`swapped_paged_attention`'s out_scale / out_bias, the DKVC
        fold's s_v and mean anchor a_v) and no split-K, apply it in the kernel's epilogue before the one cast to
        the output dtype, so the call has no XLA kernel after the attention kernel; otherwise (and with split-K
        always) XLA applies it after the kernel (and the split merge), as one fusion. The same fp32 operations in
        the same order. Off in the defaults: with no split-K (one wave of 4 CTAs an SM at 4K) the fold is
        0.64-0.69x the paged kernel's time against split-K 2's 0.57-0.60x (H100, session 36, BENCHMARKS.md).
        With `split_merge_in_kernel` it also applies under split-K.
      split_merge_in_kernel: with split-K, a (sequence, kv head)'s splits run as one cluster; each stores its
        normalised rows and log-sum-exp (as without the flag), and after a cluster barrier the first split merges
        them (`cluster_exchange.merge_attention_splits`: `combine_splits`' fp32 operations) and writes the output in
        its dtype, so no XLA kernel follows the attention kernel's (with `out_affine_in_kernel`, nor for the
        output map). The exchange goes through global memory (L2): the interpreter has no peer SMEM. Off in the
        defaults: on an H200 the fp8 fold with it was no faster than with XLA's merge (BENCHMARKS.md #12 session 37).
      split_first_percent: with split-K, longest-first splits: every sequence's first split covers this percent of
        its tiles (1..99) and the other splits share the rest evenly (`paged_tiles.split_tile_range`), and the grid
        launches every first split before any later one (the split axis outermost), so the long first splits fill
        the first waves and the short ones the tail (with split_merge_in_kernel, whose splits run as one cluster,
        it is set to None). With even splits (None) the hardware runs split-K 2's 1,024 CTAs at 4K as 2.59 waves
        of 3 CTAs an SM, whose last, 0.59-full wave left the SMs idle 11% of the fp8 kernel (H100, ncu, session
        36). The same output up to the merge's rounding (the splits' partials differ). The float8 default
        (`FP8_FIRST_SPLIT_PERCENT`), kept by the entry only where its split-K grid is more than one wave
        (`longest_first_pays`).
    """

    block_kv: int = 128
    num_stages: int = 2
    num_splits: int | None = None
    approx_math: bool = True
    no_auto_barriers: bool = True
    fp8_q_terms: int = 3
    shared_smem: bool = False
    fp8_q_stacked: bool = True
    refill_under_pv: bool = False
    fp8_q_kernel: bool = False
    fp8_q_in_kernel: bool = False
    out_affine_in_kernel: bool = False
    split_merge_in_kernel: bool = False
    split_first_percent: int | None = None

    def __post_init__(self):
        check_tile_pipeline(self.block_kv, self.num_stages, self.num_splits)
        if self.fp8_q_terms not in (1, 2, 3, 4):
            raise ValueError(f"SwappedConfig: fp8_q_terms must be 1..4, got {self.fp8_q_terms}")
        if self.split_first_percent is not None:
            if not isinstance(self.split_first_percent, int) or not 1 <= self.split_first_percent <= 99:
                raise ValueError("SwappedConfig: split_first_percent must be None or an int in 1..99, got "
                                 f"{self.split_first_percent!r}")
            if self.split_merge_in_kernel:     # a cluster's splits start together and wait for each other
                object.__setattr__(self, "split_first_percent", None)

    def smem_bytes(self, head_dim: int, max_pages: int, group: int = 4, out_itemsize: int = 2,
                   pool_dtype=jnp.bfloat16, score_stats: bool = False, merged_itemsize: int = 2,
                   scale_buffers: int = 0) -> int:
        """SMEM of one CTA in bytes, as Pallas sizes it (each allocation rounded up to 1 KB; with shared_smem, two
        run_scoped regions in sequence take the larger) plus the mbarriers (8 bytes each):
          - for the whole kernel: the page-table window (4 bytes an entry; with fp8_q_in_kernel N entries more, q's
            unscales on their way to the column layout: an upper bound where q's rows are padded and XLA splits
            them), q (bf16/f16 [N, D], or fp8_q_terms e4m3 parts [N, D] for float8 pools), the cross-warp
            reduction scratch;
          - the loop: the K and V rings stages * T * D each (itemsize of the pools), float8 pools' f16 V staging
            tile T * D * 2, P [N, T] 16-bit, and `scale_buffers` buffers of stages * (T / 8) 128-byte areas of
            granule scales (1 for `F8PackedGranulePages`);
          - or the epilogue: out [N, D] (out_itemsize: 2 for bf16 q, 4 for fp32 q or split-K), lse [N] f32 and,
            with score_stats, 3 more [N] f32; with split_merge_in_kernel (split-K) also the merge's S partials
            [S, N, D] f32, their lse [S, lse_row_floats(N)] f32, the merged tile [N, D] (merged_itemsize) and the
            bias row [D] f32 (used with an output map), and 2 more mbarriers.
        Without shared_smem the loop's and the epilogue's buffers add up instead. The lowered kernels' resource
        estimate is compared with this in tests/test_swapped_decode_attention.py."""
        n, T, D, S = query_columns(group), self.block_kv, head_dim, self.num_stages
        kb = lambda x: -(-x // 1024) * 1024
        fp8 = jnp.dtype(pool_dtype) == _FP8
        itemsize = jnp.dtype(pool_dtype).itemsize
        q_in_kernel = fp8 and self.fp8_q_in_kernel and self.fp8_q_stacked and n == 8
        window = table_window(max_pages, self.num_splits or 1, T, self.split_first_percent)
        whole = (kb(4 * (window + (n if q_in_kernel else 0)))
                 + kb((self.fp8_q_terms if fp8 else 2) * n * D) + reduction_scratch_bytes(n))
        loop = 2 * kb(S * T * D * itemsize) + (kb(T * D * 2) if fp8 else 0) + kb(n * T * 2)
        if fp8:     # `packed_scale_areas_type`
            loop += scale_buffers * kb(S * (T // GRANULE) * SCALE_AREA * 4)
        epilogue = kb(n * D * out_itemsize) + kb(n * 4) * (4 if score_stats else 1)
        barriers = 8 * (2 + 2 * S * (len(page_classes(T)) + 1))
        splits = self.num_splits or 1
        if self.split_merge_in_kernel and splits > 1:
            epilogue += (kb(splits * n * D * 4) + kb(splits * lse_row_floats(n) * 4) + kb(n * D * merged_itemsize)
                         + kb(D * 4))
            barriers += 16
        return whole + (max(loop, epilogue) if self.shared_smem else loop + epilogue) + barriers

    def ctas_per_sm(self, head_dim: int, max_pages: int, group: int = 4, out_itemsize: int = 2,
                    pool_dtype=jnp.bfloat16, merged_itemsize: int = 2, scale_buffers: int = 0) -> int:
        """CTAs of this config an H200 SM holds by SMEM alone. Registers can bound it lower: the float8 default's
        kernel takes 153 registers a thread (ncu, session 36), which allows 3 CTAs of 128 threads an SM, so
        4 by SMEM (shared_smem) still runs 3."""
        return _SMEM_PER_SM // (self.smem_bytes(head_dim, max_pages, group, out_itemsize, pool_dtype,
                                                merged_itemsize=merged_itemsize, scale_buffers=scale_buffers)
                                + _SMEM_PER_CTA_RESERVED)


# At head_dim 64, contexts up to this many keys take 64-token tiles with 3 stages (`default_swapped_config`).
SHORT_CONTEXT_KEYS = 2048


# float8 pools when the caller gives no num_splits (`fp8_default_splits`): split-K at least this deep, whatever the
# grid size, and deeper until this many CTAs fit an SM.
FP8_MIN_SPLITS = 2
FP8_CTAS_PER_SM = 4
# float8 pools: the first split's share of a sequence's tiles (`SwappedConfig.split_first_percent`) in the default
# config: of 60, 65 and 70 the fastest (BENCHMARKS.md #12 session 38: the Pallas kernel 2.2-4.7% faster than with
# even splits at 4K and 16K; three splits of 50/25/25 took -1.6 to +2.5% against even ones).
FP8_FIRST_SPLIT_PERCENT = 70


def fp8_default_splits(config: SwappedConfig, head_dim: int, max_pages: int, group: int, grid_splits: int,
                       scale_buffers: int = 0) -> int:
    """split-K for float8 pools when the caller gives none: the grid rule's `grid_splits`, at least
    FP8_MIN_SPLITS; with config.shared_smem then doubled (16 at most) until FP8_CTAS_PER_SM CTAs fit an SM by
    SMEM. With half a bf16 tile's bytes, a CTA's chain of MMAs, softmax and V conversion per tile is what bounds
    the fp8 kernel, so more CTAs an SM should pay (session 18's sweep: fewer stages and split-K 2 were the
    fastest; 4 CTAs an SM, which only shared_smem reaches, not yet timed); a deeper split shrinks each CTA's
    page-table window (16K context: k2 holds 3 CTAs, k4 4)."""
    splits = max(grid_splits, FP8_MIN_SPLITS)
    while config.shared_smem and splits < 16 and dataclasses.replace(config, num_splits=splits).ctas_per_sm(
            head_dim, max_pages, group, out_itemsize=4, pool_dtype=_FP8,
            scale_buffers=scale_buffers) < FP8_CTAS_PER_SM:
        splits *= 2
    return splits


def longest_first_pays(config: SwappedConfig, grid_ctas: int, head_dim: int, max_pages: int, group: int,
                       pool_dtype, scale_buffers: int = 0) -> bool:
    """Whether uneven, longest-first splits (`SwappedConfig.split_first_percent`) can shorten a grid of grid_ctas
    CTAs: only where it is more than one wave (by SMEM, `ctas_per_sm`, on NUM_SMS_H100 SMs). In one wave every CTA
    starts at once, so the kernel takes as long as its longest split: even splits are the shortest."""
    return grid_ctas > NUM_SMS_H100 * config.ctas_per_sm(head_dim, max_pages, group, out_itemsize=4,
                                                         pool_dtype=pool_dtype, scale_buffers=scale_buffers)


def default_swapped_config(head_dim: int, max_context: int | None = None, pool_dtype=jnp.bfloat16) -> SwappedConfig:
    """The config when the caller gives none (num_splits from the grid size), from the H200 timings
    (benchmarks/KERNEL_NOTES.md, B=64, Hq=32, Hkv=8, contexts 1K/4K/16K, pages 8/64/mixed, then 1K at every
    page size):
    - head_dim 128: 64-token tiles, 3 stages, the fastest or within 2% of it at every shape timed;
    - head_dim 64: 128-token tiles, 2 stages; but 64-token tiles with 3 stages (4 CTAs an SM) when no sequence
      can pass `SHORT_CONTEXT_KEYS` (max_context, the caller's bound on a row's keys, e.g. the engine's
      --max-context): they are 3-26% faster at 1K (every page size) and 9-38% slower at 4K and 16K, and the
      kernel cannot see a step's longest context when it is traced.
    SMEM bounds the CTAs per SM (`SwappedConfig.ctas_per_sm`): the page-table window counts (without split-K
    it is the sequence's whole table row, 4 bytes a page entry).
    pool_dtype float8_e4m3fn (the fixed-scale fp8 fold) at head_dim 128: 64-token tiles, 2 stages, q in 2 e4m3
    parts, and split-K from `fp8_default_splits` (applied by the entry where num_splits is None): 0.64-0.80x
    the bf16 paged kernel's time at 4K and 16K (pages 16/64/mixed) against 0.78-1.03x for the bf16 default
    tiles with 3 q parts in the same run (benchmarks/fp8_fold_sweep.py, BENCHMARKS.md): with half the bytes a
    tile, a CTA's chain of MMAs, softmax and V conversion bounds it, so more CTAs an SM (the smaller ring,
    split-K's smaller table window) and a shorter chain pay. Still the fastest after session 20's cheaper V
    conversion (0.61-0.66x at 4K against shared SMEM, 3 stages, k1, k4). The ring refilled under the P V MMA
    (`refill_under_pv`): faster than after it in 11 of 12 pairs at 4K and 16K, pages 16/64/mixed (BENCHMARKS.md,
    session 23). q's fp8 split inside the attention kernel (`fp8_q_in_kernel`): the fold's device time 0.557-0.570x
    the paged kernel's at 4K against 0.570-0.608x with XLA's split, and no slower at 16K (H100, session 36,
    BENCHMARKS.md). Longest-first splits (`split_first_percent` = FP8_FIRST_SPLIT_PERCENT; the entry keeps them where
    the split-K grid is more than one wave, `longest_first_pays`): the Pallas kernel 2.2-4.7% faster than with even
    splits at 4K and 16K, pages 16/64/mixed, and the fold 14-17% at batch 32 (1.3 waves) (H100, session 38,
    BENCHMARKS.md). head_dim 64 fp8 was not timed: its bf16 default."""
    if jnp.dtype(pool_dtype) == _FP8 and head_dim == 128:
        return SwappedConfig(block_kv=64, num_stages=2, fp8_q_terms=2, refill_under_pv=True, fp8_q_in_kernel=True,
                             split_first_percent=FP8_FIRST_SPLIT_PERCENT)
    if head_dim == 64:
        if max_context is not None and max_context <= SHORT_CONTEXT_KEYS:
            return SwappedConfig(block_kv=64, num_stages=3)
        return SwappedConfig(block_kv=128, num_stages=2)
    return SwappedConfig(block_kv=64, num_stages=3)


def query_columns(group: int) -> int:
    """N of the MMAs: the q rows a CTA copies (the GQA group rounded up to a multiple of 8; groups of 1, 2
    and 4 share an 8-row block with their neighbours' rows, which are computed and dropped)."""
    return max(8, -(-group // 8) * 8)


def reduction_scratch_bytes(n: int) -> int:
    """SMEM for reducing [T, n] fp32 over its rows across the 4 warps in one round: each thread holds 2
    adjacent columns of every 8, and every (warp, lane) stores them (4 * 32 * 2 * 4 bytes per 8 columns)."""
    return 1024 * (n // 8)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def swapped_paged_attention_reference(q, k_pool, v_pool, lengths, page_starts, page_sizes, *, sm_scale=None,
                                      soft_cap=None, return_score_stats: bool = False, k_scale=None, v_scale=None):
    """Pure-jnp fp32 decode attention with `swapped_paged_attention`'s contract (it is `paged_attention`'s:
    the swap changes how the kernel computes, not what; with k_scale / v_scale [Hkv, S // 8] each key and value
    is its granule's scale times the pool's row). q [B, Hq, D] -> [B, Hq, D] in q.dtype (and score_var [B, Hq]
    float32 with return_score_stats)."""
    if k_scale is None:
        return paged_attention_reference(q, k_pool, v_pool, lengths, page_starts, page_sizes, sm_scale=sm_scale,
                                         soft_cap=soft_cap, return_score_stats=return_score_stats)
    check_granule_scales("swapped_paged_attention_reference", k_pool, k_scale, v_scale)
    t, slot, valid = reference_token_slots(lengths, page_starts, page_sizes, k_pool.shape[1])
    no_anchor = jnp.zeros((k_pool.shape[0], 1, k_pool.shape[2]), jnp.float32)
    k = rebuild_reference(no_anchor, k_scale, k_pool, slot, t)
    v = rebuild_reference(no_anchor, v_scale, v_pool, slot, t)
    return reference_attend(q, k, v, valid, sm_scale=sm_scale, soft_cap=soft_cap,
                            return_score_stats=return_score_stats)


def check_granule_scales(name: str, k_pool, k_scale, v_scale) -> None:
    """The entry checks of per-granule scales: both or neither, float8_e4m3fn pools, [Hkv, S // 8] float32."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError(f"{name}: give k_scale and v_scale together (or neither)")
    if k_scale is None:
        return
    if k_pool.dtype != _FP8:
        raise ValueError(f"{name}: k_scale / v_scale are for float8_e4m3fn pools, got {k_pool.dtype} pools")
    want = (k_pool.shape[0], k_pool.shape[1] // GRANULE)
    for side, x in (("k_scale", k_scale), ("v_scale", v_scale)):
        if x.shape != want or x.dtype != jnp.float32:
            raise ValueError(f"{name}: {side} must be [num_kv_heads, num_slots // {GRANULE}] = {list(want)} float32 "
                             f"(one scale per {GRANULE}-slot granule per kv head), got {list(x.shape)} {x.dtype}")


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def swapped_paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes, *, sm_scale: float | None = None,
                            soft_cap: float | None = None, config: SwappedConfig | None = None,
                            max_context: int | None = None, interpret: bool = False,
                            return_score_stats: bool = False, q_scale: jax.Array | None = None,
                            out_dtype=None, out_scale: jax.Array | None = None, out_bias: jax.Array | None = None,
                            prefetch_weight: jax.Array | None = None, prefetch: L2Prefetch | None = None,
                            k_scale: jax.Array | None = None,
                            v_scale: jax.Array | None = None,
                            packed_scales: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention over a paged KV pool with per-sequence page sizes, keys on WGMMA's M (module docstring).

    Args:
      q: [batch, num_q_heads, head_dim] bf16 or fp32 (rounded to the pools' dtype for the MMA; for float16
        pools |q| is first clipped to F16_SAFE_MAX).
      k_pool, v_pool: [num_kv_heads, num_slots, head_dim] bf16, or both float16 (a DKVC fp16-delta pool on the
        folded mean-anchor path: stratum_jax/attention.py adds the anchor), or both float8_e4m3fn (an fp8-delta
        pool on the same path: with fixed per-head scales the caller scales q and the output; with per-granule
        scales the kernel takes them as k_scale / v_scale); num_slots a multiple of 256.
      lengths: [batch] int32 context length per sequence; 0 gives zeros. Slots past a length may hold NaN.
      page_starts: [batch, max_pages] int32 first slot of each page; entries past a sequence's last page are
        never read.
      page_sizes: [batch] int32, one of PAGE_SIZES per sequence.
      sm_scale: score scale, default 1/sqrt(head_dim).
      soft_cap: if set (> 0), scores become soft_cap * tanh(scores / soft_cap).
      config: SwappedConfig; None gives `default_swapped_config(head_dim, max_context, k_pool.dtype)` with
        split-K from the grid size (float8 pools: `fp8_default_splits`). Where num_splits is None, its
        split_first_percent is kept only for a grid of more than one wave (`longest_first_pays`).
      max_context: a bound on every row's keys (lengths), when the caller has one (the engine's
        --max-context); it only picks the default config.
      interpret: run the kernel in the Mosaic GPU interpreter on CPU (tests).
      return_score_stats: static; also return each query head's score variance (as `paged_attention`).
      q_scale: float8 pools only: [num_q_heads] float32 factors, q head j multiplied by q_scale[j] in fp32
        before its fp8 split (the fixed-scale fold's s_k; with `SwappedConfig.fp8_q_kernel` inside that kernel, with
        `fp8_q_in_kernel` inside the attention kernel).
      out_dtype: the output's dtype (default q.dtype).
      out_scale, out_bias: an affine map of the output per kv head, [num_kv_heads] and [num_kv_heads, head_dim]
        float32 (either may be None: 1 / 0): q head j's output row becomes o_j * out_scale[kv] + out_bias[kv]
        (kv = j // group) in fp32, then is cast to out_dtype once; a sequence of length 0 keeps zeros. The DKVC
        fold's s_v and mean anchor a_v (stratum_jax/attention.py). Applied in the kernel's epilogue where
        `SwappedConfig.out_affine_in_kernel` and there is no split-K, else by XLA after the kernel.
      prefetch_weight, prefetch: the next GEMM's bf16 weight (the o projection's) and an `L2Prefetch` plan of it:
        each CTA, once its keys are streamed, prefetches its share into L2 (pallas_kernels/l2_prefetch.py; no value
        changes); both or neither.
      packed_scales: float8 pools only: [num_kv_heads, num_slots // 8, 4] float32, one scale per 8-slot granule
        per side, granule g's K and V scales at [h, g, 0] and [h, g, 1] (`pack_granule_scales`; the last two
        unused): the key in slot s of kv head h is packed_scales[h, s // 8, 0] * k_pool[h, s], the value likewise
        with [.., 1] (a DKVC fp8-delta cache with per-granule scales on the folded mean-anchor path, as the cache
        stores them: stratum_jax/attention.py adds the anchor with out_bias). Read with one TMA copy a page piece
        at static places (`F8PackedGranulePages`). Scales of granules with no live key may be NaN.
      k_scale, v_scale: instead of packed_scales, both or neither: [num_kv_heads, num_slots // 8] float32, K's and
        V's granule scales as two arrays, packed here (`pack_granule_scales`, an XLA op a call); the same output.

    Returns [batch, num_q_heads, head_dim] in out_dtype; q head j uses kv head j // (num_q_heads // num_kv_heads).
    With return_score_stats: `(out, score_var)`, score_var float32 [batch, num_q_heads], the population
    variance of s_t = sm_scale * q.k_t (soft-capped if set) over the row's keys t < length, 0 for length 0;
    computed from fp32 scores of the bf16-rounded q (the MMA's input; `paged_attention` does the same).
    head_dim 64 or 128; num_q_heads // num_kv_heads <= 64.
    """
    check_pools_and_tables("swapped_paged_attention", q, ("k_pool", k_pool), ("v_pool", v_pool), lengths,
                           page_starts, page_sizes)
    if k_pool.dtype not in (jnp.bfloat16, jnp.float16, _FP8) or v_pool.dtype != k_pool.dtype:
        raise ValueError(f"swapped_paged_attention: k_pool/v_pool must both be bfloat16, both float16 or both "
                         f"float8_e4m3fn, got {k_pool.dtype}/{v_pool.dtype}")
    check_granule_scales("swapped_paged_attention", k_pool, k_scale, v_scale)
    if packed_scales is not None:
        if k_scale is not None or k_pool.dtype != _FP8:
            raise ValueError(f"swapped_paged_attention: packed_scales are for float8_e4m3fn pools without k_scale / "
                             f"v_scale; got {k_pool.dtype} pools" + (" and k_scale / v_scale" if k_scale is not None
                                                                      else ""))
        check_packed_scales("swapped_paged_attention", k_pool, packed_scales)
    scale_buffers = int(k_scale is not None or packed_scales is not None)     # one packed buffer
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    if head_dim not in (64, 128):
        raise ValueError(f"swapped_paged_attention: head_dim must be 64 or 128, got {head_dim}")
    group = num_q_heads // num_kv_heads
    if group > 64:
        raise ValueError(f"swapped_paged_attention: num_q_heads // num_kv_heads = {group} > 64 is not supported")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"swapped_paged_attention: sm_scale must be > 0, got {sm_scale}")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"swapped_paged_attention: soft_cap must be > 0, got {soft_cap}")
    if q_scale is not None and (k_pool.dtype != _FP8 or q_scale.shape != (num_q_heads,)
                                or q_scale.dtype != jnp.float32):
        raise ValueError(f"swapped_paged_attention: q_scale is for float8 pools, as [num_q_heads] = [{num_q_heads}] "
                         f"float32; got {q_scale.shape} {q_scale.dtype} with {k_pool.dtype} pools")
    for name, x, shape in (("out_scale", out_scale, (num_kv_heads,)), ("out_bias", out_bias, (num_kv_heads, head_dim))):
        if x is not None and (x.shape != shape or x.dtype != jnp.float32):
            raise ValueError(f"swapped_paged_attention: {name} must be {list(shape)} float32 (per kv head), got "
                             f"{list(x.shape)} {x.dtype}")
    config = config or default_swapped_config(head_dim, max_context, k_pool.dtype)
    if not isinstance(config, SwappedConfig):
        raise TypeError(f"swapped_paged_attention: config must be a SwappedConfig, got {type(config).__name__}")
    if config.num_splits is None:
        splits = default_num_splits(batch, num_kv_heads)
        if k_pool.dtype == _FP8:
            splits = fp8_default_splits(config, head_dim, page_starts.shape[1], group, splits, scale_buffers)
        config = dataclasses.replace(config, num_splits=splits)
        if config.split_first_percent is not None and not longest_first_pays(
                config, batch * num_kv_heads * splits, head_dim, page_starts.shape[1], group, k_pool.dtype,
                scale_buffers):
            config = dataclasses.replace(config, split_first_percent=None)
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    args = (q, k_pool, v_pool, lengths, page_starts, page_sizes)
    kw = dict(scale=scale, config=config)
    # Only a set option reaches the jit: with all off its static arguments (and so its trace) are as before.
    if soft_cap is not None:
        kw["soft_cap"] = float(soft_cap)
    if return_score_stats:
        kw["score_stats"] = True
    if q_scale is not None:
        kw["q_scale"] = q_scale
    if out_dtype is not None and jnp.dtype(out_dtype) != q.dtype:
        kw["out_dtype"] = jnp.dtype(out_dtype)
    if out_scale is not None or out_bias is not None:
        kw["out_affine"] = (out_scale, out_bias)
    check_prefetch_args("swapped_paged_attention", prefetch_weight, prefetch)
    if prefetch is not None:
        kw.update(prefetch_weight=prefetch_weight, prefetch=prefetch)
    if scale_buffers:
        kw["packed_scales"] = kernel_scales(k_scale, v_scale, packed_scales)
    if interpret:
        with mosaic_gpu_interpret():
            return _swapped_paged_attention(*args, **kw, interpreted=True)
    # `interpreted` is a static jit argument so interpreted and compiled traces never share a cache entry.
    return _swapped_paged_attention(*args, **kw, interpreted=interpret_mode_active())


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpreted", "soft_cap", "score_stats",
                                             "out_dtype", "prefetch"))
def _swapped_paged_attention(q, k_pool, v_pool, lengths, page_starts, page_sizes, *, scale, config, interpreted,
                             soft_cap=None, score_stats=False, q_scale=None, out_dtype=None, out_affine=None,
                             prefetch_weight=None, prefetch=None, packed_scales=None):
    """The wrapper traced inside a jit: q row blocks (float8 pools: q's fp8 parts), flat page table, the kernel,
    split-K merge (of the output and, with score_stats, of the score sums), the output's affine map out_affine =
    (scale [Hkv] or None, bias [Hkv, D] or None) where the kernel does not apply it. packed_scales: float8 pools'
    granule scales [Hkv, S // 8 * 4] f32 (`F8PackedGranulePages`), or None. Returns out [B, Hq, D] in
    out_dtype (default q.dtype) (and score_var [B, Hq] f32)."""
    del interpreted
    out_dtype = q.dtype if out_dtype is None else out_dtype
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    group = num_q_heads // num_kv_heads
    splits = config.num_splits
    merge_in_kernel = splits > 1 and config.split_merge_in_kernel
    affine_in_kernel = out_affine is not None and (splits == 1 or merge_in_kernel) and config.out_affine_in_kernel
    if affine_in_kernel:
        out_scale, out_bias = out_affine
        extra_after_q = (jnp.ones((num_kv_heads,), jnp.float32) if out_scale is None else out_scale,
                         jnp.zeros((num_kv_heads, head_dim), jnp.float32) if out_bias is None else out_bias)
    else:
        extra_after_q = ()
    # The kernel rounds to out_dtype itself only where nothing follows it in fp32 (a split merge or XLA's affine).
    kernel_out_dtype = (out_dtype if (splits == 1 or merge_in_kernel) and (out_affine is None or affine_in_kernel)
                        else jnp.float32)
    kv_format = {jnp.dtype(jnp.float16): F16_PAGES, _FP8: F8_PAGES}.get(jnp.dtype(k_pool.dtype), BF16_PAGES)
    if packed_scales is not None:
        kv_format = F8_PACKED_GRANULE_PAGES
    mma_dtype = jnp.dtype(kv_format.mma_dtype)
    extra = ()
    q_in_kernel = False
    if isinstance(kv_format, F8Pages):     # q as fp8 parts and a per-row unscale (F8Pages)
        q_rows, rows_per_b, rows_per_h, copy_rows = q_row_blocks(q, num_kv_heads)
        stacked = stacks_q_parts(config, copy_rows)
        takes = fp8_q_split_takes(q_rows, rows_per_b, num_q_heads)
        q_in_kernel = config.fp8_q_in_kernel and stacked and takes
        head_scale = lambda: jnp.ones((num_q_heads,), jnp.float32) if q_scale is None else q_scale
        if q_in_kernel:     # raw q rows, and the per-head scale in the unscales' input slot (`fp8_q_in_kernel`)
            q2, extra = q_rows, (head_scale(),)
        elif config.fp8_q_kernel and takes:
            q2, q_unscale = fp8_q_split(q_rows, head_scale(), terms=config.fp8_q_terms, stacked=stacked)
            extra = (q_unscale,)
        else:     # XLA's ops: q in fp32 times its head's scale, laid out in the same row blocks, then split
            q32 = q.astype(jnp.float32) if q_scale is None else q.astype(jnp.float32) * q_scale[None, :, None]
            q2, q_unscale = split_rows_fp8(q_row_blocks(q32, num_kv_heads)[0], config.fp8_q_terms)
            if stacked:
                q2 = stack_q_parts(q2)
            extra = (q_unscale,)
    else:
        q_mma = jnp.clip(q, -F16_SAFE_MAX, F16_SAFE_MAX) if mma_dtype == jnp.float16 else q
        q2, rows_per_b, rows_per_h, copy_rows = q_row_blocks(q_mma.astype(mma_dtype), num_kv_heads)
    max_pages = page_starts.shape[1]
    table = flat_table(page_starts, splits, config.block_kv, config.split_first_percent)
    kernel = _build_swapped_kernel(
        batch=batch, num_kv_heads=num_kv_heads, head_dim=head_dim, group=group, max_pages=max_pages,
        table_len=table.shape[0], rows_per_b=rows_per_b, rows_per_h=rows_per_h, n_cols=copy_rows,
        out_dtype=jnp.dtype(kernel_out_dtype), scale=scale, soft_cap=soft_cap,
        score_stats=score_stats, config=config, kv_format=kv_format, prefetch=prefetch,
        out_affine=affine_in_kernel, q_split_in_kernel=q_in_kernel, num_q_heads=num_q_heads,
        merge_in_kernel=merge_in_kernel)
    scale_inputs = () if packed_scales is None else (packed_scales,)
    res = kernel(lengths, page_sizes, table, q2, k_pool, v_pool, *scale_inputs, *extra, *extra_after_q,
                 *(() if prefetch is None else (prefetch_weight,)))

    def group_cols(x):
        """[B * S, Hkv, N] column vectors (lse, score sums) -> the group's [B, S, Hkv, G]: its columns start at
        its first q row's offset in the 8-row block."""
        first_row = np.arange(batch)[:, None] * rows_per_b + np.arange(num_kv_heads)[None, :] * rows_per_h
        cols = (first_row % 8)[:, None, :, None] + np.arange(group)[None, None, None, :]          # [B, 1, Hkv, G]
        return jnp.take_along_axis(x.reshape(batch, splits, num_kv_heads, copy_rows),
                                   jnp.asarray(np.broadcast_to(cols, (batch, splits, num_kv_heads, group))), axis=3)

    if score_stats:
        res, stats = res[:-3], res[-3:]
        n = split_key_counts(lengths, page_sizes, max_pages=max_pages, block_kv=config.block_kv, splits=splits,
                             first_split_percent=config.split_first_percent)
        score_var = score_variance_from_partials(*(group_cols(x) for x in stats), n[:, :, None, None])
        score_var = score_var.reshape(batch, num_q_heads)
    if splits == 1 or merge_in_kernel:     # (merged: res[1:3] are the splits' rows and lse, the kernel's exchange)
        out = res[0].reshape(batch, num_kv_heads, rows_per_h, head_dim)[:, :, :group]
        out = out.reshape(batch, num_q_heads, head_dim)
    else:
        o_part, lse = res
        o_part = o_part.reshape(batch, splits, num_kv_heads, rows_per_h, head_dim)[:, :, :, :group]
        out = combine_splits(o_part, group_cols(lse)).reshape(batch, num_q_heads, head_dim)
    if out_affine is not None and not affine_in_kernel:
        out = apply_out_affine(out, lengths > 0, *out_affine)
    out = out.astype(out_dtype)
    return (out, score_var) if score_stats else out


def apply_out_affine(out, has_keys, out_scale, out_bias):
    """out [rows, ..., Hq, D] -> out * out_scale + out_bias per kv head in f32 (`swapped_paged_attention`'s out_scale
    [Hkv], out_bias [Hkv, D], either None; q head j takes kv head j // group), the bias only on rows with keys
    (has_keys [rows] bool: a row with none stays zeros, as the kernels give). Returns f32."""
    group = out.shape[-2] // (out_scale if out_bias is None else out_bias).shape[0]
    out = out.astype(jnp.float32)
    if out_scale is not None:
        out = out * jnp.repeat(out_scale.astype(jnp.float32), group)[:, None]
    if out_bias is not None:
        mask = has_keys.reshape(has_keys.shape + (1,) * (out.ndim - 1))
        out = out + jnp.where(mask, jnp.repeat(out_bias.astype(jnp.float32), group, axis=0), 0.0)
    return out


# ---------------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------------

def _build_swapped_kernel(*, batch, num_kv_heads, head_dim, group, max_pages, table_len, rows_per_b, rows_per_h,
                          n_cols, out_dtype, scale, config: SwappedConfig, soft_cap=None, score_stats=False,
                          kv_format=BF16_PAGES, prefetch: L2Prefetch | None = None, out_affine: bool = False,
                          q_split_in_kernel: bool = False, num_q_heads: int | None = None,
                          merge_in_kernel: bool = False):
    """Returns f(lengths, page_sizes, table, q2, k_pool, v_pool) -> (o,) or, split, (o_part, lse) (merged in the
    kernel: (o, o_part, lse), o_part and lse the exchange buffers of `SwappedConfig.split_merge_in_kernel`), followed by
    (shift, sum, sum of squares) [B * S, Hkv, n_cols] f32 score-stat columns when score_stats. prefetch: f takes the
    next GEMM's weight as its last input, and each CTA prefetches its share of the plan after its last tile.
    out_affine (no split-K, or merge_in_kernel): f takes out_scale [Hkv] and out_bias [Hkv, D] f32 after q's inputs,
    and each output row is o * out_scale[h] + out_bias[h] (the bias only where the sequence has keys) before the
    cast. out_dtype: o's dtype (o_part is f32).
    q_split_in_kernel (F8_PAGES, stacked q, unpadded rows: `fp8_q_split_takes`): q2 is the raw q rows [rows, D]
    (bf16 or f32) and the input after the pools is the per-q-head scale [num_q_heads] f32 instead of the
    unscales; each CTA splits its block into the q tile after issuing its first K/V copies.

    kv_format: BF16_PAGES, F16_PAGES for float16 pools, or F8_PAGES for float8_e4m3fn pools (then q2 is
    [fp8_q_terms, rows, D] e4m3 parts, or with `stacks_q_parts` [rows * fp8_q_terms, D] (`stack_q_parts`), and a
    last input q_unscale [rows] f32, `split_rows_fp8`); the MMA tiles
    and P are in its mma_dtype.
    q2 [rows, D] (`q_row_blocks`): the CTA (b, h[, k]) copies the 8-aligned block of n_cols rows holding
    row q_row = b * rows_per_b + h * rows_per_h and writes its group's `group` output rows to o [rows, D] at
    q_row (split: o_part [B * S * rows_per_b, D] f32 at (b * S + k) * rows_per_b + h * rows_per_h, and lse
    [B * S, Hkv, n_cols] f32, the base-2 log-sum-exp of every column, -inf for an empty split)."""
    T, D, N = config.block_kv, head_dim, n_cols
    stages, splits = config.num_stages, config.num_splits
    window = table_window(max_pages, splits, T, config.split_first_percent)
    small_classes = page_classes(T)                                   # (log2 P, copies) for P < T
    # per page piece `copies_per_side` copies on the K and the V barrier (the rows; with granule scales theirs too)
    arrivals = [[n * c for _, n in small_classes] + [c] for c in kv_format.copies_per_side]     # K, V
    qk_scale = scale * _LOG2E                                         # exp2 below
    wgmma_layout = plgpu.Layout.WGMMA
    mma_dtype = jnp.dtype(kv_format.mma_dtype)

    def cols(x, shape):
        """A [N] column vector broadcast along the rows of a [rows, N] tile."""
        return lax.broadcast_in_dim(x, shape, [1])

    fp8_scores = isinstance(kv_format, F8Pages)       # q parts [terms, rows, D] e4m3 + q_unscale [rows] f32
    # + packed granule scales [Hkv, S // 8 * 4] f32 after the pools
    granule_scales = isinstance(kv_format, F8PackedGranulePages)
    q_stacked = fp8_scores and stacks_q_parts(config, N)     # ... or [rows * terms, D] (`stack_q_parts`)
    terms = config.fp8_q_terms
    if merge_in_kernel and splits == 1:
        raise ValueError("merge_in_kernel needs split-K (num_splits > 1)")
    if out_affine and splits != 1 and not merge_in_kernel:
        raise ValueError("out_affine in the kernel needs num_splits == 1 or the split merge in the kernel")
    part_dtype = out_dtype if splits == 1 else jnp.float32    # what each CTA stores: the output, or its split's rows
    if q_split_in_kernel and not (q_stacked and num_q_heads is not None and num_q_heads % 8 == 0):
        raise ValueError("q's split in the kernel needs float8 pools, stacked q parts and num_q_heads % 8 == 0")
    loop_types = [kv_format.scratch_types(stages=stages, block_kv=T, head_dim=D),
                  plgpu.SMEM((N, T), mma_dtype, transforms=MMA_TRANSFORMS)]
    epilogue_types = [plgpu.SMEM((N, D), part_dtype), plgpu.SMEM((N,), jnp.float32)]
    if score_stats:     # c, sum, sum of squares
        epilogue_types += [plgpu.SMEM((N,), jnp.float32) for _ in range(3)]
    if merge_in_kernel:     # the splits' rows and lse, the merged tile, the bias row (used with out_affine)
        epilogue_types += [plgpu.SMEM((splits, N, D), jnp.float32),
                           plgpu.SMEM((splits, lse_row_floats(N)), jnp.float32),
                           plgpu.SMEM((N, D), out_dtype), plgpu.SMEM((D,), jnp.float32)]
    merge_barriers = [plgpu.ClusterBarrier(collective_axes=("k",), num_arrivals=1),
                      plgpu.Barrier(num_arrivals=2 * splits + bool(out_affine))] if merge_in_kernel else []

    def body(lengths_ref, psizes_ref, table_ref, q_ref, k_ref, v_ref, *rest):
        q_unscale_ref = next_weight_ref = None
        scale_refs = ()
        if granule_scales:
            scale_refs, rest = rest[:kv_format.num_inputs - 2], rest[kv_format.num_inputs - 2:]
        if fp8_scores:
            q_unscale_ref, rest = rest[0], rest[1:]
        if out_affine:
            (out_scale_ref, out_bias_ref), rest = rest[:2], rest[2:]
        if prefetch is not None:
            next_weight_ref, rest = rest[0], rest[1:]
        merged_ref = None
        if splits == 1:
            (o_ref,), rest = rest[:1], rest[1:]
            lse_ref = None
        elif merge_in_kernel:
            (merged_ref, o_ref, lse_ref), rest = rest[:3], rest[3:]
        else:
            (o_ref, lse_ref), rest = rest[:2], rest[2:]
        if score_stats:
            stat_refs, rest = rest[:3], rest[3:]
        if merge_in_kernel:
            rest, merge_bars = rest[:-2], rest[-2:]
        if config.shared_smem:
            table_smem, q_smem, meta_bar, k_bars, v_bars = rest
        else:
            table_smem, q_smem, kv_smem, p_smem, o_smem, lse_smem, meta_bar, k_bars, v_bars, *tail_smem = rest
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        k_split = lax.axis_index("k") if splits > 1 else 0

        # --- per-sequence scalars and this CTA's tiles ------------------------------------------
        log2_p, page, length, n_pages, n_tiles = sequence_scalars(psizes_ref[b], lengths_ref[b],
                                                                  max_pages=max_pages, block_kv=T)
        tile_lo, tile_hi = split_tile_range(n_tiles, k_split, splits, config.split_first_percent)
        num_steps = tile_hi - tile_lo

        # --- page-table window and q rows -> SMEM ------------------------------------------------
        win_start = table_window_start(b, tile_lo, log2_p, max_pages=max_pages, block_kv=T, table_len=table_len,
                                       window=window)
        plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(win_start, window)],
                                table_smem.at[pl.ds(0, window)] if q_split_in_kernel else table_smem, meta_bar.at[0],
                                oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
        q_row = b * rows_per_b + h * rows_per_h
        q_row0 = pl.multiple_of(q_row - lax.rem(q_row, 8), 8)       # tiled TMA wants 8-row alignment
        row_off = q_row - q_row0                                      # the group's first column in S^T
        if q_split_in_kernel:      # split after the first K/V copies are issued (in pipeline below)
            q_unscale = None
        elif fp8_scores:
            if q_stacked:
                plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row0 * terms, terms * N)], q_smem, meta_bar.at[1])
            else:
                plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(q_row0, N)], q_smem, meta_bar.at[1])
            # S^T's column j is in units of q row j's power-of-two scale (`split_rows_fp8`).
            q_unscale = cols(plgpu.load(q_unscale_ref.at[pl.ds(q_row0, N)], layout=_COL_LAYOUT, optimized=False),
                             (T, N))
        else:
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q_row0, N)], q_smem, meta_bar.at[1])
        plgpu.barrier_wait(meta_bar.at[0])

        # The K/V ring, the staging tile and P live only through the loop, and the epilogue's output tiles only
        # after it. With shared_smem they are two run_scoped regions in sequence, which share their SMEM (Pallas
        # takes the larger): a CTA needs the loop's bytes, not both (`SwappedConfig.smem_bytes`).
        def pipeline(kv_smem, p_smem):
            nonlocal q_unscale
            # staging: F8Pages' f16 V tile, else none; scale_areas: F8PackedGranulePages' scale buffer
            kv_smem, staging, scale_areas = kv_smem[:2], kv_smem[2:3], kv_smem[3:]

            def page_entry(p):   # slot of page p of this sequence (p inside this CTA's window)
                return table_smem[b * max_pages + p - win_start]

            def wait(bars, slot):
                wait_page_class(bars, slot, log2_p, small_classes, T)

            ctx = TileContext(h=h, inputs=(k_ref, v_ref, *scale_refs), smem=(*kv_smem, *scale_areas), block_kv=T,
                              head_dim=D, log2_p=log2_p,
                              n_pages=n_pages, page_entry=page_entry, small_classes=tuple(small_classes),
                              wait_k=functools.partial(wait, k_bars), wait_v=functools.partial(wait, v_bars))

            def fetch(tile, slot):
                issue_tile_copies(
                    tile * T, log2_p=log2_p, page=page, n_pages=n_pages, page_entry=page_entry,
                    small_classes=small_classes, block_kv=T,
                    piece=lambda gi, src, off, size: kv_format.fetch_page(
                        ctx, src, off, size, slot, k_bars[gi].at[slot], v_bars[gi].at[slot]))

            # --- one tile: S^T, column softmax, O^T += V^T P^T ----------------------------------------
            def attend(carry, slot, tile, n_valid, refill_under_pv=None):
                """carry: acc [D, N] f32 (O^T, unnormalised), m [N] f32 column max (base 2), l [T, N] f32
                per-row partial column sums (with score_stats also the shift c [N] and the per-row partial sums
                of (s - c) and (s - c)^2, [T, N] each). K is awaited before S^T, V only before P V (its copy may
                still land while S^T and the softmax run). refill_under_pv: issues the ring slot's next copies
                (`SwappedConfig.refill_under_pv`, staging formats only), called while the P V MMA runs. tile: the
                sequence's tile index (where granule scales sit in the slot's scale buffers)."""
                acc, m_i, l_tile, *stats = carry
                k_ring, v_ring = kv_smem
                k_tile, v_tile = k_ring.at[slot], v_ring.at[slot]
                ctx.wait_k(slot)

                def qk(acc_ref):
                    if q_stacked:      # one fp8 MMA on the K ring slot: column block t of the result is part t's
                        plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
                    elif fp8_scores:     # fp8 MMAs on the K ring slot, one per q part, into one accumulator
                        for t in range(terms):
                            plgpu.wgmma(acc_ref, k_tile, q_smem.at[t].transpose((1, 0)))
                    else:
                        plgpu.wgmma(acc_ref, k_tile, q_smem.transpose((1, 0)))
                    if staging:     # while the MMAs run: fp8 V rows -> the f16 tile the P V MMA reads, rows past
                        ctx.wait_v(slot)        # the length as zeros.
                        if granule_scales:
                            # Both sides' scales have landed (wait_k, wait_v): their [T] vectors are built here,
                            # under the MMAs and before the conversion (faster than after it: BENCHMARKS.md #12
                            # session 40).
                            key = kv_format.key_scales(ctx, slot, tile, n_valid)
                        # The last tile's P V MMA read this staging tile, and a warp's wgmma wait covers only its
                        # own share: without a warpgroup barrier here a warp that is ahead overwrites V rows
                        # another warp's MMA still reads (nothing else syncs the warps between that MMA and this
                        # store; the bf16 path's stores come after the softmax's cross-warp max, which does).
                        # (Two staging tiles by tile parity need no barrier, but were no faster: session 20's sweep.)
                        plgpu.commit_smem()
                        # Only a sequence's last tile has rows past its length: the other tiles skip the mask's
                        # selects. Wide (4-byte) loads: half the SMEM loads, plus a shuffle per 4 elements.
                        # Together 4-8% off the kernel's time on the H200 (BENCHMARKS.md, session 20).
                        convert = functools.partial(convert_to_f16, v_ring.at[slot], staging[0], wide_loads=True)
                        pl.when(n_valid >= T)(lambda: convert())
                        pl.when(n_valid < T)(lambda: convert(valid_rows=n_valid))
                    if granule_scales:
                        return acc_ref[...], (key.score_scale, key.value_scale, key.log2_value_scale)
                    return acc_ref[...], None
                s, key_scales = pl.run_scoped(qk, plgpu.ACC((T, N * terms if q_stacked else N), jnp.float32))
                if q_stacked:   # the parts' column blocks, added in registers (WGMMA tiles are 8 columns wide)
                    s = sum((s[:, t * N:(t + 1) * N] for t in range(1, terms)), s[:, :N])
                if fp8_scores:
                    s = s * q_unscale
                if key_scales is not None:    # [T] per-key factors (the granule formats): on S^T's rows
                    k_scale, v_scale, log2_v_scale = (lax.broadcast_in_dim(x, s.shape, [0]) for x in key_scales)
                    s = s * k_scale
                if soft_cap is None:
                    s = s * qk_scale
                else:   # cap in natural units, then to base 2 (exp2 below)
                    s = jnp.tanh(s * (scale / soft_cap)) * (soft_cap * _LOG2E)
                # Keys past the length (stale slots, maybe NaN) drop out; every tile has >= 1 valid key, so
                # every column's max is finite.
                rows = plgpu.broadcasted_iota(jnp.int32, (T, N), 0, layout=wgmma_layout)
                valid = rows < n_valid
                s = jnp.where(valid, s, -jnp.inf)
                if key_scales is None:
                    m_new = jnp.maximum(m_i, s.max(axis=0))
                else:       # the max of s + log2(V scale): P * v_scale below is <= 1, its largest entry 1
                    m_new = jnp.maximum(m_i, (s + log2_v_scale).max(axis=0))
                if score_stats:
                    stats = accumulate_stats(stats, s, valid, m_i, m_new)
                alpha = jnp.exp2(m_i - m_new)                              # 0 on the first tile (m_i = -inf)
                p = jnp.exp2(s - cols(m_new, s.shape))
                l_tile = l_tile * cols(alpha, s.shape) + p
                # P^T leaves registers transposed (stmatrix.trans) into P [N, T]; WGMMA reads it back as the
                # K-major B operand P^T. Every warp's store must land before the MMA reads: commit_smem is a
                # proxy fence plus a warpgroup barrier.
                p_smem.transpose((1, 0))[...] = (p if key_scales is None else p * v_scale).astype(mma_dtype)
                if staging:      # V was converted while S^T's MMAs ran
                    v_tile = staging[0]
                else:
                    ctx.wait_v(slot)
                    # P is 0 there, but 0 * NaN (a stale slot) = NaN in the MMA
                    zero_rows_past(v_ring, slot, n_valid)
                plgpu.commit_smem()

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, v_tile.transpose((1, 0)), p_smem.transpose((1, 0)))
                    if refill_under_pv is not None:
                        # The ring slot is free: every warp's S^T MMA was awaited and its V rows converted
                        # before the warpgroup sync above (commit_smem: also the proxy fence TMA's writes need).
                        refill_under_pv()
                    return acc_ref[...]
                acc = acc * cols(alpha, acc.shape) + pl.run_scoped(pv, plgpu.ACC((D, N), jnp.float32))
                return acc, m_new, l_tile, *stats

            def accumulate_stats(stats, s, valid, m_i, m_new):
                """Adds one tile's scores to the score sums. s [T, N] f32 (base 2, -inf where not valid), valid
                [T, N] bool, m_i / m_new [N] the column max before / after this tile. Returns (c [N], s1 [T, N],
                s2 [T, N]): elementwise sums, so no cross-warp reduction per tile (reduced once, after the loop)."""
                c_i, s1_tile, s2_tile = stats
                # The shift is fixed at the first tile's column max (m_i = -inf only before it): every later
                # tile adds to sums taken about the same c, so they need no rescaling.
                c_i = jnp.where(m_i == -jnp.inf, m_new, c_i)
                # Masked keys add exactly 0 (s is -inf there: the mask above already replaced any stale NaN).
                d = jnp.where(valid, s - cols(c_i, s.shape), 0.0)
                return c_i, s1_tile + d, s2_tile + d * d

            # --- pipeline -----------------------------------------------------------------------------
            for s_ in range(stages):
                pl.when(s_ < num_steps)(functools.partial(fetch, tile_lo + s_, s_))
            if q_split_in_kernel:   # while the first tiles land (lesson 6: never in front of their copies)
                head0 = pl.multiple_of(lax.rem(q_row0, num_q_heads), 8)
                q_unscale = cols(split_block_in_kernel(
                    q_ref.at[pl.ds(q_row0, N)], q_unscale_ref.at[pl.ds(head0, N)], q_smem,
                    table_smem.at[pl.ds(window, N)], terms=terms), (T, N))
            else:
                plgpu.barrier_wait(meta_bar.at[1])

            refill_early = config.refill_under_pv and bool(staging)

            def step(i, carry):
                slot = lax.rem(i, stages)
                tile = tile_lo + i
                n_valid = length - tile * T

                def refill(sync: bool):
                    @pl.when(i + stages < num_steps)
                    def _():
                        if sync:
                            plgpu.commit_smem()
                        fetch(tile + stages, slot)
                if refill_early:    # attend() has synced the warpgroup before its P V MMA
                    return attend(carry, slot, tile, n_valid, functools.partial(refill, False))
                carry = attend(carry, slot, tile, n_valid)
                # attend() awaited its WGMMAs (each warp its share), so after one warpgroup sync the slot is free.
                refill(config.no_auto_barriers)
                return carry

            acc0 = plgpu.layout_cast(jnp.zeros((D, N), jnp.float32), wgmma_layout)
            m0 = plgpu.layout_cast(jnp.full((N,), -jnp.inf, jnp.float32), _COL_LAYOUT)
            l0 = plgpu.layout_cast(jnp.zeros((T, N), jnp.float32), wgmma_layout)
            stats0 = ()
            if score_stats:   # an empty split keeps c = 0 and zero sums; the wrapper gives it no keys
                stats0 = (plgpu.layout_cast(jnp.zeros((N,), jnp.float32), _COL_LAYOUT), l0, l0)
            return lax.fori_loop(0, num_steps, step, (acc0, m0, l0, *stats0))

        if config.shared_smem:
            acc, m_i, l_tile, *stats = pl.run_scoped(pipeline, *loop_types)
        else:
            acc, m_i, l_tile, *stats = pipeline(kv_smem, p_smem)

        # --- epilogue: normalise, write the group's rows -----------------------------------------
        if prefetch is not None:      # this CTA's tiles are all in: HBM can start on the next GEMM's weight
            issue_prefetch(next_weight_ref, prefetch, cta=(b * num_kv_heads + h) * splits + k_split,
                           num_ctas=batch * num_kv_heads * splits)
        l_i = l_tile.sum(axis=0)
        o = acc / cols(jnp.where(l_i == 0.0, 1.0, l_i), acc.shape)    # an empty row (or split) gives zeros
        if out_affine and not merge_in_kernel:     # (merged: applied after the merge)
            # This kv head's scale and bias (the fold's s_v and a_v: one per CTA, whatever the column; the
            # neighbouring group's columns are dropped below). O^T's rows are the head dim, so the bias is a row
            # vector; a sequence with no keys keeps its zeros (its bias times 0).
            bias = plgpu.load(out_bias_ref.at[h], layout=_ROW_LAYOUT, optimized=False)
            bias = bias * jnp.where(length > 0, 1.0, 0.0).astype(jnp.float32)
            o = o * out_scale_ref[h] + lax.broadcast_in_dim(bias, acc.shape, [0])

        def epilogue(o_smem, lse_smem, *tail_smem):
            stat_smem, merge_smem = tail_smem[:3 if score_stats else 0], tail_smem[3 if score_stats else 0:]
            if config.shared_smem:
                # These tiles reuse the loop's SMEM: every warp's last MMA must be done reading it before any
                # warp writes here (a warp's wgmma wait covers only its own share).
                plgpu.commit_smem()
            # O^T leaves registers transposed into the [N, D] output tile (the WGMMA_TRANSPOSED register layout
            # makes the f32 store transferable), so the TMA below writes q-head rows of the output.
            o_smem.transpose((1, 0))[...] = plgpu.layout_cast(o.astype(part_dtype), plgpu.Layout.WGMMA_TRANSPOSED)
            if lse_ref is not None:
                lse_smem[...] = m_i + jnp.log2(l_i)                       # -inf for an empty split
            if score_stats:
                c_i, s1_tile, s2_tile = stats
                for ref, val in zip(stat_smem, (c_i, s1_tile.sum(axis=0), s2_tile.sum(axis=0))):
                    ref[...] = val
            plgpu.commit_smem()
            out_row = q_row if splits == 1 else (b * splits + k_split) * rows_per_b + h * rows_per_h
            plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(row_off, group)], o_ref.at[pl.ds(out_row, group)])
            if lse_ref is not None:
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b * splits + k_split, h])
            if score_stats:
                for src, dst in zip(stat_smem, stat_refs):
                    plgpu.copy_smem_to_gmem(src, dst.at[b * splits + k_split, h])
            plgpu.wait_smem_to_gmem(0)
            if merge_in_kernel:
                part_smem, lse_in_smem, merged_smem, bias_smem = merge_smem
                merge_attention_splits(
                    parts_gmem=o_ref, lse_gmem=lse_ref, out_gmem=merged_ref,
                    part_rows=[(b * splits + s_) * rows_per_b + h * rows_per_h for s_ in range(splits)],
                    lse_blocks=[(b * splits + s_, h) for s_ in range(splits)], out_row=q_row, col0=row_off,
                    group=group, is_first=k_split == 0, part_smem=part_smem, lse_smem=lse_in_smem,
                    out_smem=merged_smem, cluster_barrier=merge_bars[0], load_barrier=merge_bars[1],
                    out_scale=out_scale_ref[h] if out_affine else None,
                    bias_gmem=out_bias_ref.at[h] if out_affine else None,
                    bias_smem=bias_smem, has_keys=length > 0)

        if config.shared_smem:
            pl.run_scoped(epilogue, *epilogue_types)
        else:
            epilogue(o_smem, lse_smem, *tail_smem)

    out_type = [jax.ShapeDtypeStruct((batch * rows_per_b * splits, D), part_dtype)]
    if merge_in_kernel:
        out_type.insert(0, jax.ShapeDtypeStruct((batch * rows_per_b, D), out_dtype))
    if splits > 1:
        out_type.append(jax.ShapeDtypeStruct((batch * splits, num_kv_heads, N), jnp.float32))
    if score_stats:
        out_type += [jax.ShapeDtypeStruct((batch * splits, num_kv_heads, N), jnp.float32)] * 3
    table_and_q = [
        # q_split_in_kernel: 8 more entries hold the block's unscales (f32 bits) on their way to the column layout
        plgpu.SMEM((window + (N if q_split_in_kernel else 0),), jnp.int32),
        kv_format.q_smem_type(terms, N, D, stacked=q_stacked) if fp8_scores
        else plgpu.SMEM((N, D), mma_dtype, transforms=MMA_TRANSFORMS)]
    barriers = [
        plgpu.Barrier(num_barriers=2),
        [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in arrivals[0]],
        [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in arrivals[1]],
    ]
    if config.shared_smem:
        scratch = table_and_q + barriers + merge_barriers
    else:     # the order the kernel had before shared_smem (its traced program unchanged)
        scratch = table_and_q + loop_types + epilogue_types[:2] + barriers + epilogue_types[2:] + merge_barriers
    grid, names = (batch, num_kv_heads), ("b", "h")
    cluster = {}
    if merge_in_kernel:     # a (sequence, kv head)'s splits: one cluster
        cluster = dict(cluster=(splits,), cluster_names=("k",))
    elif splits > 1 and config.split_first_percent is not None:    # the split axis outermost: launched last
        grid, names = (splits, batch, num_kv_heads), ("k", "b", "h")
    elif splits > 1:
        grid, names = (batch, num_kv_heads, splits), ("b", "h", "k")
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=names, scratch_types=scratch, **cluster,
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math,
                                             unsafe_no_auto_barriers=config.no_auto_barriers,
                                             reduction_scratch_bytes=reduction_scratch_bytes(N)))
