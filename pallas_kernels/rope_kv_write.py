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


def rope_kv_write_reference(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads: int, num_kv_heads: int):
    """`rope_kv_write` in jnp on arrays: returns (q [R, Hq, D] bf16, k_pool, v_pool) with the pools updated."""
    y = sum_partials(parts, k_pool.dtype)
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


PREFETCH_TOKENS = (64, 128)      # the attention kernel's tile sizes


def rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads: int, num_kv_heads: int,
                  first_tiles: FirstTiles | None = None, prefetch_tokens: int = 64, interpret: bool = False):
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
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns (q [R, Hq, D] bfloat16 rotated, k_pool, v_pool) with row r's k and v at slot slots[r] of each head.
    """
    check_inputs(parts, cos, sin, slots, k_pool, v_pool, num_q_heads, num_kv_heads)
    kw = {}
    if first_tiles is not None:
        check_first_tiles(first_tiles, parts.shape[1], prefetch_tokens)
        kw = dict(first_tiles=first_tiles, prefetch_tokens=prefetch_tokens)
    if interpret:
        with mosaic_gpu_interpret():
            return _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=num_q_heads,
                                  num_kv_heads=num_kv_heads, interpreted=True, **kw)
    return _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          interpreted=interpret_mode_active(), **kw)


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


@functools.partial(jax.jit, static_argnames=("num_q_heads", "num_kv_heads", "interpreted", "prefetch_tokens"))
def _rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, *, num_q_heads, num_kv_heads, interpreted=False,
                   first_tiles=None, prefetch_tokens=0):
    del interpreted       # keys jit's cache only: interpreted and compiled traces never share an entry
    _, r, _ = parts.shape
    _, num_slots, d = k_pool.shape
    table_rows = 0 if first_tiles is None else first_tiles.page_starts.shape[0]
    kernel = _build_kernel(splits=parts.shape[0], rows=r, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_dim=d, num_slots=num_slots, parts_dtype=parts.dtype, table_rows=table_rows,
                           prefetch_tokens=prefetch_tokens)
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
    k_ref, v_ref = jax.new_ref(k_pool), jax.new_ref(v_pool)
    q = kernel(parts, cos, sin, slots, *extra, k_ref, v_ref)
    return q.reshape(r, num_q_heads, d), jax.freeze(k_ref), jax.freeze(v_ref)


def _build_kernel(*, splits, rows, num_q_heads, num_kv_heads, head_dim, num_slots, parts_dtype, table_rows=0,
                  prefetch_tokens=0):
    """f(parts, cos, sin, slots[, page_starts [R, tokens/8], page_sizes [R], lengths [R]], k_ref, v_ref) -> q [rows,
    Hq * D] bf16, writing the refs (module docstring); the tables only with table_rows > 0 (the prefetch)."""
    half = head_dim // 2
    out_dtype = jnp.bfloat16
    prefetch = table_rows > 0
    entries = prefetch_tokens // 8

    def body(parts_gmem, cos_gmem, sin_gmem, slots_gmem, *rest):
        if prefetch:
            starts_gmem, psizes_gmem, lengths_gmem, k_ref, v_ref, q_gmem = rest
        else:
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
            rows_ = pl.ds(r0, ROW_BLOCK)
            plgpu.copy_gmem_to_smem(parts_gmem.at[:, rows_, pl.ds(col0, half)], x1_smem, loaded)
            plgpu.copy_gmem_to_smem(parts_gmem.at[:, rows_, pl.ds(col0 + half, half)], x2_smem, loaded)
            plgpu.copy_gmem_to_smem(cos_gmem.at[rows_], cos_smem, loaded)
            plgpu.copy_gmem_to_smem(sin_gmem.at[rows_], sin_smem, loaded)
            plgpu.copy_gmem_to_smem(slots_gmem.at[rows_], slots_smem, loaded)
            if prefetch:
                for src, dst in zip((starts_gmem, psizes_gmem, lengths_gmem), tables_smem, strict=True):
                    plgpu.copy_gmem_to_smem(src.at[rows_], dst, loaded)
            plgpu.barrier_wait(loaded)
            if prefetch:       # the k and v heads' CTAs of the decode rows: before their own work, HBM idle
                kv_head = head - num_q_heads
                in_table = r0 < table_rows
                pl.when((head >= num_q_heads) & (head < num_q_heads + num_kv_heads) & in_table)(
                    lambda: prefetch_first_tiles(*tables_smem, k_ref, kv_head))
                pl.when((head >= num_q_heads + num_kv_heads) & in_table)(
                    lambda: prefetch_first_tiles(*tables_smem, v_ref, kv_head - num_kv_heads))

            def summed(x_smem):      # the split-K sum in order, rounded as decode_matmul rounds it
                x = x_smem.at[0][...].astype(jnp.float32)
                for s in range(1, splits):
                    x = x + x_smem.at[s][...].astype(jnp.float32)
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
            plgpu.Barrier(num_arrivals=8 if prefetch else 5),
            *([plgpu.SMEM((ROW_BLOCK, entries), jnp.int32), plgpu.SMEM((ROW_BLOCK,), jnp.int32),
               plgpu.SMEM((ROW_BLOCK,), jnp.int32)] if prefetch else []))

    # The name a profile shows: rope_kv_write_mosaic_gpu_kernel (benchmarks/device_trace.py).
    body.__name__ = body.__qualname__ = "rope_kv_write"
    heads = num_q_heads + 2 * num_kv_heads
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((rows, num_q_heads * head_dim), out_dtype),
                        grid=(heads, rows // ROW_BLOCK), grid_names=("head", "rows"))
