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
"""
from __future__ import annotations

import functools
import logging
import time

import jax
import jax.numpy as jnp

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
