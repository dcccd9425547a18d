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

*Split-K over the context (`TuningConfig.num_splits` = S >= 2).* A short chunk over a long
context (the 256-token tail recomputed after a host-tier recall of a 32K prefix on llama-8b: 8 blocks x 8 kv
heads = 64 CTAs) leaves half of the 132 SMs idle. With S splits the grid is (blocks, Hkv, S): split k of a
block streams ceil(n_tiles / S) whole tiles of its keys (`split_tile_range`, shared with the decode kernel)
through the same three-warpgroup loop, its ring slots counted from its first tile and its unmasked tiles
those of its range that end before the block's first token. A split that starts past some rows' causal bound
gives them no key: their exp2 offsets are kept finite (`_finite_offset`), l stays 0, lse = -inf. Each CTA
writes its output normalised by its own l (bf16: f32 tiles do not fit SMEM beside the ring at D=128) and its
rows' base-2 log-sum-exp (f32); the decode kernel's `combine_splits` merges them in XLA (a row no split saw
stays 0). The delta variant splits the same way (each split adds the anchor to its own normalised partial, the
convex merge keeps it once). `ws_prefill_splits` picks S to fill one wave of SMs with several tiles per
split; `stratum_jax.attention.prefill_attention(prefill_splits=...)` passes it (the engine's `--prefill-splits`,
"auto" by default). With S = 1 the traced kernel is the unsplit one (jaxpr text compared before and after).
Tested in the interpreter, lowered on a CPU and on the H200 (tests/test_ws_prefill_splits.py); on the H200 the
llama-8b tail above takes 0.28 ms a layer at S = 2 against 0.47 unsplit at 32K (BENCHMARKS.md, #12 session 15).

*Stale slots.* Keys at or past the sequence's length are masked to -inf, and the V rows there (the
tail of the last tile, which may hold stale or NaN values) are zeroed by each compute warpgroup
before its P V (P = 0 there, but 0 * NaN = NaN inside the MMA). Both warpgroups write the same zeros.

Numerics as in the decode kernel: fp32 scores, online softmax in base 2 with the scale and log2(e)
folded into one FMA, fp32 accumulation, bf16 P. Output is bf16 (cast to q's dtype by the wrapper).
Score statistics are not computed here (the engine asks for them only with the DMLP policy, and then
uses `paged_prefill_attention`).

*The delta-KV (DKVC) format, folded mean-anchor path (`ws_delta_prefill_attention`).* The same kernel
(`_build_ws_kernel(delta_dtype=...)`; with delta_dtype None its jaxpr is the bf16 kernel's, compared
before and after the change) over delta_attention.py's format with anchor_len 1 and no soft cap (that
module's docstring has the math): q . anchor_k cancels in the softmax, so the MMAs take q (f16, clipped
to 65280) and the f16 deltas; per key, the granule's score scale multiplies the scores, the softmax max
is taken over s + log2(value scale), P * value scale (<= 1) is the f16 A operand of P @ V, l sums P
without it, and anchor_v is added in the epilogue to rows that saw a key. Per page piece the memory
warpgroup copies the delta rows and, in one more copy on K's barrier, both sides' scale granules (the
packed scales, `fetch_packed_granules`, shared with `DeltaPages`): the softmax needs the V scales before
P @ V, and both compute warpgroups read them (`packed_tile_columns`: each granule at a static place of
its piece's area, no page-table read) before releasing K's slot, whose refill brings the next ones.
Stale slots: NaN scores are masked to -inf, granules with no live key get score scale 0 / value scale 1,
V rows past the length are zeroed.
  fp16 deltas: the ring slots are WGMMA's B operands as TMA lands them (the bf16 kernel's ring layout).
  fp8 deltas: WGMMA cannot take them with f16 q/P (delta_attention.py), so each tile is converted once
  to f16 tiles in SMEM that both compute warpgroups read: warpgroup 0 converts K, warpgroup 1 converts
  V (and zeroes its rows past the length), each while the other's GEMMs run, signalling one-arrival
  barriers (`_convert_fp8_tile` says why not the memory warpgroup and why not half a side each).
  The f16 ring has as many stages as the fp8 ring and is free when a tile lands (the memory warpgroup
  refills a slot only once both compute warpgroups released it), so no barrier guards it.
  Each compute warpgroup writes its output through a bf16 tile of its own (its q tile is f16).
