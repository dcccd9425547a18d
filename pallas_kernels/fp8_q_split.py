"""q's fp8 parts for the swapped decode kernel's float8 pools, in one Pallas kernel (Mosaic GPU, Hopper).

The swapped kernel attends over float8 e4m3 pools with q split into e4m3 parts (`split_rows_fp8` in
pallas_kernels/swapped_decode_attention.py: a power-of-two row scale, then each part the e4m3 rounding of what the
parts before it left) and, for one 8-row q block a CTA, the parts stacked one after the other (`stack_q_parts`).
In XLA that is three kernels a call before the attention kernel (q times its head scale, the row maxima, the
parts in their layout: ~5.6 us at B=64, Hq=32, D=128 on the H200, BENCHMARKS.md #12 sessions 23-25), each a
launch and a ramp for under a megabyte. This kernel does all of it in one launch.

*Grid.* One CTA (one warpgroup) per block of 8 q rows: it TMA-loads the rows [8, D] (bf16 or f32) and their 8
scales, multiplies in fp32, takes each row's largest power of two (the exponent bits of |x|) as a full reduction
of the [8, D] tile masked to that row, and writes the parts [terms * 8, D] (stacked: part t at rows 8t..8t+7,
`stack_q_parts`' layout) or [terms, 8, D] (unstacked) and the 8 unscales.

*The scale.* `row_scale` has P entries and row r takes row_scale[r % P]: the engine's fold passes the per-q-head
scale (P = Hq, rows = b * Hq + head), so no [rows] broadcast runs in XLA before the kernel.

Numerics: bit for bit `split_rows_fp8(x.astype(float32) * row_scale[rows % P, None], terms)` (and
`stack_q_parts` of it): the same fp32 product, the same power-of-two unscale (a max of exact values), the same
exact division by it, and `lax.reduce_precision(., 4, 3)` as XLA computes it, done on the int32 bits (the mantissa
rounded to 3 bits, to nearest even; then values under 2^-6 flushed to a signed zero and values past 240 to
infinity, which the row scale keeps out of reach), so no excess-precision rewrite can fold it away (the reason
split_rows_fp8 uses reduce_precision, not a cast round trip).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret

ROW_BLOCK = 8          # q rows a CTA takes: the swapped kernel's q block (tiled TMA boxes want 8-row multiples)
HEAD_DIMS = (64, 128)
_F8 = jnp.float8_e4m3fn


def reduce_precision_e4m3_bits(x):
    """`lax.reduce_precision(x, exponent_bits=4, mantissa_bits=3)` of float32 x (no NaN in x), on its bits as XLA
    lowers it: the mantissa rounded to 3 bits, to nearest even, on the integer bits (a carry may raise the
    exponent); then an exponent field <= 120 (|x| < 2^-6) gives a signed zero and one > 134 a signed infinity."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    round_bias = jnp.int32(0x7FFFF) + lax.shift_right_logical(bits & 0x100000, jnp.int32(20))
    bits = (bits + round_bias) & jnp.int32(-0x100000)            # ~0xFFFFF: the 20 dropped mantissa bits cleared
    exponent = bits & 0x7F800000
    sign = bits & jnp.int32(-0x80000000)
    bits = jnp.where(exponent > (134 << 23), sign | 0x7F800000, jnp.where(exponent <= (120 << 23), sign, bits))
    return lax.bitcast_convert_type(bits, jnp.float32)


def e4m3_parts(rest, terms: int) -> list:
    """In a kernel: rest (f32, already divided by its unscale) -> its `terms` e4m3 parts, each the rounding of what
    the parts before it left (`reduce_precision_e4m3_bits`); the last a plain cast, which keeps e4m3's subnormals
    and needs no f32 value back."""
    parts = []
    for _ in range(terms - 1):
        part = reduce_precision_e4m3_bits(rest)
        parts.append(part.astype(_F8))
        rest = rest - part
    parts.append(rest.astype(_F8))
    return parts


