"""q/k/v's split-K sum, RoPE on q and k, and the K/V rows written into their slot pools, in one kernel (a Pallas
Mosaic GPU kernel for Hopper).

In a decode step the q/k/v projection (`decode_matmul`) leaves fp32 partials [S, R, N] (its split-K), and XLA ran
three small kernels on them before attention: q's sum and RoPE (a concatenate fusion), K's sum, RoPE and scatter
into the pool, V's sum and scatter. Each moves well under a megabyte and costs ~1.5-2.6 us, mostly launch, ramp
and drain (BENCHMARKS.md, #18 session 26). This kernel does all three in one launch.

Design
------
*Grid.* One CTA (one warpgroup) per (head, block of 8 rows), over the Hq + 2 Hkv heads of the fused q/k/v
columns (q heads, then k heads, then v heads, as the fused weight lays them out). A CTA copies its head's
partials as two halves [S, 8, D/2] (RoPE pairs dimension i with i + D/2: HF's rotate_half layout), with cos and
sin [8, D/2] and the rows' write slots [8], sums the partials in fp32 and rounds to bf16 (what `decode_matmul`
returns), rotates q and k heads in fp32 and rounds to bf16 (what the model's `apply_rope` does), and writes:
q heads to the [R, Hq * D] output; k and v heads row by row into pool[h, slot, :] with a TMA store per half-row,
skipping slots >= num_slots (padding rows: kv/slot_write.py).

*In place.* The pools are passed as `jax.Ref`s (`jax.new_ref`), so the kernel writes into the pool's buffer:
XLA aliases the custom call's output to the pool operand (`output_operand_aliases`), as it updates a donated
pool in place for the scatter this replaces.

*L2 prefetch of attention's first tiles (optional).* The kernel moves under a megabyte and leaves HBM idle, and the
decode attention kernel after it waits on the first K/V tile of every row before anything else. Given the rows' page
tables and `prefetch_tokens`, each k (v) head's CTAs also prefetch into L2 the first `prefetch_tokens` keys (values)
of their rows, one TMA prefetch a page piece as the attention kernel copies them (`issue_tile_copies`). No value
changes.

Numerics: the reference (`rope_kv_write_reference`) sums the partials over S in order, rounds to bf16, then
rotates in fp32 as `apply_rope` does; the kernel does the same operations, so outputs agree to the last bit
except where XLA reassociates the split-K sum or contracts the rotation into FMAs.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.decode_matmul import sum_partials
from pallas_kernels.paged_tiles import issue_tile_copies, page_classes, sequence_scalars

ROW_BLOCK = 8          # rows a CTA takes (tiled TMA boxes want 8-row multiples; a decode step has 8-128 rows)
HEAD_DIMS = (32, 64, 128)


def rotate_half_reference(x, cos, sin):
    """x [R, heads, D] -> RoPE-rotated, in x.dtype: dimension i pairs with i + D/2, computed in fp32 with cos and sin
    [R, D/2] fp32 (llama.apply_rope's rotation)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def row_inv_rms(sumsq, k: int, eps: float):
    """RowNorm's scale: rsqrt(sum over splits in order / k + eps) -> [R] fp32, as the kernel computes it."""
    total = sumsq[0]
    for s in range(1, sumsq.shape[0]):
        total = total + sumsq[s]
    return lax.rsqrt(total * (1.0 / k) + eps)


def rope_kv_write_reference(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads: int, num_kv_heads: int,
                            row_norm: RowNorm | None = None):
    """`rope_kv_write` in jnp on arrays: returns (q [R, Hq, D] bf16, k_pool, v_pool) with the pools updated."""
    if row_norm is None:
        y = sum_partials(parts, k_pool.dtype)
    else:
        y = (sum_partials(parts, jnp.float32) * row_inv_rms(row_norm.sumsq, row_norm.k, row_norm.eps)[:, None]
             ).astype(k_pool.dtype)
    r, d = y.shape[0], k_pool.shape[-1]
    q, k, v = jnp.split(y.reshape(r, num_q_heads + 2 * num_kv_heads, d), [num_q_heads, num_q_heads + num_kv_heads],
                        axis=1)
    q, k = rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin)
    k_pool = k_pool.at[:, slots].set(k.transpose(1, 0, 2), mode="drop")
    v_pool = v_pool.at[:, slots].set(v.transpose(1, 0, 2), mode="drop")
    return q, k_pool, v_pool


