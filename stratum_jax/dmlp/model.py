"""The DMLP reuse predictor: a flax MLP from block features to P(reuse within h) for each horizon h.

The head predicts a non-negative hazard per horizon interval and accumulates it, so the probabilities
are non-decreasing in h by construction (reuse within 50 ms implies reuse within 100 ms):

    H_k = sum_{j <= k} softplus(z_j),   P(reuse within h_k) = 1 - exp(-H_k)

With the default widths (36 inputs: 18 features and their masks; hidden 1024-1024-128; 5 horizons)
it has 1,219,333 parameters.
"""
from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.dmlp.features import Normalizer, feature_matrix

DEFAULT_HORIZONS_MS = (10.0, 50.0, 100.0, 200.0, 500.0)
DEFAULT_HIDDEN = (1024, 1024, 128)


@dataclasses.dataclass(frozen=True)
class DmlpConfig:
    num_inputs: int
    horizons_ms: tuple[float, ...] = DEFAULT_HORIZONS_MS
    hidden: tuple[int, ...] = DEFAULT_HIDDEN

    def __post_init__(self):
        h = self.horizons_ms
        if not h or any(not (x > 0 and math.isfinite(x)) for x in h) or list(h) != sorted(set(h)):
            raise ValueError(f"horizons_ms must be positive, finite and strictly increasing, got {h}")


class DmlpNet(nn.Module):
    """x: float32 [N, num_inputs] -> cumulative hazards float32 [N, H] (H = number of horizons)."""

    config: DmlpConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in self.config.hidden:
            x = nn.gelu(nn.Dense(width)(x))
        z = nn.Dense(len(self.config.horizons_ms))(x)
        return jnp.cumsum(nn.softplus(z), axis=-1)


def init_params(config: DmlpConfig, seed: int):
    return DmlpNet(config).init(jax.random.PRNGKey(seed), jnp.zeros((1, config.num_inputs)))["params"]


def count_params(params) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree_util.tree_leaves(params)))


def hazard_to_prob(hazard: jax.Array) -> jax.Array:
    return -jnp.expm1(-hazard)


def bce_from_hazard(hazard: jax.Array, labels: jax.Array) -> jax.Array:
    """Binary cross-entropy per example and horizon, [N, H], computed stably from the hazards.
    log P = log(1 - exp(-H)); log(1 - P) = -H."""
    log_p = jnp.log(-jnp.expm1(-jnp.maximum(hazard, 1e-7)))
    return -(labels * log_p - (1.0 - labels) * hazard)


class Predictor:
    """Batched, jitted inference from raw features: `predict(raw [N, F]) -> P(reuse) [N, H]` (numpy).

    Batches are padded to a power of two (at least MIN_BATCH: 8 rows, for the few rows a step usually
    brings, cost about half a 64-row bucket on a CPU) so that a busy server triggers only a handful
    of compilations, not one per candidate count; more rows than MAX_BATCH run in pieces of MAX_BATCH, so
    the shapes are the fixed set `batch_buckets()` that `runtime.warm_predictor` compiles before serving (a
    long prompt's blocks scored on access once compiled a 1,024-row bucket after SERVING). `params` may be
    replaced at any time (the online fine-tuner hot-swaps them); a call uses whichever params it read first.

    `dispatch(raw)` launches a prediction without waiting for it and returns a `PendingPrediction` to read
    later (the policy's score-ahead, policy.py): on a GPU the read would wait behind the step in flight.
    The params live on the predictor's device (set once, not uploaded per call: a checkpoint's numpy params
    were copied to the GPU at every call before).
    """

    MIN_BATCH = 8
    MAX_BATCH = 1024

    @classmethod
    def batch_buckets(cls) -> list[int]:
        """Every row count `predict` runs the network at: 64, 128, ..., MAX_BATCH."""
        return [1 << k for k in range(cls.MIN_BATCH.bit_length() - 1, cls.MAX_BATCH.bit_length())]

    def __init__(self, config: DmlpConfig, params, normalizer: Normalizer, device: jax.Device | None = None):
        """device: where predictions run (None: jax's default device); params set later (a hot swap) go there
        too."""
        self.config = config
        self.device = device
        self.params = params
        self.normalizer = normalizer
        net = DmlpNet(config)
        self._fn = jax.jit(lambda p, x: hazard_to_prob(net.apply({"params": p}, x)))

    @property
    def params(self):
        return self._params

    @params.setter
    def params(self, value) -> None:
        # Placed once (on jax's default device when `device` is None), so a call never uploads weights.
        self._params = jax.device_put(value, self.device if self.device is not None else jax.devices()[0])

    def predict(self, raw: np.ndarray) -> np.ndarray:
        """P(reuse within each horizon) [N, H] for raw features [N, F]; waits for the result."""
        return self.dispatch(raw).result()

    def dispatch(self, raw: np.ndarray) -> "PendingPrediction":
        """Launches `predict(raw)` on the predictor's device and returns at once."""
        x = feature_matrix(raw, self.normalizer)
        params = self.params            # one set of weights for every piece of this call
        pieces = [self._dispatch_padded(params, x[i:i + self.MAX_BATCH]) for i in range(0, len(x), self.MAX_BATCH)]
        return PendingPrediction(pieces, len(x), len(self.config.horizons_ms))

    def _dispatch_padded(self, params, x: np.ndarray) -> tuple[jax.Array, int]:
        """x [n, F] normalised features, n <= MAX_BATCH -> (the network's output at n's bucket, n)."""
        n = len(x)
        size = max(self.MIN_BATCH, 1 << max(0, (n - 1).bit_length()))
        padded = np.zeros((size, x.shape[1]), np.float32)
        padded[:n] = x
        return self._fn(params, padded), n


class PendingPrediction:
    """A dispatched prediction: `ready()` without waiting, `result()` [N, H] numpy (waits if not ready)."""

    def __init__(self, pieces: list, rows: int, horizons: int):
        self._pieces = pieces           # [(device array [bucket, H], rows used)]
        self._rows, self._horizons = rows, horizons
        self._value: np.ndarray | None = None

    def ready(self) -> bool:
        return self._value is not None or all(a.is_ready() for a, _ in self._pieces)

    def result(self) -> np.ndarray:
        if self._value is None:
            parts = [np.asarray(a)[:n] for a, n in self._pieces]
            self._value = np.concatenate(parts) if parts else np.zeros((self._rows, self._horizons), np.float32)
            self._pieces = []
        return self._value
