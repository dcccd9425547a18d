"""The offline DMLP trainer: jitted optax steps over shuffled minibatches, best epoch by validation loss.

Deterministic: the seed fixes the initial weights and the batch order, and XLA on CPU computes the
same step the same way, so the same seed and data give the same weights.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import optax
from tqdm import tqdm

from stratum_jax.dmlp.features import Normalizer, feature_matrix, num_inputs
from stratum_jax.dmlp.model import DEFAULT_HIDDEN, DmlpConfig, DmlpNet, init_params
from stratum_jax.dmlp.train_step import make_step, mean_bce, predict_in_batches
from training.labels import Examples
from training.metrics import horizon_metrics


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    epochs: int = 3
    seed: int = 0
    batch_size: int = 512
    learning_rate: float = 3e-4
    weight_decay: float = 1e-4
    hidden: tuple[int, ...] = DEFAULT_HIDDEN


@dataclasses.dataclass
class TrainResult:
    config: DmlpConfig
    params: dict
    normalizer: Normalizer
    epochs: list[dict]      # per epoch: train_loss, val_loss, val metrics
    best_epoch: int
    seconds: float


def train(train_ex: Examples, val_ex: Examples, horizons_ms, cfg: TrainConfig) -> TrainResult:
    normalizer = Normalizer.fit(train_ex.raw)
    x_tr = feature_matrix(train_ex.raw, normalizer)
    x_va = feature_matrix(val_ex.raw, normalizer)
    config = DmlpConfig(num_inputs=num_inputs(), horizons_ms=tuple(horizons_ms), hidden=cfg.hidden)
    net = DmlpNet(config)
    params = init_params(config, cfg.seed)
    batches = len(x_tr) // cfg.batch_size
    if batches == 0:
        raise ValueError(f"{len(x_tr)} training examples is less than one batch of {cfg.batch_size}")
    total = batches * cfg.epochs
    schedule = optax.warmup_cosine_decay_schedule(0.0, cfg.learning_rate, max(1, min(1000, total // 10)), total)
    opt = optax.adamw(schedule, weight_decay=cfg.weight_decay)
    opt_state = opt.init(params)
    step = make_step(net, opt)
    rng = np.random.default_rng(cfg.seed)
    best, best_loss, epochs = params, np.inf, []
    start = time.perf_counter()
    for epoch in range(cfg.epochs):
        perm = rng.permutation(len(x_tr))[: batches * cfg.batch_size].reshape(batches, cfg.batch_size)
        losses = []
        bar = tqdm(perm, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="batch", leave=False)
        for idx in bar:
            params, opt_state, loss = step(params, opt_state, x_tr[idx], train_ex.labels[idx],
                                           train_ex.known[idx])
            losses.append(loss)
            if len(losses) % 50 == 0:
                bar.set_postfix(loss=f"{float(loss):.4f}")
        probs = predict_in_batches(net, params, x_va)
        val_loss = mean_bce(probs, val_ex.labels, val_ex.known)
        row = {"epoch": epoch + 1, "train_loss": float(np.mean(jax.device_get(losses))),
               "val_loss": val_loss, **horizon_metrics(probs, val_ex.labels, val_ex.known)}
        epochs.append(row)
        tqdm.write(f"epoch {epoch + 1}: train loss {row['train_loss']:.4f}  val loss {val_loss:.4f}  "
                   f"val auc {_fmt(row['auc'])}  val acc {_fmt(row['accuracy'])}")
        if val_loss < best_loss:
            best, best_loss = params, val_loss
    best_epoch = int(np.argmin([e["val_loss"] for e in epochs])) + 1
    return TrainResult(config, jax.device_get(best), normalizer, epochs, best_epoch,
                       time.perf_counter() - start)


def _fmt(xs) -> str:
    return "[" + " ".join(f"{x:.3f}" for x in xs) + "]"
