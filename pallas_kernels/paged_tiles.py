"""How the paged attention kernels stream K/V tiles out of a pool of pages (Pallas Mosaic GPU, in-kernel helpers).

Shared by every kernel that reads paged K/V (paged_attention, swapped_decode_attention, delta_attention,
prefill_attention, and rope_kv_write / l2_prefetch, which prefetch the tiles those kernels read first): the page
sizes and the copy classes they give a tile, the TMA copies of one tile and their barriers, a sequence's in-kernel
scalars, the split-K tile ranges, and the page-table window a CTA copies to SMEM. paged_attention.py's docstring
says why tiles are built this way ("Mixed page sizes: static token tiles, per-page TMA copies").
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

PAGE_SIZES = (8, 16, 32, 64, 128, 256)


def check_tile_pipeline(block_kv: int, num_stages: int, num_splits: int | None) -> None:
    """The checks a decode kernel's tile pipeline config shares (TuningConfig, the swapped kernel's
    SwappedConfig): tile size, ring depth and split count."""
    if block_kv not in (64, 128, 256):
        raise ValueError(f"block_kv must be 64, 128 or 256, got {block_kv}")
    if not isinstance(num_stages, int) or num_stages < 2:
        raise ValueError(f"num_stages must be an int >= 2, got {num_stages!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= 64):
        raise ValueError(f"num_splits must be None or an int in [1, 64], got {num_splits!r}")


def flat_table(page_starts, splits: int, block_kv: int, first_split_percent: int | None = None):
    """page_starts [batch, max_pages] -> the flat int32 table the kernel bulk-copies a CTA's window of
    (16-byte aligned), padded so the last window is in bounds (`table_window`'s arguments)."""
    window = table_window(page_starts.shape[1], splits, block_kv, first_split_percent)
    table = page_starts.reshape(-1)
    if table.shape[0] % 4 or table.shape[0] < window:
        table = jnp.pad(table, (0, (-table.shape[0]) % 4 + max(0, window - table.shape[0])))
    return table


def page_classes(block_kv: int) -> list[tuple[int, int]]:
    """The page-size classes of a K/V tile of `block_kv` keys that take several copies: (log2 P, T // P) for
    every page size P < T. Pages of >= T keys are one more class (one copy of a T-key piece)."""
    return [(p.bit_length() - 1, block_kv // p) for p in PAGE_SIZES if p < block_kv]


def wait_page_class(bars, slot, log2_p, small_classes, block_kv: int) -> None:
    """In a kernel: awaits ring slot `slot` of the stage-barrier array of this sequence's page-size class
    (bars: one barrier array per class of `page_classes`, then the >= T class)."""
    for gi, (lp, _) in enumerate(small_classes):
        pl.when(log2_p == lp)(lambda gi=gi: plgpu.barrier_wait(bars[gi].at[slot]))
    pl.when(log2_p >= block_kv.bit_length() - 1)(lambda: plgpu.barrier_wait(bars[-1].at[slot]))


def issue_tile_copies(t0, *, log2_p, page, n_pages, page_entry, small_classes, block_kv: int, piece,
                      after=None) -> None:
    """In a kernel: the TMA copies of the K/V tile of keys [t0, t0 + T), for the sequence's page class.
    piece(class_index, src_slot, tile_offset, size) issues one copy of `size` keys from pool slot
    `src_slot` to the tile's rows [tile_offset, +size); after(class_index), if given, runs once per class
    after its pieces (class_index -1: pages of >= T keys). Pages < T: T / P whole pages (copies past the
    last page re-read it, clamped, so the arrival count stays static and table entries past the sequence
    are never read); pages >= T: the T-key piece of one page. Page starts are multiples of P >= 8, which
    the tiled TMA needs."""
    for gi, (lp, n) in enumerate(small_classes):
        @pl.when(log2_p == lp)
        def _():
            p = 1 << lp
            first_page = lax.shift_right_logical(t0, lp)
            for i in range(n):
                piece(gi, pl.multiple_of(page_entry(jnp.minimum(first_page + i, n_pages - 1)), 8), i * p, p)
            if after is not None:
                after(gi)

    @pl.when(log2_p >= block_kv.bit_length() - 1)
    def _():
        src = page_entry(lax.shift_right_logical(t0, log2_p)) + (t0 & (page - 1))
        piece(-1, pl.multiple_of(src, 8), 0, block_kv)
        if after is not None:
            after(-1)


def split_tile_range(n_tiles, k_split, splits: int, first_split_percent: int | None = None):
    """(tile_lo, tile_hi): the tiles [lo, hi) of a sequence of n_tiles that split k_split of `splits` covers; all
    of them unsplit. Even splits: ceil(n_tiles / splits) each, the last ones short or empty. With
    first_split_percent (`SwappedConfig.split_first_percent`): split 0 covers ceil(n_tiles * percent / 100) tiles
    and the others share the rest evenly (ceil each). In a kernel (int32 scalars) or outside one on arrays of one
    shape (`split_k.split_key_counts`): the same partition."""
    scalar = jnp.ndim(n_tiles) == 0
    if splits == 1:
        return (jnp.int32(0) if scalar else jnp.zeros_like(n_tiles)), n_tiles
    # lax.div (C division, as the kernel lowers it) takes operands of one shape
    ints = lambda v: jnp.int32(v) if scalar else jnp.full(jnp.shape(n_tiles), v, jnp.int32)
    if first_split_percent is None:
        per_split = lax.div(n_tiles + (splits - 1), ints(splits))
        tile_lo = jnp.minimum(k_split * per_split, n_tiles)
        return tile_lo, jnp.minimum(tile_lo + per_split, n_tiles)
    first = lax.div(n_tiles * first_split_percent + 99, ints(100))
    per_rest = lax.div(n_tiles - first + (splits - 2), ints(splits - 1))
    rest_lo = jnp.minimum(first + (k_split - 1) * per_rest, n_tiles)
    tile_lo = jnp.where(k_split == 0, 0, rest_lo)
    return tile_lo, jnp.where(k_split == 0, first, jnp.minimum(rest_lo + per_rest, n_tiles))


def table_window_start(b, tile_lo, log2_p, *, max_pages: int, block_kv: int, table_len: int, window: int):
    """In a kernel: the flat-table index (a multiple of 4, for the 16-byte bulk copy) where the `window`
    entries a CTA copies to SMEM start: at or before sequence b's page holding tile tile_lo, clamped so the
    window ends inside the table (`flat_table` pads it for that)."""
    page_lo = jnp.minimum(lax.shift_right_logical(tile_lo * block_kv, log2_p), max_pages - 1)
    first = b * max_pages + page_lo
    return pl.multiple_of(jnp.minimum(first - lax.rem(first, 4), table_len - window), 4)


def table_window(max_pages: int, num_splits: int, block_kv: int, first_split_percent: int | None = None) -> int:
    """Page-table entries one CTA copies to SMEM (static bound, multiple of 32 = 128 bytes).

    A split covers ceil(n_tiles / S) tiles (with first_split_percent, `split_tile_range`: the first split
    ceil(n_tiles * percent / 100), the others ceil of an even share of the rest), i.e. at most its share of
    max_pages + 2 * T / 8 + 2 page entries (rounding at both ends), plus 3 for aligning the bulk copy's start
    to 16 bytes.
    """
    share = -(-max_pages // num_splits)
    if first_split_percent is not None and num_splits > 1:
        share = max(-(-max_pages * first_split_percent // 100),
                    -(-max_pages * (100 - first_split_percent) // (100 * (num_splits - 1))))
    need = min(share + block_kv // 4 + 5, max_pages + 3)
    return -(-need // 32) * 32


def sequence_scalars(page_size, length, *, max_pages: int, block_kv: int):
    """In-kernel scalars of one sequence: (log2_p, page, length, n_pages, n_tiles) for its page size
    (log2 of P in 8..256; anything else rounds up, so a bad size never hangs the pipeline), its length
    clamped to what the page table addresses (bad input cannot read past it), its pages and its tiles
    of block_kv tokens."""
    log2_p = jnp.int32(3)
    for c in range(5):
        log2_p = log2_p + jnp.where(page_size > (8 << c), 1, 0).astype(jnp.int32)
    page = lax.shift_left(jnp.int32(1), log2_p)
    length = jnp.clip(length, 0, max_pages * page)
    n_pages = lax.shift_right_logical(length + page - 1, log2_p)
    n_tiles = lax.shift_right_logical(length + (block_kv - 1), jnp.int32(block_kv.bit_length() - 1))
    return log2_p, page, length, n_pages, n_tiles
