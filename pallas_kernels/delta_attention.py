"""Delta-KV (DKVC) decode attention: the paged kernel's pipeline over anchor + low-precision deltas.

Storage (one layer; the engine writes it, this kernel reads it):
  anchor_k, anchor_v [num_kv_heads, anchor_len, head_dim] bf16: resident, never evicted. anchor_len
      is 1 (a mean anchor, broadcast over positions) or a multiple of 256 (position-aligned blocks).
  k_delta, v_delta [num_kv_heads, num_slots, head_dim] float16 ("fp16-delta") or float8_e4m3fn
      ("fp8-delta"): the same slot pool, page tables and lengths as `paged_attention`.
  k_scale, v_scale [num_kv_heads, num_slots // 8] float32: one scale per 8-slot granule per kv head.
The key of sequence b at absolute position t, in slot s = page_starts[b, t // P] + t % P, is
    K = anchor_k[h, t % anchor_len] + k_scale[h, s // 8] * float(k_delta[h, s])     (same for V),
rebuilt in fp32 and rounded to bf16 for the MMA (the paged kernel's K/V precision).

Design
------
The kernel is `paged_attention`'s pipeline (`_build_kernel`: grid, page-table window, SMEM ring,
split-K, online softmax, score statistics) with another `KVFormat` (`DeltaPages` below):
  fetch, per page piece: one TMA copy of the delta rows (1 or 2 bytes per element, so a ring slot
      is 1/2 or 1/1 the bytes of a bf16 one) and one of the piece's scale granules. TMA moves
      multiples of 16 bytes from 16-byte-aligned addresses, i.e. 4 granules: a page of 32+ tokens
      brings exactly its P / 8 granules (P / 8 is then a multiple of 4 and the page start a
      multiple of 32 slots); an 8- or 16-token page brings the aligned group of 4 granules holding
      its 1 or 2, into its own 4-entry area of the slot's scale buffer.
  fetch, per tile (position-aligned anchor only): one TMA copy of the tile's T anchor rows, which are
      contiguous because T (64/128) divides 256 which divides anchor_len, into an anchor ring.
      With a mean anchor (anchor_len 1) the wrapper broadcasts the row to one [64, D] chunk, which each
      CTA copies once (prologue, through its staging tile) and keeps in registers for the whole loop.
  materialize: per 64-row chunk, load the delta (WGMMA layout), the anchor rows and the per-row
      scales (T / 8 scalar SMEM reads selected into a row vector), rebuild K and V in fp32 registers,
      zero the V rows at or past the length (stale slots may hold NaN deltas or scales, and
      0 * NaN = NaN inside the MMA), round to bf16 and store the tile WGMMA reads: in place of the
      anchor tile for a position-aligned anchor (its ring slot is refilled next round anyway), else
      into a bf16 staging tile. `attend` is the paged kernel's, unchanged.
fp8 -> fp32 goes through fp16 (Mosaic GPU converts e4m3 pairwise to f16x2; both steps are exact).

The register-resident mean anchor is the one part with no counterpart in the GPU-tested paged kernel
(a [64, D] bf16 chunk per K and V held across the loop: 64 more registers per thread beside the
accumulator and the fp32 rebuild). Every config lowers to Mosaic GPU on a CPU (checked for fp8/fp16 x
mean/256-row anchors, D=64/128), but register allocation and spills are only decided by ptxas on a GPU.
So the resident path can be switched off (`resident_anchor=False`, or STRATUM_DKVC_RESIDENT_ANCHOR=0 for
every call, the engine's included): a mean anchor is then broadcast to one 256-row position-aligned
block and takes the anchor-ring path, the same TMA + SMEM-ring machinery as the bf16 paged kernel's K/V
(+32 KB SMEM at T=64, D=128: one CTA per SM instead of two).

SMEM per CTA (`delta_smem_bytes`; 227 KB at most) at D=128, 2 stages, B=64 (no split), 4K-16K contexts:
with T=64, fp8 deltas and a mean anchor 99-105 KB, the paged kernel's footprint (two CTAs per SM);
fp16 deltas or a position-aligned anchor add 32 KB each (one CTA per SM). With T=128 only fp8 deltas
fit (164-170 KB with a mean anchor, 228-234 KB with an anchor ring: over the limit at D=128, refused
at the entry with a message); at D=64 every combination fits.
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
    MMA_TRANSFORMS, TileContext, TuningConfig, check_pools_and_tables, decode_attention_pipeline,
    kernel_static_args, reference_attend, reference_token_slots)

# The precision names of the engine flag (--kv-precision) -> delta dtype.
DELTA_DTYPES = {"fp16-delta": jnp.dtype(jnp.float16), "fp8-delta": jnp.dtype(jnp.float8_e4m3fn)}
GRANULE = 8            # slots per scale
SCALE_AREA = 32        # granules per page piece in SMEM: 128 bytes, the TMA destination alignment
ANCHOR_BLOCK = 256     # a position-aligned anchor is a multiple of this many rows
_CHUNK = 64            # rows rebuilt at a time (WGMMA's M; bounds the registers a rebuild needs)
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)
_SMEM_LIMIT = 227 * 1024
RESIDENT_ANCHOR_ENV = "STRATUM_DKVC_RESIDENT_ANCHOR"


def default_resident_anchor() -> bool:
    """Whether a mean anchor is kept in registers (module docstring): $STRATUM_DKVC_RESIDENT_ANCHOR, 1 (the
    default) or 0 (the anchor-ring path)."""
    value = os.environ.get(RESIDENT_ANCHOR_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"${RESIDENT_ANCHOR_ENV} must be 0 (mean anchor through the anchor ring) or 1 (kept in "
                         f"registers), got {value!r}")
    return value == "1"


@dataclasses.dataclass(frozen=True)
class DeltaPages:
    """KV format of the delta kernel (see the module docstring). Inputs, in order: k_delta, v_delta
    [Hkv, S, D] delta dtype; k_scale, v_scale [Hkv, S // 8] f32; anchor_k, anchor_v [Hkv, A, D] bf16
    with A = 64 (a mean anchor broadcast to one 64-row chunk, kept in registers; `resident_anchor`)
    or the anchor's length (a multiple of 256)."""
    delta_dtype: str              # "float16" or "float8_e4m3fn" (a string: static and hashable)
    resident_anchor: bool
    num_inputs: int = 6
    copies_per_page: int = 2      # delta rows + scale granules

    @property
    def copies_per_tile(self) -> int:
        return 0 if self.resident_anchor else 1

    def scratch_types(self, *, stages, block_kv, head_dim):
        dt = jnp.dtype(self.delta_dtype)
        swizzle = min(128, head_dim * dt.itemsize)     # fp8 rows of D=64 are 64 bytes
        ring = plgpu.SMEM((stages, block_kv, head_dim), dt,
                          transforms=(plgpu.TilingTransform((8, swizzle // dt.itemsize)),
                                      plgpu.SwizzleTransform(swizzle)))
        # Scale entries per slot: one 128-byte area (32 granules) per page piece of the tile (T / 8 pieces
        # at most, for 8-token pages): a TMA copy into SMEM must land on a 128-byte boundary (a 16-byte
        # one is not enough: CUDA_ERROR_MISALIGNED_ADDRESS on the H200).
        scales = plgpu.SMEM((stages, (block_kv // GRANULE) * SCALE_AREA), jnp.float32)
        out = [ring, ring, scales, scales]
        if self.resident_anchor:   # staging tiles (the anchor chunk lands in them first), a barrier
            tile = plgpu.SMEM((block_kv, head_dim), jnp.bfloat16, transforms=MMA_TRANSFORMS)
            out += [tile, tile, plgpu.Barrier(num_arrivals=2, num_barriers=1)]
        else:
            anchor_ring = plgpu.SMEM((stages, block_kv, head_dim), jnp.bfloat16, transforms=MMA_TRANSFORMS)
            out += [anchor_ring, anchor_ring]
        return out

    def prologue(self, ctx: TileContext):
        if self.resident_anchor:   # the 64-row anchor chunk -> the first rows of the staging tiles
            _, _, _, _, ak, av = ctx.inputs
            k_st, v_st, bar = ctx.smem[4:]
            plgpu.copy_gmem_to_smem(ak.at[ctx.h], k_st.at[pl.ds(0, _CHUNK)], bar.at[0])
            plgpu.copy_gmem_to_smem(av.at[ctx.h], v_st.at[pl.ds(0, _CHUNK)], bar.at[0])

    def prologue_wait(self, ctx: TileContext):
        """A mean anchor stays in registers for the whole loop: [64, D] bf16 per K and V (32 registers
        each per thread), which saves the SMEM of two resident tiles (the fp8 kernel then fits two
        CTAs per SM at T=64, D=128, as the paged kernel does). Returns (anchor_k, anchor_v) or None."""
        if not self.resident_anchor:
            return None
        k_st, v_st, bar = ctx.smem[4:]
        plgpu.barrier_wait(bar.at[0])
        return k_st[pl.ds(0, _CHUNK)], v_st[pl.ds(0, _CHUNK)]

    def fetch_page(self, ctx: TileContext, src, row, n, slot, k_bar, v_bar):
        kd, vd, ks, vs, _, _ = ctx.inputs
        k_ring, v_ring, k_sc, v_sc = ctx.smem[:4]
        dst = (slot, pl.ds(row, n)) if n < ctx.block_kv else (slot,)
        plgpu.copy_gmem_to_smem(kd.at[ctx.h, pl.ds(src, n)], k_ring.at[dst], k_bar)
        plgpu.copy_gmem_to_smem(vd.at[ctx.h, pl.ds(src, n)], v_ring.at[dst], v_bar)
        granule = lax.shift_right_logical(src, 3)
        if n >= 32:     # P / 8 granules from a multiple of 4 (src is a multiple of 32)
            g_src, count = granule, n // GRANULE
        else:           # the 16-byte group of 4 granules holding this page's 1 or 2
            g_src, count = granule - lax.rem(granule, 4), 4
        g_src = pl.multiple_of(g_src, 4)
        g_dst = SCALE_AREA * (row // n)      # the piece's own 128-byte area
        plgpu.copy_gmem_to_smem(ks.at[ctx.h, pl.ds(g_src, count)], k_sc.at[slot, pl.ds(g_dst, count)], k_bar)
        plgpu.copy_gmem_to_smem(vs.at[ctx.h, pl.ds(g_src, count)], v_sc.at[slot, pl.ds(g_dst, count)], v_bar)

    def fetch_tile(self, ctx: TileContext, t0, slot, k_bar, v_bar):
        if self.resident_anchor:
            return
        _, _, _, _, ak, av = ctx.inputs
        k_anc, v_anc = ctx.smem[4:6]
        a0 = pl.multiple_of(lax.rem(t0, ak.shape[1]), ctx.block_kv)
        plgpu.copy_gmem_to_smem(ak.at[ctx.h, pl.ds(a0, ctx.block_kv)], k_anc.at[slot], k_bar)
        plgpu.copy_gmem_to_smem(av.at[ctx.h, pl.ds(a0, ctx.block_kv)], v_anc.at[slot], v_bar)

    def _scale_index(self, ctx: TileContext, tile, j):
        """Index in a slot's scale buffer of the tile's granule j (rows 8j..8j+7), as fetch_page put it."""
        log2_p = ctx.log2_p
        log2_n = jnp.minimum(log2_p, ctx.block_kv.bit_length() - 1)     # rows per piece: min(P, T)
        piece = lax.shift_right_logical(jnp.int32(GRANULE * j), log2_n)
        within = jnp.int32(j) & (lax.shift_left(jnp.int32(1), log2_n - 3) - 1)   # granule within the piece
        first_page = lax.shift_right_logical(tile * ctx.block_kv, log2_p)
        # The same clamp as the fetch (copies past the last page re-read it).
        entry = ctx.page_entry(jnp.minimum(first_page + piece, ctx.n_pages - 1))
        # 8/16-token pages: their granules sit at their place in the aligned group of 4 that was copied.
        offset = jnp.where(log2_p <= 4, lax.shift_right_logical(entry, 3) & 3, 0)
        return SCALE_AREA * piece + offset + within

    def materialize(self, ctx: TileContext, state, slot, tile, n_valid):
        T, D = ctx.block_kv, ctx.head_dim
        k_ring, v_ring, k_sc, v_sc = ctx.smem[:4]
        if self.resident_anchor:
            k_anc, v_anc = state
            k_out, v_out, _ = ctx.smem[4:]
            anchor = lambda value, r: value
            # The staging tiles were the previous tile's WGMMA operands (or, at the first tile, where
            # the anchor was loaded from): every warp must be past its reads before any thread
            # overwrites them (commit_smem syncs the warpgroup).
            plgpu.commit_smem()
        else:
            k_anc, v_anc = ctx.smem[4:6]
            k_out, v_out = k_anc.at[slot], v_anc.at[slot]     # rebuilt in place
            anchor = lambda ref, r: ref[slot, pl.ds(r, _CHUNK)]
        idx = [self._scale_index(ctx, tile, j) for j in range(T // GRANULE)]
        granule_of_row = lax.shift_right_logical(
            plgpu.broadcasted_iota(jnp.int32, (_CHUNK,), 0, layout=_ROW_LAYOUT), 3)
        rows = plgpu.broadcasted_iota(jnp.int32, (_CHUNK, D), 0, layout=plgpu.Layout.WGMMA)

        def rebuild(ring, sc, anc, out, r0, zero_past_end):
            scale = plgpu.layout_cast(jnp.zeros((_CHUNK,), jnp.float32), _ROW_LAYOUT)
            for j in range(_CHUNK // GRANULE):
                scale = jnp.where(granule_of_row == j, sc[slot, idx[r0 // GRANULE + j]], scale)
            delta = ring[slot, pl.ds(r0, _CHUNK)]
            if delta.dtype.itemsize == 1:
                delta = delta.astype(jnp.float16)
            scale = lax.broadcast_in_dim(scale, (_CHUNK, D), [0])
            x = anchor(anc, r0).astype(jnp.float32) + scale * delta.astype(jnp.float32)
            if zero_past_end:
                x = jnp.where(rows < n_valid - r0, x, 0.0)
            out[pl.ds(r0, _CHUNK)] = x.astype(jnp.bfloat16)

        ctx.wait_k(slot)
        for r0 in range(0, T, _CHUNK):
            rebuild(k_ring, k_sc, k_anc, k_out, r0, False)   # K rows past the end: their scores are masked
        ctx.wait_v(slot)
        for r0 in range(0, T, _CHUNK):
            rebuild(v_ring, v_sc, v_anc, v_out, r0, True)
        plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)
        return k_out, v_out


def delta_smem_bytes(config: TuningConfig, head_dim: int, delta_dtype, *, resident_anchor: bool, max_pages: int,
                     out_itemsize: int = 4) -> int:
    """Approximate SMEM footprint of one CTA of the delta kernel (227 KB max; <= ~113 KB for two CTAs
    per SM): the paged kernel's q/out/table share plus the delta ring, scales and bf16 tiles."""
    T, S = config.block_kv, config.num_stages
    rest = config.smem_bytes(head_dim, max_pages, out_itemsize) - 2 * S * T * head_dim * 2   # minus the bf16 ring
    ring = 2 * S * T * head_dim * jnp.dtype(delta_dtype).itemsize + 2 * S * (T // GRANULE) * SCALE_AREA * 4
    tiles = 2 * T * head_dim * 2 if resident_anchor else 2 * S * T * head_dim * 2
    return rest + ring + tiles


# ---------------------------------------------------------------------------------------------
# Entry checks, reference
# ---------------------------------------------------------------------------------------------

def _check_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes):
    def fail(msg):
        raise ValueError(f"delta_attention: {msg}")
    check_pools_and_tables("delta_attention", q, ("k_delta", k_delta), ("v_delta", v_delta), lengths,
                           page_starts, page_sizes)
    if k_delta.dtype != v_delta.dtype or k_delta.dtype not in DELTA_DTYPES.values():
        fail(f"k_delta/v_delta must both be float16 (fp16-delta) or float8_e4m3fn (fp8-delta), got "
             f"{k_delta.dtype}/{v_delta.dtype}")
    num_kv_heads, num_slots, head_dim = k_delta.shape
    want = (num_kv_heads, num_slots // GRANULE)
    for name, a in (("k_scale", k_scale), ("v_scale", v_scale)):
        if a.shape != want or a.dtype != jnp.float32:
            fail(f"{name} must be float32 [num_kv_heads, num_slots // 8] = {list(want)} (one scale per "
                 f"8-slot granule), got {a.dtype} {list(a.shape)}")
    for name, a in (("anchor_k", anchor_k), ("anchor_v", anchor_v)):
        if a.ndim != 3 or a.shape[0] != num_kv_heads or a.shape[2] != head_dim or a.dtype != jnp.bfloat16:
            fail(f"{name} must be bfloat16 [num_kv_heads={num_kv_heads}, anchor_len, head_dim={head_dim}], "
                 f"got {a.dtype} {list(a.shape)}")
        if a.shape[1] != 1 and a.shape[1] % ANCHOR_BLOCK:
            fail(f"{name}: anchor_len must be 1 (mean anchor) or a multiple of {ANCHOR_BLOCK} "
                 f"(position-aligned), got {a.shape[1]}")
    if anchor_v.shape != anchor_k.shape:
        fail(f"anchor_k and anchor_v must have the same shape, got {anchor_k.shape} and {anchor_v.shape}")


def rebuild_reference(anchor, scale, delta, slot, t):
    """Rebuilt keys/values in fp32: [Hkv, B, T, D] from anchor [Hkv, A, D], scale [Hkv, S // 8], delta
    [Hkv, S, D], slot [B, T] int32 (the pool slot of token t of sequence b) and t [T] positions."""
    a = anchor[:, t % anchor.shape[1]].astype(jnp.float32)                       # [Hkv, T, D]
    return a[:, None] + scale[:, slot // GRANULE][..., None] * delta[:, slot].astype(jnp.float32)


def delta_attention_reference(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts,
                              page_sizes, *, sm_scale=None, soft_cap=None, return_score_stats: bool = False):
    """Pure-jnp delta decode attention, fp32 math, same contract as `delta_attention` (K/V rebuilt in fp32,
    not rounded to bf16). For tests and small shapes: it gathers a dense [Hkv, B, max_pages * 256, D] view."""
    _check_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes)
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
                    return_score_stats: bool = False,
                    resident_anchor: bool | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Decode attention over a delta-KV pool (Mosaic GPU kernel): one query per sequence, keys at
    positions 0..lengths[b]-1 rebuilt as anchor + scale * delta (module docstring).

    Args:
      q: [batch, num_q_heads, head_dim], bf16 or fp32 (rounded to bf16 for the MMA).
      k_delta, v_delta: [num_kv_heads, num_slots, head_dim] float16 or float8_e4m3fn (both the same).
      k_scale, v_scale: [num_kv_heads, num_slots // 8] float32, one scale per 8-slot granule.
      anchor_k, anchor_v: [num_kv_heads, anchor_len, head_dim] bf16, anchor_len 1 or a multiple of 256.
      lengths, page_starts, page_sizes, sm_scale, soft_cap, config, interpret, return_score_stats: as in
        `paged_attention` (pages of 8..256 tokens, mixed per batch; length 0 gives zeros; slots, deltas
        and scales outside the live tokens are never used, even if NaN).
      resident_anchor: a mean anchor (anchor_len 1) in registers (True) or through the anchor ring as a
        256-row block (False); None: `default_resident_anchor()`. Must be None or False for anchor_len > 1.

    Returns:
      [batch, num_q_heads, head_dim] in q.dtype; with return_score_stats also score_var [batch,
      num_q_heads] float32 (as in `paged_attention`, over the rebuilt bf16 keys).
    """
    _check_inputs(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes)
    config, scale, cap = kernel_static_args("delta_attention", q, k_delta.shape[0], sm_scale, soft_cap, config)
    if config.block_kv not in (64, 128):
        raise ValueError(f"delta_attention: block_kv must be 64 or 128, got {config.block_kv}")
    mean = anchor_k.shape[1] == 1
    if resident_anchor and not mean:
        raise ValueError(f"delta_attention: resident_anchor=True needs a mean anchor (anchor_len 1), got "
                         f"anchor_len {anchor_k.shape[1]}")
    resident = mean and (default_resident_anchor() if resident_anchor is None else resident_anchor)
    if mean and not resident:      # the mean as one position-aligned block: the anchor-ring path
        block = (anchor_k.shape[0], ANCHOR_BLOCK, anchor_k.shape[2])
        anchor_k, anchor_v = jnp.broadcast_to(anchor_k, block), jnp.broadcast_to(anchor_v, block)
    smem = delta_smem_bytes(config, q.shape[2], k_delta.dtype, resident_anchor=resident,
                            max_pages=page_starts.shape[1],
                            out_itemsize=q.dtype.itemsize if config.num_splits == 1 else 4)
    if smem > _SMEM_LIMIT:
        raise ValueError(f"delta_attention: {config} needs about {smem // 1024} KB of shared memory per CTA, more "
                         f"than the {_SMEM_LIMIT // 1024} KB a Hopper SM has; use block_kv=64 or fewer num_stages")
    kw = dict(scale=scale, soft_cap=cap, config=config, score_stats=bool(return_score_stats))
    args = (q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes)
    if interpret:
        with mosaic_gpu_interpret():
            return _delta_attention(*args, p_via_smem=True, **kw)
    return _delta_attention(*args, p_via_smem=interpret_mode_active(), **kw)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "config", "p_via_smem", "score_stats"))
def _delta_attention(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts, page_sizes, *,
                     scale, soft_cap, config, p_via_smem, score_stats):
    num_kv_heads, _, head_dim = k_delta.shape
    resident = anchor_k.shape[1] == 1
    if resident:   # a mean anchor: one [64, D] chunk per head that each CTA copies once
        tile = (num_kv_heads, _CHUNK, head_dim)
        anchor_k, anchor_v = jnp.broadcast_to(anchor_k, tile), jnp.broadcast_to(anchor_v, tile)
    fmt = DeltaPages(delta_dtype=jnp.dtype(k_delta.dtype).name, resident_anchor=resident)
    return decode_attention_pipeline(
        q, (k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v), lengths, page_starts, page_sizes,
        kv_format=fmt, num_kv_heads=num_kv_heads, scale=scale, soft_cap=soft_cap, config=config,
        p_via_smem=p_via_smem, score_stats=score_stats)
