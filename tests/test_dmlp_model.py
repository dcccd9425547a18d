"""The predictor: size, monotone reuse curves, stable loss, missing-value masks, padding."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer, feature_matrix, num_inputs
from stratum_jax.dmlp.model import (DmlpConfig, DmlpNet, Predictor, bce_from_hazard, count_params,
                                    hazard_to_prob, init_params)


def test_default_size_is_about_1_2m():
    assert count_params(init_params(DmlpConfig(num_inputs()), 0)) == 1_219_333


def test_probabilities_are_monotone_in_the_horizon():
    cfg = DmlpConfig(num_inputs(), hidden=(64, 64))
    params = init_params(cfg, 1)
    x = jax.random.normal(jax.random.PRNGKey(0), (256, num_inputs())) * 3
    p = np.asarray(hazard_to_prob(DmlpNet(cfg).apply({"params": params}, x)))
    assert p.shape == (256, 5) and (np.diff(p, axis=1) >= 0).all() and ((p >= 0) & (p <= 1)).all()


def test_loss_matches_plain_cross_entropy():
    hz = jnp.array([[0.1, 0.5, 2.0]])
    y = jnp.array([[0.0, 1.0, 1.0]])
    p = 1 - jnp.exp(-hz)
    want = -(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))
    np.testing.assert_allclose(bce_from_hazard(hz, y), want, rtol=1e-5)


def test_missing_is_not_zero():
    raw = np.zeros((2, len(FEATURE_NAMES)), np.float32)
    raw[1, FEATURE_NAMES.index("attn_var5")] = np.nan
    norm = Normalizer(np.zeros(len(FEATURE_NAMES), np.float32), np.ones(len(FEATURE_NAMES), np.float32))
    x = feature_matrix(raw, norm)
    j = FEATURE_NAMES.index("attn_var5")
    assert x[0, j] == x[1, j] == 0 and x[0, len(FEATURE_NAMES) + j] == 1 and x[1, len(FEATURE_NAMES) + j] == 0


def test_predictor_pads_batches():
    cfg = DmlpConfig(num_inputs(), hidden=(16,))
    params = init_params(cfg, 0)
    raw = np.random.default_rng(0).uniform(0, 5, (100, len(FEATURE_NAMES))).astype(np.float32)
    norm = Normalizer.fit(raw)
    pred = Predictor(cfg, params, norm)
    direct = hazard_to_prob(DmlpNet(cfg).apply({"params": params}, feature_matrix(raw, norm)))
    np.testing.assert_allclose(pred.predict(raw), direct, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pred.predict(raw[:3]), direct[:3], rtol=1e-5, atol=1e-6)


def test_predictor_runs_only_the_warmed_buckets():
    """Any row count runs at one of `batch_buckets()` (more than MAX_BATCH rows in pieces), so warming those
    is every compile a server will see: 2,500 rows once compiled a new bucket after SERVING."""
    from stratum_jax.dmlp.policy import DmlpPolicy
    from stratum_jax.dmlp.runtime import warm_predictor
    cfg = DmlpConfig(num_inputs(), hidden=(16,))
    params = init_params(cfg, 0)
    raw = np.random.default_rng(1).uniform(0, 5, (2500, len(FEATURE_NAMES))).astype(np.float32)
    norm = Normalizer.fit(raw)
    pred = Predictor(cfg, params, norm)
    assert pred.batch_buckets() == [8, 16, 32, 64, 128, 256, 512, 1024]
    warm_predictor(DmlpPolicy(pred))
    warmed = pred._fn._cache_size()
    assert warmed == len(pred.batch_buckets())
    direct = hazard_to_prob(DmlpNet(cfg).apply({"params": params}, feature_matrix(raw, norm)))
    for n in (2500, 1024, 1025, 700, 1):
        np.testing.assert_allclose(pred.predict(raw[:n]), direct[:n], rtol=1e-5, atol=1e-6)
    assert pred._fn._cache_size() == warmed


@pytest.mark.parametrize("h", [(), (10.0, 10.0), (50.0, 10.0), (-1.0, 5.0)])
def test_bad_horizons_are_refused(h):
    with pytest.raises(ValueError, match="horizons_ms"):
        DmlpConfig(num_inputs(), horizons_ms=h)


def test_predictor_on_a_chosen_device_keeps_swapped_params_there():
    """--dmlp-device cpu: predictions run on the host CPU, and a hot swap (the online tuner sets `params`) lands
    there too, not on the default device."""
    import jax
    from stratum_jax.config import RuntimeConfig
    cpu = jax.devices("cpu")[0]
    cfg = DmlpConfig(num_inputs(), hidden=(16,))
    params = init_params(cfg, 0)
    raw = np.random.default_rng(2).uniform(0, 5, (10, len(FEATURE_NAMES))).astype(np.float32)
    norm = Normalizer.fit(raw)
    pred = Predictor(cfg, params, norm, device=cpu)
    leaves = jax.tree_util.tree_leaves(pred.params)
    assert all(leaf.devices() == {cpu} for leaf in leaves)
    before = pred.predict(raw)
    pred.params = jax.tree_util.tree_map(lambda x: np.asarray(x) * 0.5, params)
    assert all(leaf.devices() == {cpu} for leaf in jax.tree_util.tree_leaves(pred.params))
    assert not np.allclose(pred.predict(raw), before)
    with pytest.raises(ValueError, match="--dmlp-device must be one of"):
        RuntimeConfig(model="tiny", dmlp_device="tpu")
    with pytest.raises(ValueError, match="--dmlp-device only applies with --cache-policy dmlp"):
        RuntimeConfig(model="tiny", dmlp_device="cpu")
