"""The engine's layout of a model's weights: q/k/v in one qkv_proj and gate/up in one gate_up_proj.

Left to itself XLA merges those GEMMs too (its dot merger), but by concatenating the weights on the device
inside every executable call: a copy of 1.3 GB per call at llama-1b, paid per call of 2 decode steps (the
server's default) and per packed step. Done once here, at engine start, the step runs one GEMM per merged
projection and copies nothing (BENCHMARKS.md, issue #18).

With tensor parallelism each device must keep exactly its own columns, so the fused weight is
[S, sum(features) / S, hidden] with S the mesh size: shard s's block is its q rows, then its k rows, then
its v rows (gate then up for the MLP), and the leading axis is split over the mesh. The block of a projection
sharded P("tp", None) is a reshape of it, so fusing moves no data between devices. Without a mesh S = 1.

`fuse_projections` rewrites a LoadedModel's params in place and deletes the arrays it replaced (keeping both
would need ~60% more weight memory); it is idempotent, so several engines may share one model.

`fold_norms` (--fold-norms) then folds each layer's two RMSNorm weights into the fused projection each norm feeds
(q/k/v, gate/up: `norm_fold.fold_norm_weight`, columns scaled in fp32 and rounded once) and sets the norms' weights
to ones, so rms_norm(x) * g @ W.T becomes rms_norm(x) @ (W * g).T: the same function on every path (XLA's prefill
normalises with unit weights), and the decode step's folded layer (pallas_kernels/norm_fold.py) takes the rows'
scale inside the GEMMs. The final norm before the LM head is not folded (the head may be tied to the embedding).
"""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp

from pallas_kernels.norm_fold import fold_norm_weight
from stratum_jax.model.llama import Params, fused_shards_of

log = logging.getLogger(__name__)

_ATTENTION = ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"))
_MLP = ("mlp", "gate_up_proj", ("gate_proj", "up_proj"))


@functools.partial(jax.jit, static_argnames=("shards",))
def _blocks(parts: tuple[jax.Array, ...], shards: int) -> jax.Array:
    """parts [features_j, ...] -> [shards, sum(features_j) / shards, ...]: shard s's slice of each in turn."""
    return jnp.concatenate([p.reshape(shards, p.shape[0] // shards, *p.shape[1:]) for p in parts], axis=1)


def fuse_layer(layer: Params, shards: int, sharding=None) -> Params:
    """One decoder layer's params with its projections fused (a new dict; the input is left as it was).
    sharding: of the fused weights (P("tp", None, None) on a mesh), or None."""
    out = {name: dict(sub) for name, sub in layer.items()}
    for module, fused_name, names in (_ATTENTION, _MLP):
        sub = out[module]
        fused = {}
        for kind in ("weight", "bias"):
            if kind in sub[names[0]]:
                parts = tuple(sub[n][kind] for n in names)
                blocks = _blocks(parts, shards)
                fused[kind] = blocks if sharding is None else jax.device_put(blocks, sharding[kind])
        for n in names:
            del sub[n]
        sub[fused_name] = fused
    return out


def fuse_projections(model) -> None:
    """Rewrites model.params (a LoadedModel) into the fused layout, layer by layer, deleting each replaced
    array once its layer is fused (so memory grows by at most one layer's projections). No-op when the
    params are fused already."""
    params = model.params
    if params is None or fused_shards_of(params):      # None: a shape-only model (tests), nothing to fuse
        return
    start = time.perf_counter()
    tp = model.tp
    shards = tp.size if tp is not None else 1
    sharding = None if tp is None else {"weight": tp.sharding("tp", None, None), "bias": tp.sharding("tp", None)}
    for key in [k for k in params if k.startswith("layers_")]:
        old = params[key]
        # Written before the old arrays go: delete() must not race the copies that read them.
        params[key] = jax.block_until_ready(fuse_layer(old, shards, sharding))
        for module, _, names in (_ATTENTION, _MLP):
            for n in names:
                for array in old[module][n].values():
                    array.delete()
    log.info("fused q/k/v and gate/up weights of %d layers (%d shard block%s) in %.2f s", model.config.num_layers,
             shards, "s" if shards > 1 else "", time.perf_counter() - start)


# (the norm, the fused projection it feeds) in a layer's params
_FOLDS = (("input_layernorm", ("self_attn", "qkv_proj")), ("post_attention_layernorm", ("mlp", "gate_up_proj")))


@jax.jit
def _fold_layer(norm_weight: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(unit norm weight [K], w [1, N, K] with norm_weight [K] folded into its columns)."""
    return jnp.ones_like(norm_weight), fold_norm_weight(norm_weight, w[0])[None]


def fold_norms(model) -> None:
    """Folds each layer's RMSNorm weights into the fused projection after them (the module docstring), in place and
    once (model.norms_folded); the params must be fused on one device (`fuse_projections`, no tensor parallelism)."""
    if model.norms_folded or model.params is None:     # None: a shape-only model (tests), nothing to fold
        return
    if fused_shards_of(model.params) != 1:
        raise ValueError("fold_norms needs the fused one-device layout (fuse_projections without tensor parallelism); "
                         f"the params have {fused_shards_of(model.params)} shard blocks")
    start = time.perf_counter()
    for key in [k for k in model.params if k.startswith("layers_")]:
        layer = model.params[key]
        for norm, (module, proj) in _FOLDS:
            old_norm, old_w = layer[norm]["weight"], layer[module][proj]["weight"]
            if not isinstance(old_w, jax.Array):       # abstract params (gpu_preflight.py): the shapes stay
                continue
            new_norm, new_w = jax.block_until_ready(_fold_layer(old_norm, old_w))
            layer[norm]["weight"], layer[module][proj]["weight"] = new_norm, new_w
            old_norm.delete()
            old_w.delete()
    model.norms_folded = True
    log.info("folded the RMSNorm weights of %d layers into q/k/v and gate/up in %.2f s", model.config.num_layers,
             time.perf_counter() - start)
