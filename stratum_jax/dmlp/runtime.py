"""Builds the engine's cache policy from `RuntimeConfig`, with the DMLP's online fine-tuning wired in.

    policy, tuner = build_cache_policy(config)          # tuner is None unless --dmlp-online

`--cache-policy lru` gives `LruPolicy()`. `--cache-policy dmlp` loads the checkpoint and wires

    load_checkpoint -> Predictor -> ConfidenceThreshold(--dmlp-confidence)
        -> OnlineFineTuner (with --dmlp-online)
        -> wiring.wire_policy: OutcomeTracker(horizons, tuner.observe, hold_reuse) and
           DmlpPolicy(predictor, threshold, decision horizon, on_access=tracker.accessed,
                      track_fraction=--dmlp-online-track: the share of blocks, by id, it labels)

The decision horizon and hold_reuse are `OnlineConfig`'s defaults, the same the cache simulator's online
replay uses (one wiring function for both).

The tracker runs on the engine thread (the policy calls it after scoring each batch of accesses) and
hands finished (features, observed reuse) pairs to `tuner.observe`, which never blocks. The tuner is
returned unstarted: the server starts it after warm-up and stops it (final orbax checkpoint) when it
drains. `export_dmlp_metrics` puts stratum_dmlp_* into a server's registry.
"""
from __future__ import annotations

import logging

from stratum_jax.config import RuntimeConfig
from stratum_jax.cache_policy import LruPolicy
from stratum_jax.dmlp.policy import DmlpPolicy

log = logging.getLogger(__name__)


def build_cache_policy(config: RuntimeConfig, metrics_registry=None):
    """Returns (policy, tuner or None). Raises CheckpointError (a ValueError naming the file) for a bad
    --dmlp-checkpoint. With `metrics_registry`, the stratum_dmlp_* metrics are registered there."""
    if config.cache_policy == "lru":
        return LruPolicy(), None
    wired, tuner = build_dmlp(config)
    if metrics_registry is not None:
        export_dmlp_metrics(wired.policy, tuner, metrics_registry)
    return wired.policy, tuner


def build_dmlp(config: RuntimeConfig):
    """`--cache-policy dmlp`'s policy with its tracker (`wiring.WiredPolicy`) and tuner (None unless
    --dmlp-online)."""
    from stratum_jax.dmlp.checkpoint import load_checkpoint
    from stratum_jax.dmlp.guard import ShadowLruGuard
    from stratum_jax.dmlp.learner import OnlineConfig
    from stratum_jax.dmlp.model import Predictor
    from stratum_jax.dmlp.policy import ConfidenceThreshold
    from stratum_jax.dmlp.wiring import wire_policy

    ckpt = load_checkpoint(config.dmlp_checkpoint)
    import jax

    device = jax.devices("cpu")[0] if config.dmlp_device == "cpu" else None
    predictor = Predictor(ckpt.config, ckpt.params, ckpt.normalizer, device=device)
    threshold = ConfidenceThreshold(config.dmlp_confidence)
    # The decision horizon and the label rule (hold_reuse) are OnlineConfig's defaults, the ones the
    # replay uses (`wiring.wire_policy`), whether or not this server fine-tunes online.
    online = OnlineConfig(cpu_cores=config.dmlp_online_cores)
    tuner = None
    if config.dmlp_online:
        from stratum_jax.dmlp.online import OnlineFineTuner

        tuner = OnlineFineTuner(predictor, online, config.dmlp_online_dir, threshold=threshold)
    guard = ShadowLruGuard(window=config.dmlp_guard_window) if config.dmlp_guard else None
    wired = wire_policy(predictor, threshold, online, sink=tuner.observe if tuner else None,
                        track_fraction=config.dmlp_online_track, guard=guard,
                        score_ahead=config.dmlp_score_ahead)
    log.info("cache policy dmlp: %s (horizons %s ms, confidence %.2f, online %s, guard %s, %s)", config.dmlp_checkpoint,
             list(ckpt.config.horizons_ms), threshold.value, "on" if tuner else "off", "on" if guard else "off",
             wired.settings())
    return wired, tuner


def export_dmlp_metrics(policy, tuner, registry) -> None:
    """Registers stratum_dmlp_confidence (any DMLP policy), with a guard stratum_dmlp_guard_active and
    its three windowed hit rates (real, ghost LRU, ghost DMLP), and, with a tuner, stratum_dmlp_accuracy, stratum_dmlp_updates_total and
    stratum_dmlp_online_dropped_total. A no-op for LRU; idempotent."""
    if not isinstance(policy, DmlpPolicy):
        return
    if policy.exported_to is registry:
        return
    if tuner is not None:
        tuner.export(registry)               # includes the threshold's gauge
    else:
        policy.threshold.export(registry)
    if policy.guard is not None:
        policy.guard.export(registry)
    policy.exported_to = registry


def dmlp_status(policy, tuner) -> dict | None:
    """A snapshot for GetMetrics: None for LRU."""
    if not isinstance(policy, DmlpPolicy):
        return None
    out = {"confidence": policy.threshold.value, "online": tuner is not None, "accuracy": float("nan"),
           "updates": 0, "dropped": 0}
    if tuner is not None:
        out.update(accuracy=float(tuner.accuracy), updates=int(tuner.updates), dropped=int(tuner.dropped))
    return out


def warm_predictor(policy) -> None:
    """Compiles every batch bucket the predictor runs at (`Predictor.batch_buckets`), so serving never waits
    on a compile."""
    if not isinstance(policy, DmlpPolicy):
        return
    import numpy as np

    n_features = len(policy.predictor.normalizer.mean)
    for rows in policy.predictor.batch_buckets():
        policy.predictor.predict(np.full((rows, n_features), np.nan, np.float32))
