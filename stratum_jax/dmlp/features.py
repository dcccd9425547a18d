"""DMLP input features: what is known about a KV block at the moment a request uses it.

The predictor scores a block at each access (its creation included): "given this block and the request
that just used it, will it be used again within h?". Between accesses nothing about a block changes
except the time, which the policy handles analytically (see `policy.py`), so the model never has to be
run over idle blocks.

Three producers fill the same columns: the label maker (a whole trace, vectorised), the cache simulator
(the same columns, precomputed) and the engine (a list of `BlockInfo`). All of them go through
`raw_features` and `feature_matrix`, so a feature means the same thing everywhere.

Missing values. A source that cannot provide a feature (the Mooncake trace has no attention scores, no
queue and no GPU) leaves it NaN. `feature_matrix` turns each column into a pair: the standardised value
(0 where missing) and a presence mask (1 present, 0 missing). The model sees "unknown" as its own input
and never confuses it with a real zero.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Sequence

import numpy as np

from stratum_jax.block_info import BLOCK_FEATURES, FEATURE_NAMES, SEED_FEATURES, BlockInfo

__all__ = ["BLOCK_FEATURES", "FEATURE_NAMES", "SEED_FEATURES", "BlockInfo", "Normalizer", "feature_matrix",
           "num_inputs", "raw_features", "raw_from_infos"]

# Heavy-tailed non-negative quantities are compressed with log1p before standardising, so a gap of
# minutes and one of milliseconds both land in a useful input range.
_LOG_FEATURES = frozenset({
    "queue_wait_ms", "recency_ms", "access_count", "age_ms", "depth", "blocks_after", "sharers",
    "fan_out", "prefix_uses", "prefix_gap_ms", "input_tokens", "max_tokens",
})


def num_inputs() -> int:
    """Model input width: one value and one presence mask per feature."""
    return 2 * len(FEATURE_NAMES)


def raw_features(cols: dict[str, np.ndarray]) -> np.ndarray:
    """cols: feature name -> values [N] (NaN = missing; an absent name is missing everywhere).
    Returns float32 [N, F] in FEATURE_NAMES order."""
    n = len(next(iter(cols.values())))
    out = np.full((n, len(FEATURE_NAMES)), np.nan, dtype=np.float32)
    for j, name in enumerate(FEATURE_NAMES):
        if name in cols:
            out[:, j] = cols[name]
    return out


_feature_values = operator.attrgetter(*FEATURE_NAMES)


def raw_from_infos(infos: Sequence[BlockInfo]) -> np.ndarray:
    """float32 [N, F] from `BlockInfo`s (None -> NaN).

    On the engine thread for every scored or tracked access, hence one C-level attrgetter per block and
    numpy's own None -> NaN conversion (float64), not a Python loop over features."""
    rows = [_feature_values(b) for b in infos]
    return np.array(rows, dtype=np.float64).astype(np.float32).reshape(len(infos), len(FEATURE_NAMES))


@dataclasses.dataclass(frozen=True)
class Normalizer:
    """Per-feature mean/std of the transformed present values, fitted on training data, shapes [F]."""

    mean: np.ndarray
    std: np.ndarray

    @staticmethod
    def fit(raw: np.ndarray) -> "Normalizer":
        """raw: float32 [N, F] from `raw_features`."""
        t = _transform(raw)
        present = ~np.isnan(t)
        count = np.maximum(present.sum(0), 1)
        mean = np.where(present, t, 0.0).sum(0) / count
        std = np.sqrt(np.where(present, (t - mean) ** 2, 0.0).sum(0) / count)
        # A constant or all-missing column gets std 1: its standardised value is then 0, not inf.
        std = np.where(std > 1e-6, std, 1.0)
        return Normalizer(mean.astype(np.float32), std.astype(np.float32))

    def to_dict(self) -> dict[str, list[float]]:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @staticmethod
    def from_dict(d: dict) -> "Normalizer":
        mean, std = np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32)
        if mean.shape != (len(FEATURE_NAMES),) or std.shape != mean.shape:
            raise ValueError(f"normalizer has {mean.shape}/{std.shape} entries, expected {len(FEATURE_NAMES)}")
        return Normalizer(mean, std)


def _transform(raw: np.ndarray) -> np.ndarray:
    t = raw.astype(np.float32, copy=True)
    for j, name in enumerate(FEATURE_NAMES):
        if name in _LOG_FEATURES:
            t[:, j] = np.log1p(np.maximum(t[:, j], 0.0))
    return t


def feature_matrix(raw: np.ndarray, norm: Normalizer) -> np.ndarray:
    """Model input: standardised values (0 where missing), then presence masks.

    raw: float32 [N, F] from `raw_features`. Returns float32 [N, 2F].
    """
    t = _transform(raw)
    present = ~np.isnan(t)
    z = np.where(present, (t - norm.mean) / norm.std, 0.0).astype(np.float32)
    return np.concatenate([z, present.astype(np.float32)], axis=1)