SMEM per CTA (`ws_delta_smem_bytes`, 227 KB at most), 2 stages, a 16K-token table of 8-token pages
(8 KB): fp16 T=128: D=128 205 KB (ring 128, q/o 64, scale areas 4), D=64 109 KB; fp16 T=64: D=128
139 KB; fp8 T=64 (the fp8 default: T=128 would take 269 KB at D=128): D=128 171 KB (fp8 ring 32 KB
plus the 64 KB f16 ring), D=64 91 KB. Defaults (`default_ws_delta_config`): fp16 128-token tiles
where they fit, else 64; fp8 64. None of this is measured on a GPU yet: correctness is checked in the
Mosaic GPU interpreter and the lowering on a CPU (tests/test_ws_delta_prefill_attention.py); register
spills (the scale columns add T / 4 registers per vector per thread to the compute warpgroups) and
speed wait for the H200 (`benchmarks/kernels.py --delta-prefill`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.delta_attention import (
    F16_SAFE_MAX, GRANULE, SCALE_AREA, add_anchor_v, check_delta_inputs, convert_to_f16, delta_ring_type,
    fetch_packed_granules, kernel_scales, packed_scale_areas_type, packed_tile_columns)
from pallas_kernels.paged_attention import MMA_TRANSFORMS, TuningConfig, check_prefill_blocks, check_prefill_query
from pallas_kernels.paged_tiles import (flat_table, issue_tile_copies, page_classes, sequence_scalars, split_tile_range,
                                        table_window, wait_page_class)
from pallas_kernels.split_k import combine_splits

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
    table = 4 * table_window(max_pages, 1, config.block_kv)
    p = _CTA_ROWS * config.block_kv * 2 if interpret else 0
    return ring + q_o + table + p + _lse_tile_bytes(config) + 1024


def _lse_tile_bytes(config: TuningConfig) -> int:
    """SMEM of the split kernel's per-row log-sum-exp tiles ([2, 64] f32); none unsplit."""
    return _CTA_ROWS * 4 if (config.num_splits or 1) > 1 else 0


def ws_prefill_splits(blocks: int, num_kv_heads: int, context_tokens: int, *, num_sms: int = 132,
                      block_kv: int = 128, min_tiles_per_split: int = 4) -> int:
    """Split-K factor S for the WS prefill kernel (`TuningConfig.num_splits`): the most splits such that the
    grid blocks * Hkv * S still fits one wave of `num_sms` CTAs (the kernel's 128-row CTAs take most of an
    SM's SMEM, one CTA an SM), and each split still streams at least `min_tiles_per_split` tiles of a
    `context_tokens`-key context (below that the merge and the per-CTA prologue outweigh the extra SMs). 1 when
    the grid already fills the GPU or the context is short. E.g. llama-8b's 256-token tail after a 32K prefix:
    8 blocks x 8 heads = 64 CTAs -> S = 2 (128 CTAs), 1.66x faster at 32K on the H200 (BENCHMARKS.md)."""
    ctas = max(blocks * num_kv_heads, 1)
    tiles = -(-max(context_tokens, 0) // block_kv)
    return int(max(1, min(num_sms // ctas, tiles // min_tiles_per_split, 16)))


def ws_prefill_attention(q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes, *,
                         sm_scale: float | None = None, config: TuningConfig | None = None,
                         interpret: bool = False):
    """Causal attention of blocks of consecutive query tokens over a paged KV pool.

    Args:
      q: [blocks, tokens, num_q_heads, head_dim] bf16/fp32, tokens <= ws_prefill_block_tokens(...).
        Token i of block b is at position q_starts[b] + i.
      k_pool, v_pool: [num_kv_heads, num_slots, head_dim] bf16 (the block's own keys already written), or both
        float16: a DKVC fp16-delta pool on the folded mean-anchor path (stratum_jax/attention.py adds the
        anchor); the MMAs then run in f16 (q clipped to F16_SAFE_MAX).
      q_starts: [blocks] int32, each block's first position (negative counts as 0).
      lengths: [blocks] int32, keys the block may see: min(q_starts + tokens, the sequence's context);
        0 marks a padding block (output zeros). Keys >= length are never read as values.
      page_starts: [blocks, max_pages] int32 and page_sizes: [blocks] int32: each block's sequence's
        block table, as in `paged_attention`.
      config: TuningConfig (block_kv 64 or 128, or 256 at head_dim 64; num_stages; num_splits None or 1,
        or S >= 2: split-K over each block's keys, `_build_ws_kernel` says how); default
        `default_ws_config(head_dim)`. `ws_prefill_splits` picks an S.
    Returns [blocks, tokens, num_q_heads, head_dim] in q.dtype: token i attends to the keys at
    positions < min(q_starts + i + 1, lengths).
    """
    blocks, tokens, num_q_heads, head_dim = check_prefill_blocks(
        "ws_prefill_attention", q, k_pool, v_pool, q_starts, lengths, page_starts, page_sizes,
        most_tokens=ws_prefill_block_tokens(q.shape[2] if q.ndim == 4 else 0, k_pool.shape[0]), q_rows=_CTA_ROWS,
        pool_dtypes=(jnp.bfloat16, jnp.float16))
    config = config or default_ws_config(head_dim)
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
    pool_dtype = jnp.dtype(k_pool.dtype)
    q_mma = jnp.clip(q, -F16_SAFE_MAX, F16_SAFE_MAX) if pool_dtype == jnp.float16 else q
    q2 = _cta_q_rows(q_mma.astype(pool_dtype), num_kv_heads)
    max_pages = page_starts.shape[1]
    table = flat_table(page_starts, 1, config.block_kv)
    # Only a float16 pool passes pool_dtype: the bf16 kernel's trace stays as it was.
    f16 = dict(pool_dtype="float16") if pool_dtype == jnp.float16 else {}
    kernel = _build_ws_kernel(blocks=blocks, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              group=num_q_heads // num_kv_heads, max_pages=max_pages, table_len=table.shape[0],
                              scale=scale, config=config, interpret=interpret, **f16)
    # A negative start would leave a row no key at all (its online softmax would be NaN, not zeros).
    out = kernel(lengths, page_sizes, jnp.maximum(q_starts, 0), table, q2.reshape(-1, head_dim), k_pool, v_pool)
    out = _merge_split_rows(out, blocks=blocks, num_kv_heads=num_kv_heads, splits=config.num_splits or 1)
    return _cta_rows_to_tokens(out, q.shape, num_kv_heads).astype(q.dtype)


def _merge_split_rows(out, *, blocks: int, num_kv_heads: int, splits: int):
    """The kernel's output -> rows [blocks * Hkv * 128, D]. Unsplit: out is those rows (returned as is).
    Split: out = (o_part [S * blocks * Hkv * 128, D] bf16, each split's output normalised by its own l,
    lse [S * blocks * Hkv * 128] f32, base 2, -inf where a row saw no key of the split), merged by the decode
    kernel's `combine_splits` (weights 2^(lse - max); a row no split saw stays 0), in f32."""
    if splits == 1:
        return out
    o_part, lse = out
    head_dim = o_part.shape[-1]
    o_part = o_part.reshape(splits, blocks, num_kv_heads, _CTA_ROWS, head_dim).astype(jnp.float32)
    lse = lse.reshape(splits, blocks, num_kv_heads, _CTA_ROWS)
    merged = combine_splits(jnp.moveaxis(o_part, 0, 1), jnp.moveaxis(lse, 0, 1))     # [blocks, Hkv, 128, D]
    return merged.reshape(-1, head_dim)


def _cta_q_rows(q, num_kv_heads: int):
    """q [blocks, tokens, Hq, D] -> the kernel's q tiles [blocks, Hkv, 128, D]: the tile of (block b, kv head h)
    holds its rows token-major (row = token * group + g), padded to 128 rows."""
    blocks, tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    rows = tokens * group
    q2 = q.reshape(blocks, tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    return jnp.pad(q2.reshape(blocks, num_kv_heads, rows, head_dim), ((0, 0), (0, 0), (0, _CTA_ROWS - rows), (0, 0)))


def _cta_rows_to_tokens(out, q_shape, num_kv_heads: int):
    """The kernel's output rows [blocks * Hkv * 128, D] (q's row layout) -> [blocks, tokens, Hq, D]."""
    blocks, tokens, num_q_heads, head_dim = q_shape
    group = num_q_heads // num_kv_heads
    out = out.reshape(blocks, num_kv_heads, _CTA_ROWS, head_dim)[:, :, :tokens * group]
    out = out.reshape(blocks, num_kv_heads, tokens, group, head_dim)
    return jnp.moveaxis(out, 1, 2).reshape(blocks, tokens, num_q_heads, head_dim)


# ---------------------------------------------------------------------------------------------
# The delta-KV (DKVC) format, folded mean-anchor path
# ---------------------------------------------------------------------------------------------

def ws_delta_smem_bytes(config: TuningConfig, head_dim: int, delta_dtype, max_pages: int,
                        interpret: bool = False) -> int:
    """SMEM of one CTA of `ws_delta_prefill_attention`: the delta ring (K and V, 1 or 2 bytes an element), the
    scale areas (one 128-byte area per page piece: T / 8 per slot and side), the f16 q tiles and bf16 output
    tiles of both compute warpgroups, the page-table window; with fp8 deltas also the f16 tiles WGMMA reads
    (a ring of num_stages) and the granule-ordered scales; P tiles in the interpreter."""
    T, S = config.block_kv, config.num_stages
    itemsize = jnp.dtype(delta_dtype).itemsize
    ring = 2 * S * T * head_dim * itemsize
    areas = S * (T // GRANULE) * SCALE_AREA * 4           # packed scale areas (`packed_scale_areas_type`)
    q_o = 2 * _CTA_ROWS * head_dim * 2
    table = 4 * table_window(max_pages, 1, T)
    converted = (2 * S * T * head_dim * 2 + S * 2 * (T // GRANULE) * 4) if itemsize == 1 else 0
    p = _CTA_ROWS * T * 2 if interpret else 0
    return ring + areas + q_o + table + converted + p + _lse_tile_bytes(config) + 1024


def default_ws_delta_config(head_dim: int, delta_dtype, max_pages: int, interpret: bool = False) -> TuningConfig:
    """fp16 deltas: the bf16 kernel's default (128-token tiles, 2 stages) where it fits SMEM (D=128: 209 KB with
    a 16K-token table of 8-token pages; past ~28K tokens of them it does not fit), else 64-token tiles. fp8
    deltas: 64-token tiles, 2 stages (128-token ones need 273 KB at D=128 with the f16 ring, and at D=64 would
    add 32 registers of scale columns per vector per thread to a full compute warpgroup). Not swept on a GPU
    yet."""
    big = TuningConfig(block_kv=128, num_stages=2, num_splits=1)
    if jnp.dtype(delta_dtype).itemsize == 2 and ws_delta_smem_bytes(big, head_dim, delta_dtype, max_pages,
                                                                     interpret) <= _SMEM_LIMIT:
        return big
    return TuningConfig(block_kv=64, num_stages=2, num_splits=1)


def ws_delta_prefill_attention(q, k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, q_starts, lengths,
                               page_starts, page_sizes, *, sm_scale: float | None = None,
                               config: TuningConfig | None = None, interpret: bool = False,
                               packed_scales: jax.Array | None = None):
    """Causal attention of blocks of consecutive query tokens over a delta-KV pool with a mean anchor, in the
    warp-specialised kernel (module docstring; the folded path of delta_attention.py's module docstring).
    Same contract as `delta_prefill_attention`, except: blocks hold up to 128 // group tokens (128 q rows),
    anchor_len must be 1, there is no score-statistics output and no rebuild path.

    Args:
      q: [blocks, tokens, Hq, D] bf16/fp32, tokens <= ws_prefill_block_tokens(Hq, Hkv); rounded to f16 for the
        MMA (|q| clipped to 65280). Token i of block b is at position q_starts[b] + i.
      k_delta, v_delta: [Hkv, S, D] float16 or float8_e4m3fn; k_scale, v_scale: [Hkv, S // 8] f32, or (both
        None) packed_scales [Hkv, S // 8, 4] f32 (`pack_granule_scales`: what the kernel reads and the engine's
        cache stores; two arrays are packed here, an XLA op a call);
      anchor_k, anchor_v: [Hkv, 1, D] bf16 (anchor_k cancels in the softmax and is not read).
      q_starts, lengths, page_starts, page_sizes: as in `delta_prefill_attention` (length 0: a padding block,
        zeros; slots, deltas and scales at or past a block's length are never used, even if NaN).
      sm_scale: default 1/sqrt(D). config: TuningConfig (block_kv 64 or 128, num_splits as in
        `ws_prefill_attention`: each split adds the anchor to its own normalised partial, so the merge adds it
        once, to rows that saw a key); default
        `default_ws_delta_config`. interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns [blocks, tokens, Hq, D] in q.dtype (through bf16): token i attends to the keys at positions
    < min(q_starts + i + 1, lengths).
    """
    name = "ws_delta_prefill_attention"
    if q.ndim != 4:
        raise ValueError(f"{name}: q must be [blocks, tokens, num_q_heads, head_dim], got {q.shape}")
    check_delta_inputs(q[:, 0], k_delta, v_delta, k_scale, v_scale, anchor_k, anchor_v, lengths, page_starts,
                       page_sizes, name=name, packed_scales=packed_scales)
    if anchor_k.shape[1] != 1:
        raise ValueError(f"{name}: takes a mean anchor (anchor_len 1), got anchor_len {anchor_k.shape[1]}; "
                         "position-aligned anchors go through delta_prefill_attention")
    _, _, num_q_heads, head_dim = check_prefill_query(
        name, q, k_delta.shape[0], q_starts, most_tokens=ws_prefill_block_tokens(q.shape[2], k_delta.shape[0]),
        q_rows=_CTA_ROWS)
    in_interpreter = interpret or interpret_mode_active()
    max_pages = page_starts.shape[1]
    config = config or default_ws_delta_config(head_dim, k_delta.dtype, max_pages, in_interpreter)
    if config.block_kv not in (64, 128):
        raise ValueError(f"{name}: block_kv must be 64 or 128, got {config.block_kv}")
    need = ws_delta_smem_bytes(config, head_dim, k_delta.dtype, max_pages, in_interpreter)
    if need > _SMEM_LIMIT:
        raise ValueError(f"{name}: block_kv={config.block_kv} x {config.num_stages} stages at head_dim {head_dim} "
                         f"with {k_delta.dtype} deltas needs {need // 1024} KB of SMEM (> 227 KB): use fewer "
                         "stages or block_kv=64")
    if sm_scale is not None and not sm_scale > 0:
        raise ValueError(f"{name}: sm_scale must be > 0, got {sm_scale}")
    scale = (1.0 / math.sqrt(head_dim)) if sm_scale is None else float(sm_scale)
    config = dataclasses.replace(config, num_splits=config.num_splits or 1)
    args = (q, k_delta, v_delta, kernel_scales(k_scale, v_scale, packed_scales), anchor_v, q_starts, lengths,
            page_starts, page_sizes)
    if interpret:
        with mosaic_gpu_interpret():
            return _ws_delta_prefill_attention(*args, scale=scale, config=config, interpret=True)
    return _ws_delta_prefill_attention(*args, scale=scale, config=config, interpret=in_interpreter)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _ws_delta_prefill_attention(q, k_delta, v_delta, scales, anchor_v, q_starts, lengths, page_starts,
                                page_sizes, *, scale, config, interpret):
    blocks, tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_delta.shape[0]
    # f16 q for the f16 MMAs with the deltas; clipped so no product turns inf (delta_attention.F16_SAFE_MAX).
    q2 = _cta_q_rows(jnp.clip(q, -F16_SAFE_MAX, F16_SAFE_MAX).astype(jnp.float16), num_kv_heads)
    table = flat_table(page_starts, 1, config.block_kv)
    kernel = _build_ws_kernel(blocks=blocks, num_kv_heads=num_kv_heads, head_dim=head_dim,
                              group=num_q_heads // num_kv_heads, max_pages=page_starts.shape[1],
                              table_len=table.shape[0], scale=scale, config=config, interpret=interpret,
                              delta_dtype=jnp.dtype(k_delta.dtype).name)
    out = kernel(lengths, page_sizes, jnp.maximum(q_starts, 0), table, q2.reshape(-1, head_dim), k_delta, v_delta,
                 scales, anchor_v)
    out = _merge_split_rows(out, blocks=blocks, num_kv_heads=num_kv_heads, splits=config.num_splits)
    return _cta_rows_to_tokens(out, q.shape, num_kv_heads).astype(q.dtype)


def _build_ws_kernel(*, blocks, num_kv_heads, head_dim, group, max_pages, table_len, scale, config, interpret,
                     delta_dtype=None, pool_dtype="bfloat16"):
    """f(lengths, page_sizes, q_starts, table, q2 [blocks * Hkv * 128, D], *kv) -> o [blocks * Hkv * 128, D] bf16
    (row layout of q2). delta_dtype None: kv = (k_pool, v_pool) in pool_dtype (bf16, or float16: the fp16-delta
    fold), q2 in the same dtype. delta_dtype "float16" or
    "float8_e4m3fn": the folded delta format (module docstring), kv = (k_delta, v_delta, packed scales
    [Hkv, S // 8 * 4] f32, anchor_v [Hkv, 1, D] bf16), q2 f16.

    Split-K (config.num_splits = S >= 2): grid (blocks, Hkv, S); split k of a block streams the tiles
    `split_tile_range` gives it (ceil(n_tiles / S) whole tiles each, the last ones short or empty) through the
    same loop, ring slots counted from its first tile, the unmasked/masked boundary clipped to its range.
    Returns (o_part [S * blocks * Hkv * 128, D] bf16, normalised by the split's own l; lse [S * blocks * Hkv *
    128] f32, base 2, -inf for a row that saw no key of the split), row k * blocks * Hkv * 128 + r for row r of
    q2; `_merge_split_rows` merges them. The partials stay bf16 because f32 [2, 64, D] output tiles (64 KB at
    D=128) do not fit beside the 128 KB ring; each is a convex combination of V rows, so the bf16 rounding is
    relative to the output, like the unsplit kernel's. S = 1 traces exactly the unsplit kernel."""
    T = config.block_kv
    splits = config.num_splits or 1
    stages = config.num_stages
    window = table_window(max_pages, 1, T)
    log2_t = T.bit_length() - 1
    log2_group = group.bit_length() - 1
    small_classes = page_classes(T)                                           # (log2 P, copies per tile)
    copies = [n for _, n in small_classes] + [1]
    qk_scale = scale * _LOG2E
    wgmma_layout = plgpu.Layout.WGMMA
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    delta = delta_dtype is not None
    fp8 = delta and jnp.dtype(delta_dtype).itemsize == 1
    mma_dtype = jnp.float16 if delta else jnp.dtype(pool_dtype)
    out_dtype = jnp.bfloat16 if delta else mma_dtype        # the output leaves through a tile of this dtype
    # K-side arrivals per page piece: the K rows, and with deltas the piece's packed scales (the V scales ride
    # with K: the softmax needs them before P @ V, and they are read before K's slot is released).
    k_copies = [n * (2 if delta else 1) for n in copies]

    n_out = 1 if splits == 1 else 2          # (o,) or (o_part, lse)

    def body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, *kv_and_out):
        def scoped(table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars, k_bars, v_bars,
                   k_free, v_free, schedule_bar, *extra):
            delta_smem = extra[0] if delta else None
            lse_smem = extra[-1] if splits > 1 else None
            kernel_body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, kv_and_out[:-n_out],
                        kv_and_out[-n_out:], table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars,
                        k_bars, v_bars, k_free, v_free, schedule_bar, delta_smem, lse_smem)

        if delta:
            ring = delta_ring_type(stages, T, head_dim, delta_dtype)
        else:
            ring = plgpu.SMEM((stages, T, head_dim), mma_dtype, transforms=MMA_TRANSFORMS)
        p_tiles = (plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS, T), mma_dtype, transforms=MMA_TRANSFORMS)
                   if interpret else None)
        pl.run_scoped(
            scoped,
            plgpu.SMEM((window,), jnp.int32),
            plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS, head_dim), mma_dtype, transforms=MMA_TRANSFORMS),
            ring, ring, p_tiles,
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_barriers=_COMPUTE_WGS),
            [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in k_copies],
            [plgpu.Barrier(num_arrivals=n, num_barriers=stages) for n in copies],
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS, num_barriers=stages),
            plgpu.Barrier(num_arrivals=_COMPUTE_WGS),
            *([_delta_scratch(stages, T, head_dim, fp8)] if delta else []),
            *([plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS), jnp.float32)] if splits > 1 else []),
            collective_axes="wg",
        )

    def kernel_body(lengths_ref, psizes_ref, qstart_ref, table_ref, q_ref, kv_refs, out_refs,
                    table_smem, qo_smem, k_ring, v_ring, p_smem, table_bar, q_bars, k_bars, v_bars,
                    k_free, v_free, schedule_bar, dsm, lse_smem):
        b = lax.axis_index("b")
        h = lax.axis_index("h")
        wg = lax.axis_index("wg")
        k_ref, v_ref = kv_refs[:2]
        o_ref = out_refs[0]

        # --- per-sequence scalars (every warpgroup computes them: a few scalar ops) --------
        log2_p, page, length, n_pages, n_tiles = sequence_scalars(psizes_ref[b], lengths_ref[b],
                                                                  max_pages=max_pages, block_kv=T)
        q_start = qstart_ref[b]
        # This CTA's tiles: local tile i is the sequence's tile tile_of(i), i < n_local (all of them unsplit).
        k_split, tile_lo, n_local = _split_range(n_tiles, splits)

        def tile_of(i):
            return i if splits == 1 else tile_lo + i

        def wait(bars, slot):
            wait_page_class(bars, slot, log2_p, small_classes, T)

        def table_window():
            """(first, win_start, page_entry): this sequence's page-table entries in table_smem."""
            first = b * max_pages
            win_start = pl.multiple_of(jnp.minimum(first - lax.rem(first, 4), table_len - window), 4)

            def page_entry(p):   # slot of page p of this sequence
                return table_smem[first + p - win_start]
            return first, win_start, page_entry

        @pl.when(wg == _COMPUTE_WGS)
        def _memory_warpgroup():
            if not interpret:
                plgpu.set_max_registers(40, action="decrease")
            first, win_start, page_entry = table_window()
            plgpu.copy_gmem_to_smem(table_ref.at[pl.ds(win_start, window)], table_smem, table_bar.at[0],
                                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS)
            plgpu.barrier_wait(table_bar.at[0])

            def fetch(src_ref, ring, bars, tile, slot, with_scales=False):
                """Issue the TMA copies of one K or V tile into ring slot `slot` (and, per page piece with
                with_scales, its packed scale granules, on the same barrier)."""
                def piece(gi, src, off, size):
                    plgpu.copy_gmem_to_smem(src_ref.at[h, pl.ds(src, size)], ring.at[slot, pl.ds(off, size)],
                                            bars[gi].at[slot])
                    if with_scales:
                        fetch_packed_granules(kv_refs[2].at[h], src, off, size, dsm.scales.at[slot],
                                              bars[gi].at[slot])
                issue_tile_copies(
                    tile * T, log2_p=log2_p, page=page, n_pages=n_pages, page_entry=page_entry,
                    small_classes=small_classes, block_kv=T, piece=piece)

            # One loop issues every tile (the first `stages` into empty slots), so each fetch is traced
            # once: the page-class branches unroll up to T / 8 copies per side, and Mosaic GPU lowering
            # time (paid at every server start, per prefill bucket) grows with the traced code.
            def issue(i, carry):
                slot = lax.rem(i, stages)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])
                fetch(k_ref, k_ring, k_bars, tile_of(i), slot, with_scales=delta)

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])
                fetch(v_ref, v_ring, v_bars, tile_of(i), slot)
                return carry
            lax.fori_loop(0, n_local, issue, None)

            def drain(i, carry):
                # Observe the last releases too: a barrier's phases must all be seen by the threads
                # that wait on it (the interpreter checks it), and the CTA's SMEM outlives no copy.
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                return carry
            lax.fori_loop(jnp.maximum(n_local - stages, 0), n_local, drain, None)

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
            if fp8:     # converted by the compute warpgroups, K by warpgroup 0 and V by warpgroup 1
                k_mma, v_mma = dsm.k16, dsm.v16
                wait_k = functools.partial(_convert_fp8_tile, wg=wg, wait=wait, k_bars=k_bars, v_bars=v_bars,
                                           k_ring=k_ring, v_ring=v_ring, dsm=dsm, length=length, block_kv=T)
                wait_v = lambda slot: plgpu.barrier_wait(dsm.v_conv.at[slot])
            else:       # the ring slots as TMA fills them
                k_mma, v_mma = k_ring, v_ring
                wait_k = lambda slot, tile_of: wait(k_bars, slot)
                wait_v = functools.partial(wait, v_bars)
            if delta:   # each granule's scales sit at a static place of its piece's area (no page-table read)
                columns = _columns_reader(dsm, log2_p=log2_p, block_kv=T, length=length)

            def schedule():
                plgpu.barrier_arrive(schedule_bar)
                plgpu.barrier_wait(schedule_bar)

            def tile_step(i, carry, *, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(i, stages)
                tile = tile_of(i)
                # A split starting past a row's causal bound leaves it no key in a masked tile: keep its
                # exp2 offsets finite (l stays 0). Unsplit, tile 0 gives every row key 0.
                guard = masked and splits > 1

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_mma.at[slot].transpose((1, 0)))
                    schedule()
                    return acc_ref[...]
                s = pl.run_scoped(qk, plgpu.ACC((_WG_ROWS, T), jnp.float32))
                # The scale columns are read before K's slot is released: its refill brings the next ones.
                cols = columns(slot, tile) if delta else None
                plgpu.barrier_arrive(k_free.at[slot])
                if cols is None:
                    if masked:
                        cols_idx = plgpu.broadcasted_iota(jnp.int32, (_WG_ROWS, T), 1, layout=wgmma_layout)
                        s = jnp.where(cols_idx < row_end - tile * T, s, -jnp.inf)
                    # Scores stay unscaled; m is kept in scaled (base-2) units so p is one FMA + exp2.
                    m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
                    m_off = _finite_offset(m_new) if guard else m_new
                    alpha = jnp.exp2(m_i - m_off)
                    p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_off, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                else:
                    acc, m_new, l_i, p = _folded_softmax(s, cols, acc, m_i, l_i, qk_scale=qk_scale,
                                                         row_end=(row_end - tile * T) if masked else None,
                                                         guard=guard)
                p16 = p.astype(mma_dtype)
                if not interpret:
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                plgpu.barrier_arrive(schedule_bar)        # softmax done: the other warpgroup's GEMMs may go
                wait_v(slot)
                if masked and not fp8:     # (fp8: warpgroup 1 zeroed them while converting)
                    n_valid = length - tile * T

                    @pl.when(n_valid < T)
                    def _():
                        v = v_ring[slot]
                        vrows = plgpu.broadcasted_iota(jnp.int32, (T, head_dim), 0, layout=wgmma_layout)
                        v_ring[slot] = jnp.where(vrows < n_valid, v, jnp.zeros_like(v))
                        plgpu.commit_smem()     # make the stores visible to the async proxy (WGMMA)
                plgpu.barrier_wait(schedule_bar)          # the tensor cores are ours

                def next_k_wait():
                    @pl.when(i + 1 < n_local)
                    def _():
                        wait_k(lax.rem(i + 1, stages), lambda: tile_of(i + 1))

                if interpret:
                    # The interpreter has no register A operand and no run_state: P goes through SMEM
                    # into a fresh accumulator. Same math.
                    p_smem[wg] = p16
                    plgpu.commit_smem()

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem.at[wg], v_mma.at[slot])
                        next_k_wait()
                        return acc_ref[...]
                    acc = acc + pl.run_scoped(pv, plgpu.ACC((_WG_ROWS, head_dim), jnp.float32))
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_mma.at[slot])
                        next_k_wait()
                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            acc = plgpu.layout_cast(jnp.zeros((_WG_ROWS, head_dim), jnp.float32), wgmma_layout)
            m_i = plgpu.layout_cast(jnp.full((_WG_ROWS,), -jnp.inf, jnp.float32), row_layout)
            l_i = plgpu.layout_cast(jnp.zeros((_WG_ROWS,), jnp.float32), row_layout)
            plgpu.barrier_wait(q_bars.at[wg])

            @pl.when(n_local > 0)
            def _():
                wait_k(0, lambda: tile_of(0))

            pl.when(wg == 1)(schedule)     # start the ping-pong: warpgroup 0 computes first
            # Tiles ending at or before the block's first token (and the length) are whole for every
            # row: no mask there.
            full = lax.shift_right_logical(jnp.minimum(q_start, length), jnp.int32(log2_t))
            if splits > 1:      # this range's share of them, counted from its first tile
                full = jnp.clip(full - tile_lo, 0, n_local)
            carry = lax.fori_loop(0, full, functools.partial(tile_step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(full, n_local, functools.partial(tile_step, masked=True), carry)
            pl.when(wg == 0)(schedule)     # balance the barrier phases

            # --- epilogue: normalise, write this warpgroup's 64 rows -----------------------------
            l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
            o = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
            if delta:   # + the mean anchor; through a bf16 tile of its own (q's tile is f16)
                o_smem = dsm.o.at[wg]
                o = add_anchor_v(kv_refs[3].at[h, 0], o, l_i)
            else:       # through this warpgroup's q tile (bf16, or f16 for the fp16-delta fold)
                o_smem = q_smem
            o_smem[...] = o.astype(out_dtype)
            if splits > 1:
                lse_smem[wg] = m_i + jnp.log2(l_i)     # -inf where the split gave the row no key
            plgpu.commit_smem()
            out_row = row0 if splits == 1 else k_split * rows_per_split + row0
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(out_row, _WG_ROWS)])
            if splits > 1:
                plgpu.copy_smem_to_gmem(lse_smem.at[wg], out_refs[1].at[pl.ds(out_row, _WG_ROWS)])
            plgpu.wait_smem_to_gmem(0)

    rows_per_split = blocks * num_kv_heads * _CTA_ROWS
    out_type = jax.ShapeDtypeStruct((splits * rows_per_split, head_dim), out_dtype)
    grid, grid_names = (blocks, num_kv_heads), ("b", "h")
    if splits > 1:
        out_type = (out_type, jax.ShapeDtypeStruct((splits * rows_per_split,), jnp.float32))
        grid, grid_names = grid + (splits,), grid_names + ("k",)
    return plgpu.kernel(
        body, out_type=out_type, grid=grid, grid_names=grid_names,
        num_threads=_COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=config.approx_math))


