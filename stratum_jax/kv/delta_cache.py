"""DKVC's storage: a resident anchor per layer and KV head, and each KV slot as a low-precision delta from it.

The storage contract, per layer (pallas_kernels/delta_attention.py reads the same arrays):

    anchor_k, anchor_v: [num_kv_heads, anchor_len, head_dim] in the model's dtype (bf16). anchor_len is 1
        (a mean anchor) or a multiple of 256 (position-aligned anchor blocks; stratum_jax/kv/anchor.py).
    k_delta, v_delta:   [num_kv_heads, num_slots, head_dim], float16 ("fp16-delta") or float8_e4m3fn
        ("fp8-delta"); the same slots and page tables as the bf16 pools.
    scales:             [num_kv_heads, num_slots // 8, 4] float32: granule g's K scale at [:, g, 0] and its V
        scale at [:, g, 1] (`k_scale` / `v_scale`), one per 8-slot granule per KV head; [:, g, 2:] unused. Packed
        so that each granule's pair starts on a 16-byte boundary: the swapped decode kernel reads a page piece's
        scales with one TMA copy and finds each granule at a static place (pallas_kernels/swapped_decode_attention.py
        `F8PackedGranulePages`; BENCHMARKS.md #12 session 41).

The K (or V) of the token at absolute position t in slot s is

    anchor[:, t % anchor_len] + scale[:, s // 8] * delta[:, s]        (float32, cast to the anchor's dtype)

with scale = scales[..., 0] for K and scales[..., 1] for V.

fp16 deltas keep unit scales (fp16's range holds any delta of a bf16 model's K/V, and its 11-bit mantissa
is finer than bf16's 8, so the rebuild is the bf16 value or one rounding away: not always exact, since a
value much smaller than its anchor leaves a delta that needs more bits). fp8 e4m3 (|x| <= 448) needs a scale, set per granule so:

  - A granule's scale is set when its first slot (s % 8 == 0) is written, and then stays fixed until that
    slot is written again: scale = max(floor, amax / 448), where amax is the largest |delta| among the
    tokens that land in the granule in that same step, and floor is the layer/head's calibrated scale
    (`k_floor` / `v_floor`, from the warm-up run: stratum_jax/kv/anchor.py).
  - Tokens written into the granule by later steps use the scale as it is; a delta beyond 448 * scale
    saturates at +-448 (e4m3fn has no inf: an unclipped cast would give NaN).

Why this rule: a page's slots fill in position order (pages start on 8-slot boundaries and positions map
to consecutive slots), so the first-slot write is the granule's first write. A prefill chunk writes
whole granules in one step and gets their exact amax. A decode step writes one token; growing the scale
afterwards would mean re-quantising the granule's earlier slots (a second rounding of data already
rounded, plus a read-modify-write of 8 slots per token), and a scale that never moves is what lets a
granule be copied to the host tier and back bit for bit. The floor bounds how tight a decode granule's
first token can make the scale, so later tokens seldom saturate. The quality study
(benchmarks/dkvc_quality.py) measures the result with decode-written positions.

Fixed scales (`DeltaKV.fixed_scales`, `--fp8-scale head`): every granule keeps its layer/head's floor for
good, and the floor is the largest per-token max |delta| of the warm-up run / 448 (`AnchorChoice.max_floors`),
so no warm-up token would have saturated. A write then only quantises: no amax reduction and no scale
scatter per step, and a head's scale is one number (what a kernel can fold into q and the output instead of
scaling each key and P column). The price: a delta beyond the warm-up's largest saturates at +-448 * scale.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.delta_attention import GRANULE, PACKED_SCALE_FLOATS, pack_granule_scales
from stratum_jax.kv.slot_write import write_slot_rows

log = logging.getLogger(__name__)

FP8_MAX = 448.0                 # the largest finite float8_e4m3fn
DELTA_DTYPES = {"fp16-delta": jnp.float16, "fp8-delta": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class DeltaKV:
    """One layer's delta cache (a registered pytree; module docstring for the contract).

    anchor_k, anchor_v: [Hkv, anchor_len, D] model dtype; k_delta, v_delta: [Hkv, num_slots, D] float16 or
    float8_e4m3fn; scales: [Hkv, num_slots // 8, 4] float32 (K, V, 2 unused per granule: `k_scale` and `v_scale`
    are its first two); k_floor, v_floor: [Hkv] float32, the
    smallest scale a granule is given (fp16: ones, unused). fixed_scales (static, fp8 only): every granule's
    scale is its head's floor, never rewritten (module docstring).
    """

    anchor_k: jax.Array
    anchor_v: jax.Array
    k_delta: jax.Array
    v_delta: jax.Array
    scales: jax.Array
    k_floor: jax.Array
    v_floor: jax.Array
    fixed_scales: bool = False

    @property
    def num_slots(self) -> int:
        return self.k_delta.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_delta.shape[0]

    @property
    def k_scale(self) -> jax.Array:
        """[Hkv, num_slots // 8] float32: each granule's K scale."""
        return self.scales[..., 0]

    @property
    def v_scale(self) -> jax.Array:
        """[Hkv, num_slots // 8] float32: each granule's V scale."""
        return self.scales[..., 1]

    @property
    def dtype(self):
        """The dtype K/V are rebuilt in (the anchor's: the model's)."""
        return self.anchor_k.dtype

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array, slots: jax.Array) -> "DeltaKV":
        """Stores the deltas of k, v [T, Hkv, D] (tokens at absolute `positions` [T] int32) at `slots` [T]
        int32; slots >= num_slots are padding and dropped. Returns the updated cache (inside the jit step)."""
        fixed = self.fixed_scales
        k_delta, scales = _write(self.anchor_k, self.k_delta, self.scales, 0, self.k_floor, k, positions, slots, fixed)
        v_delta, scales = _write(self.anchor_v, self.v_delta, scales, 1, self.v_floor, v, positions, slots, fixed)
        return dataclasses.replace(self, k_delta=k_delta, v_delta=v_delta, scales=scales)

    def gather(self, slots: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """K and V rebuilt at slots [N, K] int32 holding absolute positions [K] int32 (the same positions for
        every one of the N rows, as in the tiled attention's key blocks) -> k, v [Hkv, N, K, D] in
        self.dtype."""
        return (_rebuild(self.anchor_k, self.k_delta, self.k_scale, slots, positions),
                _rebuild(self.anchor_v, self.v_delta, self.v_scale, slots, positions))


jax.tree_util.register_dataclass(DeltaKV, data_fields=[f.name for f in dataclasses.fields(DeltaKV)
                                                      if f.name != "fixed_scales"],
                                 meta_fields=["fixed_scales"])


def _write(anchor, delta, scales, side: int, floor, x, positions, slots, fixed_scales=False):
    """One of K/V (side 0 / 1 of the packed scales [Hkv, G, 4]): x [T, Hkv, D] -> (delta, scales) updated (module
    docstring for the scale rule; with fixed_scales the scale is the floor and stays as it is). The scale updates
    are scatters into the granules written, not a rewrite of the whole array."""
    a = anchor[:, positions % anchor.shape[1]].astype(jnp.float32)                   # [Hkv, T, D]
    d = x.transpose(1, 0, 2).astype(jnp.float32) - a
    if delta.dtype == jnp.float16:
        return write_slot_rows(delta, slots, d.astype(jnp.float16)), scales
    if fixed_scales:
        q = jnp.clip(d / floor[:, None, None], -FP8_MAX, FP8_MAX).astype(delta.dtype)
        return write_slot_rows(delta, slots, q), scales
    granules = scales.shape[1]
    g = slots // GRANULE                                                             # padding: >= granules
    first = jnp.where(slots % GRANULE == 0, g, granules)                             # granules restarted
    fresh = jnp.zeros((granules,), jnp.bool_).at[first].set(True, mode="drop")
    in_fresh = jnp.where(fresh.at[g].get(mode="fill", fill_value=False), g, granules)
    scales = scales.at[:, first, side].set(jnp.broadcast_to(floor[:, None], (floor.shape[0], first.shape[0])),
                                           mode="drop")
    scales = scales.at[:, in_fresh, side].max(jnp.max(jnp.abs(d), axis=-1) / FP8_MAX, mode="drop")
    s = scales.at[:, g, side].get(mode="fill", fill_value=1.0)                       # [Hkv, T]
    q = jnp.clip(d / s[..., None], -FP8_MAX, FP8_MAX).astype(delta.dtype)
    return write_slot_rows(delta, slots, q), scales


def _rebuild(anchor, delta, scale, slots, positions):
    """[Hkv, N, K, D] = anchor[:, positions % anchor_len] + scale[:, slots // 8] * delta[:, slots]."""
    a = anchor[:, positions % anchor.shape[1]].astype(jnp.float32)[:, None]          # [Hkv, 1, K, D]
    d = delta[:, slots].astype(jnp.float32)                                          # [Hkv, N, K, D]
    if delta.dtype != jnp.float16:                                                   # fp16 scales are ones
        d = d * scale[:, slots // GRANULE][..., None]
    return (a + d).astype(anchor.dtype)


@functools.partial(jax.jit, static_argnums=2)
def _filled_scales(k_floor: jax.Array, v_floor: jax.Array, granules: int) -> jax.Array:
    """k_floor, v_floor [Hkv] -> packed scales [Hkv, granules, 4] float32, every granule of head h (k_floor[h],
    v_floor[h], 0, 0): a new buffer, split over heads as the floors are."""
    shape = (k_floor.shape[0], granules)
    return pack_granule_scales(jnp.broadcast_to(k_floor[:, None], shape), jnp.broadcast_to(v_floor[:, None], shape))


def num_slots_of(layer_cache) -> int:
    """Slots in one layer's cache: a DeltaKV, or the bf16 (k_pool, v_pool) pair [Hkv, num_slots, D]."""
    return layer_cache.num_slots if isinstance(layer_cache, DeltaKV) else layer_cache[0].shape[1]


def _head_sharded(sharding, ndim: int):
    """The sharding of a [Hkv, ...] DKVC array of `ndim` axes: `sharding` (the bf16 pools' [Hkv, slots, D]
    one, split over kv heads under tensor parallelism) with the same split of axis 0 and nothing else split;
    None (the default device) without one."""
    if sharding is None:
        return None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(sharding.spec[0], *[None] * (ndim - 1)))


def init_delta_cache(anchors, floors, num_slots: int, precision: str, sharding=None,
                     fixed_scales: bool = False) -> list[DeltaKV]:
    """Zeroed delta pools around resident anchors.

    anchors: per layer (anchor_k, anchor_v) [Hkv, anchor_len, D]; floors: per layer (k_floor, v_floor)
    [Hkv] float32 (fp16-delta ignores them: its scales are ones); num_slots: a multiple of 8;
    precision: "fp16-delta" or "fp8-delta"; fixed_scales (fp8-delta only): every granule keeps its head's
    floor (module docstring; pass `AnchorChoice.max_floors` as floors); sharding: where the bf16 pools would live
    (`TensorParallel.kv_sharding`: every array here is split over its kv-head axis the same way, so each
    device holds the anchors, deltas, scales and floors of its own heads), or None.
    """
    if precision not in DELTA_DTYPES:
        raise ValueError(f"delta precision must be one of {tuple(DELTA_DTYPES)}, got {precision!r}")
    if num_slots % GRANULE:
        raise ValueError(f"num_slots must be a multiple of {GRANULE}, got {num_slots}")
    if fixed_scales and precision != "fp8-delta":
        raise ValueError(f"fixed scales are an fp8-delta storage rule; {precision} has none to fix")
    start = time.perf_counter()
    dtype = DELTA_DTYPES[precision]
    cache = []
    for (ak, av), (fk, fv) in zip(anchors, floors, strict=True):
        heads, _, dim = ak.shape
        if precision == "fp16-delta":
            fk = fv = np.ones((heads,), np.float32)
        granules = num_slots // GRANULE
        # Every leaf its own buffer: the step donates the cache, and XLA refuses one buffer donated twice.
        # Each is made in place on its devices (a delta pool never materialises whole on one device).
        s1, s3 = _head_sharded(sharding, 1), _head_sharded(sharding, 3)
        k_floor, v_floor = (jax.device_put(np.asarray(f, np.float32), s1) for f in (fk, fv))
        cache.append(DeltaKV(
            anchor_k=jax.device_put(np.asarray(ak), s3), anchor_v=jax.device_put(np.asarray(av), s3),
            k_delta=jnp.zeros((heads, num_slots, dim), dtype, device=s3),
            v_delta=jnp.zeros((heads, num_slots, dim), dtype, device=s3),
            scales=_filled_scales(k_floor, v_floor, granules),
            k_floor=k_floor, v_floor=v_floor, fixed_scales=fixed_scales))
    jax.block_until_ready(cache)
    ak = anchors[0][0]
    pool_bytes = 2 * math.prod((ak.shape[0], num_slots, ak.shape[2])) * jnp.dtype(dtype).itemsize
    scale_bytes = ak.shape[0] * (num_slots // GRANULE) * PACKED_SCALE_FLOATS * 4
    anchor_bytes = 2 * ak.size * ak.dtype.itemsize
    log.info("KV cache (%s%s): %d layers x (2 x %s %s deltas + scales + anchor of %d positions) = %.3f GiB "
             "allocated in %.2f s", precision, ", fixed per-head scales" if fixed_scales else "", len(cache),
             [ak.shape[0], num_slots, ak.shape[2]],
             jnp.dtype(dtype).name, ak.shape[1], len(cache) * (pool_bytes + scale_bytes + anchor_bytes) / 2**30,
             time.perf_counter() - start)
    return cache
