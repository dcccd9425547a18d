"""Delta-KV (DKVC) decode and prefill attention: the paged kernels' pipeline over anchor + low-precision deltas.

Storage (one layer; the engine writes it, this kernel reads it):
  anchor_k, anchor_v [num_kv_heads, anchor_len, head_dim] bf16: resident, never evicted. anchor_len
      is 1 (a mean anchor, broadcast over positions) or a multiple of 256 (position-aligned blocks).
  k_delta, v_delta [num_kv_heads, num_slots, head_dim] float16 ("fp16-delta") or float8_e4m3fn
      ("fp8-delta"): the same slot pool, page tables and lengths as `paged_attention`.
  k_scale, v_scale [num_kv_heads, num_slots // 8] float32: one scale per 8-slot granule per kv head,
      stored packed (`pack_granule_scales`: scales [num_kv_heads, num_slots // 8, 4], K scale, V scale and 2
      unused floats per granule, the engine cache's layout); the entries take either form (`packed_scales=`).
The key of sequence b at absolute position t, in slot s = page_starts[b, t // P] + t % P, is
    K = anchor_k[h, t % anchor_len] + k_scale[h, s // 8] * float(k_delta[h, s])     (same for V).
The folded path (mean anchor) attends over these exact values (f16 deltas, fp32 scales); the rebuild
path rounds the rebuilt K/V to bf16 for its MMAs (the paged kernel's K/V precision).

Design
------
The kernel is `paged_attention`'s pipeline (`_build_kernel`: grid, page-table window, SMEM ring,
split-K, online softmax, score statistics) with another `KVFormat` (`DeltaPages` below). Per page
piece it fetches one TMA copy of the K and one of the V delta rows (1 or 2 bytes per element) and one
of the piece's packed scales (both sides', 16 bytes a granule: TMA's unit, so any page's granules are
one aligned copy), on K's barrier, into the piece's own 128-byte area of the slot's scale buffer, where
granule j of the piece sits at floats [4j, 4j + 4) whatever the page's slot (`fetch_packed_granules`,
`packed_scale_index`: no page-table read). Then one of two paths:

*Folded (a mean anchor, anchor_len 1; the default).* The anchor needs no rebuild at all. With one
vector a_k per kv head, the score of key j is q . (a_k + sk_j dk_j) = q . a_k + sk_j (q . dk_j), and
q . a_k is the same for every key of a query row: it cancels in the softmax (and in the score
variance, which is shift-invariant; not under a soft cap, which takes the rebuild path). So the MMA
computes q @ dk^T straight from the deltas and the scores are sk (a per-key column vector of the
tile, from the granule scales) times that. For V, with P normalised (sum_j P_j / l = 1),
    out = sum_j P_j (a_v + sv_j dv_j) / l = a_v + (sum_j (P_j sv_j) dv_j) / l,
so sv is folded into P's columns before P @ dv and a_v is added once, in the epilogue (to the rows
that saw a key; length-0 rows stay 0; split-K partials each carry a_v and their merge is a convex
combination). The per-key factors reach the pipeline as `TileColumns`; the pipeline takes the
softmax's running max over s + log2(sv), so P * sv <= 1 with its largest entry 1 and the f16
rounding of P never sees subnormals (scales of fp8 deltas are ~amax / 448, so P * sv alone could be
~1e-8, below f16's smallest subnormal); l sums P without sv, in fp32 (P may exceed 1 there).
  fp16 deltas: WGMMA takes f16 operands, so the K and V ring slots are the MMAs' B operands as
      they arrive (no staging tile), q is rounded to f16 in the wrapper (|q| clipped to 65280, the
      largest bf16 below f16's max) and P to f16.
  fp8 deltas: Hopper's fp8 WGMMA needs both operands fp8 (q and P in e4m3 would lose too much) and a
      K-major B, which P @ V's V is not; so each fp8 slot is converted to an f16 tile in SMEM with no
      math (e4m3 pairs -> f16x2, exact) and the f16 path runs. Loading the fp8 rows as the register
      A operand instead would need a transposed problem (keys as WGMMA's M), i.e. a different
      softmax; the convert is one pass over half the bytes of a bf16 tile.
  Stale slots (past the length) may hold NaN deltas and scales: the granule scales of granules with
  no live key are replaced (score scale 0, value scale 1) before they reach any vector, K rows' NaN
  scores are masked to -inf, and the V rows past the end are zeroed in SMEM (last tile only), since
  P = 0 there but 0 * NaN = NaN inside the P @ V MMA.
  The scales are read as T / 8 scalars per side (a piece's area depends on the page size, a runtime
  value, so no single vector read covers every page size) and put into the column vectors with one
  select per granule; in the WGMMA column layout every register of a thread
  belongs to one static granule, so those selects fold to moves (an assumption about the compiler
  that only a GPU profile confirms).

*Rebuild (a position-aligned anchor, anchor_len a multiple of 256; or a mean anchor with a soft cap
or STRATUM_DKVC_FOLD_MEAN_ANCHOR=0, broadcast to one 256-row block).* Per tile one more TMA copy
brings the tile's T anchor rows (contiguous: T (64/128) divides 256 which divides anchor_len) into an
anchor ring; per 64-row chunk the delta (WGMMA layout), the anchor rows and the per-row scales (T / 8
scalar SMEM reads selected into a row vector) rebuild K and V in fp32 registers, V rows at or past the
length are zeroed, and the bf16 result is stored in place of the anchor tile, which WGMMA reads with
bf16 q and P. fp8 -> fp32 goes through fp16 (Mosaic GPU converts e4m3 pairwise to f16x2; both steps
are exact). On the H200 this path took 2.0-2.5x the bf16 paged kernel's time (BENCHMARKS.md), bound by
the rebuild, not by bytes: the reason for the folded path.

Every config lowers to Mosaic GPU on a CPU (checked for fp8/fp16 x folded/rebuild, D=64/128, block_kv
64/128, with and without score stats); register allocation and spills are only decided by ptxas on a
GPU. STRATUM_DKVC_FOLD_MEAN_ANCHOR=0 (every call, the engine's included) or fold_mean_anchor=False
sends a mean anchor through the rebuild path, the fallback if the folded path fails on a GPU
(benchmarks/gpu_dkvc_session.sh switches it when only the folded cases fail).

*Prefill (`delta_prefill_attention`).* The same format in `paged_prefill_attention`'s causal-block pipeline
(`prefill_attention_pipeline`: `_build_kernel(query_tokens=...)`, a 64-row q tile of 64 // group consecutive
tokens x the GQA group, row r seeing the keys < min(q_start + r // group + 1, length)). Nothing in the format
depends on the query: the folded path's per-key columns, the V zeroing and the live-granule masks use the
block's length (the furthest key any row sees), the causal bound is the pipeline's mask on the scores, and
the epilogue's anchor_v goes to every row that saw a key (every real token does: q_start >= 0). The q tile
is f16 on the folded path (clipped as above), bf16 on the rebuild path. Score statistics come from the
pipeline unchanged. Default config: PREFILL_KERNEL_CONFIG (128-token tiles) where it fits SMEM, else 64-token
tiles (`default_delta_prefill_config`; not yet swept on a GPU). The folded path also runs in the warp-specialised
prefill kernel (`prefill_attention.ws_delta_prefill_attention`, 128-row CTAs, what the engine's "ws" variant uses
without score statistics); the format's in-kernel pieces both kernels use are the module-level functions below
(`fetch_packed_granules`, `packed_tile_columns`, `granule_columns`, `convert_to_f16`, `add_anchor_v`; the
swapped decode kernel's `F8PackedGranulePages` reads the packed scales the same way).

SMEM per CTA (`delta_smem_bytes`; 227 KB at most; two CTAs per SM below ~113 KB) at D=128, 2 stages,
B=64 (no split), 4K-16K contexts, T=64: folded fp16 101-107 KB, the bf16 paged kernel's 99-105 KB plus
2 KB of packed scales; folded fp8 the same (half the ring, plus two f16 tiles); the rebuild path adds the
anchor ring (32 KB more with fp8, 64 KB with fp16: one CTA per SM). With T=128 the folded paths take
171-177 KB and the rebuild path does not fit at D=128 (refused at the entry with a message); at D=64
every combination fits.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.paged_attention import (
    _Q_ROWS, MMA_TRANSFORMS, PREFILL_KERNEL_CONFIG, TileColumns, TileContext, TuningConfig, check_pools_and_tables,
    check_prefill_query, decode_attention_pipeline, kernel_static_args, prefill_attention_pipeline,
    prefill_block_tokens, prefill_rows_to_blocks, prefill_static_args, prefill_token_rows, reference_attend,
    reference_token_slots)

# The precision names of the engine flag (--kv-precision) -> delta dtype.
DELTA_DTYPES = {"fp16-delta": jnp.dtype(jnp.float16), "fp8-delta": jnp.dtype(jnp.float8_e4m3fn)}
GRANULE = 8            # slots per scale
SCALE_AREA = 32        # granules per page piece in SMEM: 128 bytes, the TMA destination alignment
ANCHOR_BLOCK = 256     # a position-aligned anchor is a multiple of this many rows
_CHUNK = 64            # rows rebuilt at a time (WGMMA's M; bounds the registers a rebuild needs)
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)
_COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)
_SMEM_LIMIT = 227 * 1024
# Value scales are clamped to this before their log2 (a zero scale would give a -inf softmax max).
_MIN_VALUE_SCALE = 2.0 ** -100
# The largest bf16 that is a finite f16 (65504, f16's max, rounds up to 65536 in bf16): q is clipped to it
# before the folded path's f16 MMA, so no score turns inf/NaN. Within the range bf16 -> f16 is exact for
# |q| >= 2^-14 (f16 has 3 more mantissa bits) and fp32 -> f16 keeps 11 bits (bf16: 8); smaller components
# become f16 subnormals, off by at most 2^-25 each: negligible in q . k.
F16_SAFE_MAX = 65280.0
FOLD_MEAN_ANCHOR_ENV = "STRATUM_DKVC_FOLD_MEAN_ANCHOR"


def default_fold_mean_anchor() -> bool:
    """Whether a mean anchor takes the folded path (module docstring): $STRATUM_DKVC_FOLD_MEAN_ANCHOR, 1 (the
    default) or 0 (the rebuild path, the mean broadcast to a 256-row anchor block)."""
    value = os.environ.get(FOLD_MEAN_ANCHOR_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"${FOLD_MEAN_ANCHOR_ENV} must be 0 (mean anchor through the rebuild path) or 1 (folded "
                         f"out of the loop), got {value!r}")
    return value == "1"


@dataclasses.dataclass(frozen=True)
class DeltaPages:
    """KV format of the delta kernel (see the module docstring). Inputs, in order: k_delta, v_delta
    [Hkv, S, D] delta dtype; packed scales [Hkv, S // 8 * 4] f32 (`pack_granule_scales`, flattened); anchor_k,
    anchor_v [Hkv, A, D] bf16. Per page piece the K barrier counts the K rows and the piece's scales (both
    sides': the rebuild path reads K's after the K wait, the folded path both after both waits), the V barrier
    the V rows. fold=True: a mean anchor (A = 1) folded out of the loop (only anchor_v is read, in `finish`);
    fold=False: the rebuild path over an anchor ring (A a multiple of 256)."""
    delta_dtype: str              # "float16" or "float8_e4m3fn" (a string: static and hashable)
    fold: bool
    num_inputs: int = 5
    copies_per_side: tuple[int, int] = (2, 1)     # (K rows + packed scales, V rows) per page piece

    @property
    def copies_per_tile(self) -> int:
        return 0 if self.fold else 1

    @property
    def mma_dtype(self) -> str:
        # Folded: the MMAs read the f16 deltas themselves, so q and P are f16 too (WGMMA needs both
        # operands of one type). Rebuild: the rebuilt K/V tiles are bf16, as in the paged kernel.
        return "float16" if self.fold else "bfloat16"

    @property
    def _fp8(self) -> bool:
        return jnp.dtype(self.delta_dtype).itemsize == 1

    def scratch_types(self, *, stages, block_kv, head_dim):
        ring = delta_ring_type(stages, block_kv, head_dim, self.delta_dtype)
        out = [ring, ring, packed_scale_areas_type(stages, block_kv)]
        if self.fold:
            if self._fp8:   # the f16 copies of the fp8 slot that WGMMA reads (module docstring)
                tile = plgpu.SMEM((block_kv, head_dim), jnp.float16, transforms=MMA_TRANSFORMS)
                out += [tile, tile]
        else:
            anchor_ring = plgpu.SMEM((stages, block_kv, head_dim), jnp.bfloat16, transforms=MMA_TRANSFORMS)
            out += [anchor_ring, anchor_ring]
        return out

    def prologue(self, ctx: TileContext):
        pass

    def prologue_wait(self, ctx: TileContext):
        return None

    def fetch_page(self, ctx: TileContext, src, row, n, slot, k_bar, v_bar):
        kd, vd, scales = ctx.inputs[:3]
        k_ring, v_ring, areas = ctx.smem[:3]
        dst = (slot, pl.ds(row, n)) if n < ctx.block_kv else (slot,)
        plgpu.copy_gmem_to_smem(kd.at[ctx.h, pl.ds(src, n)], k_ring.at[dst], k_bar)
        plgpu.copy_gmem_to_smem(vd.at[ctx.h, pl.ds(src, n)], v_ring.at[dst], v_bar)
        fetch_packed_granules(scales.at[ctx.h], src, row, n, areas.at[slot], k_bar)

    def fetch_tile(self, ctx: TileContext, t0, slot, k_bar, v_bar):
        if self.fold:
            return
        ak, av = ctx.inputs[3:5]
        k_anc, v_anc = ctx.smem[3:5]
        a0 = pl.multiple_of(lax.rem(t0, ak.shape[1]), ctx.block_kv)
        plgpu.copy_gmem_to_smem(ak.at[ctx.h, pl.ds(a0, ctx.block_kv)], k_anc.at[slot], k_bar)
        plgpu.copy_gmem_to_smem(av.at[ctx.h, pl.ds(a0, ctx.block_kv)], v_anc.at[slot], v_bar)

    def materialize(self, ctx: TileContext, state, slot, tile, n_valid):
        if not self.fold:
            return self._rebuild(ctx, slot, n_valid)
        T, D = ctx.block_kv, ctx.head_dim
        k_ring, v_ring = ctx.smem[:2]
        if self._fp8:
            k_out, v_out = ctx.smem[3:5]
            # The f16 tiles were the previous tile's WGMMA operands: every warp must be past its reads
            # before any thread overwrites them (commit_smem syncs the warpgroup).
            plgpu.commit_smem()
            ctx.wait_k(slot)
            convert_to_f16(k_ring.at[slot], k_out)
            ctx.wait_v(slot)
            convert_to_f16(v_ring.at[slot], v_out)
        else:
            ctx.wait_k(slot)
            ctx.wait_v(slot)
            k_out, v_out = k_ring.at[slot], v_ring.at[slot]

        # Stale slots past the length may hold NaN deltas: P is 0 there, but 0 * NaN = NaN inside the
        # P @ V MMA, so the V rows past the end are zeroed (only the last tile has any). K rows need
        # nothing: their NaN scores are masked to -inf before the softmax.
        @pl.when(n_valid < T)
        def _():
            v = v_out[...]
            rows = plgpu.broadcasted_iota(jnp.int32, (T, D), 0, layout=plgpu.Layout.WGMMA)
            v_out[...] = jnp.where(rows < n_valid, v, jnp.zeros_like(v))
            if not self._fp8:
                plgpu.commit_smem()
        if self._fp8:
            plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)
        return k_out, v_out

    def columns(self, ctx: TileContext, state, slot, tile, n_valid):
        """The folded path's per-key factors (TileColumns): the K and V granule scales of each key's
        granule, read as T / 8 scalars per side. Granules with no live key (NaN scales are allowed
        there) get score scale 0 and value scale 1 (finite, and P is 0 there anyway)."""
        if not self.fold:
            return None
        return packed_tile_columns(ctx.smem[2], slot, ctx.log2_p, n_valid, ctx.block_kv)

    def finish(self, ctx: TileContext, state, o, l):
        """Folded: out = anchor_v + (sum_j P_j sv_j dv_j) / l for the rows that saw a key (l > 0); rows
        with no key (length 0, an empty split) stay 0."""
        if not self.fold:
            return o
        return add_anchor_v(ctx.inputs[4].at[ctx.h, 0], o, l)

    def _rebuild(self, ctx: TileContext, slot, n_valid):
        """The rebuild path: K/V = anchor + scale * delta in fp32 registers, rounded to bf16 in place of
        the anchor tiles (their ring slot is refilled next round anyway)."""
        T, D = ctx.block_kv, ctx.head_dim
        k_ring, v_ring, areas, k_anc, v_anc = ctx.smem
        k_out, v_out = k_anc.at[slot], v_anc.at[slot]
        idx = [packed_scale_index(j, ctx.log2_p, T) for j in range(T // GRANULE)]
        granule_of_row = lax.shift_right_logical(
            plgpu.broadcasted_iota(jnp.int32, (_CHUNK,), 0, layout=_ROW_LAYOUT), 3)
        rows = plgpu.broadcasted_iota(jnp.int32, (_CHUNK, D), 0, layout=plgpu.Layout.WGMMA)

        def rebuild(ring, side, anc, out, r0, zero_past_end):
            scale = plgpu.layout_cast(jnp.zeros((_CHUNK,), jnp.float32), _ROW_LAYOUT)
            for j in range(_CHUNK // GRANULE):
                scale = jnp.where(granule_of_row == j, areas[slot, idx[r0 // GRANULE + j] + side], scale)
            delta = ring[slot, pl.ds(r0, _CHUNK)]
            if delta.dtype.itemsize == 1:
                delta = delta.astype(jnp.float16)
            scale = lax.broadcast_in_dim(scale, (_CHUNK, D), [0])
            x = anc[slot, pl.ds(r0, _CHUNK)].astype(jnp.float32) + scale * delta.astype(jnp.float32)
            if zero_past_end:
                x = jnp.where(rows < n_valid - r0, x, 0.0)
            out[pl.ds(r0, _CHUNK)] = x.astype(jnp.bfloat16)

        ctx.wait_k(slot)            # the K rows and both sides' scales
        for r0 in range(0, T, _CHUNK):
            rebuild(k_ring, 0, k_anc, k_out, r0, False)   # K rows past the end: their scores are masked
        ctx.wait_v(slot)
        for r0 in range(0, T, _CHUNK):
            rebuild(v_ring, 1, v_anc, v_out, r0, True)
        plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)
        return k_out, v_out


# ---------------------------------------------------------------------------------------------
# The format's in-kernel pieces, shared by DeltaPages (the single-warpgroup pipeline), the
# warp-specialised prefill kernel (pallas_kernels/prefill_attention.py) and the swapped decode kernel's
# fp8 granule format (`F8PackedGranulePages`)
# ---------------------------------------------------------------------------------------------

def delta_ring_type(stages: int, block_kv: int, head_dim: int, delta_dtype):
    """SMEM ring of delta rows [stages, T, D] as TMA lands them: swizzled rows (fp8 rows of D=64 are 64
    bytes, so a 64-byte swizzle); f16 rows get MMA_TRANSFORMS' layout, so WGMMA reads them in place."""
    dt = jnp.dtype(delta_dtype)
    swizzle = min(128, head_dim * dt.itemsize)
    return plgpu.SMEM((stages, block_kv, head_dim), dt,
                      transforms=(plgpu.TilingTransform((8, swizzle // dt.itemsize)), plgpu.SwizzleTransform(swizzle)))


PACKED_SCALE_FLOATS = 4    # floats per granule in packed scales: K scale, V scale, 2 unused (16 bytes, TMA's unit)


def pack_granule_scales(k_scale, v_scale):
    """k_scale, v_scale [Hkv, S // 8] f32 -> packed scales [Hkv, S // 8, 4] f32 (K, V, 0, 0 per granule): each
    granule's scales on a 16-byte boundary, so a page piece's scales are one TMA copy whose granules land at
    static places (`fetch_packed_granules`)."""
    zeros = jnp.zeros_like(k_scale)
    return jnp.stack([k_scale, v_scale, zeros, zeros], axis=-1)


def packed_area_floats(n: int) -> int:
    """Floats of a ring slot's packed scale buffer given to a page piece of n rows: its n / 8 granules' 4 floats
    each, at least 128 bytes (a TMA destination's alignment)."""
    return max(SCALE_AREA, n // GRANULE * PACKED_SCALE_FLOATS)


def packed_scale_areas_type(stages: int, block_kv: int):
    """SMEM of packed scale granules [stages, (T / 8) * SCALE_AREA] f32: room for T / 8 pieces of 8 rows (one
    128-byte area each), which also holds any other piece size's areas (`packed_area_floats`). Each piece gets its
    own area because a TMA copy into SMEM must land on a 128-byte boundary (a 16-byte one is not enough:
    CUDA_ERROR_MISALIGNED_ADDRESS on the H200)."""
    return plgpu.SMEM((stages, (block_kv // GRANULE) * SCALE_AREA), jnp.float32)


def fetch_packed_granules(scale_row, src, row: int, n: int, areas, bar) -> None:
    """In a kernel: the one TMA copy of both sides' scales of the page piece of n slots [src, src + n) (src a
    multiple of 8) that lands in rows [row, row + n) of a tile. scale_row: one kv head's packed scales
    [S // 8 * 4] f32 (GMEM, `pack_granule_scales` flattened); areas: one ring slot's buffer
    (`packed_scale_areas_type`); the copy arrives on `bar`. Granule j of the piece lands at floats
    [4j, 4j + 4) of the piece's area, whatever the page's slot."""
    first = pl.multiple_of(lax.shift_right_logical(src, 3) * PACKED_SCALE_FLOATS, PACKED_SCALE_FLOATS)
    count = n // GRANULE * PACKED_SCALE_FLOATS
    plgpu.copy_gmem_to_smem(scale_row.at[pl.ds(first, count)],
                            areas.at[pl.ds(packed_area_floats(n) * (row // n), count)], bar)


def packed_scale_index(j: int, log2_p, block_kv: int):
    """In a kernel: where granule j (rows 8j..8j+7) of a tile sits in a ring slot's packed scale buffer filled by
    `fetch_packed_granules`, for a sequence with pages of 2^log2_p tokens: the K scale's float (the V scale's is
    the next). The same for every tile of the sequence (no page-table read)."""
    log2_n = jnp.minimum(log2_p, block_kv.bit_length() - 1)      # rows per piece: min(P, T)
    piece = lax.shift_right_logical(jnp.int32(GRANULE * j), log2_n)
    within = jnp.int32(j) & (lax.shift_left(jnp.int32(1), log2_n - 3) - 1)
    area = jnp.maximum(jnp.int32(SCALE_AREA), lax.shift_left(jnp.int32(1), log2_n - 1))    # packed_area_floats
    return area * piece + PACKED_SCALE_FLOATS * within


def packed_tile_columns(areas, slot, log2_p, n_valid, block_kv: int, *, layout=_COL_LAYOUT) -> TileColumns:
    """In a kernel: the per-key factors of a tile (`granule_columns` in `layout`) from the packed scales
    `fetch_packed_granules` landed in ring slot `slot` of `areas` (`packed_scale_areas_type`), for a sequence with
    pages of 2^log2_p tokens; each granule's place found once for both sides (`packed_scale_index`)."""
    idx = functools.cache(lambda j: packed_scale_index(j, log2_p, block_kv))
    return granule_columns(lambda j: areas[slot, idx(j)], lambda j: areas[slot, idx(j) + 1], n_valid, block_kv,
                           layout=layout)


def granule_columns(k_scale_of, v_scale_of, n_valid, block_kv: int, *, layout=_COL_LAYOUT) -> TileColumns:
    """In a kernel: the folded path's per-key factors of a tile of T = block_kv keys (TileColumns, [T] f32 in
    `layout`: the WGMMA column layout for the keys of S [64, T], or the row layout (WGMMA.reduce(1)) for the keys of
    the swapped kernel's S^T [T, N]) from its T / 8 granule scales, read as scalars by k_scale_of(j) / v_scale_of(j)
    (granule j: keys 8j..8j+7). Granules with no live key (j * 8 >= n_valid; NaN scales are allowed there) get
    score scale 0 and value scale 1 (finite, and P is 0 there anyway)."""
    # In the column layout each thread holds 2 adjacent columns of every 8-column group, so the
    # granule of each of its registers is a compile-time constant (col >> 3 of a register is its
    # group index): the selects below reduce to one move per register once that folds. In the row layout a
    # thread holds 2 rows of each 64-row group (its warp's 16 rows: granules 2 * warp and 2 * warp + 1), so the
    # selects stay, but on 2 registers per 64 rows; log2 then runs on those registers instead of on T / 8 scalars.
    row_layout = layout != _COL_LAYOUT
    granule = lax.shift_right_logical(plgpu.broadcasted_iota(jnp.int32, (block_kv,), 0, layout=layout), 3)
    zero = plgpu.layout_cast(jnp.zeros((block_kv,), jnp.float32), layout)
    ks, vs, lvs = zero, zero, zero
    for j in range(block_kv // GRANULE):
        live = GRANULE * j < n_valid
        sk = jnp.where(live, k_scale_of(j), 0.0)
        # Clamped below: log2(0) = -inf would make the softmax max -inf for a row of zero scales.
        sv = jnp.where(live, jnp.maximum(v_scale_of(j), _MIN_VALUE_SCALE), 1.0)
        here = granule == j
        ks = jnp.where(here, sk, ks)
        vs = jnp.where(here, sv, vs)
        if not row_layout:
            lvs = jnp.where(here, jnp.log2(sv), lvs)
    if row_layout:
        lvs = jnp.log2(vs)
    return TileColumns(score_scale=ks, value_scale=vs, log2_value_scale=lvs)


def convert_to_f16(src, dst, *, valid_rows=None, wide_loads: bool = False) -> None:
    """In a kernel: dst[...] = src[...] as f16, 64 rows (WGMMA's M) at a time: src [T, D] fp8 rows in SMEM as
    `delta_ring_type` lays them out, dst [T, D] f16 in MMA_TRANSFORMS' layout. A plain convert (e4m3 pairs
    -> f16x2, exact), no math. valid_rows (traced): rows at or past it are written as zeros instead (stale
    V slots may hold NaN, and 0 * NaN = NaN inside the P @ V MMA). The caller commits the stores.

    The f16 rows leave registers in the WGMMA layout (stmatrix). Loaded in that layout, the fp8 rows take one
    2-byte SMEM load per e4m3 pair; wide_loads reads them in the WGMMA_UPCAST_2X layout instead (4-byte loads,
    half as many) and moves them into the WGMMA layout with a warp shuffle per 4 elements."""
    rows = None
    if valid_rows is not None:
        rows = plgpu.broadcasted_iota(jnp.int32, (_CHUNK, dst.shape[1]), 0, layout=plgpu.Layout.WGMMA)
    for r0 in range(0, src.shape[0], _CHUNK):
        if wide_loads:
            x = plgpu.load(src.at[pl.ds(r0, _CHUNK)], layout=plgpu.Layout.WGMMA_UPCAST_2X).astype(jnp.float16)
            x = plgpu.layout_cast(x, plgpu.Layout.WGMMA)
        else:
            x = src[pl.ds(r0, _CHUNK)].astype(jnp.float16)
        if rows is not None:
            x = jnp.where(rows < valid_rows - r0, x, jnp.zeros_like(x))
        dst[pl.ds(r0, _CHUNK)] = x


def add_anchor_v(anchor_v_row, o, l):
    """In a kernel, the folded path's epilogue: o [64, D] f32 (normalised, the anchor left out of V) plus the
    mean anchor anchor_v_row ([D] bf16 in GMEM) on the rows that saw a key (l [64] > 0); rows with no key
    (length 0, an empty split) stay 0."""
    # A plain (element-wise) load: the optimized vector path only reads SMEM; it runs once per CTA.
    a = plgpu.load(anchor_v_row, layout=_COL_LAYOUT, optimized=False).astype(jnp.float32)      # [D]
    seen = jnp.where(l > 0, 1.0, 0.0)
    return o + lax.broadcast_in_dim(a, o.shape, [1]) * lax.broadcast_in_dim(seen, o.shape, [0])


def delta_smem_bytes(config: TuningConfig, head_dim: int, delta_dtype, *, fold: bool, max_pages: int,
                     out_itemsize: int = 4) -> int:
    """Approximate SMEM footprint of one CTA of the delta kernel (227 KB max; <= ~113 KB for two CTAs
    per SM): the paged kernel's q/out/table share plus the delta ring, scales and the f16 tiles (folded
    fp8) or the bf16 anchor ring (rebuild)."""
    T, S = config.block_kv, config.num_stages
    rest = config.smem_bytes(head_dim, max_pages, out_itemsize) - 2 * S * T * head_dim * 2   # minus the bf16 ring
    itemsize = jnp.dtype(delta_dtype).itemsize
    ring = 2 * S * T * head_dim * itemsize + S * (T // GRANULE) * SCALE_AREA * 4     # rows + packed scale areas
    if fold:
        tiles = 2 * T * head_dim * 2 if itemsize == 1 else 0
    else:
        tiles = 2 * S * T * head_dim * 2
    return rest + ring + tiles


# ---------------------------------------------------------------------------------------------
# Entry checks, reference
# ---------------------------------------------------------------------------------------------

def check_delta_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes,
                       name="delta_attention", packed_scales=None):
    """Entry checks of the delta kernels; the scales are k_scale and v_scale [Hkv, S // 8] f32, or (both None)
    packed_scales [Hkv, S // 8, 4] f32."""
    def fail(msg):
        raise ValueError(f"{name}: {msg}")
    check_pools_and_tables(name, q, ("k_delta", k_delta), ("v_delta", v_delta), lengths,
                           page_starts, page_sizes)
    if k_delta.dtype != v_delta.dtype or k_delta.dtype not in DELTA_DTYPES.values():
        fail(f"k_delta/v_delta must both be float16 (fp16-delta) or float8_e4m3fn (fp8-delta), got "
             f"{k_delta.dtype}/{v_delta.dtype}")
    num_kv_heads, num_slots, head_dim = k_delta.shape
    want = (num_kv_heads, num_slots // GRANULE)
    if packed_scales is not None:
        if k_scale is not None or v_scale is not None:
            fail("pass the scales either as k_scale and v_scale or as packed_scales, not both")
        check_packed_scales(name, k_delta, packed_scales)
    for name, a in (("k_scale", k_scale), ("v_scale", v_scale)) if packed_scales is None else ():
        if a is None or a.shape != want or a.dtype != jnp.float32:
            fail(f"{name} must be float32 [num_kv_heads, num_slots // 8] = {list(want)} (one scale per "
                 f"8-slot granule), got {'None' if a is None else f'{a.dtype} {list(a.shape)}'} (or pass "
                 "packed_scales)")
    for name, a in (("anchor_k", anchor_k), ("anchor_v", anchor_v)):
        if a.ndim != 3 or a.shape[0] != num_kv_heads or a.shape[2] != head_dim or a.dtype != jnp.bfloat16:
            fail(f"{name} must be bfloat16 [num_kv_heads={num_kv_heads}, anchor_len, head_dim={head_dim}], "
                 f"got {a.dtype} {list(a.shape)}")
        if a.shape[1] != 1 and a.shape[1] % ANCHOR_BLOCK:
            fail(f"{name}: anchor_len must be 1 (mean anchor) or a multiple of {ANCHOR_BLOCK} "
                 f"(position-aligned), got {a.shape[1]}")
    if anchor_v.shape != anchor_k.shape:
        fail(f"anchor_k and anchor_v must have the same shape, got {anchor_k.shape} and {anchor_v.shape}")


def check_packed_scales(name: str, pool, packed_scales) -> None:
    """The entry check of packed granule scales (`pack_granule_scales`) beside a pool [Hkv, S, D]: float32
    [Hkv, S // 8, 4]."""
    want = (pool.shape[0], pool.shape[1] // GRANULE, PACKED_SCALE_FLOATS)
    if packed_scales.shape != want or packed_scales.dtype != jnp.float32:
        raise ValueError(f"{name}: packed_scales must be float32 [num_kv_heads, num_slots // 8, 4] = {list(want)} (K "
                         f"scale, V scale, 2 unused per 8-slot granule), got {packed_scales.dtype} "
                         f"{list(packed_scales.shape)}")


def rebuild_reference(anchor, scale, delta, slot, t):
    """Rebuilt keys/values in fp32: [Hkv, B, T, D] from anchor [Hkv, A, D], scale [Hkv, S // 8], delta
    [Hkv, S, D], slot [B, T] int32 (the pool slot of token t of sequence b) and t [T] positions."""
    a = anchor[:, t % anchor.shape[1]].astype(jnp.float32)                       # [Hkv, T, D]
    return a[:, None] + scale[:, slot // GRANULE][..., None] * delta[:, slot].astype(jnp.float32)


def kernel_scales(k_scale, v_scale, packed_scales):
    """The delta kernels' scale operand [Hkv, S // 8 * 4] f32 (`fetch_packed_granules`): packed_scales flattened, or
    k_scale / v_scale packed (`pack_granule_scales`, an XLA op a call; the engine's cache stores them packed)."""
    packed = pack_granule_scales(k_scale, v_scale) if packed_scales is None else packed_scales
    return packed.reshape(packed.shape[0], -1)


def delta_attention_reference(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts,
                              page_sizes, *, sm_scale=None, soft_cap=None, return_score_stats: bool = False,
                              packed_scales=None):
    """Pure-jnp delta decode attention, fp32 math, same contract as `delta_attention` (K/V rebuilt in fp32,
    not rounded to bf16). For tests and small shapes: it gathers a dense [Hkv, B, max_pages * 256, D] view."""
    check_delta_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes,
                       packed_scales=packed_scales)
    if packed_scales is not None:
        k_scale, v_scale = packed_scales[..., 0], packed_scales[..., 1]
    t, slot, valid = reference_token_slots(lengths, page_starts, page_sizes, k_delta.shape[1])
    k = rebuild_reference(anchor_k, k_scale, k_delta, slot, t)
    v = rebuild_reference(anchor_v, v_scale, v_delta, slot, t)
    return reference_attend(q, k, v, valid, sm_scale=sm_scale, soft_cap=soft_cap,
                            return_score_stats=return_score_stats)


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------

def delta_attention(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes, *,
                    sm_scale: float | None = None, soft_cap: float | None = None,
                    config: TuningConfig | None = None, interpret: bool = False,
                    return_score_stats: bool = False, fold_mean_anchor: bool | None = None,
                    packed_scales: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention over a delta-KV pool (Mosaic GPU kernel): one query per sequence, keys at
    positions 0..lengths[b]-1 rebuilt as anchor + scale * delta (module docstring).

    Args:
      q: [batch, num_q_heads, head_dim], bf16 or fp32 (rounded to bf16 for the rebuild path's MMA, to f16
        for the folded path's, |q| clipped to 65280).
      k_delta, v_delta: [num_kv_heads, num_slots, head_dim] float16 or float8_e4m3fn (both the same).
      k_scale, v_scale: [num_kv_heads, num_slots // 8] float32, one scale per 8-slot granule.
      anchor_k, anchor_v: [num_kv_heads, anchor_len, head_dim] bf16, anchor_len 1 or a multiple of 256.
      lengths, page_starts, page_sizes, sm_scale, soft_cap, config, interpret, return_score_stats: as in
        `paged_attention` (pages of 8..256 tokens, mixed per batch; length 0 gives zeros; slots, deltas
        and scales outside the live tokens are never used, even if NaN).
      fold_mean_anchor: a mean anchor (anchor_len 1) folded out of the loop (True) or through the rebuild
        path as a 256-row block (False); None: `default_fold_mean_anchor()`, and the rebuild path when
        soft_cap is set (the cap is not shift-invariant, so q . anchor_k can't be dropped). True needs
        anchor_len 1 and no soft_cap.
      packed_scales: instead of k_scale / v_scale (both None then): [num_kv_heads, num_slots // 8, 4] float32
        (`pack_granule_scales`: K scale, V scale, 2 unused per granule), the layout the kernel reads (one TMA copy
        a page piece) and the engine's cache stores; two arrays are packed here (an XLA op a call).

    Returns:
      [batch, num_q_heads, head_dim] in q.dtype; with return_score_stats also score_var [batch,
      num_q_heads] float32 (as in `paged_attention`: over the keys the MMA sees, the rebuilt bf16 keys, or
      the exact keys on the folded path, whose dropped q . anchor_k shift leaves the variance unchanged).
    """
    check_delta_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes,
                       packed_scales=packed_scales)
    config, scale, cap = kernel_static_args("delta_attention", q, k_delta.shape[0], sm_scale, soft_cap, config)
    anchor_k, anchor_v = _choose_path("delta_attention", q.shape[2], k_delta.dtype, anchor_k, anchor_v, soft_cap=cap,
                                      fold_mean_anchor=fold_mean_anchor, config=config, max_pages=page_starts.shape[1],
                                      out_itemsize=q.dtype.itemsize if config.num_splits == 1 else 4)
    kw = dict(scale=scale, soft_cap=cap, config=config, score_stats=bool(return_score_stats))
    args = (q, k_delta, v_delta, kernel_scales(k_scale, v_scale, packed_scales), anchor_k, anchor_v, lengths,
            page_starts, page_sizes)
    if interpret:
        with mosaic_gpu_interpret():
            return _delta_attention(*args, p_via_smem=True, **kw)
    return _delta_attention(*args, p_via_smem=interpret_mode_active(), **kw)


def _folds(anchor_k, soft_cap, fold_mean_anchor) -> bool:
    """Whether the kernel takes the folded path: a mean anchor, no soft cap, and fold_mean_anchor (None:
    `default_fold_mean_anchor()`)."""
    mean = anchor_k.shape[1] == 1
    return mean and soft_cap is None and (default_fold_mean_anchor() if fold_mean_anchor is None else fold_mean_anchor)


def _choose_path(name, head_dim, delta_dtype, anchor_k, anchor_v, *, soft_cap, fold_mean_anchor, config, max_pages,
                 out_itemsize):
    """The folded or the rebuild path (module docstring), shared by the decode and prefill entries: checks
    fold_mean_anchor against the anchor and the soft cap, and the config's SMEM against a Hopper SM. Returns
    the anchors the kernel reads: as given (a folded mean anchor, or a position-aligned one), or a mean
    anchor broadcast to one 256-row block for the rebuild path. The jitted wrappers tell the paths apart
    by anchor_len (1: folded)."""
    if config.block_kv not in (64, 128):
        raise ValueError(f"{name}: block_kv must be 64 or 128, got {config.block_kv}")
    mean = anchor_k.shape[1] == 1
    if fold_mean_anchor and not mean:
        raise ValueError(f"{name}: fold_mean_anchor=True needs a mean anchor (anchor_len 1), got "
                         f"anchor_len {anchor_k.shape[1]}")
    if fold_mean_anchor and soft_cap is not None:
        raise ValueError(f"{name}: fold_mean_anchor=True cannot take a soft_cap (the folded path drops "
                         "q . anchor_k, which the cap does not ignore); pass fold_mean_anchor=None or False")
    fold = _folds(anchor_k, soft_cap, fold_mean_anchor)
    if mean and not fold:      # the mean as one position-aligned block: the rebuild path
        block = (anchor_k.shape[0], ANCHOR_BLOCK, anchor_k.shape[2])
        anchor_k, anchor_v = jnp.broadcast_to(anchor_k, block), jnp.broadcast_to(anchor_v, block)
    smem = delta_smem_bytes(config, head_dim, delta_dtype, fold=fold, max_pages=max_pages, out_itemsize=out_itemsize)
    if smem > _SMEM_LIMIT:
        raise ValueError(f"{name}: {config} needs about {smem // 1024} KB of shared memory per CTA, more "
                         f"than the {_SMEM_LIMIT // 1024} KB a Hopper SM has; use block_kv=64 or fewer num_stages")
    return anchor_k, anchor_v


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "config", "p_via_smem", "score_stats"))
def _delta_attention(q, k_delta, v_delta, scales, anchor_k, anchor_v, lengths, page_starts, page_sizes, *,
                     scale, soft_cap, config, p_via_smem, score_stats):
    q, fmt = _format_and_query(q, k_delta, anchor_k)
    return decode_attention_pipeline(
        q, (k_delta, v_delta, scales, anchor_k, anchor_v), lengths, page_starts, page_sizes,
        kv_format=fmt, num_kv_heads=k_delta.shape[0], scale=scale, soft_cap=soft_cap, config=config,
        p_via_smem=p_via_smem, score_stats=score_stats)


def _format_and_query(q, k_delta, anchor_k):
    """(q as the kernel's MMA takes it, the DeltaPages format) for the anchors `_choose_path` returned
    (anchor_len 1: the folded path, whose f16 MMA needs |q| <= 65280 to stay finite)."""
    fold = anchor_k.shape[1] == 1
    if fold:
        q = jnp.clip(q, -F16_SAFE_MAX, F16_SAFE_MAX)
    return q, DeltaPages(delta_dtype=jnp.dtype(k_delta.dtype).name, fold=fold)


# ---------------------------------------------------------------------------------------------
# Prefill: causal blocks of query tokens over the delta cache
# ---------------------------------------------------------------------------------------------

def default_delta_prefill_config(head_dim: int, delta_dtype, *, fold: bool, max_pages: int,
                                 out_itemsize: int = 2) -> TuningConfig:
    """The delta prefill kernel's default: the bf16 prefill kernel's (PREFILL_KERNEL_CONFIG, 128-token
    tiles) where it fits a Hopper SM's shared memory (the folded paths do), else the same with 64-token
    tiles (the rebuild path's anchor ring at D=128). Not yet swept on a GPU."""
    if delta_smem_bytes(PREFILL_KERNEL_CONFIG, head_dim, delta_dtype, fold=fold, max_pages=max_pages,
                        out_itemsize=out_itemsize) <= _SMEM_LIMIT:
        return PREFILL_KERNEL_CONFIG
    return dataclasses.replace(PREFILL_KERNEL_CONFIG, block_kv=64)


def delta_prefill_attention_reference(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, q_starts, lengths,
                                      page_starts, page_sizes, *, sm_scale=None, return_score_stats: bool = False,
                                      packed_scales=None):
    """Pure-jnp causal attention of query blocks over the delta cache (same contract as
    `delta_prefill_attention`; K/V rebuilt in fp32), via the decode reference with one row per query
    token. For tests and small shapes."""
    rows = prefill_token_rows(q, q_starts, lengths, page_starts, page_sizes)
    res = delta_attention_reference(rows[0], k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, *rows[1:],
                                    sm_scale=sm_scale, return_score_stats=return_score_stats,
                                    packed_scales=packed_scales)
    return prefill_rows_to_blocks(res, q.shape, return_score_stats)


def delta_prefill_attention(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, q_starts, lengths, page_starts,
                            page_sizes, *, sm_scale: float | None = None, config: TuningConfig | None = None,
                            interpret: bool = False, return_score_stats: bool = False,
                            fold_mean_anchor: bool | None = None, packed_scales: jax.Array | None = None):
    """Causal attention of blocks of consecutive query tokens over a delta-KV pool (the DKVC prefill path):
    `paged_prefill_attention`'s causal-block pipeline (a 64-row q tile of `tokens` tokens x the GQA group)
    with `delta_attention`'s KV format (anchor + scale * delta, folded or rebuilt as in the module docstring).

    Args:
      q: [blocks, tokens, num_q_heads, head_dim] bf16/fp32, tokens <= prefill_block_tokens(num_q_heads,
        num_kv_heads) (64 // group; the group a power of 2). Token i of block b is at position q_starts[b] + i.
      k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v: the delta cache, as in `delta_attention`
        (the block's own keys already written); or packed_scales instead of k_scale / v_scale, as there.
      q_starts, lengths, page_starts, page_sizes: as in `paged_prefill_attention` (lengths[b] = min(q_starts[b]
        + tokens, context); 0 marks a padding block: zeros; slots, deltas and scales at or past a block's
        length are never used, even if NaN).
      sm_scale: score scale, default 1/sqrt(head_dim). (No soft cap: the bf16 prefill kernel has none either.)
      config: TuningConfig with num_splits None or 1; default `default_delta_prefill_config`.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
      return_score_stats: also return each row's score variance (the pipeline's, free of extra code here).
      fold_mean_anchor: as in `delta_attention`.

    Returns:
      [blocks, tokens, num_q_heads, head_dim] in q.dtype: token i attends to the keys at positions
      < min(q_starts + i + 1, lengths); with return_score_stats also score_var [blocks, tokens, num_q_heads]
      float32 (over the keys the MMA sees, as in `delta_attention`).
    """
    name = "delta_prefill_attention"
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [blocks, tokens, num_q_heads, head_dim], got {q.shape}")
    check_delta_inputs(q[:, 0], k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts,
                       page_sizes, name=name, packed_scales=packed_scales)
    _, _, _, head_dim = check_prefill_query(
        name, q, k_delta.shape[0], q_starts, most_tokens=prefill_block_tokens(q.shape[2], k_delta.shape[0]),
        q_rows=_Q_ROWS)
    if config is None:
        config = default_delta_prefill_config(head_dim, k_delta.dtype, fold=_folds(anchor_k, None, fold_mean_anchor),
                                              max_pages=page_starts.shape[1], out_itemsize=q.dtype.itemsize)
    config, scale = prefill_static_args(name, head_dim, sm_scale, config)
    anchor_k, anchor_v = _choose_path(name, head_dim, k_delta.dtype, anchor_k, anchor_v, soft_cap=None,
                                      fold_mean_anchor=fold_mean_anchor, config=config, max_pages=page_starts.shape[1],
                                      out_itemsize=q.dtype.itemsize)
    kw = dict(scale=scale, config=config, score_stats=bool(return_score_stats))
    args = (q, k_delta, v_delta, kernel_scales(k_scale, v_scale, packed_scales), anchor_k, anchor_v, q_starts,
            lengths, page_starts, page_sizes)
    if interpret:
        with mosaic_gpu_interpret():
            return _delta_prefill_attention(*args, p_via_smem=True, **kw)
    return _delta_prefill_attention(*args, p_via_smem=interpret_mode_active(), **kw)


@functools.partial(jax.jit, static_argnames=("scale", "config", "p_via_smem", "score_stats"))
def _delta_prefill_attention(q, k_delta, v_delta, scales, anchor_k, anchor_v, q_starts, lengths, page_starts,
                             page_sizes, *, scale, config, p_via_smem, score_stats):
    q, fmt = _format_and_query(q, k_delta, anchor_k)
    return prefill_attention_pipeline(
        q, (k_delta, v_delta, scales, anchor_k, anchor_v), q_starts, lengths, page_starts, page_sizes,
        kv_format=fmt, num_kv_heads=k_delta.shape[0], scale=scale, config=config, p_via_smem=p_via_smem,
        score_stats=score_stats)
