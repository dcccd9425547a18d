"""Split-K partials exchanged inside a cluster (the CTAs of one output tile run as one cluster over the split axis):
the cluster-scope fence the exchange needs, and the attention merge done by one CTA of the cluster
(`merge_attention_splits`), so no XLA kernel follows the attention kernel. decode_matmul.py's residual GEMM sums its
partials the same way (`_cluster_sum_and_add`)."""
from __future__ import annotations

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import llvm

from pallas_kernels._interpret import interpret_mode_active


def fence_for_peers(async_proxy: bool = True) -> None:
    """In a kernel, on the GPU: order this block's writes of its partial before the cluster barrier, and the barrier
    before its reads of its peers' partials, at cluster scope (the barrier's arrive and wait order only the block's
    own accesses). async_proxy: the writes and reads are TMA copies of a global exchange buffer, so the generic and
    async proxies are ordered too. The interpreter runs each access to completion in program order, so it needs (and
    has) no fence."""
    if interpret_mode_active():
        return
    asm = ("fence.proxy.async.global;\n\t" if async_proxy else "") + "fence.acq_rel.cluster;"

    @plgpu.inline_mgpu()
    def fence(_):
        llvm.inline_asm(ir.Type.parse("!llvm.void"), [], asm, "", has_side_effects=True)

    fence()


# A TMA copy's shared-memory address must be 128-byte aligned (PTX cp.async.bulk.tensor); Pallas aligns each SMEM
# allocation to 1 KB, but a row of a 2-D one starts at row * its length.
TMA_SMEM_ALIGN_BYTES = 128


def lse_row_floats(n_cols: int) -> int:
    """The f32 row length of the merge's [S, row] lse scratch: n_cols rounded up so every split's row, a TMA
    destination, starts 128-byte aligned (at N = 8 a [S, 8] tile put split 1's row 32 bytes in: the merged kernel
    failed with CUDA_ERROR_MISALIGNED_ADDRESS on an H100, session 37)."""
    per_align = TMA_SMEM_ALIGN_BYTES // 4
    return -(-n_cols // per_align) * per_align


def merge_attention_splits(*, parts_gmem, lse_gmem, out_gmem, part_rows, lse_blocks, out_row, col0, group: int,
                           is_first, part_smem, lse_smem, out_smem, cluster_barrier, load_barrier,
                           out_scale=None, bias_gmem=None, bias_smem=None, has_keys=None) -> None:
    """In a kernel, after every split of the cluster has stored its normalised output rows and its base-2 log-sum-exp
    (TMA stores completed): a cluster barrier, then the cluster's first block (is_first) merges the splits' rows into
    the output, as `split_k.combine_splits` does (the same fp32 operations in the same order), applies the output's
    affine map (out_scale: a scalar or None; bias_gmem [D] f32 or None, added only where has_keys) and stores the
    group's rows in out_gmem's dtype. The other blocks leave after the barrier (the exchange goes through global
    memory, so no block's shared memory must outlive it).

    parts_gmem [rows, D] f32: split s's rows start at part_rows[s]; lse_gmem [..., N] f32: split s's columns are
    lse_gmem[lse_blocks[s]] (N of them, the group's from column col0, traced); out_gmem [rows, D]: the group's rows
    from out_row. Scratch: part_smem [S, N, D] f32, lse_smem [S, lse_row_floats(N)] f32 (each row's first N
    columns used), out_smem [N, D] out dtype, bias_smem [D] f32 (with bias_gmem); cluster_barrier a ClusterBarrier
    over the split axis; load_barrier for 2 * S (+1 with the bias) copies."""
    splits = len(part_rows)
    n_cols = lse_gmem.shape[-1]
    if lse_smem.shape != (splits, lse_row_floats(n_cols)):
        raise ValueError(f"lse_smem must be [splits, lse_row_floats(N)] = {(splits, lse_row_floats(n_cols))} so each "
                         f"split's row is a 128-byte aligned TMA destination; got {lse_smem.shape}")
    fence_for_peers()
    plgpu.barrier_arrive(cluster_barrier)
    plgpu.barrier_wait(cluster_barrier)
    fence_for_peers()

    @pl.when(is_first)
    def _():
        for s in range(splits):
            plgpu.copy_gmem_to_smem(parts_gmem.at[pl.ds(part_rows[s], group)], part_smem.at[s, pl.ds(0, group)],
                                    load_barrier)
            plgpu.copy_gmem_to_smem(lse_gmem.at[lse_blocks[s]], lse_smem.at[s, pl.ds(0, n_cols)], load_barrier)
        if bias_gmem is not None:
            plgpu.copy_gmem_to_smem(bias_gmem, bias_smem, load_barrier)
        plgpu.barrier_wait(load_barrier)
        bias = None if bias_gmem is None else bias_smem[...] * jnp.where(has_keys, 1.0, 0.0).astype(jnp.float32)
        for r in range(group):     # a row's weights are scalars; its D values one vector
            lse = [lse_smem[s, col0 + r] for s in range(splits)]
            m = lse[0]
            for x in lse[1:]:
                m = jnp.maximum(m, x)
            # lse is finite or -inf (an empty split), so this is combine_splits' isfinite guard
            m = jnp.where(m == -jnp.inf, 0.0, m)
            denom, o = 0.0, 0.0
            for s in range(splits):
                # An empty split's rows are zeros (its l is 0), so combine_splits' `where(w > 0, ...)` guard
                # against a NaN partial changes nothing here: w * 0 = 0.
                w = jnp.exp2(lse[s] - m)
                denom = denom + w
                o = o + w * part_smem[s, r]
            o = o / jnp.where(denom == 0.0, 1.0, denom)
            if out_scale is not None:
                o = o * out_scale
            if bias is not None:
                o = o + bias
            out_smem[r] = o.astype(out_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(0, group)], out_gmem.at[pl.ds(out_row, group)])
        plgpu.wait_smem_to_gmem(0)