def split_block_in_kernel(q_rows, row_scale, parts_smem, unscale_smem, *, terms: int):
    """Inside a kernel (one warpgroup): one block of 8 q rows split into e4m3 parts, as `split_rows_fp8` and
    `stack_q_parts` compute them, written into the swapped decode kernel's stacked q tile: the attention kernel's
    own q prologue (`SwappedConfig.fp8_q_in_kernel`), so no kernel runs before it.

    q_rows: GMEM ref [8, D] (bf16 or f32), the block's rows; row_scale: GMEM ref [8] f32, each row's scale (the
    fold's s_k); parts_smem: SMEM ref [terms * 8, D] e4m3 with the WGMMA operand transforms (part t at rows
    8t..8t+7); unscale_smem: an SMEM ref of 8 int32 the unscales pass through. Returns the 8 unscales as a [8] f32
    vector in the WGMMA accumulator's column layout (`Layout.WGMMA.reduce(0)`: one value per column of an [M, 8]
    MMA result), ready to scale S^T's columns.

    The block is loaded transposed ([D, 8], the WGMMA_TRANSPOSED layout, straight from GMEM), since an e4m3 tile is
    stored from registers only from that layout into the transposed view of the swizzled tile; each row's unscale
    is then a column max. That vector has no layout cast to the accumulator's column layout (and layout inference
    found no solution for a broadcast, cast and second reduction inside the attention kernel), so it goes through
    SMEM as int32 bits (the caller's table window has room for 8 more entries in its allocation). One proxy fence
    and warpgroup barrier covers the parts (the MMA reads them through the async proxy) and the unscales. Numerics:
    bit for bit the XLA split's (the same fp32 product, power-of-two unscale, division, and
    `reduce_precision_e4m3_bits`)."""
    transposed = plgpu.Layout.WGMMA_TRANSPOSED
    d = q_rows.shape[1]
    x = plgpu.load(q_rows.transpose((1, 0)), layout=transposed, optimized=False).astype(jnp.float32)   # [D, 8]
    scale = plgpu.load(row_scale, layout=transposed.reduce(0), optimized=False)
    x = x * lax.broadcast_in_dim(scale, (d, ROW_BLOCK), [1])
    pow2_floor = lax.bitcast_convert_type(lax.bitcast_convert_type(jnp.abs(x), jnp.int32) & 0x7F800000, jnp.float32)
    unscale = jnp.clip(pow2_floor * 2.0 ** -6, 2.0 ** -100, 2.0 ** 100).max(axis=0)       # monotone maps, then max
    for t, part in enumerate(e4m3_parts(x * lax.broadcast_in_dim(1.0 / unscale, (d, ROW_BLOCK), [1]), terms)):
        parts_smem.at[pl.ds(t * ROW_BLOCK, ROW_BLOCK)].transpose((1, 0))[...] = part
    unscale_smem[...] = lax.bitcast_convert_type(unscale, unscale_smem.dtype)
    plgpu.commit_smem()
    columns = plgpu.load(unscale_smem, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
    return lax.bitcast_convert_type(columns, jnp.float32)


def check_inputs(x, row_scale, terms: int) -> None:
    """Raises ValueError, saying what to fix, for what the kernel does not take."""
    if x.ndim != 2 or x.dtype not in (jnp.bfloat16, jnp.float32):
        raise ValueError(f"fp8_q_split: x must be [rows, D] bfloat16 or float32, got {x.shape} {x.dtype}")
    rows, d = x.shape
    if d not in HEAD_DIMS or rows % ROW_BLOCK:
        raise ValueError(f"fp8_q_split: x's rows ({rows}) must be a multiple of {ROW_BLOCK} and D ({d}) one of "
                         f"{HEAD_DIMS}")
    if row_scale.ndim != 1 or row_scale.dtype != jnp.float32 or row_scale.shape[0] % ROW_BLOCK \
            or rows % row_scale.shape[0]:
        raise ValueError(f"fp8_q_split: row_scale must be [P] float32 with P a multiple of {ROW_BLOCK} that divides "
                         f"the rows ({rows}), got {row_scale.shape} {row_scale.dtype}")
    if terms not in (1, 2, 3, 4):
        raise ValueError(f"fp8_q_split: terms must be 1..4, got {terms}")


def fp8_q_split(x, row_scale, *, terms: int, stacked: bool, interpret: bool = False):
    """q rows -> their e4m3 parts and unscales, as `split_rows_fp8` (module docstring).

    Args:
      x: [rows, D] bfloat16 or float32 q rows (`q_row_blocks`' layout); rows a multiple of 8, D 64 or 128.
      row_scale: [P] float32, row r scaled by row_scale[r % P] before the split (P a multiple of 8 dividing rows).
      terms: e4m3 parts a row (1..4).
      stacked: parts as [rows * terms, D], each 8-row block's parts one after the other (`stack_q_parts`); else
        [terms, rows, D].
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns (parts float8_e4m3fn, unscale [rows] float32) with x * scale ~ sum(parts) * unscale[:, None].
    """
    check_inputs(x, row_scale, terms)
    if interpret:
        with mosaic_gpu_interpret():
            return _fp8_q_split(x, row_scale, terms=terms, stacked=stacked, interpreted=True)
    return _fp8_q_split(x, row_scale, terms=terms, stacked=stacked, interpreted=interpret_mode_active())


@functools.partial(jax.jit, static_argnames=("terms", "stacked", "interpreted"))
def _fp8_q_split(x, row_scale, *, terms, stacked, interpreted=False):
    del interpreted       # keys jit's cache only: interpreted and compiled traces never share an entry
    rows, d = x.shape
    return _build_kernel(rows=rows, head_dim=d, period=row_scale.shape[0], terms=terms, stacked=stacked,
                         x_dtype=x.dtype)(x, row_scale)


def _build_kernel(*, rows, head_dim, period, terms, stacked, x_dtype):
    """f(x [rows, D], row_scale [P]) -> (parts, unscale [rows]) (module docstring)."""
    shape = (ROW_BLOCK, head_dim)
    layout = plgpu.Layout.WG_STRIDED(shape, 1)

    def body(x_gmem, scale_gmem, parts_gmem, unscale_gmem, x_smem, scale_smem, parts_smem, unscale_smem, loaded):
        r0 = pl.multiple_of(lax.axis_index("rows") * ROW_BLOCK, ROW_BLOCK)
        s0 = pl.multiple_of(lax.rem(r0, period), ROW_BLOCK)
        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(r0, ROW_BLOCK)], x_smem, loaded)
        plgpu.copy_gmem_to_smem(scale_gmem.at[pl.ds(s0, ROW_BLOCK)], scale_smem, loaded)
        plgpu.barrier_wait(loaded)

        row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=layout)
        x = x_smem[...].astype(jnp.float32)
        scale = jnp.zeros(shape, jnp.float32)
        for i in range(ROW_BLOCK):
            scale = jnp.where(row == i, scale_smem[i], scale)
        x = x * scale
        # Each row's unscale: its largest |x| with the mantissa cleared (a power of two, 0 if tiny) times 2^-6,
        # clipped (`split_rows_fp8`); one masked full reduction a row.
        pow2_floor = lax.bitcast_convert_type(lax.bitcast_convert_type(jnp.abs(x), jnp.int32) & 0x7F800000,
                                              jnp.float32)
        unscale = jnp.zeros(shape, jnp.float32)
        for i in range(ROW_BLOCK):
            u = jnp.clip(jnp.max(jnp.where(row == i, pow2_floor, 0.0)) * 2.0 ** -6, 2.0 ** -100, 2.0 ** 100)
            unscale_smem[i] = u
            unscale = jnp.where(row == i, u, unscale)
        for t, part in enumerate(e4m3_parts(x * (1.0 / unscale), terms)):
            dst = parts_smem.at[pl.ds(t * ROW_BLOCK, ROW_BLOCK)] if stacked else parts_smem.at[t]
            dst[...] = part
        plgpu.commit_smem()
        if stacked:
            plgpu.copy_smem_to_gmem(parts_smem, parts_gmem.at[pl.ds(r0 * terms, ROW_BLOCK * terms)])
        else:
            plgpu.copy_smem_to_gmem(parts_smem, parts_gmem.at[:, pl.ds(r0, ROW_BLOCK)])
        plgpu.copy_smem_to_gmem(unscale_smem, unscale_gmem.at[pl.ds(r0, ROW_BLOCK)])
        plgpu.wait_smem_to_gmem(0)

    # The name a profile shows: fp8_q_split_mosaic_gpu_kernel.
    body.__name__ = body.__qualname__ = "fp8_q_split"
    parts_shape = (rows * terms, head_dim) if stacked else (terms, rows, head_dim)
    smem_parts = (ROW_BLOCK * terms, head_dim) if stacked else (terms, ROW_BLOCK, head_dim)
    return plgpu.kernel(
        body, out_type=(jax.ShapeDtypeStruct(parts_shape, _F8), jax.ShapeDtypeStruct((rows,), jnp.float32)),
        grid=(rows // ROW_BLOCK,), grid_names=("rows",),
        scratch_types=[plgpu.SMEM(shape, x_dtype), plgpu.SMEM((ROW_BLOCK,), jnp.float32),
                       plgpu.SMEM(smem_parts, _F8), plgpu.SMEM((ROW_BLOCK,), jnp.float32),
                       plgpu.Barrier(num_arrivals=2)])