def check_inputs(parts, cos, sin, slots, k_pool, v_pool, num_q_heads: int, num_kv_heads: int) -> None:
    """Raises ValueError, saying what to fix, for shapes and dtypes the kernel does not take."""
    if parts.ndim != 3 or parts.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"rope_kv_write: parts must be [S, R, N] float32 or bfloat16, got {parts.shape} {parts.dtype}")
    _, r, n = parts.shape
    if k_pool.ndim != 3 or k_pool.shape != v_pool.shape or k_pool.dtype != jnp.bfloat16 or v_pool.dtype != jnp.bfloat16:
        raise ValueError(f"rope_kv_write: k_pool and v_pool must be [Hkv, num_slots, D] bfloat16 of one shape, got "
                         f"{k_pool.shape} {k_pool.dtype} and {v_pool.shape} {v_pool.dtype}")
    hkv, _, d = k_pool.shape
    if d not in HEAD_DIMS:
        raise ValueError(f"rope_kv_write: head_dim must be one of {HEAD_DIMS}, got {d}")
    if hkv != num_kv_heads or n != (num_q_heads + 2 * num_kv_heads) * d:
        raise ValueError(f"rope_kv_write: parts' N ({n}) must be (num_q_heads + 2 * num_kv_heads) * head_dim = "
                         f"({num_q_heads} + 2 * {num_kv_heads}) * {d}, and the pools must have {num_kv_heads} heads "
                         f"(they have {hkv})")
    if r % ROW_BLOCK:
        raise ValueError(f"rope_kv_write: R ({r}) must be a multiple of {ROW_BLOCK}")
    if cos.shape != (r, d // 2) or sin.shape != (r, d // 2) or cos.dtype != jnp.float32 or sin.dtype != jnp.float32:
        raise ValueError(f"rope_kv_write: cos and sin must be [R, D/2] = [{r}, {d // 2}] float32, got {cos.shape} "
                         f"{cos.dtype} and {sin.shape} {sin.dtype}")
    if slots.shape != (r,) or slots.dtype != jnp.int32:
        raise ValueError(f"rope_kv_write: slots must be [R] = [{r}] int32, got {slots.shape} {slots.dtype}")


class FirstTiles(NamedTuple):
    """What the decode attention kernel reads first, for `rope_kv_write`'s L2 prefetch: the first `tokens` keys of
    each of the first T rows (the decode rows; T <= R). page_starts [T, W] int32, page_sizes [T]
    int32 and lengths [T] int32 (each row's keys after this step's write; 0: none), as the attention kernel gets
    them."""
    page_starts: jax.Array
    page_sizes: jax.Array
    lengths: jax.Array


class RowNorm(NamedTuple):
    """The layer's input RMSNorm folded into the q/k/v projection (pallas_kernels/norm_fold.py): its weight is in the
    projection's weight, and each row's scale comes from sumsq [S, R] fp32, the sums of x^2 over each K split of the
    projection's input (`norm_fold.decode_matmul_partials_sumsq`); k the norm's width, eps its epsilon."""
    sumsq: jax.Array
    k: int
    eps: float


PREFETCH_TOKENS = (64, 128)      # the attention kernel's tile sizes


def rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads: int, num_kv_heads: int,
                  first_tiles: FirstTiles | None = None, prefetch_tokens: int = 64, row_norm: RowNorm | None = None,
                  interpret: bool = False):
    """q/k/v from the q/k/v projection's partials, RoPE on q and k, K and V written into the pools (module docstring).

    Args:
      parts: [S, R, (Hq + 2 Hkv) * D] float32 split-K partials (or bfloat16 with S = 1) of the fused q/k/v
        projection (`decode_matmul_partials`); R a multiple of 8.
      cos, sin: [R, D/2] float32, cos and sin of each row's RoPE angles (position * inverse frequency).
      slots: [R] int32 write slot of each row; a slot >= num_slots (padding rows) is not written, a negative one
        counts from the end (as the scatter it replaces, `.at[].set(mode="drop")`).
      k_pool, v_pool: [Hkv, num_slots, D] bfloat16 arrays.
      first_tiles: the decode rows' page tables (`FirstTiles`), where the k/v heads' CTAs should also prefetch into
        L2 the first `prefetch_tokens` keys and values of each of those rows (module docstring); None: no prefetch.
      prefetch_tokens: keys a row to prefetch, one of PREFETCH_TOKENS (the attention kernel's tile).
      row_norm: the input norm folded into the projection (pallas_kernels/norm_fold.py): each row's summed q/k/v is
        scaled by `row_inv_rms` of these sums of squares before it is rounded; None: no scale.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns (q [R, Hq, D] bfloat16 rotated, k_pool, v_pool) with row r's k and v at slot slots[r] of each head.
    """
    check_inputs(parts, cos, sin, slots, k_pool, v_pool, num_q_heads, num_kv_heads)
    kw = {}
    if first_tiles is not None:
        check_first_tiles(first_tiles, parts.shape[1], prefetch_tokens)
        kw = dict(first_tiles=first_tiles, prefetch_tokens=prefetch_tokens)
    if row_norm is not None:
        check_row_norm(row_norm, parts.shape[1])
        kw.update(row_sumsq=row_norm.sumsq, norm_k=row_norm.k, norm_eps=row_norm.eps)
    if interpret:
        with mosaic_gpu_interpret():
            return _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=num_q_heads,
                                  num_kv_heads=num_kv_heads, interpreted=True, **kw)
    return _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          interpreted=interpret_mode_active(), **kw)


