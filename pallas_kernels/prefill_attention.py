"""Warp-specialised causal prefill attention over adaptive paged KV (FlashAttention-3 style, Hopper).

The prefill path's hot loop at long context: blocks of consecutive query tokens of one sequence attend
causally to that sequence's paged KV (the same pools, page tables and mixed page sizes as
`paged_attention`). `paged_attention.paged_prefill_attention` runs this with the decode kernel's
pipeline (one warpgroup per CTA that both issues the copies and computes, a 64-row q tile): about 30%
of the H200's dense bf16 peak at 12K-32K context (BENCHMARKS.md). This kernel restructures the CTA:

*Three warpgroups per CTA.* Two compute warpgroups, each with its own 64-row q tile (so one CTA holds
128 rows = 128 / group consecutive tokens x the GQA group), and one memory warpgroup that only issues
TMA copies (a few registers: `set_max_registers` moves the rest to the compute warpgroups). Each K/V
tile brought into SMEM serves 128 q rows instead of 64, halving the SMEM traffic per FLOP.

*Ping-pong.* A schedule barrier shared by the two compute warpgroups makes them alternate: while one
runs its softmax (exp2 on the CUDA cores), the other's two GEMMs (S = q K^T, acc += P V) run on the
tensor cores. This is what keeps the tensor cores busy in FlashAttention-3 for head_dim <= 128.

*Ring with consumed barriers.* `num_stages` K and V tiles in flight; the memory warpgroup waits for
both compute warpgroups to release a slot (K after q K^T, V after P V, separately) before it refills
it. Tiles are T = block_kv tokens; a tile is T / P whole pages (P < T) or a T-token piece of one page
(P >= T), one TMA copy per piece, with one stage-barrier array per "copies per tile" class, as in the
decode kernel (see its module docstring for why).

*Causal mask only where it can bite.* Tiles that end at or before the block's first token are seen
whole by every row; only the last few tiles of a block apply the per-row causal bound.

*Stale slots.* Keys at or past the sequence's length are masked to -inf, and the V rows there (the
tail of the last tile, which may hold stale or NaN values) are zeroed by each compute warpgroup
before its P V (P = 0 there, but 0 * NaN = NaN inside the MMA). Both warpgroups write the same zeros.

Numerics as in the decode kernel: fp32 scores, online softmax in base 2 with the scale and log2(e)
folded into one FMA, fp32 accumulation, bf16 P. Output is bf16 (cast to q's dtype by the wrapper).
Score statistics are not computed here (the engine asks for them only with the DMLP policy, and then
uses `paged_prefill_attention`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.paged_attention import (
    MMA_TRANSFORMS, TuningConfig, _flat_table, _table_window, check_prefill_blocks, issue_tile_copies,
    page_classes, sequence_scalars, wait_page_class)

_LOG2E = math.log2(math.e)
_WG_ROWS = 64                  # WGMMA M: rows of one compute warpgroup's q tile
_COMPUTE_WGS = 2
_CTA_ROWS = _WG_ROWS * _COMPUTE_WGS
_SMEM_LIMIT = 227 * 1024


def default_ws_config(head_dim: int) -> TuningConfig:
    """128-token tiles, 2 stages: the best or within 8% of it at every head_dim and context on the H200
    (benchmarks/prefill_attention.py sweeps, BENCHMARKS.md). 256-token tiles (head_dim 64 only) won by
    up to 8% at 12K-32K context but double the traced copy code (T / 8 copies per side for 8-token
    pages), and with it the Mosaic GPU lowering time every server start pays per prefill bucket."""
    del head_dim
    return TuningConfig(block_kv=128, num_stages=2, num_splits=1)


def ws_prefill_block_tokens(num_q_heads: int, num_kv_heads: int) -> int | None:
    """Query tokens per block of `ws_prefill_attention` (128 q rows = tokens x the GQA group), or None
    when the group is not a power of 2 <= 64."""
    group = num_q_heads // max(num_kv_heads, 1)
    if group < 1 or group > _WG_ROWS or group & (group - 1) or num_q_heads % max(num_kv_heads, 1):
        return None
    return _CTA_ROWS // group


def ws_smem_bytes(config: TuningConfig, head_dim: int, max_pages: int, interpret: bool = False) -> int:
    """SMEM of one CTA: the K/V ring, two q/o tiles, the page-table window (+ P tiles in the interpreter)."""
    ring = 2 * config.num_stages * config.block_kv * head_dim * 2
    q_o = _CTA_ROWS * head_dim * 2
    table = 4 * _table_window(max_pages, 1, config.block_kv)
    p = _CTA_ROWS * config.block_kv * 2 if interpret else 0
    return ring + q_o + table + p + 1024


def ws_prefill_attention(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *,
                         sm_scale: float | None = None, config: TuningConfig | None = None,
                         interpret: bool = False):
    """Causal attention of blocks of consecutive query tokens over a paged KV pool.

    Args:
      q: [blocks, tokens, num_q_heads, head_dim] bf16/fp32, tokens <= ws_prefill_block_tokens(...).
        Token i of block b is at position q_starts[b] + i.
      k_pool, v_pool: [num_kv_heads, num_slots, head_dim] bf16 (the block's own keys already written).
      q_starts: [blocks] int32, each block's first position (negative counts as 0).
      lengths: [blocks] int32, keys the block may see: min(q_starts + tokens, the sequence's context);
        0 marks a padding block (output zeros). Keys >= length are never read as values.
      page_starts: [blocks, max_pages] int32 and page_sizes: [blocks] int32: each block's sequence's
        block table, as in `paged_attention`.
      config: TuningConfig (block_kv 64 or 128, or 256 at head_dim 64; num_stages; num_splits None or
        1); default `default_ws_config(head_dim)`.
    Returns [blocks, tokens, num_q_heads, head_dim] in q.dtype: token i attends to the keys at
    positions < min(q_starts + i + 1, lengths).
    """
    blocks, tokens, num_q_heads, head_dim = check_prefill_blocks(
        "ws_prefill_attention", q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes,
        most_tokens=ws_prefill_block_tokens(q.shape[2] if q.ndim == 4 else 0, k_pool.shape[0]), q_rows=_CTA_ROWS)
    config = config or default_ws_config(head_dim)
    if config.num_splits not in (None, 1):
        raise ValueError(f"ws_prefill_attention: causal blocks are not split, got num_splits={config.num_splits}")
    if config.block_kv == 256 and head_dim != 64:
        raise ValueError(f"ws_prefill_attention: block_kv 256 is for head_dim 64 (a [64, 256] fp32 score tile "
                         f"plus a [64, {head_dim}] accumulator leave no registers), got head_dim {head_dim}")
    in_interpreter = interpret or interpret_mode_active()
    need = ws_smem_bytes(config, head_dim, page_starts.shape[1], in_interpreter)
    if need > _SMEM_LIMIT:
        raise ValueError(f"ws_prefill_attention: block_kv={config.block_kv} x {config.num_stages} stages at "
                         f"head_dim {head_dim} needs {need // 1024} KB of SMEM (> 227 KB): use fewer stages or "
                         f"a smaller block_kv")
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    args = (q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes)
    if interpret:
        with mosaic_gpu_interpret():
            return _ws_prefill_attention(*args, scale=scale, config=config, interpret=True)
    return _ws_prefill_attention(*args, scale=scale, config=config, interpret=in_interpreter)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _ws_prefill_attention(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *, scale, config,
                          interpret):
    blocks, tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pool.shape[0]
    group = num_q_heads // num_kv_heads
    rows = tokens * group
    # q tile of (block b, kv head h): rows token-major (row = token * group + g), padded to 128 rows.
    q2 = q.astype(jnp.bfloat16).reshape(blocks, tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    q2 = jnp.pad(q2.reshape(blocks, num_kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, _CTA_ROWS - rows), (0, 0)))
    max_pages = page_starts.shape[1]
    table = _flat_table(page_starts, 1, config.block_kv)
    kernel = _build_ws_kernel(blocks=blocks, num_kv_heads=num_kv_heads, head_dim=head_dim, group=group,
                              max_pages=max_pages, table_len=table.shape[0], scale=scale, config=config,
                              interpret=interpret)
    # A negative start would leave a row no key at all (its online softmax would be NaN, not zeros).
    out = kernel(lengths, page_sizes, jnp.maximum(q_starts, 0), table, q2.reshape(-1, head_dim), k_pool, v_pool)
    out = out.reshape(blocks, num_kv_heads, _CTA_ROWS, head_dim)[:, :, :rows]
    out = out.reshape(blocks, num_kv_heads, tokens, group, head_dim)
    return jnp.moveaxis(out, 1, 2).reshape(blocks, tokens, num_q_heads, head_dim).astype(q.dtype)


def _build_ws_kernel(*, blocks, num_kv_heads, head_dim, group, max_pages, table_len, scale, config, interpret):
    """f(lengths, page_sizes, q_starts, table, q2 [blocks * Hkv * 128, D] bf16, k_pool, v_pool)
    -> o [blocks * Hkv * 128, D] bf16 (row layout of q2)."""
    T = config.block_kv
    stages = config.num_stages
    window = _table_window(max_pages, 1, T)
    log2_t = T.bit_length() - 1
    log2_group = group.bit_length() - 1
    small_classes = page_classes(T)                                           # (log2 P, copies per tile)
    copies = [n for _, n in small_classes] + [1]
    qk_scale = scale * _LOG2E
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    def body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, k_ref, v_ref, o_ref):
        def scoped(table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars, k_bars, v_bars,
                   k_free, v_free, schedule_bar):
            kernel_body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, k_ref, v_ref, o_ref,
                        table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars, k_bars, v_bars,
                        k_free, v_free, schedule_bar)

        ring = plgpu.SMEM((stages, T, head_dim), jnp.bfloat16, transforms=MMA_TRANSFORMS)
        p_tiles = (plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS, T), jnp.bfloat16, transforms=MMA_TRANSFORMS)
                   if interpret else None)
        pl.run_scoped(
            scoped,
            plgpu.SMEM((window,), jnp.int32),
            plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS, head_dim), jnp.bfloat16, transforms=MMA_TRANSFORMS),
            ring, ring, p_tiles,
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=_COMPUTE_WGS),
            [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in copies],
            [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in copies],
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
            collective_axes="wg",
        )

    def kernel_body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, k_ref, v_ref, o_ref,
                    table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars, k_bars, v_bars,
                    k_free, v_free, schedule_bar):
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        wg = lax.axis_index("wg")

        # --- per-sequence scalars (every warpgroup computes them: a few scalar ops) --------
        log2_p, page, length, n_pages, n_tiles = sequence_scalars(psizes_ref[b], lengths_ref[b],
                                                                  max_pages=max_pages, block_kv=T)
        q_start = qstart_ref[b]

        def wait(bars, slot):
            wait_page_class(bars, slot, log2_p, small_classes, T)

        @pl.when(wg == _COMPUTE_WGS)
        def _memory_warpgroup():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")
            first = b * max_pages
            win_start = pl.multiple_of(jnp.minimum(first - lax.rem(first, 4), table_len - window), 4)
            plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(win_start, window)], table_smem, table_bar.at[0],
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            plgpu.barrier_wait(table_bar.at[0])

            def page_entry(p):   # slot of page p of this sequence
                return table_smem[first + p - win_start]

            def fetch(src_ref, ring, bars, tile, slot):
                """Issue the TMA copies of one K or V tile into ring slot `slot`."""
                issue_tile_copies(
                    tile * T, log2_p=log2_p, page=page, n_pages=n_pages, page_entry=page_entry,
                    small_classes=small_classes, block_kv=T,
                    piece=lambda gi, src, off, size: plgpu.copy_gmem_to_smem(
                        src_ref.at[h, pl.ds(src, size)], ring.at[slot, pl.ds(off, size)], bars[gi].at[slot]))

            # One loop issues every tile (the first `stages` into empty slots), so each fetch is traced
            # once: the page-class branches unroll up to T / 8 copies per side, and Mosaic GPU lowering
            # time (paid at every server start, per prefill bucket) grows with the traced code.
            def issue(i, carry):
                slot = lax.rem(i, stages)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                fetch(k_ref, k_ring, k_bars, i, slot)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                fetch(v_ref, v_ring, v_bars, i, slot)
                return carry
            lax.fori_loop(0, n_tiles, issue, None)

            def drain(i, carry):
                # Observe the last releases too: a barrier's phases must all be seen by the threads
                # that wait on it (the interpreter checks it), and the CTA's SMEM outlives no copy.
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return carry
            lax.fori_loop(jnp.maximum(n_tiles - stages, 0), n_tiles, drain, None)

        @pl.when(wg < _COMPUTE_WGS)
        def _compute_warpgroup():
            if not interpret:
                plgpu.set_max_registers(232, action="increase")
            q_smem = qo_smem.at[wg]
            row0 = (b * num_kv_heads + h) * _CTA_ROWS + wg * _WG_ROWS
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row0, _WG_ROWS)], q_smem, q_bars.at[wg])
            # Row r of this warpgroup is token (wg * 64 + r) // group of the block; it sees the keys
            # below its own position + 1 (and below the length).
            row_tok = lax.shift_right_logical(
                plgpu.broadcasted_iota(jnp.int32, (_WG_ROWS, T), 0, layout=wgmma_layout) + wg * _WG_ROWS,
                log2_group)
            row_end = jnp.minimum(q_start + row_tok + 1, length)

            def schedule():
                plgpu.barrier_arrive(schedule_bar)
                plgpu.barrier_wait(schedule_bar)

            def tile_step(i, carry, *, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(i, stages)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_ring.at[slot].transpose((1, 0)))
                    schedule()
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((_WG_ROWS, T), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    cols = plgpu.broadcasted_iota(jnp.int32, (_WG_ROWS, T), 1, layout=wgmma_layout)
                    s = jnp.where(cols < row_end - i * T, s, -jnp.inf)
                # Scores stay unscaled; m is kept in scaled (base-2) units so p is one FMA + exp2.
                m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(jnp.bfloat16)
                if not interpret:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(schedule_bar)        # softmax done: the other warpgroup's GEMMs may go
                wait(v_bars, slot)
                if masked:
                    n_valid = length - i * T

                    @pl.when(n_valid < T)
                    def _():
                        v = v_ring[slot]
                        vrows = plgpu.broadcasted_iota(jnp.int32, (T, head_dim), 0, layout=wgmma_layout)
                        v_ring[slot] = jnp.where(vrows < n_valid, v, jnp.zeros_like(v))
                        plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)
                plgpu.barrier_wait(schedule_bar)          # the tensor cores are ours

                def next_k_wait():
                    @pl.when(i + 1 < n_tiles)
                    def _():
                        wait(k_bars, lax.rem(i + 1, stages))

                if interpret:
                    # The interpreter has no register A operand and no run_state: P goes through SMEM
                    # into a fresh accumulator. Same math.
                    p_smem[wg] = p16
                    plgpu.commit_smem()

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem.at[wg], v_ring.at[slot])
                        next_k_wait()
                        return acc_ref[...]
                    acc = acc + pl.run_scoped(pv, plgpu.ACC((_WG_ROWS, head_dim), jnp.float32))
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_ring.at[slot])
                        next_k_wait()
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc = plgpu.layout_cast(jnp.zeros((_WG_ROWS, head_dim), jnp.float32), wgmma_layout)
            m_i = plgpu.layout_cast(jnp.full((_WG_ROWS,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((_WG_ROWS,), jnp.float32), row_layout)
            plgpu.barrier_wait(q_bars.at[wg])

            @pl.when(n_tiles > 0)
            def _():
                wait(k_bars, 0)

            pl.when(wg == 1)(schedule)     # start the ping-pong: warpgroup 0 computes first
            # Tiles ending at or before the block's first token (and the length) are whole for every
            # row: no mask there.
            full = lax.shift_right_logical(jnp.minimum(q_start, length), jnp.int32(log2_t))
            carry = lax.fori_loop(0, full, functools.partial(tile_step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(full, n_tiles, functools.partial(tile_step, masked=True), carry)
            pl.when(wg == 0)(schedule)     # balance the barrier phases

            # --- epilogue: normalise, write this warpgroup's 64 rows through its q tile ---------
            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            q_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(jnp.bfloat16)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[pl.ds(row0, _WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

    out_type = jax.ShapeDtypeStruct((blocks * num_kv_heads * _CTA_ROWS, head_dim), jnp.bfloat16)
    return plgpu.kernel(
        body, out_type=out_type, grid=(blocks, num_kv_heads), grid_names=("b", "h"),
        num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math))
