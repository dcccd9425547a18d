"""Per-access block history, vectorised: the feature columns of every access, and when the block is
next accessed. Everything here looks only backwards, except `next_ms`/`next_event` (the labels and
Belady's oracle). The label maker and the cache simulator both read these columns.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from stratum_jax.dmlp.features import SEED_FEATURES, raw_features
from training.traces import AccessStream


@dataclasses.dataclass
class History:
    """`cols`: feature name -> value at access e (FEATURE_NAMES, NaN = missing), plus `t_ms`, each [E].
    `next_ms`: time of the block's next access after event e, +inf if none in the trace, shape [E].
    `next_event`: index of that access, E (one past the end) if none, int64 [E].
    """

    cols: dict[str, np.ndarray]
    next_ms: np.ndarray
    next_event: np.ndarray

    def raw(self) -> np.ndarray:
        """float32 [E, F]: the model's raw features at every access."""
        return raw_features(self.cols)


def _group_starts(keys_sorted: np.ndarray) -> np.ndarray:
    """Boolean [N]: True where a new run of equal keys begins."""
    starts = np.ones(len(keys_sorted), bool)
    starts[1:] = keys_sorted[1:] != keys_sorted[:-1]
    return starts


def _rank_in_group(starts: np.ndarray) -> np.ndarray:
    """0-based position of each element within its run, from the run-start mask [N]."""
    idx = np.arange(len(starts))
    return idx - np.maximum.accumulate(np.where(starts, idx, 0))


def build_history(s: AccessStream) -> History:
    E = s.num_events
    idx = np.arange(E)

    # Per block, in time order: previous/next access, count, creation time, distinct requests.
    by_block = np.lexsort((idx, s.block))
    b_sorted = s.block[by_block]
    starts = _group_starts(b_sorted)
    rank = _rank_in_group(starts)
    prev_ms = np.full(E, np.nan)
    next_ms = np.full(E, np.inf)
    has_prev = ~starts
    prev_ms[by_block[has_prev]] = s.t_ms[by_block[np.flatnonzero(has_prev) - 1]]
    has_next = np.append(~starts[1:], False)
    next_event = np.full(E, E, np.int64)
    next_event[by_block[has_next]] = by_block[np.flatnonzero(has_next) + 1]
    found = next_event < E
    next_ms[found] = s.t_ms[next_event[found]]
    count = np.empty(E)
    count[by_block] = rank + 1
    created = np.empty(E)
    created[by_block] = s.t_ms[by_block[np.flatnonzero(starts)]][np.cumsum(starts) - 1]
    sharers = np.empty(E)
    sharers[by_block] = _distinct_so_far(b_sorted, s.request[by_block])

    cols = {
        "t_ms": s.t_ms, "recency_ms": s.t_ms - prev_ms, "age_ms": s.t_ms - created,
        "access_count": count, "sharers": sharers, "depth": s.depth, "blocks_after": s.blocks_after,
        "fill": s.fill, "input_tokens": s.input_tokens, "max_tokens": s.max_tokens,
        "fan_out": _fan_out(s), **_request_prefix(s, count, prev_ms),
    }
    cols.update({name: s.seed[:, j] for j, name in enumerate(SEED_FEATURES)})
    return History(cols=cols, next_ms=next_ms, next_event=next_event)


def _distinct_so_far(group: np.ndarray, item: np.ndarray) -> np.ndarray:
    """For a sequence sorted by group (time order inside), the number of distinct items seen so far in
    the group, at each position. group, item: int [N]."""
    n = len(group)
    pos = np.arange(n)
    first = np.lexsort((pos, item, group))   # by (group, item, position)
    g, it = group[first], item[first]
    new_pair = np.ones(n, bool)
    new_pair[1:] = (g[1:] != g[:-1]) | (it[1:] != it[:-1])
    is_first = np.zeros(n, bool)
    is_first[first[new_pair]] = True
    csum = np.cumsum(is_first)
    gs = np.maximum.accumulate(np.where(_group_starts(group), pos, 0))   # start of each one's group
    return (csum - (csum[gs] - is_first[gs])).astype(np.float64)


def _fan_out(s: AccessStream) -> np.ndarray:
    """Distinct child blocks (the block at depth+1 of the same request) seen up to each event, [E]."""
    E = s.num_events
    idx = np.arange(E)
    by_req = np.lexsort((s.depth, s.request))
    r, d = s.request[by_req], s.depth[by_req]
    link = (r[1:] == r[:-1]) & (d[1:] == d[:-1] + 1)
    parent_ev, child_ev = by_req[:-1][link], by_req[1:][link]
    pb, cb = s.block[parent_ev], s.block[child_ev]
    # First parent event at which each (parent, child) pair appears.
    order = np.lexsort((parent_ev, cb, pb))
    pb, cb, pe = pb[order], cb[order], parent_ev[order]
    first = np.ones(len(pb), bool)
    first[1:] = (pb[1:] != pb[:-1]) | (cb[1:] != cb[:-1])
    keys = np.sort(pb[first] * E + pe[first])
    lo = np.searchsorted(keys, s.block * E, side="left")
    hi = np.searchsorted(keys, s.block * E + idx, side="right")
    return (hi - lo).astype(np.float64)


def _request_prefix(s: AccessStream, count: np.ndarray, prev_ms: np.ndarray) -> dict[str, np.ndarray]:
    """Per request, from its leading run of blocks used before (its reused prefix), per event [E]:
    `prefix_hit_frac` (run length / chain length), `prefix_uses` (uses of the run's deepest block, this
    one included: how many requests went that far down the chain) and `prefix_gap_ms` (how long that
    block had been idle: the think time before this turn). The last two are NaN with no reused prefix.
    """
    by_req = np.lexsort((s.depth, s.request))
    r = s.request[by_req]
    starts = _group_starts(r)
    rank = _rank_in_group(starts)
    seg = np.flatnonzero(starts)
    size = np.diff(np.append(seg, len(r)))
    seen = ~np.isnan(prev_ms[by_req])
    run = np.minimum.reduceat(np.where(seen, size.repeat(size), rank), seg)
    deepest = by_req[seg + np.maximum(run - 1, 0)]
    uses = np.where(run > 0, count[deepest], np.nan)
    gap = np.where(run > 0, s.t_ms[deepest] - prev_ms[deepest], np.nan)
    out = {}
    for name, per_req in (("prefix_hit_frac", run / size), ("prefix_uses", uses), ("prefix_gap_ms", gap)):
        col = np.empty(len(r))
        col[by_req] = per_req.repeat(size)
        out[name] = col
    return out