def check_row_norm(row_norm: RowNorm, rows: int) -> None:
    """Raises ValueError, saying what to fix, for a RowNorm `rope_kv_write` cannot apply."""
    sumsq, k, eps = row_norm
    if sumsq.ndim != 2 or sumsq.shape[1] != rows or sumsq.dtype != jnp.float32 or not 1 <= sumsq.shape[0] <= 64:
        raise ValueError(f"rope_kv_write: row_norm.sumsq must be [S, R] = [S, {rows}] float32 with 1 <= S <= 64, got "
                         f"{sumsq.shape} {sumsq.dtype}")
    if not (isinstance(k, int) and k > 0 and isinstance(eps, float) and eps > 0):
        raise ValueError(f"rope_kv_write: row_norm.k must be a positive int (the norm's width) and eps a positive "
                         f"float, got {k!r} and {eps!r}")


def check_first_tiles(first_tiles: FirstTiles, rows: int, prefetch_tokens: int) -> None:
    """Raises ValueError, saying what to fix, for page tables `rope_kv_write` cannot prefetch from."""
    if prefetch_tokens not in PREFETCH_TOKENS:
        raise ValueError(f"rope_kv_write: prefetch_tokens must be one of {PREFETCH_TOKENS}, got {prefetch_tokens}")
    starts, sizes, lengths = first_tiles
    if starts.ndim != 2 or starts.dtype != jnp.int32 or not 1 <= starts.shape[0] <= rows or starts.shape[1] < 1:
        raise ValueError(f"rope_kv_write: first_tiles.page_starts must be [T, W] int32 with 1 <= T <= R = {rows} and "
                         f"W >= 1, got {starts.shape} {starts.dtype}")
    for name, a in (("page_sizes", sizes), ("lengths", lengths)):
        if a.shape != (starts.shape[0],) or a.dtype != jnp.int32:
            raise ValueError(f"rope_kv_write: first_tiles.{name} must be [T] = [{starts.shape[0]}] int32, got "
                             f"{a.shape} {a.dtype}")


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "interpreted", "prefetch_tokens", "norm_k",
                                             "norm_eps"))
def _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads, num_kv_heads, interpreted=False,
                   first_tiles=None, prefetch_tokens=0, row_sumsq=None, norm_k=0, norm_eps=0.0):
    del interpreted       # keys jit's cache only: interpreted and compiled traces never share an entry
    _, r, _ = parts.shape
    _, num_slots, d = k_pool.shape
    table_rows = 0 if first_tiles is None else first_tiles.page_starts.shape[0]
    kernel = _build_kernel(splits=parts.shape[0], rows=r, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_dim=d, num_slots=num_slots, parts_dtype=parts.dtype, table_rows=table_rows,
                           prefetch_tokens=prefetch_tokens,
                           row_norm=None if row_sumsq is None else (row_sumsq.shape[0], norm_k, norm_eps))
    slots = jnp.where(slots < 0, slots + num_slots, slots)      # jnp's negative indices; still < 0: not written
    extra = ()
    if first_tiles is not None:
        # Rows padded to R (length 0: nothing prefetched) and the table cut or padded to the entries the prefetch
        # reads, so every 8-row block copies one whole box. A padded entry is never read: a row's pages cover its
        # length, and the prefetch reads none past its last page.
        pad = r - table_rows
        entries = prefetch_tokens // 8
        starts = first_tiles.page_starts[:, :entries]
        extra = (jnp.pad(starts, ((0, pad), (0, entries - starts.shape[1]))),
                 jnp.pad(first_tiles.page_sizes, (0, pad), constant_values=8),
                 jnp.pad(first_tiles.lengths, (0, pad)))
    if row_sumsq is not None:
        extra = extra + (row_sumsq,)
    k_ref, v_ref = jax.new_ref(k_pool), jax.new_ref(v_pool)
    q = kernel(parts, cos, sin, slots, *extra, k_ref, v_ref)
    return q.reshape(r, num_q_heads, d), jax.freeze(k_ref), jax.freeze(v_ref)


