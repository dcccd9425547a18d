"""Training examples: a block's features at an access, and whether it was used again within each horizon.

Label for horizon h at an access at time t: the block's next access falls in [t, t + h] (a later
request at the same timestamp counts). A label whose window runs past the end of the trace is unknown:
`known` masks it out, per horizon and decided by the access time alone, so the kept labels are not
biased towards reuse. An example with no known label is dropped.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from training.history import History


@dataclasses.dataclass
class Examples:
    """N examples: `raw` float32 [N, F] (NaN = missing), `labels` float32 [N, H] in {0, 1}, `known`
    float32 [N, H] (1 = label observed), `t_ms` float64 [N] access times, `event` int64 [N] the access's
    index in its stream."""

    raw: np.ndarray
    labels: np.ndarray
    known: np.ndarray
    t_ms: np.ndarray
    event: np.ndarray

    def __len__(self) -> int:
        return len(self.t_ms)

    def take(self, idx: np.ndarray) -> "Examples":
        return Examples(*(getattr(self, f.name)[idx] for f in dataclasses.fields(Examples)))

    @staticmethod
    def concat(parts: list["Examples"]) -> "Examples":
        return Examples(*(np.concatenate([getattr(p, f.name) for p in parts])
                          for f in dataclasses.fields(Examples)))


def reuse_labels(next_ms: np.ndarray, t_ms: np.ndarray, horizons_ms) -> np.ndarray:
    """float32 [N, H]: 1 where the next access (next_ms [N], +inf if none) is within h of t_ms [N]."""
    gap = next_ms - t_ms
    return (gap[:, None] <= np.asarray(horizons_ms, np.float64)[None, :]).astype(np.float32)


def label_known(t_ms: np.ndarray, t_end_ms: float, horizons_ms) -> np.ndarray:
    """float32 [N, H]: 1 where the window [t, t + h] ends inside the trace."""
    return (t_ms[:, None] + np.asarray(horizons_ms, np.float64)[None, :] <= t_end_ms).astype(np.float32)


def make_examples(history: History, t_end_ms: float, horizons_ms) -> Examples:
    """One example per access with at least one known label."""
    t = history.cols["t_ms"]
    known = label_known(t, t_end_ms, horizons_ms)
    keep = np.flatnonzero(known.any(1))
    return Examples(raw=history.raw()[keep], labels=reuse_labels(history.next_ms[keep], t[keep], horizons_ms),
                    known=known[keep], t_ms=t[keep], event=keep)
