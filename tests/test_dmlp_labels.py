"""History features and reuse labels on a hand-made trace."""
import json
import math

import numpy as np
import pytest

from stratum_jax.dmlp.features import FEATURE_NAMES
from training.history import build_history
from training.labels import make_examples
from training.traces import read_mooncake

# (time ms, block ids, input tokens); time scale 1.
REQUESTS = [
    (0, [0, 1, 2], 1536),
    (0, [0, 5], 600),
    (30, [0, 1, 3], 1500),
    (200, [0, 1, 2, 4], 2048),
    (320, [9], 10),
]


@pytest.fixture()
def trace(tmp_path):
    p = tmp_path / "hand.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": 7, "hash_ids": ids}) + "\n"
                         for t, ids, n in REQUESTS))
    s = read_mooncake(str(p))
    return s, build_history(s)


def event(s, request, depth):
    return int(np.flatnonzero((s.request == request) & (s.depth == depth))[0])


def col(h, name, e):
    return h.cols[name][e]


def test_history_features(trace):
    s, h = trace
    e = event(s, 2, 0)                    # block 0 as request 2 (t=30) uses it
    assert col(h, "access_count", e) == 3 and col(h, "sharers", e) == 3
    assert col(h, "recency_ms", e) == 30 and col(h, "age_ms", e) == 30
    assert col(h, "fan_out", e) == 2      # children 1 (twice) and 5
    e = event(s, 2, 1)                    # block 1 at request 2
    assert col(h, "fan_out", e) == 2      # children 2 (request 0) and 3 (request 2)
    assert col(h, "blocks_after", e) == 1 and col(h, "depth", e) == 1
    assert col(h, "fill", event(s, 2, 2)) == (1500 - 1024) / 512
    # Request 2 reuses [0, 1] of [0, 1, 3]; the deepest reused block (1) had 2 uses and was idle 30 ms.
    assert col(h, "prefix_hit_frac", e) == pytest.approx(2 / 3)
    assert col(h, "prefix_uses", e) == 2 and col(h, "prefix_gap_ms", e) == 30
    e = event(s, 3, 3)                    # request 3 reuses [0, 1, 2]; block 2 was idle 200 ms
    assert col(h, "prefix_hit_frac", e) == 0.75 and col(h, "prefix_gap_ms", e) == 200
    e = event(s, 0, 0)                    # a first access: no recency, no reused prefix
    assert math.isnan(col(h, "recency_ms", e)) and math.isnan(col(h, "prefix_uses", e))
    assert col(h, "prefix_hit_frac", e) == 0 and col(h, "age_ms", e) == 0
    assert np.isnan(h.raw()[:, FEATURE_NAMES.index("attn_var5")]).all()   # Mooncake has no attention


def test_labels(trace):
    s, h = trace
    ex = make_examples(h, s.t_end_ms, (50.0, 100.0))
    got = {(int(s.request[e]), int(s.depth[e])): tuple(lab) for e, lab in zip(ex.event, ex.labels)}
    assert got == {
        (0, 0): (1, 1),   # block 0 again at t=0 (request 1, same timestamp)
        (0, 1): (1, 1),   # block 1 again at t=30
        (0, 2): (0, 0),   # block 2 again only at t=200
        (1, 0): (1, 1),   # block 0 again at t=30
        (1, 1): (0, 0),   # block 5 never again
        (2, 0): (0, 0), (2, 1): (0, 0), (2, 2): (0, 0),   # next uses 170 ms later, or never
        (3, 0): (0, 0), (3, 1): (0, 0), (3, 2): (0, 0), (3, 3): (0, 0),
    }                     # request 4 (t=320 = end of trace) has no known label and is dropped
    assert ex.known.all()


def test_censored_labels_are_masked(trace):
    s, h = trace
    ex = make_examples(h, s.t_end_ms, (50.0, 150.0))
    late = ex.t_ms == 200                 # 200 + 150 > 320: the 150 ms label is unknown
    assert late.any() and (ex.known[late] == [1, 0]).all() and (ex.known[~late] == 1).all()