# ---------------------------------------------------------------------------------------------
# The folded delta format's pieces of the kernel
# ---------------------------------------------------------------------------------------------

class _DeltaSmem(NamedTuple):
    """The delta format's SMEM beyond the bf16 kernel's (refs inside the kernel, SMEM types outside).

    o: [2, 64, D] bf16, each compute warpgroup's output tile (its q tile is f16); scales: [stages,
    (T / 8) * SCALE_AREA] f32, the packed scale granules as TMA lands them (`fetch_packed_granules`, on K's
    barrier).
    fp8 only (None otherwise): k16, v16 [stages, T, D] f16, the converted tiles WGMMA reads; k_conv, v_conv:
    one arrival per converted K / V tile (warpgroup 0's / warpgroup 1's)."""
    o: object
    scales: object
    k16: object = None
    v16: object = None
    k_conv: object = None
    v_conv: object = None


def _delta_scratch(stages: int, block_kv: int, head_dim: int, fp8: bool) -> _DeltaSmem:
    areas = packed_scale_areas_type(stages, block_kv)
    o = plgpu.SMEM((_COMPUTE_WGS, _WG_ROWS, head_dim), jnp.bfloat16)
    if not fp8:
        return _DeltaSmem(o=o, scales=areas)
    f16_ring = plgpu.SMEM((stages, block_kv, head_dim), jnp.float16, transforms=MMA_TRANSFORMS)
    converted = plgpu.Barrier(num_arrivals=1, num_barriers=stages)
    return _DeltaSmem(o=o, scales=areas, k16=f16_ring, v16=f16_ring, k_conv=converted,
                      v_conv=converted)


