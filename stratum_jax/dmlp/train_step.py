"""The DMLP's optimisation step and batched prediction, shared by the offline trainer (training/trainer.py)
and the online learner that fine-tunes inside the server (learner.py)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from stratum_jax.dmlp.model import DmlpNet, bce_from_hazard


def masked_loss(net: DmlpNet, params, x, labels, known):
    """Mean binary cross-entropy over known labels. x [B, D], labels/known [B, H]."""
    loss = bce_from_hazard(net.apply({"params": params}, x), labels) * known
    return loss.sum() / jnp.maximum(known.sum(), 1.0)


def make_step(net: DmlpNet, opt: optax.GradientTransformation):
    @jax.jit
    def step(params, opt_state, x, labels, known):
        loss, grads = jax.value_and_grad(lambda p: masked_loss(net, p, x, labels, known))(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return step


def predict_in_batches(net: DmlpNet, params, x: np.ndarray, batch: int = 16384) -> np.ndarray:
    """P(reuse) [N, H] for model inputs x [N, D]; fixed batch shape so it compiles once."""
    fn = _prob_fn(net)
    out = []
    for i in range(0, len(x), batch):
        chunk = x[i:i + batch]
        pad = np.zeros((batch, x.shape[1]), np.float32)
        pad[:len(chunk)] = chunk
        out.append(np.asarray(fn(params, pad))[:len(chunk)])
    return np.concatenate(out) if out else np.zeros((0, len(net.config.horizons_ms)), np.float32)


@functools.lru_cache(maxsize=8)
def _prob_fn(net: DmlpNet):
    """Cached per network (flax modules hash by their config): the online learner predicts its holdout
    every round, and a fresh jit each time would compile each time."""
    return jax.jit(lambda p, x: -jnp.expm1(-net.apply({"params": p}, x)))


def mean_bce(probs: np.ndarray, labels: np.ndarray, known: np.ndarray | None = None) -> float:
    """Mean binary cross-entropy of probabilities [N, H] over the known labels (all if known is None)."""
    known = np.ones_like(labels) if known is None else known
    p = np.clip(probs, 1e-7, 1 - 1e-7)
    bce = -(labels * np.log(p) + (1 - labels) * np.log1p(-p))
    return float((bce * known).sum() / max(known.sum(), 1.0))
