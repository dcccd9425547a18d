"""Online fine-tuning: it repairs a deliberately wrong model from a synthetic stream with a known pattern."""
import time

import jax
import numpy as np
import prometheus_client as prom

from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, Predictor, init_params
from stratum_jax.dmlp.policy import ConfidenceThreshold
from stratum_jax.dmlp.checkpoint import latest_checkpoint, load_checkpoint
from stratum_jax.dmlp.learner import Learner
from stratum_jax.dmlp.online import OnlineConfig, OnlineFineTuner
from stratum_jax.dmlp.outcomes import OutcomeTracker

H = (10.0, 50.0, 100.0, 200.0, 500.0)
RECENCY = FEATURE_NAMES.index("recency_ms")


def stream(n, seed):
    """The pattern: a block comes back after the same gap as last time, so reuse within h <=> recency <= h."""
    rng = np.random.default_rng(seed)
    raw = np.full((n, len(FEATURE_NAMES)), np.nan, np.float32)
    raw[:, RECENCY] = rng.uniform(0, 1000, n)
    raw[:, FEATURE_NAMES.index("depth")] = rng.integers(0, 50, n)
    labels = (raw[:, RECENCY, None] <= np.array(H)[None, :]).astype(np.float32)
    return raw, labels


def wrong_model():
    """A model that answers "never reused" for everything: the last layer's bias pushed far down."""
    cfg = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H, hidden=(64, 64))
    params = jax.device_get(init_params(cfg, 0))
    last = sorted(params)[-1]
    params[last]["bias"] = np.full_like(params[last]["bias"], -8.0)
    raw, _ = stream(4096, seed=9)
    return Predictor(cfg, params, Normalizer.fit(raw))


def accuracy(pred, raw, labels):
    """At the longest horizon, where half the stream is reused."""
    return float(((pred.predict(raw)[:, -1] >= 0.5) == (labels[:, -1] > 0.5)).mean())


def test_fine_tuning_repairs_a_wrong_model(tmp_path):
    pred = wrong_model()
    raw, labels = stream(12000, seed=1)
    test_raw, test_labels = stream(4000, seed=2)
    before = accuracy(pred, test_raw, test_labels)
    registry = prom.CollectorRegistry()
    threshold = ConfidenceThreshold(0.75)
    # Judged at the longest horizon, where `accuracy` measures (the default decision horizon is shorter).
    cfg = OnlineConfig(min_examples=2048, min_holdout=512, steps_per_round=50, learning_rate=3e-3,
                       cpu_budget=0.5, checkpoint_interval_s=1e9, decision_horizon_ms=H[-1])
    tuner = OnlineFineTuner(pred, cfg, str(tmp_path / "ck"), registry, threshold=threshold)
    for i in range(0, len(raw), 200):
        assert tuner.observe(raw[i:i + 200], labels[i:i + 200])
    tuner.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not tuner.accuracy > 0.95:
        time.sleep(0.2)
    final = tuner.stop()
    assert tuner.error is None
    after = accuracy(pred, test_raw, test_labels)
    assert before < 0.6 and after > 0.93, (before, after)
    assert tuner.current_params() is pred.params
    assert registry.get_sample_value("stratum_dmlp_updates_total") == tuner.updates >= 1
    assert registry.get_sample_value("stratum_dmlp_accuracy") > 0.93
    assert 0.5 <= registry.get_sample_value("stratum_dmlp_confidence") <= 0.95
    # stop() wrote a checkpoint holding the repaired weights.
    assert final == latest_checkpoint(str(tmp_path / "ck"))
    loaded = load_checkpoint(final)
    assert accuracy(Predictor(loaded.config, loaded.params, loaded.normalizer), test_raw, test_labels) == after


def test_worse_candidates_are_not_swapped_in():
    pred = wrong_model()
    raw, labels = stream(6000, seed=4)
    good = Learner(pred.config, pred.params, pred.normalizer,
                   OnlineConfig(learning_rate=3e-3, steps_per_round=50), ConfidenceThreshold())
    good.add(raw, labels)
    while good.updates < 10:
        good.round()
    assert good.accuracy > 0.9
    # The same data, a learning rate that wrecks every candidate: the good weights must stay live.
    bad = Learner(pred.config, good.live, pred.normalizer,
                  OnlineConfig(learning_rate=50.0, steps_per_round=20), ConfidenceThreshold())
    bad.add(raw, labels)
    swapped = [bad.round() for _ in range(3)]
    assert not any(swapped) and bad.live is good.live and bad.accuracy == good.accuracy


def test_observe_never_blocks_and_counts_drops(tmp_path):
    registry = prom.CollectorRegistry()
    tuner = OnlineFineTuner(wrong_model(), OnlineConfig(queue_batches=2), str(tmp_path), registry)
    raw, labels = stream(30, seed=5)
    t = time.perf_counter()
    results = [tuner.observe(raw[i:i + 10], labels[i:i + 10]) for i in range(0, 30, 10)]
    assert time.perf_counter() - t < 0.1
    assert results == [True, True, False] and tuner.dropped == 10
    assert registry.get_sample_value("stratum_dmlp_online_dropped_total") == 10


def test_outcome_tracker_labels():
    """Each horizon's label is handed over once, when it is decided: at the block's next use (1 for every
    horizon not yet decided) or when that horizon has passed without one (0)."""
    got = []
    tr = OutcomeTracker((10.0, 100.0), lambda raw, lab, known: got.extend(
        zip(raw[:, 0].tolist(), lab.tolist(), known.tolist())), batch=1)
    row = lambda v: np.full((1, len(FEATURE_NAMES)), v, np.float32)
    tr.accessed(["a"], row(1), 0.0)
    tr.accessed(["b"], row(2), 5.0)       # a's 10 ms horizon is still open
    assert got == []
    tr.accessed(["a"], row(3), 50.0)       # a's 10 ms passed unused (0), then a came back: 100 ms is 1
    assert got == [(1.0, [0.0, 0.0], [1.0, 0.0]), (2.0, [0.0, 0.0], [1.0, 0.0]), (1.0, [0.0, 1.0], [0.0, 1.0])]
    got.clear()
    tr.accessed(["c"], row(4), 200.0)      # b (from 5) and a (from 50): 100 ms passed unused; a's 10 ms too
    assert sorted(got) == [(2.0, [0.0, 0.0], [0.0, 1.0]), (3.0, [0.0, 0.0], [0.0, 1.0]),
                           (3.0, [0.0, 0.0], [1.0, 0.0])]
    got.clear()
    tr.accessed(["c"], row(5), 204.0)      # c came back after 4 ms: both horizons 1, in one row
    tr.expire(1000.0)                      # c (from 204) expires unused, one horizon at a time
    assert got == [(4.0, [1.0, 1.0], [1.0, 1.0]), (5.0, [0.0, 0.0], [1.0, 0.0]), (5.0, [0.0, 0.0], [0.0, 1.0])]
