"""Paged attention per tensor-parallel shard: the attention functions of stratum_jax/attention.py (the Pallas
kernel through `decode_attention`, the tiled jnp path) run under `shard_map`, each device on its own q
heads and the KV heads of its own pools.

Attention is the one part of the step that jit's automatic partitioning cannot be left to: it indexes
pages through block tables (gathers, or a Pallas kernel, which has no partitioning rule), while heads
are independent. So each device runs the unchanged single-device function on its slice of the head
axis (of the bf16 pools, or of every array of a DKVC DeltaKV); the block tables and positions are replicated. No collective happens here: the all-reduce
follows in o_proj. Shapes are the wrapped functions' own (attention.py), with heads split N ways
inside; with tp None these call them directly.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from stratum_jax.attention import decode_attention, prefill_attention
from stratum_jax.kv.delta_cache import DeltaKV
from stratum_jax.tensor_parallel import AXIS, TensorParallel

_POOL = P(AXIS, None, None)            # [kv_heads, slots, head_dim]
# A DKVC layer (stratum_jax/kv/delta_cache.py): every array split over its leading kv-head axis.
_DELTA = DeltaKV(anchor_k=_POOL, anchor_v=_POOL, k_delta=_POOL, v_delta=_POOL, scales=P(AXIS, None, None),
                 k_floor=P(AXIS), v_floor=P(AXIS))


def _pool_specs(k_pool, v_pool):
    """in_specs of (k_pool, v_pool): two bf16 pools, or a DKVC DeltaKV and None."""
    if isinstance(k_pool, DeltaKV):   # the spec tree carries the cache's static storage rule, as its treedef does
        return dataclasses.replace(_DELTA, fixed_scales=k_pool.fixed_scales), None
    return _POOL, _POOL


def _per_shard(fn, tp: TensorParallel, in_specs, out_specs):
    # check_vma off: a Pallas call carries no varying-axis annotations for shard_map to check.
    return jax.shard_map(fn, mesh=tp.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def sharded_decode_attention(tp: TensorParallel | None, q, positions, tables, k_pool, v_pool, **kwargs):
    """`decode_attention(q [rows, heads, D], positions, tables, k_pool, v_pool, **kwargs)` per shard."""
    if tp is None:
        return decode_attention(q, positions, tables, k_pool, v_pool, **kwargs)
    heads = P(None, AXIS, None)
    out = (heads, P(None, AXIS)) if kwargs.get("return_score_stats") else heads
    fn = _per_shard(functools.partial(decode_attention, **kwargs), tp, (heads, P(), P(), *_pool_specs(k_pool, v_pool)),
                    out)
    return fn(q, positions, tables, k_pool, v_pool)


def sharded_prefill_attention(tp: TensorParallel | None, q, q_positions, tile_rows, tables, k_pool, v_pool,
                              **kwargs):
    """`prefill_attention(q [tiles, tile, heads, D], q_positions, tile_rows, tables, k_pool, v_pool,
    **kwargs)` per shard (the kernel's causal blocks, or the tiled jnp path)."""
    if tp is None:
        return prefill_attention(q, q_positions, tile_rows, tables, k_pool, v_pool, **kwargs)
    heads = P(None, None, AXIS, None)
    out = (heads, P(None, None, AXIS)) if kwargs.get("return_score_stats") else heads
    fn = _per_shard(functools.partial(prefill_attention, **kwargs), tp,
                    (heads, P(), P(), P(), *_pool_specs(k_pool, v_pool)), out)
    return fn(q, q_positions, tile_rows, tables, k_pool, v_pool)