def _build_kernel(*, splits, rows, num_q_heads, num_kv_heads, head_dim, num_slots, parts_dtype, table_rows=0,
                  prefetch_tokens=0, row_norm=None):
    """f(parts, cos, sin, slots[, page_starts [R, tokens/8], page_sizes [R], lengths [R]][, sumsq [S', R]], k_ref,
    v_ref) -> q [rows, Hq * D] bf16, writing the refs (module docstring); the tables only with table_rows > 0 (the
    prefetch), the sums of squares only with row_norm = (S', k, eps) (`RowNorm`)."""
    half = head_dim // 2
    out_dtype = jnp.bfloat16
    prefetch = table_rows > 0
    entries = prefetch_tokens // 8

    def body(parts_gmem, cos_gmem, sin_gmem, slots_gmem, *rest):
        if prefetch:
            starts_gmem, psizes_gmem, lengths_gmem, *rest = rest
        if row_norm is not None:
            sumsq_gmem, *rest = rest
        k_ref, v_ref, q_gmem = rest
        head = lax.axis_index("head")
        r0 = pl.multiple_of(lax.axis_index("rows") * ROW_BLOCK, ROW_BLOCK)
        col0 = head * head_dim

        def prefetch_first_tiles(starts_smem, psizes_smem, lengths_smem, pool_ref, kv_head):
            """The first prefetch_tokens keys of each of this block's rows, as the attention kernel's tile copies
            of tile 0 (`issue_tile_copies`), as L2 prefetches."""
            for i in range(ROW_BLOCK):
                log2_p, page, length, n_pages, _ = sequence_scalars(psizes_smem[i], lengths_smem[i],
                                                                    max_pages=entries, block_kv=prefetch_tokens)

                def piece(_, src_slot, __, size, i=i):
                    plgpu.async_prefetch(pool_ref.at[kv_head, pl.ds(src_slot, size)])

                @pl.when(length > 0)
                def _():
                    issue_tile_copies(jnp.int32(0), log2_p=log2_p, page=page, n_pages=n_pages,
                                      page_entry=lambda p, i=i: starts_smem[i, p],
                                      small_classes=page_classes(prefetch_tokens), block_kv=prefetch_tokens,
                                      piece=piece)

        def scoped(x1_smem, x2_smem, cos_smem, sin_smem, slots_smem, o1_smem, o2_smem, loaded, *tables_smem):
            if row_norm is not None:
                *tables_smem, sumsq_smem = tables_smem
            rows_ = pl.ds(r0, ROW_BLOCK)
            plgpu.copy_gmem_to_smem(parts_gmem.at[:, rows_, pl.ds(col0, half)], x1_smem, loaded)
            plgpu.copy_gmem_to_smem(parts_gmem.at[:, rows_, pl.ds(col0 + half, half)], x2_smem, loaded)
            plgpu.copy_gmem_to_smem(cos_gmem.at[rows_], cos_smem, loaded)
            plgpu.copy_gmem_to_smem(sin_gmem.at[rows_], sin_smem, loaded)
            plgpu.copy_gmem_to_smem(slots_gmem.at[rows_], slots_smem, loaded)
            if prefetch:
                for src, dst in zip((starts_gmem, psizes_gmem, lengths_gmem), tables_smem, strict=True):
                    plgpu.copy_gmem_to_smem(src.at[rows_], dst, loaded)
            if row_norm is not None:
                plgpu.copy_gmem_to_smem(sumsq_gmem.at[:, rows_], sumsq_smem, loaded)
            plgpu.barrier_wait(loaded)
            if prefetch:       # the k and v heads' CTAs of the decode rows: before their own work, HBM idle
                kv_head = head - num_q_heads
                in_table = r0 < table_rows
                pl.when((head >= num_q_heads) & (head < num_q_heads + num_kv_heads) & in_table)(
                    lambda: prefetch_first_tiles(*tables_smem, k_ref, kv_head))
                pl.when((head >= num_q_heads + num_kv_heads) & in_table)(
                    lambda: prefetch_first_tiles(*tables_smem, v_ref, kv_head - num_kv_heads))

            row_scale = None
            if row_norm is not None:       # each row's rsqrt(mean(x^2) + eps), as row_inv_rms: a select a row
                norm_splits, norm_k, norm_eps = row_norm
                row = plgpu.broadcasted_iota(jnp.int32, (ROW_BLOCK, half), 0,
                                             layout=plgpu.Layout.WG_STRIDED((ROW_BLOCK, half), 1))
                row_scale = jnp.zeros((ROW_BLOCK, half), jnp.float32)
                for i in range(ROW_BLOCK):
                    total = sumsq_smem[0, i]
                    for s in range(1, norm_splits):
                        total = total + sumsq_smem[s, i]
                    row_scale = jnp.where(row == i, lax.rsqrt(total * (1.0 / norm_k) + norm_eps), row_scale)

            def summed(x_smem):      # the split-K sum in order, rounded as decode_matmul rounds it
                x = x_smem.at[0][...].astype(jnp.float32)
                for s in range(1, splits):
                    x = x + x_smem.at[s][...].astype(jnp.float32)
                if row_scale is not None:
                    x = x * row_scale
                return x.astype(out_dtype).astype(jnp.float32)

            x1, x2 = summed(x1_smem), summed(x2_smem)

            @pl.when(head < num_q_heads + num_kv_heads)      # q and k heads: rotated
            def _():
                c, s = cos_smem[...], sin_smem[...]
                o1_smem[...] = (x1 * c - x2 * s).astype(out_dtype)
                o2_smem[...] = (x2 * c + x1 * s).astype(out_dtype)

            @pl.when(head >= num_q_heads + num_kv_heads)     # v heads: as summed
            def _():
                o1_smem[...] = x1.astype(out_dtype)
                o2_smem[...] = x2.astype(out_dtype)

            plgpu.commit_smem()

            @pl.when(head < num_q_heads)
            def _():
                plgpu.copy_smem_to_gmem(o1_smem, q_gmem.at[rows_, pl.ds(col0, half)])
                plgpu.copy_smem_to_gmem(o2_smem, q_gmem.at[rows_, pl.ds(col0 + half, half)])

            def write_rows(pool_ref, kv_head):
                for i in range(ROW_BLOCK):
                    slot = slots_smem[i]

                    @pl.when((slot >= 0) & (slot < num_slots))      # padding rows' slots are past the pool
                    def _():
                        dst = pool_ref.at[kv_head, pl.ds(slot, 1)]
                        plgpu.copy_smem_to_gmem(o1_smem.at[pl.ds(i, 1)], dst.at[:, pl.ds(0, half)])
                        plgpu.copy_smem_to_gmem(o2_smem.at[pl.ds(i, 1)], dst.at[:, pl.ds(half, half)])

            is_k = (head >= num_q_heads) & (head < num_q_heads + num_kv_heads)
            pl.when(is_k)(lambda: write_rows(k_ref, head - num_q_heads))
            pl.when(head >= num_q_heads + num_kv_heads)(
                lambda: write_rows(v_ref, head - num_q_heads - num_kv_heads))
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((splits, ROW_BLOCK, half), parts_dtype), plgpu.SMEM((splits, ROW_BLOCK, half), parts_dtype),
            plgpu.SMEM((ROW_BLOCK, half), jnp.float32), plgpu.SMEM((ROW_BLOCK, half), jnp.float32),
            plgpu.SMEM((ROW_BLOCK,), jnp.int32),
            plgpu.SMEM((ROW_BLOCK, half), out_dtype), plgpu.SMEM((ROW_BLOCK, half), out_dtype),
            plgpu.Barrier(num_arrivals=5 + 3 * prefetch + (row_norm is not None)),
            *([plgpu.SMEM((ROW_BLOCK, entries), jnp.int32), plgpu.SMEM((ROW_BLOCK,), jnp.int32),
               plgpu.SMEM((ROW_BLOCK,), jnp.int32)] if prefetch else []),
            *([plgpu.SMEM((row_norm[0], ROW_BLOCK), jnp.float32)] if row_norm is not None else []))

    # The name a profile shows: rope_kv_write_mosaic_gpu_kernel (benchmarks/device_trace.py).
    body.__name__ = body.__qualname__ = "rope_kv_write"
    heads = num_q_heads + 2 * num_kv_heads
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, num_q_heads * head_dim), out_dtype),
                        grid=(heads, rows // ROW_BLOCK), grid_names=("head", "rows"))
