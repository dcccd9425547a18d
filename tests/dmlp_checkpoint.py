"""A small randomly initialised DMLP saved as a real checkpoint, for tests that need `--dmlp-checkpoint`."""
import jax
import numpy as np

from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, init_params
from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, save_checkpoint

HORIZONS_MS = (10.0, 50.0, 100.0, 200.0, 500.0)


def write_checkpoint(path, hidden=(32, 32), seed=0) -> str:
    """Fast to make; its predictions are arbitrary. Returns the directory as a string."""
    cfg = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=HORIZONS_MS, hidden=hidden)
    raw = np.random.default_rng(seed).uniform(0, 100, (256, len(FEATURE_NAMES))).astype(np.float32)
    save_checkpoint(str(path), DmlpCheckpoint(cfg, jax.device_get(init_params(cfg, seed)), Normalizer.fit(raw), {}))
    return str(path)
