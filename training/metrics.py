"""Per-horizon classification metrics of reuse predictions, over the labels that are known."""
from __future__ import annotations

import numpy as np


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the rank-sum formula, ties counted half. labels, scores: [N]. NaN if one class only."""
    labels = labels > 0.5
    n_pos = int(labels.sum())
    n_neg = len(labels) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="stable")
    s = scores[order]
    ranks = np.empty(len(s))
    # Average ranks over runs of equal scores.
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def horizon_metrics(probs: np.ndarray, labels: np.ndarray, known: np.ndarray) -> dict[str, list[float]]:
    """probs, labels, known: [N, H]. Lists of length H: positive_rate, accuracy (threshold 0.5),
    majority_accuracy (always answering the more frequent class), auc, brier, count."""
    out: dict[str, list[float]] = {k: [] for k in (
        "positive_rate", "accuracy", "majority_accuracy", "auc", "brier", "count")}
    for k in range(probs.shape[1]):
        m = known[:, k] > 0
        y, p = labels[m, k], probs[m, k]
        rate = float(y.mean()) if len(y) else float("nan")
        out["positive_rate"].append(rate)
        out["accuracy"].append(float(((p >= 0.5) == (y > 0.5)).mean()) if len(y) else float("nan"))
        out["majority_accuracy"].append(max(rate, 1.0 - rate))
        out["auc"].append(auc(y, p))
        out["brier"].append(float(((p - y) ** 2).mean()) if len(y) else float("nan"))
        out["count"].append(int(len(y)))
    return out


def calibration(probs: np.ndarray, labels: np.ndarray, bins: int = 10) -> dict[str, list[float]]:
    """Reliability curve for one horizon: per probability bin, mean prediction, observed rate, count."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(probs, edges) - 1, 0, bins - 1)
    out = {"mean_predicted": [], "observed_rate": [], "count": []}
    for b in range(bins):
        m = which == b
        if m.any():
            out["mean_predicted"].append(float(probs[m].mean()))
            out["observed_rate"].append(float(labels[m].mean()))
            out["count"].append(int(m.sum()))
    return out
