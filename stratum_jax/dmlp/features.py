"""DMLP input features: what is known about one cached KV block at one moment, and the model matrix.

Three producers fill the same columns: the label maker (from a whole trace, vectorised), the cache
simulator (from its per-block state at an eviction) and the engine (a list of `BlockInfo`). All of them
go through `feature_matrix`, so a feature means the same thing everywhere.

Missing values. A source that cannot provide a feature (the Mooncake trace has no attention scores,
no queue and no GPU) leaves it NaN. `feature_matrix` turns each column into a pair: the standardised
value (0 where missing) and a presence mask (1 present, 0 missing). The model therefore sees "unknown"
as its own input and never confuses it with a real zero.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

# The five seed features of the design, then the block features. Order is the model's input order;
# appending a feature changes the input width and invalidates checkpoints (they store this list).
SEED_FEATURES = (
    "gen_frac",          # generated tokens / max tokens of the last request using the block, 0..1
    "attn_var5",         # variance of attention scores over the last 5 decoded tokens
    "kv_hbm_frac",       # KV occupancy: HBM blocks / (HBM + host blocks), 0..1
    "queue_wait_ms",     # mean upstream queue wait of recent requests
    "gpu_idle_frac",     # fraction of recent wall time the GPU sat idle, 0..1
)
BLOCK_FEATURES = (
    "since_last_ms",     # recency: now - last access
    "prev_gap_ms",       # the gap between the last two accesses (missing after one access)
    "access_count",      # accesses so far, the creating one included
    "age_ms",            # now - creation
    "depth",             # position in the prefix chain (0 = first block of the prompt)
    "blocks_after",      # blocks after this one in the last request's chain
    "fill",              # tokens in the block / block size; < 1 only for a prompt's tail block
    "sharers",           # distinct requests that have used the block
    "fan_out",           # distinct next blocks seen after this one (prefix-tree branching)
    "prefix_hit_frac",   # share of the last request's chain that had been computed before it arrived
    "prefix_uses",       # uses of the deepest block of that reused prefix (~ turns of the conversation)
    "prefix_gap_ms",     # how long that block had been idle when the last request came (think time)
    "input_tokens",      # prompt tokens of the last request using the block
    "max_tokens",        # output budget of the last request (Mooncake: its output_length)
)
FEATURE_NAMES = SEED_FEATURES + BLOCK_FEATURES

# Heavy-tailed non-negative quantities are compressed with log1p before standardising, so a block idle
# for minutes and one idle for milliseconds both land in a useful input range.
_LOG_FEATURES = frozenset({
    "queue_wait_ms", "since_last_ms", "prev_gap_ms", "access_count", "age_ms", "depth", "blocks_after",
    "sharers", "fan_out", "prefix_uses", "prefix_gap_ms", "input_tokens", "max_tokens",
})


# Block features derived from timestamps and the decision time, not stored as such.
BLOCK_TIME_FEATURES = frozenset({"since_last_ms", "prev_gap_ms", "age_ms"})


def num_inputs() -> int:
    """Model input width: one value and one presence mask per feature."""
    return 2 * len(FEATURE_NAMES)


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """One cached block as the engine (or any caller) sees it. `None` means "not known here".

    Times are milliseconds on one clock (the engine's monotonic clock, or the replay's simulated time).
    `needed_by_running` marks blocks a running request still reads; the policy never evicts those.
    """

    block_id: object
    last_access_ms: float
    created_ms: float
    access_count: int
    depth: int
    prev_access_ms: float | None = None
    blocks_after: int | None = None
    fill: float | None = None
    sharers: int | None = None
    fan_out: int | None = None
    prefix_hit_frac: float | None = None
    prefix_uses: int | None = None
    prefix_gap_ms: float | None = None
    input_tokens: int | None = None
    max_tokens: int | None = None
    gen_frac: float | None = None
    attn_var5: float | None = None
    kv_hbm_frac: float | None = None
    queue_wait_ms: float | None = None
    gpu_idle_frac: float | None = None
    needed_by_running: bool = False


def columns_from_infos(infos: Sequence[BlockInfo]) -> dict[str, np.ndarray]:
    """Stacks `BlockInfo`s into the history columns `raw_features` takes (None -> NaN), shapes [N]."""
    def col(name: str) -> np.ndarray:
        return np.array([math.nan if getattr(b, name) is None else getattr(b, name) for b in infos],
                        dtype=np.float64)

    names = ("last_access_ms", "prev_access_ms", "created_ms", "access_count", "depth") + tuple(
        n for n in FEATURE_NAMES if n not in BLOCK_TIME_FEATURES)
    return {n: col(n) for n in names}


def raw_features(cols: dict[str, np.ndarray], now_ms: np.ndarray | float) -> np.ndarray:
    """Raw feature values at decision time `now_ms`, NaN where missing.

    cols: history columns, each shape [N]: `last_access_ms`, `prev_access_ms` (NaN if accessed once),
      `created_ms`, and every non-time feature of FEATURE_NAMES (absent key = missing everywhere).
    now_ms: scalar or shape [N].
    Returns float32 [N, F] in FEATURE_NAMES order.
    """
    n = len(cols["last_access_ms"])
    derived = {
        "since_last_ms": np.asarray(now_ms) - cols["last_access_ms"],
        "prev_gap_ms": cols["last_access_ms"] - cols["prev_access_ms"],
        "age_ms": np.asarray(now_ms) - cols["created_ms"],
    }
    out = np.full((n, len(FEATURE_NAMES)), np.nan, dtype=np.float32)
    for j, name in enumerate(FEATURE_NAMES):
        v = derived.get(name, cols.get(name))
        if v is not None:
            out[:, j] = v
    return out


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
        return Normalizer(np.asarray(d["mean"], np.float32), np.asarray(d["std"], np.float32))


def _transform(raw: np.ndarray) -> np.ndarray:
    t = raw.astype(np.float32, copy=True)
    for j, name in enumerate(FEATURE_NAMES):
        if name in _LOG_FEATURES:
            t[:, j] = np.log1p(np.maximum(t[:, j], 0.0))
    return t


def feature_matrix(raw: np.ndarray, norm: Normalizer) -> np.ndarray:
    """Model input: standardised values (0 where missing) then presence masks.

    raw: float32 [N, F] from `raw_features`. Returns float32 [N, 2F].
    """
    t = _transform(raw)
    present = ~np.isnan(t)
    z = np.where(present, (t - norm.mean) / norm.std, 0.0).astype(np.float32)
    return np.concatenate([z, present.astype(np.float32)], axis=1)
