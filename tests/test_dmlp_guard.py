"""The shadow-LRU guard: when it trips (two trailing windows) and returns (when its ghost DMLP cache leads
the real LRU-mode cache for two windows), its metrics, and the CI check of issue #15: a DMLP
trained on one synthetic workload and replayed on a shifted one stays within half a point of LRU at
every capacity with the guard, and does not without it."""
import collections
import math

import numpy as np
import prometheus_client as prom
import pytest

from stratum_jax.dmlp.ghost import GhostDmlpCache
from stratum_jax.dmlp.guard import ShadowLruGuard
from stratum_jax.dmlp.model import Predictor
from training.dataset import eval_examples, train_val_examples
from training.evaluate import policy_hit_rates
from training.shift import ShiftSpec, derive
from training.synthetic import conversation_trace, write_jsonl
from training.trainer import TrainConfig, train
from training.traces import read_timeline, read_traces

H = (10.0, 50.0, 100.0, 200.0, 500.0)


def wrong_cache(guard, n):
    """n accesses alternating a, b, while the real cache keeps two blocks (p, q) nobody uses again and
    drops a and b right after each use: a ghost LRU of the same size (3 at each access) keeps a and b."""
    for i in range(n):
        k = "ab"[i % 2]
        guard.accessed([k])
        guard.forget([k])


def par_cache(guard, n):
    """n accesses of one block the real cache keeps: real and ghost hit alike."""
    for _ in range(n):
        guard.accessed(["x"])


def test_one_trailing_window_between_windows_at_par_does_not_trip():
    w = 40
    g = ShadowLruGuard(window=w, margin=0.005, z=3.0, confirm=2)
    for _ in range(5):
        wrong_cache(g, w)
        par_cache(g, w)
    assert g.trips == 0 and not g.active
    wrong_cache(g, 2 * w)
    assert g.trips == 1 and g.active


class MiniCache:
    """A real cache of `capacity` keys that evicts as a guarded DMLP policy would: in LRU order while the
    guard is active, else the key the model rates coldest (ties to the least recently used). model(key)
    -> P(reuse), the whole curve (one horizon); the guard's ghost DMLP ranks with the same numbers."""

    def __init__(self, guard, capacity, model):
        self.guard, self.capacity, self.model = guard, capacity, model
        self.order = collections.OrderedDict()
        self.t = 0.0

    def run(self, keys):
        for k in keys:
            self.t += 1.0
            self.guard.accessed([k], np.array([[self.model(k)]]), self.t)
            if k in self.order:
                self.order.move_to_end(k)
                continue
            if len(self.order) == self.capacity:
                cand = list(self.order)
                victim = cand[0] if self.guard.active else min(cand, key=lambda c: self.model(c))
                del self.order[victim]
                self.guard.forget([victim])
            self.order[k] = None


def rank_by_curve(curves, idle_ms, n, now_ms, cached, access_seq):
    """The ghost's ranking in these tests: coldest first, ties to the least recently used."""
    return np.lexsort((access_seq, curves[:, 0]))[:n]


def guard_with_ghost(w):
    return ShadowLruGuard(window=w, margin=0.005, z=3.0, confirm=2, ghost=GhostDmlpCache(rank_by_curve, 1))


def lru_friendly(n):
    """a, b, c in a cycle with a one-off key after each round: LRU of 4 keeps a, b, c."""
    return [("once", i) if i % 4 == 3 else "abc"[i % 4] for i in range(n)]


