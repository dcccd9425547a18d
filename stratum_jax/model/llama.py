"""The Llama-family decoder (Llama 3.x, Qwen2/2.5, Mistral): flax.linen modules behind a functional API.

The model knows nothing about paging. `forward` writes each token's K/V into the per-layer pools at the
slots it is given and hands the updated pools to an `attend` closure that the caller supplies (the
engine's paged kernels, or `attend_dense_causal` for one contiguous sequence).

Parameters are a plain nested dict that mirrors HF's names, in HF's (torch) layout, so that checkpoint
loading is a renaming with no transposes:

    embed_tokens/weight [vocab, hidden]
    layers_{i}/input_layernorm/weight [hidden]
    layers_{i}/self_attn/{q,k,v}_proj/weight [heads * head_dim, hidden]   (+ bias [heads * head_dim])
    layers_{i}/self_attn/o_proj/weight [hidden, num_heads * head_dim]
    layers_{i}/post_attention_layernorm/weight [hidden]
    layers_{i}/mlp/{gate,up}_proj/weight [intermediate, hidden]
    layers_{i}/mlp/down_proj/weight [hidden, intermediate]
    norm/weight [hidden]
    lm_head/weight [vocab, hidden]   (absent when cfg.tie_word_embeddings)

The engine runs on a fused layout of the same weights (stratum_jax/model/fused.py), one GEMM where HF has
two or three, with each tensor-parallel shard's block contiguous (S = shards, 1 without tensor parallelism):

    layers_{i}/self_attn/qkv_proj/weight [S, (heads + 2 * kv_heads) * head_dim / S, hidden]  (+ bias)
    layers_{i}/mlp/gate_up_proj/weight [S, 2 * intermediate / S, hidden]

`forward` reads which layout it was given from the parameters.

Numerics follow HF: RMSNorm in float32 cast back before the weight multiply, RoPE angles in float32,
attention scores and softmax in float32.

Layer boundaries: a layer hands the next one its residual stream and its MLP output still to be added
(`DecoderLayer`), and each boundary (`ResidualRMSNorm`) adds and normalises in one place, so where the projections
run on the decode kernels the add, its split-K sum and the norm are one kernel (projection.py, `Matmul.unsummed`).
With the norms folded into the weights (`Matmul.norms_folded`: norm weights ones, model/fused.py `fold_norms`) a
layer has no boundary kernels: o and down add the residual in their GEMMs and q/k/v and gate/up take the stream
un-normalised, applying the norm themselves (`DecoderLayer`'s folded path; pallas_kernels/norm_fold.py).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.l2_prefetch import WeightPrefetch
from stratum_jax.kv.delta_cache import DeltaKV
from stratum_jax.kv.slot_write import write_slot_rows
from stratum_jax.model.config import ModelConfig
from stratum_jax.model.projection import FirstTiles, Matmul, NextWeight, RopeKVWrite, Unsummed, xla_matmul

log = logging.getLogger(__name__)

Params = dict[str, Any]
# One (k_pool, v_pool) per layer, each [num_kv_heads, num_slots, head_dim] in cfg.dtype; or, with DKVC,
# one DeltaKV per layer (stratum_jax/kv/delta_cache.py).
KVCache = list[tuple[jax.Array, jax.Array]] | list[DeltaKV]
# attend(layer, q [T, num_heads, head_dim], k_pool, v_pool) -> [T, num_heads, head_dim]; with DKVC,
# attend(layer, q, delta_kv, None). A keyword `prefetch` (a WeightPrefetch of the o projection, for the decode
# kernel's L2 prefetch) is passed only where the Matmul plans one (`Matmul.prefetch_plan`: --l2-prefetch-mb on the
# Pallas projections, whose step's attend takes it), so an attend for other paths may leave it out.
Attend = Callable[..., jax.Array]

_INIT_STD = 0.02  # HF's default initializer_range


def _normal_init(key, shape, dtype):
    # Drawn in float32, then cast: jax.random.normal drawn directly in bfloat16 has a truncated tail
    # (|x| < 3 sigma, 128 distinct values). Inside a jit the draw, scale and cast fuse into one loop.
    return (jax.random.normal(key, shape, jnp.float32) * _INIT_STD).astype(dtype)


@functools.cache
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim // 2] float32, computed step by step as HF does in float32.

    Scaling: "linear" divides every frequency by `factor`; "llama3" (HF `_compute_llama3_parameters`)
    divides the low frequencies (wavelength > original_max / low_freq_factor) by `factor`, keeps the high
    ones (wavelength < original_max / high_freq_factor), and interpolates smoothly in between.
    """
    dim = cfg.head_dim
    # HF: 1 / base ** (arange(0, dim, 2, float32) / dim), all in float32. numpy's float32 power is off by
    # an ulp for many entries at large base and head_dim (14 of 64 for rope_theta 1e6, head_dim 128); at
    # position p that ulp turns into p ulps of angle, which moved a Qwen2-shaped model's log-probs by
    # 1.2e-4 at 130 tokens. So: the exponent in float32 as HF has it, the power in float64 rounded once
    # to float32 (what torch's float32 pow returns in all but a handful of near-tie entries), the
    # reciprocal in float32.
    exponent = np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)
    power = (np.float64(np.float32(cfg.rope_theta)) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / power).astype(np.float32)
    scaling = cfg.rope_scaling_dict()
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(factor)).astype(np.float32)
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = (2 * np.pi / inv_freq).astype(np.float32)
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(factor), inv_freq)
    smooth = (np.float32(old_context_len) / wavelen - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * inv_freq_llama / np.float32(factor) + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [T, head_dim/2] float32 of the RoPE angles positions [T] * inv_freq."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x [T, heads, head_dim] by the angles positions [T] * inv_freq, in HF's rotate_half layout.

    Dimension i pairs with i + head_dim/2 (not with i+1): that is how Llama/Qwen2 HF checkpoints store
    q_proj/k_proj. Computed in float32, returned in x.dtype (the decode step's fused kernel,
    pallas_kernels/rope_kv_write.py, rotates the same way).
    """
    cos, sin = (a[:, None, :] for a in rope_cos_sin(positions, inv_freq))
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attend_dense_causal(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, q_positions: jax.Array,
                        kv_slots: jax.Array | None = None) -> jax.Array:
    """Plain causal GQA attention over one sequence whose K/V sit in a pool (a reference, not a kernel).

    q: [T, num_heads, head_dim]; k_pool, v_pool: [num_kv_heads, num_slots, head_dim];
    q_positions: [T] int32, the absolute position of each query (it sees positions 0..q_position);
    kv_slots: [S] int32, the pool slot holding position s (default: position s lives in slot s).
    Query head h uses kv head h // (num_heads / num_kv_heads), HF's repeat_kv order.
    Returns [T, num_heads, head_dim] in q.dtype; scores and softmax are float32.
    """
    if kv_slots is not None:
        k_pool, v_pool = k_pool[:, kv_slots], v_pool[:, kv_slots]
    t, num_heads, head_dim = q.shape
    num_kv_heads, s = k_pool.shape[:2]
    qg = q.reshape(t, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("tkgd,ksd->tkgs", qg, k_pool, preferred_element_type=jnp.float32) * head_dim**-0.5
    visible = jnp.arange(s)[None, :] <= q_positions[:, None]  # [T, S]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,ksd->tkgd", probs, v_pool.astype(jnp.float32))
    return out.reshape(t, num_heads, head_dim).astype(q.dtype)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), weight [features, in] in torch's layout; y in out_dtype (default: dtype).
    matmul: how x @ weight.T is computed when out_dtype is the default (None: XLA's dot; projection.py).
    unsummed (no bias, default out_dtype): the product may come back as `Unsummed` partials where the Matmul leaves
    them for the residual add after it (`ResidualRMSNorm`); else y. Called with a residual [..., features] (no bias,
    default out_dtype): residual + y, the product rounded first (in one kernel where the Matmul fuses them,
    `Matmul.residual_matmul`)."""

    features: int
    use_bias: bool
    dtype: Any
    out_dtype: Any = None
    matmul: Matmul | None = None
    unsummed: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array | Unsummed:
        w = self.param("weight", _normal_init, (self.features, x.shape[-1]), self.dtype)
        if residual is not None:
            if self.use_bias or self.out_dtype is not None:
                raise ValueError("Linear: a residual is added only to a projection without bias in its own dtype")
            fused = None if self.matmul is None else self.matmul.residual_matmul(x, w, residual)
            return fused if fused is not None else residual + (self.matmul or xla_matmul)(x, w)
        if self.unsummed and self.matmul is not None and self.out_dtype is None and not self.use_bias:
            parts = self.matmul.unsummed(x, w)
            if parts is not None:
                return parts
        if self.out_dtype is None:
            y = (self.matmul or xla_matmul)(x, w)
        else:
            y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=self.out_dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


class ShardedFusedLinear(nn.Module):
    """Several column-parallel projections in one GEMM: weight [S, sum(features) / S, in], where shard s's
    block holds its slice of each projection in turn (fused.py builds it). Returns one [..., features[j]]
    per projection, each laid out as its own Linear's output; gated (two equal features, gate then up, no
    bias): silu(gate) * up instead, [..., features[0]] (on one device through `Matmul.gated`, whose kernel
    applies the activation in the GEMM's epilogue)."""

    features: tuple[int, ...]
    shards: int
    use_bias: bool
    dtype: Any
    matmul: Matmul | None = None   # used when shards == 1 (None: XLA's dot); several shards are one einsum
    gated: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, rope_kv_write: RopeKVWrite | None = None, next_weight: NextWeight | None = None,
                 norm_eps: float | None = None) -> tuple[jax.Array, ...] | jax.Array | None:
        """rope_kv_write (q/k/v, one shard, no bias): `Matmul.rope_kv_write`'s (q rotated, k_pool, v_pool), or None
        where the Matmul does not fuse them (call again without it). next_weight (gated): the projection after,
        for `Matmul.gated`'s L2 prefetch. norm_eps (gated): x is the un-normalised stream and the norm before (unit
        weight, its weight folded into this one) is applied here (`Matmul.gated_normed` where it takes it)."""
        s = self.shards
        w = self.param("weight", _normal_init, (s, sum(self.features) // s, x.shape[-1]), self.dtype)
        if norm_eps is not None:
            if not self.gated:
                raise ValueError("ShardedFusedLinear: norm_eps is for the gated MLP's projection")
            fused = self.matmul.gated_normed(x, w[0], norm_eps) if s == 1 and self.matmul is not None else None
            if fused is not None:
                return fused
            x = unit_rms_norm(x, norm_eps)
        if rope_kv_write is not None:
            if s != 1 or self.use_bias or self.gated or len(self.features) != 3:
                raise ValueError("ShardedFusedLinear: rope_kv_write is for the q/k/v projection on one shard without "
                                 f"bias, got features {self.features}, shards {s}, use_bias={self.use_bias}")
            if self.matmul is None:
                return None
            return self.matmul.rope_kv_write(x, w[0], rope_kv_write,
                                             num_q_heads=self.features[0] // rope_kv_write.k_pool.shape[-1])
        if self.gated and (len(self.features) != 2 or self.features[0] != self.features[1] or self.use_bias):
            raise ValueError(f"ShardedFusedLinear: gated needs two equal features and no bias, got "
                             f"{self.features}, use_bias={self.use_bias}")
        if self.gated and s == 1 and self.matmul is not None:
            return self.matmul.gated(x, w[0], next_weight)
        if s == 1 and self.matmul is not None:
            y = self.matmul(x, w[0])[..., None, :]                     # [..., 1, sum(features)]
        else:
            y = jnp.einsum("...i,soi->...so", x, w)                    # [..., S, sum(features) / S]
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (s, sum(self.features) // s), self.dtype)
        bounds = np.cumsum([f // s for f in self.features])[:-1]
        parts = tuple(part.reshape(*x.shape[:-1], f) for part, f in
                      zip(jnp.split(y, bounds, axis=-1), self.features, strict=True))
        if self.gated:
            gate, up = parts
            return jax.nn.silu(gate) * up
        return parts


def unit_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    """x [..., H] normalised by its rows' RMS in fp32, cast back to x.dtype: RMSNorm with a unit weight."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF Llama's RMSNorm: x [..., H] normalised in fp32, cast back to x.dtype, then times weight [H]."""
    return weight * unit_rms_norm(x, eps)  # HF casts back before the weight multiply


# What the residual stream still has to add: a sublayer's output, or its unsummed partials, or nothing (the first
# layer's input).
Pending = jax.Array | Unsummed | None


class ResidualRMSNorm(nn.Module):
    """A layer boundary: the residual stream x [T, H] plus what is pending (a sublayer's output y, or its `Unsummed`
    partials), and the RMSNorm of the sum. Returns (x + y, rms_norm(x + y)). Its parameter is the norm's "weight",
    so it reads the same checkpoints. Unsummed partials go to `Matmul.residual_rmsnorm` (one kernel for the sum, the
    add and the norm, writing both outputs) where it takes them; else they are summed here."""
    eps: float
    dtype: Any
    matmul: Matmul | None = None

    @nn.compact
    def __call__(self, x: jax.Array, pending: Pending,
                 next_weight: NextWeight | None = None) -> tuple[jax.Array, jax.Array]:
        """next_weight: the projection the norm feeds, for the fused kernel's L2 prefetch
        (`Matmul.residual_rmsnorm`)."""
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
        if isinstance(pending, Unsummed):
            fused = (self.matmul.residual_rmsnorm(x, pending, w, self.eps, next_weight) if self.matmul is not None
                     else None)
            if fused is not None:
                return fused
            pending = pending.summed(x.shape[0], x.dtype)
        if pending is not None:
            x = x + pending
        return x, rms_norm(x, w, self.eps)


class Attention(nn.Module):
    cfg: ModelConfig
    layer: int
    fused_shards: int = 0     # 0: HF's q/k/v_proj; S: one qkv_proj of S shard blocks (module docstring)
    matmul: Matmul | None = None

    @nn.compact
    def __call__(self, x, positions, cache, write_slots, attend: Attend, first_tiles: FirstTiles | None = None,
                 norm_eps: float | None = None):
        """x [T, hidden]: the input norm's output; or, with norm_eps (the norms folded: `DecoderLayer`), the residual
        stream itself, which this module normalises (unit weight; inside the q/k/v kernels where they take it) and
        adds o's output to. Returns (o's output, or its Unsummed partials; with norm_eps the new stream, the cache)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        t = x.shape[0]
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inv_freq = rope_inv_freq(cfg)
        residual = x if norm_eps is not None else None

        def o_proj(o):      # o [T, Hq, D] -> [T, hidden] or its Unsummed partials (for the residual add after it)
            return Linear(cfg.hidden_size, False, dtype, matmul=self.matmul, unsummed=True,
                          name="o_proj")(o.reshape(t, q_out), residual=residual)

        # The named scopes label the compiled ops (HLO metadata op_name), so a profile can say which part
        # of the model a kernel belongs to (benchmarks/profile_decode.py); they change no computation.
        if self.fused_shards:
            qkv_proj = ShardedFusedLinear((q_out, kv_out, kv_out), self.fused_shards, cfg.attention_bias, dtype,
                                          self.matmul, name="qkv_proj")
            if self.fused_shards == 1 and not cfg.attention_bias and not isinstance(cache, DeltaKV):
                # A decode step on the Pallas projections: q/k/v, RoPE and the KV write in two kernels
                # (pallas_kernels/rope_kv_write.py) instead of four; None where the Matmul does not fuse them.
                fused = qkv_proj(x, RopeKVWrite(*rope_cos_sin(positions, inv_freq), write_slots, *cache,
                                                first_tiles=first_tiles, row_norm_eps=norm_eps))
                if fused is not None:
                    q, k_pool, v_pool = fused
                    with jax.named_scope("attention"):
                        o = attend(self.layer, q, k_pool, v_pool, **self._o_prefetch(t)).astype(dtype)
                    return o_proj(o), (k_pool, v_pool)
        if norm_eps is not None:
            x = unit_rms_norm(x, norm_eps)
        if self.fused_shards:
            q, k, v = qkv_proj(x)
        else:
            q = Linear(q_out, cfg.attention_bias, dtype, matmul=self.matmul, name="q_proj")(x)
            k = Linear(kv_out, cfg.attention_bias, dtype, matmul=self.matmul, name="k_proj")(x)
            v = Linear(kv_out, cfg.attention_bias, dtype, matmul=self.matmul, name="v_proj")(x)
        with jax.named_scope("rope"):
            q = apply_rope(q.reshape(t, cfg.num_heads, cfg.head_dim), positions, inv_freq)
            k = apply_rope(k.reshape(t, cfg.num_kv_heads, cfg.head_dim), positions, inv_freq)
        v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
        if isinstance(cache, DeltaKV):
            # DKVC: the deltas from the layer's anchor are written here, inside the step; attend gets the
            # DeltaKV as its k_pool and None as v_pool (stratum_jax/kv/delta_cache.py).
            with jax.named_scope("kv_write"):
                cache = cache.write(k, v, positions, write_slots)
            with jax.named_scope("attention"):
                o = attend(self.layer, q, cache, None).astype(dtype)
        else:
            k_pool, v_pool = cache
            # Slots >= num_slots are padding tokens, whose writes are dropped (kv/slot_write.py).
            with jax.named_scope("kv_write"):
                k_pool = write_slot_rows(k_pool, write_slots, k.transpose(1, 0, 2))
                v_pool = write_slot_rows(v_pool, write_slots, v.transpose(1, 0, 2))
            with jax.named_scope("attention"):
                o = attend(self.layer, q, k_pool, v_pool, **self._o_prefetch(t)).astype(dtype)
            cache = (k_pool, v_pool)
        return o_proj(o), cache

    def _o_prefetch(self, rows: int) -> dict:
        """{"prefetch": the o projection's WeightPrefetch} where the Matmul plans an L2 prefetch of it at `rows`
        token rows (attend's keyword, llama.Attend), else {}."""
        next_weight = _next_weight(self, ("o_proj",))
        plan = None if next_weight is None else self.matmul.prefetch_plan(rows, next_weight)
        return {} if plan is None else {"prefetch": WeightPrefetch(next_weight.weight, plan)}


class MLP(nn.Module):
    cfg: ModelConfig
    fused_shards: int = 0     # 0: HF's gate_proj and up_proj; S: one gate_up_proj of S shard blocks
    matmul: Matmul | None = None

    @nn.compact
    def __call__(self, x, norm_eps: float | None = None):
        """x [T, hidden]: the norm's output; or, with norm_eps (the norms folded: `DecoderLayer`), the residual stream,
        normalised here (unit weight; inside the gate/up kernel where it takes it) and added to down's output.
        Returns down's output (or its Unsummed partials); with norm_eps the new stream."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        residual = x if norm_eps is not None else None
        if self.fused_shards:
            act = ShardedFusedLinear((cfg.intermediate_size,) * 2, self.fused_shards, False, dtype,
                                     self.matmul, gated=True, name="gate_up_proj")(
                x, next_weight=None if norm_eps is not None else _next_weight(self, ("down_proj",)),
                norm_eps=norm_eps)
        else:
            if norm_eps is not None:
                x = unit_rms_norm(x, norm_eps)
            gate = Linear(cfg.intermediate_size, False, dtype, matmul=self.matmul, name="gate_proj")(x)
            up = Linear(cfg.intermediate_size, False, dtype, matmul=self.matmul, name="up_proj")(x)
            act = jax.nn.silu(gate) * up
        return Linear(cfg.hidden_size, False, dtype, matmul=self.matmul, unsummed=True, name="down_proj")(
            act, residual=residual)


class DecoderLayer(nn.Module):
    cfg: ModelConfig
    layer: int
    fused_shards: int = 0
    matmul: Matmul | None = None

    @nn.compact
    def __call__(self, x, pending: Pending, positions, cache, write_slots, attend: Attend,
                 first_tiles: FirstTiles | None = None):
        """x [T, hidden]: the residual stream before the previous layer's MLP output `pending` is added. Returns
        (the stream after this layer's attention, this layer's MLP output to add to it, the cache): the add happens
        in the next boundary's `ResidualRMSNorm`, which can take the output as unsummed partials.

        With the norms folded (`Matmul.norms_folded`; one-shard fused weights, no bias, bf16 pools) the layer has no
        boundary kernels: it returns (the stream after the whole layer, None, the cache), the adds and norms inside
        its projections (pallas_kernels/norm_fold.py)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        if (self.matmul is not None and self.matmul.norms_folded and self.fused_shards == 1
                and not cfg.attention_bias and not isinstance(cache, DeltaKV)):
            if isinstance(pending, Unsummed):
                pending = pending.summed(x.shape[0], x.dtype)
            if pending is not None:
                x = x + pending
            x, cache = Attention(cfg, self.layer, self.fused_shards, self.matmul, name="self_attn")(
                x, positions, cache, write_slots, attend, first_tiles, norm_eps=cfg.rms_norm_eps)
            return MLP(cfg, self.fused_shards, self.matmul, name="mlp")(x, norm_eps=cfg.rms_norm_eps), None, cache
        x, h = ResidualRMSNorm(cfg.rms_norm_eps, dtype, self.matmul, name="input_layernorm")(
            x, pending, _next_weight(self, ("self_attn", "qkv_proj")))
        o, cache = Attention(cfg, self.layer, self.fused_shards, self.matmul, name="self_attn")(
            h, positions, cache, write_slots, attend, first_tiles)
        x, h = ResidualRMSNorm(cfg.rms_norm_eps, dtype, self.matmul, name="post_attention_layernorm")(
            x, o, _next_weight(self, ("mlp", "gate_up_proj"), gated=True))
        return x, MLP(cfg, self.fused_shards, self.matmul, name="mlp")(h), cache


def _next_weight(module: nn.Module, path: tuple[str, ...], gated: bool = False) -> NextWeight | None:
    """The [N, K] weight at `path` under module's parameters, a projection that runs after the caller's current op
    (for the Matmul's L2 prefetch of it): a fused one-shard [1, N, K] weight as [N, K], a Linear's [N, K] as it is.
    None without a Matmul, in a sharded layout, or at init (the later projection's parameters do not exist yet)."""
    if module.matmul is None or module.fused_shards != 1 or module.is_initializing():
        return None
    node = module.variables.get("params", {})
    for key in path:
        node = node.get(key, {})
    weight = node.get("weight")
    if weight is None:
        return None
    return NextWeight(weight[0] if weight.ndim == 3 else weight, gated)


class Embedding(nn.Module):
    num_embeddings: int
    features: int
    dtype: Any

    def setup(self):
        self.weight = self.param("weight", _normal_init, (self.num_embeddings, self.features),
                                 self.dtype)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, h: jax.Array) -> jax.Array:
        """Tied output projection: h [N, hidden] -> float32 logits [N, vocab]."""
        return jnp.einsum("nh,vh->nv", h, self.weight, preferred_element_type=jnp.float32)


class Decoder(nn.Module):
    cfg: ModelConfig
    fused_shards: int = 0     # the projections' layout (module docstring): fused_shards_of(params)
    matmul: Matmul | None = None   # the layers' projections (projection.py); None: XLA's dot

    def setup(self):
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        # named layers_0, layers_1, ...
        self.layers = [DecoderLayer(cfg, i, self.fused_shards, self.matmul) for i in range(cfg.num_layers)]
        self.norm = ResidualRMSNorm(cfg.rms_norm_eps, dtype, self.matmul)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.vocab_size, False, dtype, out_dtype=jnp.float32)

    def __call__(self, token_ids, positions, kv_cache: KVCache, write_slots, attend: Attend,
                 first_tiles: FirstTiles | None = None):
        x = self.embed_tokens(token_ids)
        pending, new_cache = None, []
        for layer, cache in zip(self.layers, kv_cache, strict=True):  # unrolled: the cache stays per layer
            x, pending, cache = layer(x, pending, positions, cache, write_slots, attend, first_tiles)
            new_cache.append(cache)
        return self.norm(x, pending)[1], new_cache

    def logits(self, hidden):
        if self.cfg.tie_word_embeddings:
            return self.embed_tokens.attend(hidden)
        return self.lm_head(hidden)

    def init_all(self, token_ids, positions, kv_cache, write_slots, attend):
        """Touches every parameter (lm_head is only used by `logits`); for `Module.init`."""
        hidden, _ = self(token_ids, positions, kv_cache, write_slots, attend)
        return self.logits(hidden)


def init_kv_cache(cfg: ModelConfig, num_slots: int, sharding: jax.sharding.Sharding | None = None) -> KVCache:
    """Zeroed pools: per layer (k_pool, v_pool), each [num_kv_heads, num_slots, head_dim] in cfg.dtype.
    sharding: where the pools live (tensor parallelism splits their kv heads over devices, each device
    allocating only its own); default: the default device."""
    start = time.perf_counter()
    shape = (cfg.num_kv_heads, num_slots, cfg.head_dim)
    cache = [(jnp.zeros(shape, cfg.dtype, device=sharding), jnp.zeros(shape, cfg.dtype, device=sharding))
             for _ in range(cfg.num_layers)]
    jax.block_until_ready(cache)  # costs nothing at start-up, and makes the logged time true
    log.info("KV cache: %d layers x 2 x %s %s = %.2f GiB allocated in %.2f s", cfg.num_layers, list(shape),
             cfg.dtype, 2 * cfg.num_layers * math.prod(shape) * jnp.dtype(cfg.dtype).itemsize / 2**30,
             time.perf_counter() - start)
    return cache


def param_shapes(cfg: ModelConfig) -> Params:
    """The parameter tree as jax.ShapeDtypeStruct leaves, written out from the config (no tracing, no
    allocation). tests/test_model.py checks it against the tree flax's `Decoder.init` builds."""
    dtype = jnp.dtype(cfg.dtype)
    hidden, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def leaf(*shape):
        return jax.ShapeDtypeStruct(shape, dtype)

    def linear(features, fan_in, bias=False):
        return {"weight": leaf(features, fan_in), **({"bias": leaf(features)} if bias else {})}

    bias = cfg.attention_bias
    params: Params = {"embed_tokens": {"weight": leaf(cfg.vocab_size, hidden)}, "norm": {"weight": leaf(hidden)}}
    for i in range(cfg.num_layers):
        params[f"layers_{i}"] = {
            "input_layernorm": {"weight": leaf(hidden)},
            "self_attn": {"q_proj": linear(q_out, hidden, bias), "k_proj": linear(kv_out, hidden, bias),
                          "v_proj": linear(kv_out, hidden, bias), "o_proj": linear(hidden, q_out)},
            "post_attention_layernorm": {"weight": leaf(hidden)},
            "mlp": {"gate_proj": linear(cfg.intermediate_size, hidden), "up_proj": linear(cfg.intermediate_size, hidden),
                    "down_proj": linear(hidden, cfg.intermediate_size)},
        }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": leaf(cfg.vocab_size, hidden)}
    return params


_MASK64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    """SplitMix64's output function (host side, exact in Python ints): a well-mixed 64-bit hash of z."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's finaliser on uint32 [any shape]: a bijection in which every input bit flips each output
    bit with probability ~1/2 (uint32 products wrap, shifts are logical)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "sharding"))
def _normal_leaf(words: jax.Array, shape: tuple[int, ...], dtype: str,
                 sharding: jax.sharding.Sharding | None = None) -> jax.Array:
    """N(0, 0.02) [shape] in dtype from the leaf's stream words [2] uint32, laid out as `sharding`
    (default: the default device). Element values do not depend on the sharding.

    A counter-based generator: element i gets bits = fmix32(fmix32(i * golden + w0) ^ w1), whose top 24
    bits make u in (-1, 1) and sqrt(2) * erfinv(u) a standard normal (|z| <= 5.4). Not jax.random: on CPU
    its threefry took ~3x this generator's compile and run time for a [8192, 2048] bf16 matrix (rng_compare
    in benchmarks/results/startup_cpu.json), and weights need no cryptographic-strength stream. Hash,
    transform, scale and cast fuse into one loop, so no float32 copy of the leaf exists. One compile per
    (shape, dtype): llama-1b's 113 matrices have 5 distinct shapes.
    """
    # The row-major flat index, built in the leaf's own shape (no reshape), so that a sharded leaf's
    # generator partitions elementwise and each device computes only its shard.
    strides = np.cumprod((1,) + shape[:0:-1])[::-1]
    ctr = sum(jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(strides[d]) for d in range(len(shape)))
    bits = _fmix32(_fmix32(ctr * jnp.uint32(0x9E3779B9) + words[0]) ^ words[1])
    u = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-23) - np.float32(1 - 2.0**-24)
    z = (jax.lax.erf_inv(u) * np.float32(np.sqrt(2.0) * _INIT_STD)).astype(dtype)
    return z if sharding is None else jax.lax.with_sharding_constraint(z, sharding)


def init_params(cfg: ModelConfig, seed: int = 0, shardings: Params | None = None) -> Params:
    """Random parameters, deterministic in seed: N(0, 0.02) matrices, unit norms, zero biases.

    Matrix i of the flattened tree (jax.tree_util order) is drawn from stream words that hash (seed, i),
    on the default device, directly in cfg.dtype (no host arrays, no flax trace of the whole decoder).
    shardings: a tree like `param_shapes(cfg)` of jax Shardings; each leaf is then created already laid
    out that way (every device generating only its shard: no leaf materialises whole on one device),
    with the same values as without. The calls are asynchronous; block on the result to time them.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg))
    placements = [None] * len(leaves) if shardings is None else treedef.flatten_up_to(shardings)
    seed_hash = _splitmix64(seed & _MASK64)
    out = []
    for index, ((path, spec), sharding) in enumerate(zip(leaves, placements)):
        name, parent = path[-1].key, path[-2].key
        if name == "bias":
            out.append(jnp.zeros(spec.shape, spec.dtype, device=sharding))
        elif parent.endswith("norm"):  # input_layernorm, post_attention_layernorm, norm
            out.append(jnp.ones(spec.shape, spec.dtype, device=sharding))
        else:
            if math.prod(spec.shape) >= 2**32:
                raise ValueError(f"{'/'.join(k.key for k in path)} {list(spec.shape)} has 2**32 elements or "
                                 "more: the init's uint32 counter would repeat")
            h = _splitmix64(seed_hash ^ index)
            words = np.array([h & 0xFFFFFFFF, h >> 32], np.uint32)
            out.append(_normal_leaf(words, shape=spec.shape, dtype=spec.dtype.name, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, out)


def forward(params: Params, cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
            write_slots: jax.Array, attend: Attend, matmul: Matmul | None = None,
            first_tiles: FirstTiles | None = None) -> tuple[jax.Array, KVCache]:
    """Runs the decoder over a flat (ragged) batch of T tokens.

    token_ids, positions, write_slots: [T] int32. positions are absolute (they drive RoPE); write_slots
    is the pool slot receiving each token's K/V, and a slot >= num_slots marks a padding token whose
    K/V is dropped (negative slots are not padding: they index from the end).
    kv_cache: per layer (k_pool, v_pool) [num_kv_heads, num_slots, head_dim]; donate it when jitting.
    attend(layer, q [T, num_heads, head_dim], k_pool, v_pool) -> [T, num_heads, head_dim] is called
    once per layer with that layer's pools after this batch's writes.
    Returns (hidden [T, hidden_size] after the final RMSNorm, in cfg.dtype; the updated cache).
    params: HF's layout or the fused one (module docstring); which one is read from the tree.
    matmul: how the layers' projections multiply (stratum_jax/model/projection.py); None: XLA's dot.
    first_tiles: the decode rows' page tables as attend reads them, for a Matmul that prefetches attention's first
    K/V tiles into L2 from the fused q/k/v write (`RopeKVWrite.first_tiles`); None: no such prefetch.
    """
    return Decoder(cfg, fused_shards_of(params), matmul).apply({"params": params}, token_ids, positions, kv_cache,
                                                       write_slots, attend, first_tiles)


def fused_shards_of(params: Params) -> int:
    """0 for parameters in HF's layout; S for the fused layout of S shard blocks (stratum_jax/model/fused.py)."""
    qkv = params["layers_0"]["self_attn"].get("qkv_proj")
    return 0 if qkv is None else int(qkv["weight"].shape[0])


def compute_logits(params: Params, cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """hidden [N, hidden_size] -> float32 logits [N, vocab_size] (lm_head, or the tied embedding)."""
    with jax.named_scope("lm_head"):
        return Decoder(cfg).apply({"params": params}, hidden, method=Decoder.logits)