def _columns_reader(dsm: _DeltaSmem, *, log2_p, block_kv: int, length):
    """columns(slot, tile) -> TileColumns of the tile in ring slot `slot`, from its landed packed scales
    (`packed_tile_columns`; a sequence's granules sit at the same places in every tile)."""
    def columns(slot, tile):
        return packed_tile_columns(dsm.scales, slot, log2_p, length - tile * block_kv, block_kv)
    return columns


def _split_range(n_tiles, splits: int):
    """In a kernel: (k_split, tile_lo, n_local) of this CTA, split k_split (grid axis "k") of `splits` over a
    sequence of n_tiles tiles; unsplit (None, None, n_tiles), so the unsplit kernel traces no extra op."""
    if splits == 1:
        return None, None, n_tiles
    k_split = lax.axis_index("k")
    tile_lo, tile_hi = split_tile_range(n_tiles, k_split, splits)
    return k_split, tile_lo, tile_hi - tile_lo


def _finite_offset(m):
    """The exp2 offset for row maxima m [64]: m, or 0 where m is -inf (a row that has seen no key yet), so
    exp2(m_old - offset) and exp2(s - offset) are 0 there instead of NaN (-inf - -inf)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _folded_softmax(s, cols, acc, m_i, l_i, *, qk_scale, row_end, guard=False):
    """One online-softmax step of the folded path (delta_attention's module docstring): s [64, T] f32 = q . dk,
    cols: the tile's TileColumns; row_end [64, T] int32 (keys of the tile each row sees: column < row_end) or
    None (every key). The max is taken over s + log2(value scale), so P * value scale <= 1 (f16-safe); l
    sums P without the value scale. guard: rows may have no key yet (`_finite_offset`). Returns (acc rescaled,
    m_new, l_new, P * value scale [64, T] f32)."""
    s = s * lax.broadcast_in_dim(cols.score_scale * qk_scale, s.shape, [1])
    if row_end is not None:     # also drops the NaN scores of stale slots
        col = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
        s = jnp.where(col < row_end, s, -jnp.inf)
    m_new = jnp.maximum(m_i, (s + lax.broadcast_in_dim(cols.log2_value_scale, s.shape, [1])).max(axis=1))
    m_off = _finite_offset(m_new) if guard else m_new
    alpha = jnp.exp2(m_i - m_off)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_off, s.shape, [0]))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    l_i = l_i * alpha + p.sum(axis=1)
    return acc, m_new, l_i, p * lax.broadcast_in_dim(cols.value_scale, s.shape, [1])


def _convert_fp8_tile(slot, tile_of, *, wg, wait, k_bars, v_bars, k_ring, v_ring, dsm: _DeltaSmem, length,
                      block_kv: int) -> None:
    """In a compute warpgroup, before the QK of the tile in ring slot `slot` (the kernel's wait_k for fp8; tile_of()
    gives the tile's index): the
    tile's fp8 rows become the f16 tiles both compute warpgroups read, converted once: warpgroup 0 converts K
    (as soon as it lands) and signals k_conv, warpgroup 1 converts V (zeroing the rows past the length: stale
    slots may hold NaN) and signals v_conv; then both wait for K (V is awaited before P @ V). Each warpgroup
    converts its side of a tile while the other one's GEMMs run (the ping-pong), and the K side of tile i + 1
    during its own P @ V of tile i (this is called for the next tile inside it). The f16 slot is free when its
    fp8 data lands: the memory warpgroup refills a ring slot only after both compute warpgroups released it.
    Why not the memory warpgroup: converting needs ~48 more registers per thread in it (taken from the
    compute warpgroups, whose score tile, accumulator, P and scale columns fill 232), and it would serialise
    every tile's conversion on one warpgroup; why not both halves of each side: a 64-token tile's half is 32
    rows, below WGMMA's 64-row register layout. (On a 2-core CPU the Mosaic GPU interpreter also deadlocked
    with the memory warpgroup converting: its XLA execution found no thread while both compute warpgroups'
    executions blocked in barrier waits.)"""
    @pl.when(wg == 0)
    def _():
        wait(k_bars, slot)
        convert_to_f16(k_ring.at[slot], dsm.k16.at[slot])
        plgpu.commit_smem()     # visible to WGMMA, and every thread of this warpgroup past it before the arrive
        plgpu.barrier_arrive(dsm.k_conv.at[slot])

    @pl.when(wg == 1)
    def _():
        wait(v_bars, slot)
        convert_to_f16(v_ring.at[slot], dsm.v16.at[slot], valid_rows=length - tile_of() * block_kv)
        plgpu.commit_smem()
        plgpu.barrier_arrive(dsm.v_conv.at[slot])
    plgpu.barrier_wait(dsm.k_conv.at[slot])