def scan(n, start=0):
    """Three hot keys, each followed by three one-offs: their reuse distance (12) is past a 4-key LRU; a
    cache that keeps them (and drops the one-offs) hits a quarter of the accesses."""
    return [("hot", (i // 4) % 3) if i % 4 == 0 else ("scan", start + i) for i in range(n)]


def wrong(k):
    return 1.0 if k[0] in ("once", "scan") else 0.0       # one-offs look hot, the reused keys cold


def right(k):
    return 0.0 if k[0] in ("once", "scan") else 1.0


def test_the_ghost_dmlp_keeps_a_wrong_model_out_and_brings_a_right_one_back_when_it_would_lead():
    w = 40
    g = guard_with_ghost(w)
    model = {"f": wrong}
    cache = MiniCache(g, 4, lambda k: model["f"](k))
    cache.run(lru_friendly(3 * w))
    assert g.active and g.trips == 1                       # the wrong model trails LRU: tripped
    cache.run(lru_friendly(200 * w))                       # its ghost trails the real LRU cache too:
    assert g.active and g.returns == 0                     # no return, and no real window spent on it
    assert g.ghost_hit_rate < g.dmlp_hit_rate              # (the real cache is LRU now)
    model["f"] = right                                     # an update makes the model right
    cache.run(lru_friendly(20 * w))
    assert g.active and g.returns == 0                     # at par with LRU: LRU is kept
    assert g.ghost_hit_rate == g.dmlp_hit_rate
    cache.run(scan(2 * w))                                 # traffic where the model beats LRU:
    assert not g.active and g.returns == 1                 # its ghost leads for two windows, it returns
    cache.run(scan(20 * w, start=10 ** 6))
    assert not g.active and g.trips == 1                   # and the real cache now keeps the lead
    assert g.dmlp_hit_rate >= 0.2 > g.lru_hit_rate


def test_a_guard_without_a_ghost_stays_in_lru_mode_after_a_trip():
    g = ShadowLruGuard(window=40, margin=0.005, z=3.0, confirm=2)
    cache = MiniCache(g, 4, wrong)
    cache.run(lru_friendly(3 * 40))
    assert g.active
    cache.run(scan(100 * 40))
    assert g.active and g.returns == 0 and math.isnan(g.ghost_hit_rate)


def test_windows_before_judge_from_ms_neither_trip_nor_return():
    g = ShadowLruGuard(window=40, margin=0.005, z=3.0, confirm=2, ghost=GhostDmlpCache(rank_by_curve, 1),
                       judge_from_ms=400.0)
    cache = MiniCache(g, 4, wrong)
    cache.run(lru_friendly(360))                           # 9 trailing windows, all before t = 400
    assert not g.active and g.lru_hit_rate > g.dmlp_hit_rate
    cache.run(lru_friendly(80))                            # two more after it: tripped
    assert g.active and g.trips == 1


def test_a_cache_as_good_as_lru_never_trips():
    """Real cache = the resident set never shrinks (nothing forgotten): every ghost hit is a real hit."""
    g = ShadowLruGuard(window=16, margin=0.0, z=0.0)
    rng = np.random.default_rng(0)
    g.accessed(rng.integers(0, 50, 4000).tolist())
    assert g.trips == 0 and g.dmlp_hit_rate >= g.lru_hit_rate


def test_exports_its_four_gauges():
    registry = prom.CollectorRegistry()
    g = ShadowLruGuard(window=4, ghost=GhostDmlpCache(rank_by_curve, 1))
    g.export(registry)
    for _ in range(4):
        g.accessed(["x"])
    assert registry.get_sample_value("stratum_dmlp_guard_active") == 0.0
    assert registry.get_sample_value("stratum_dmlp_guard_dmlp_hit_rate") == 0.75   # the first access missed
    assert registry.get_sample_value("stratum_dmlp_guard_lru_hit_rate") == 0.75
    assert registry.get_sample_value("stratum_dmlp_guard_ghost_dmlp_hit_rate") == 0.75   # it mirrors the real cache


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(margin=1.0), dict(z=-1), dict(confirm=0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ShadowLruGuard(**kwargs)


def test_guard_keeps_a_shifted_workload_within_half_a_point_of_lru(tmp_path):
    train_path, eval_path = str(tmp_path / "train.jsonl"), str(tmp_path / "eval.jsonl")
    write_jsonl(train_path, conversation_trace(1500, seed=3, rate_per_s=4.0, think_median_s=30.0))
    # The shift: the same kind of workload with arrivals three times as dense.
    write_jsonl(eval_path, derive(conversation_trace(1000, seed=5, rate_per_s=4.0, think_median_s=30.0),
                                  ShiftSpec(rate=3.0)))
    tr, va, _ = train_val_examples(read_traces([train_path], "mooncake", 100.0), H, 0.25)
    res = train(tr, va, H, TrainConfig(epochs=2, hidden=(64, 64), batch_size=256, learning_rate=1e-3))
    pred = Predictor(res.config, res.params, res.normalizer)
    _, rep = eval_examples(read_timeline([eval_path], "mooncake", 100.0), 0, H)
    hit = policy_hit_rates([rep], pred, (0.05, 0.1, 0.2, 0.4), guard=True, guard_window=512,
                           baselines=("lru",))["hit_rate"]
    unguarded = np.array(hit["dmlp"]) - np.array(hit["lru"])
    guarded = np.array(hit["dmlp_guarded"]) - np.array(hit["lru"])
    assert unguarded.min() < -0.005, hit        # the shift makes the unguarded DMLP lose somewhere
    assert guarded.min() >= -0.005, hit         # the guard keeps it within half a point everywhere
