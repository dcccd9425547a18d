"""The eviction score: P(reuse before the block would leave the cache), with the time left taken as
exponential with mean = the residency (`reuse_before_eviction`, used by `DmlpPolicy.order_victims`)."""
import numpy as np
import pytest

from stratum_jax.dmlp.features import FEATURE_NAMES
from stratum_jax.dmlp.model import DmlpConfig
from stratum_jax.dmlp.policy import (EVICTION_WINDOW_MULTIPLES, DmlpPolicy, Residency, reuse_before_eviction,
                                     reuse_within)

H = (10.0, 50.0, 100.0)


class _Config:
    config = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H)


def test_multiples_are_the_quartile_midpoints_of_an_exponential():
    k = np.array(EVICTION_WINDOW_MULTIPLES)
    assert np.allclose(1.0 - np.exp(-k), [0.125, 0.375, 0.625, 0.875])


def test_score_is_the_mean_of_single_window_scores_and_zero_past_the_horizons():
    curves = np.array([[0.2, 0.6, 0.8], [0.0, 0.1, 0.7], [0.5, 0.5, 0.5]])
    idle = np.array([5.0, 30.0, 20.0])
    want = np.mean([reuse_within(curves, H, idle, 40.0 * k) for k in EVICTION_WINDOW_MULTIPLES], axis=0)
    assert reuse_before_eviction(curves, H, idle, 40.0) == pytest.approx(want)
    assert reuse_before_eviction(curves[:1], H, np.array([150.0]), 40.0)[0] == 0.0
    assert reuse_before_eviction(curves[2:], H, np.array([20.0]), 40.0)[0] == 0.0   # flat curve: no reuse left


def test_likely_reuse_just_past_the_residency_outranks_a_small_chance_within_it():
    # "late": surely back, but only between 50 and 100 ms; "faint": a 6% chance, all within 50 ms.
    # With a single window of the residency (40 ms) "late" would score 0 and go first; a block that is
    # kept stays longer than the mean residency, so the rule keeps it and evicts "faint".
    curves = np.array([[0.0, 0.0, 0.9], [0.05, 0.06, 0.06]])
    idle = np.zeros(2)
    assert reuse_within(curves, H, idle, 40.0).tolist() == pytest.approx([0.0, 0.0575])
    pol = DmlpPolicy(_Config())
    pol.residency = Residency(initial_ms=40.0)
    assert pol.order_victims(curves, idle, 1, now_ms=0.0, cached=2).tolist() == [1]
