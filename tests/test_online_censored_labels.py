"""Censored online labels (issue #15): an access's label at horizon h is decided only once h has passed or
the block came back; an undecided horizon counts in neither the online loss nor the holdout's metrics, and
a holdout with one class at the decision horizon swaps nothing."""
import jax
import numpy as np
import pytest

from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.learner import Learner, OnlineConfig, decision_index, holdout_rows
from stratum_jax.dmlp.model import DmlpConfig, init_params
from stratum_jax.dmlp.outcomes import OutcomeTracker
from stratum_jax.dmlp.policy import ConfidenceThreshold
from training.labels import reuse_labels

H = (10.0, 50.0, 100.0, 200.0, 500.0)
RECENCY = FEATURE_NAMES.index("recency_ms")
CONFIG = OnlineConfig(min_examples=256, min_holdout=64, batch_size=64, steps_per_round=5, learning_rate=3e-3)


def access_stream(n, seed):
    """n accesses of 40 blocks at increasing times [n] (ms), the access's index in feature 0."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(4.0, n))
    blocks = rng.integers(0, 40, n)
    raw = np.full((n, len(FEATURE_NAMES)), np.nan, np.float32)
    raw[:, 0] = np.arange(n)
    return t, blocks, raw


def tracked(t, blocks, raw, until_ms, hold_reuse=False):
    """Drives an OutcomeTracker over the accesses up to until_ms; returns index [R], labels/known [R, H]."""
    rows = []
    tr = OutcomeTracker(H, lambda r, lab, known: rows.append((r[:, 0].astype(int), lab, known)), batch=7,
                        hold_reuse=hold_reuse)
    for i in np.flatnonzero(t <= until_ms):
        tr.accessed([int(blocks[i])], raw[i:i + 1], float(t[i]))
    tr.idle(until_ms)
    return (np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]),
            np.concatenate([r[2] for r in rows]))


def next_use_ms(t, blocks):
    nxt = np.full(len(t), np.inf)
    last = {}
    for i in range(len(t) - 1, -1, -1):
        nxt[i] = last.get(blocks[i], np.inf)
        last[blocks[i]] = t[i]
    return nxt


def test_each_horizon_is_decided_once_when_it_passes_or_on_reuse():
    t, blocks, raw = access_stream(3000, seed=0)
    truth = reuse_labels(next_use_ms(t, blocks), t, H)
    now = float(t[2000])           # mid-stream: some horizons of the recent accesses are still open
    idx, labels, known = tracked(t, blocks, raw, now)
    decided = np.zeros((len(t), len(H)))
    np.add.at(decided, idx, known)
    assert decided.max() == 1                       # no (access, horizon) pair is handed over twice
    gap = next_use_ms(t, blocks) - t
    # Decided exactly when the horizon has passed by `now`, or the block came back by `now` within it.
    expect = (t[:, None] <= now) & ((now - t[:, None] > np.array(H)) | ((t + gap)[:, None] <= now) & (gap[:, None] <= np.array(H)))
    np.testing.assert_array_equal(decided.astype(bool), expect)
    # Every decided label is the true one.
    rows, cols = np.nonzero(known)
    np.testing.assert_array_equal(labels[rows, cols], truth[idx[rows], cols])
    # Where the longest horizon has not passed, a reused access is decided at the horizons it covers and an
    # unreused one is not: the censoring the old tracker's whole-row handover turned into all-positive rows.
    open_ = t > now - H[-1]
    assert (decided[open_ & (gap <= H[-1]) & (t + gap <= now), -1] == 1).all()
    assert (decided[open_ & ~(t + gap <= now), -1] == 0).all() and (open_ & ~(t + gap <= now)).any()


def test_held_reuses_are_handed_over_at_the_horizon_whatever_the_label():
    t, blocks, raw = access_stream(3000, seed=0)
    truth = reuse_labels(next_use_ms(t, blocks), t, H)
    now = float(t[2000])
    idx, labels, known = tracked(t, blocks, raw, now, hold_reuse=True)
    decided = np.zeros((len(t), len(H)))
    np.add.at(decided, idx, known)
    # Handed over exactly when the horizon has passed, reused or not: the same accesses for both labels.
    np.testing.assert_array_equal(decided.astype(bool), (t[:, None] <= now) & (now - t[:, None] > np.array(H)))
    rows, cols = np.nonzero(known)
    np.testing.assert_array_equal(labels[rows, cols], truth[idx[rows], cols])


def model():
    cfg = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H, hidden=(16,))
    raw = np.random.default_rng(3).uniform(0, 1000, (512, len(FEATURE_NAMES))).astype(np.float32)
    return cfg, jax.device_get(init_params(cfg, 0)), Normalizer.fit(raw)


def examples(n, seed):
    """Rows whose reuse follows recency (labels [N, H]), each with some horizons undecided (known [N, H])."""
    rng = np.random.default_rng(seed)
    raw = rng.uniform(0, 1000, (n, len(FEATURE_NAMES))).astype(np.float32)
    labels = (raw[:, RECENCY, None] <= np.array(H)[None, :]).astype(np.float32)
    known = (rng.random((n, len(H))) < 0.6).astype(np.float32)
    known[:, -1] = 1.0          # the decision horizon decided everywhere: both classes in the holdout
    return raw, labels, known


def run_learner(raw, labels, known, rounds=3):
    cfg, params, norm = model()
    lr = Learner(cfg, params, norm, CONFIG, ConfidenceThreshold())
    lr.add(raw, labels, known)
    swaps = [lr.round() for _ in range(rounds)]
    return lr, swaps


def test_undecided_horizons_count_in_neither_the_loss_nor_the_holdout():
    raw, labels, known = examples(2000, seed=1)
    noise = np.random.default_rng(2).integers(0, 2, labels.shape).astype(np.float32)
    garbled = np.where(known > 0, labels, noise)         # other values where undecided
    assert (garbled != labels).any()
    a, swaps_a = run_learner(raw, labels, known)
    b, swaps_b = run_learner(raw, garbled, known)
    assert swaps_a == swaps_b and any(swaps_a)
    assert a.accuracy == b.accuracy and a.threshold.value == b.threshold.value
    for x, y in zip(jax.tree_util.tree_leaves(a.live), jax.tree_util.tree_leaves(b.live)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The mask is what does it: the same garbled labels taken as decided train other weights.
    c, _ = run_learner(raw, garbled, np.ones_like(known))
    assert any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree_util.tree_leaves(a.live), jax.tree_util.tree_leaves(c.live)))


def test_a_holdout_with_one_class_at_the_decision_horizon_swaps_nothing():
    raw, labels, known = examples(2000, seed=4)
    # Decided at the decision horizon only where reused (the censored shape of a run shorter than it);
    # the undecided rows there carry a 0 that must not count as a second class.
    k = decision_index(H, CONFIG.decision_horizon_ms)
    known[:, k] = labels[:, k]
    lr, swaps = run_learner(raw, labels, known)
    assert swaps == [False] * 3 and lr.refusals == 3 and lr.updates == 0
    assert "all reused" in lr.refused
    assert lr.threshold.value == ConfidenceThreshold().value     # nor calibrated on one class
    assert lr.accuracy == 1.0          # measured on the decided labels only (all reused, predicted so)...
    known[:, k] = 1.0                  # ...and with both classes decided, the same data is judged and swaps
    lr, swaps = run_learner(raw, labels, known)
    assert any(swaps) and lr.refusals == 0 and lr.refused is None


def test_rows_of_one_access_land_on_one_side_of_the_holdout():
    raw = np.random.default_rng(5).uniform(0, 1000, (4000, len(FEATURE_NAMES))).astype(np.float32)
    held = holdout_rows(np.concatenate([raw, raw]), 5)
    np.testing.assert_array_equal(held[:4000], held[4000:])
    assert 0.15 < held[:4000].mean() < 0.25


def test_bad_known_shape_is_refused():
    cfg, params, norm = model()
    lr = Learner(cfg, params, norm, CONFIG, ConfidenceThreshold())
    raw, labels, known = examples(10, seed=6)
    with pytest.raises(ValueError, match="known"):
        lr.add(raw, labels, known[:, :2])
