"""The ghost DMLP cache the shadow-LRU guard runs in LRU mode (stratum_jax/dmlp/ghost.py): it mirrors the
real cache until told otherwise, then evicts by the ranking it is given, in slack-sized batches whose mean
size is the real cache's, never among the running access's keys."""
import numpy as np
import pytest

from stratum_jax.dmlp.ghost import GhostDmlpCache


def coldest_first(curves, idle_ms, n, now_ms, cached, access_seq):
    return np.lexsort((access_seq, curves[:, 0]))[:n]


def curve(p):
    return np.array([[p]], np.float32)


def test_it_mirrors_the_real_cache_and_ranks_nothing_until_it_is_told_to_evict_by_itself():
    g = GhostDmlpCache(coldest_first, 1)
    assert g.access(["a", "b"], np.array([[0.1], [0.9]]), 1.0) == [False, False]
    assert g.access(["a"], None, 2.0) == [True]
    g.forget(["a"])                         # the real cache dropped it: so does the mirror
    assert "a" not in g and "b" in g
    g.fit(0, set(), 3.0)                    # mirroring: fit is the real cache's business
    assert len(g) == 1 and g.rankings == 0


def test_on_its_own_it_evicts_the_coldest_but_never_the_running_access():
    g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0)
    g.mirror = False
    for i, p in enumerate([0.9, 0.1, 0.5]):
        g.access([f"k{i}"], curve(p), float(i))
    g.fit(3, {"k2"}, 2.0)
    assert len(g) == 3                      # at capacity: nothing to do
    g.access(["new"], curve(0.0), 3.0)      # the coldest key is the new one, but it is running
    g.forget(["k0"])                        # the real cache's evictions do not reach it now
    g.fit(3, {"new"}, 3.0)
    assert "k1" not in g and all(k in g for k in ("k0", "k2", "new"))
    assert g.rankings == 1


def test_a_key_seen_without_a_curve_goes_first_until_the_policy_scores_it():
    g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0)
    g.mirror = False
    g.access(["a", "b"], None, 1.0)
    g.note_curves(["a"], curve(0.8), [1.0])  # a was scored (at the access it holds): b still unknown
    g.note_curves(["b"], curve(0.9), [0.5])  # a curve of an older access of b is not b's now
    g.access(["c"], curve(0.5), 2.0)
    g.fit(2, {"c"}, 2.0)
    assert "b" not in g and "a" in g and "c" in g


def test_batched_evictions_keep_its_mean_size_at_the_real_caches():
    cap, g = 64, GhostDmlpCache(coldest_first, 1, slack_frac=1 / 8)
    g.mirror = False
    rng = np.random.default_rng(0)
    sizes = []
    for i in range(4000):
        g.access([int(rng.integers(0, 10 ** 6))], curve(float(rng.random())), float(i))
        g.fit(cap, set(), float(i))
        sizes.append(len(g))
    sizes = np.array(sizes[500:])
    assert sizes.min() == cap - 4 and sizes.max() == cap + 4      # slack 8: +- 4
    assert abs(sizes.mean() - cap) <= 0.5
    assert g.rankings <= 4000 // 8 + 1                             # one ranking per slack insertions
    small = GhostDmlpCache(coldest_first, 1, slack_frac=1 / 8, min_slack=6)
    small.mirror = False
    for i in range(40):
        small.access([i], curve(0.5), float(i))
        small.fit(8, set(), float(i))                              # 1/8 of 8 is 1 block; the floor is 6
        assert len(small) <= 11 and (i < 11 or len(small) >= 5)


def test_start_mirroring_takes_the_real_caches_contents():
    g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0)
    g.mirror = False
    g.access(["a", "b", "c"], curve(0.5).repeat(3, 0), 1.0)
    g.start_mirroring({"b", "c", "d"})
    assert g.mirror and "a" not in g and all(k in g for k in "bcd")
    g.mirror = False
    g.access(["e"], curve(0.5), 2.0)
    g.fit(3, {"e"}, 2.0)                    # d came back with no curve, long idle: it goes first
    assert "d" not in g


def test_a_bad_slack_is_refused():
    with pytest.raises(ValueError, match="slack_frac"):
        GhostDmlpCache(coldest_first, 1, slack_frac=1.0)
    with pytest.raises(ValueError, match="min_slack"):
        GhostDmlpCache(coldest_first, 1, min_slack=0)


def test_keys_accessed_with_features_are_scored_together_when_a_ranking_needs_them():
    calls = []

    def score(features):                     # the "model": a record's P(reuse) is the record
        calls.append(len(features))
        return np.array(features)[:, None]

    g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0, score=score)
    g.mirror = False
    for i, p in enumerate([0.9, 0.2, 0.7]):
        g.access([f"k{i}"], None, float(i), features=[p])
    assert calls == []                       # nothing scored per access
    g.access(["new"], None, 3.0, features=[0.5])
    g.fit(3, {"new"}, 3.0)
    assert calls == [3] and "k1" not in g    # the three candidates in one call; the coldest went
    g.access(["k4"], None, 4.0, features=[0.95])
    g.fit(3, {"k4"}, 4.0)
    assert calls == [3, 1] and "new" not in g   # only the one not scored yet


def test_features_without_a_score_function_are_refused():
    g = GhostDmlpCache(coldest_first, 1)
    with pytest.raises(ValueError, match="score function"):
        g.access(["a"], None, 0.0, features=[0.5])


def test_background_scoring_evicts_as_scoring_at_the_ranking_does_and_off_the_callers_thread():
    import threading
    threads = []

    def score(features):
        threads.append(threading.current_thread())
        return np.array(features)[:, None]

    def run(background):
        g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0, score=score, background=background)
        g.mirror = False
        rng = np.random.default_rng(7)
        for i in range(200):
            keys = [f"k{j}" for j in rng.integers(0, 40, 3)]
            g.access(keys, None, float(i), features=rng.uniform(0, 1, len(keys)).tolist())
            g.fit(16, set(keys), float(i))
        return sorted(g._keys), g.rankings

    here = run(False)
    n = len(threads)
    assert n and all(t is threading.current_thread() for t in threads)      # scored at the ranking
    there = run(True)
    assert there == here and here[1] > 50      # the same evictions, whenever the worker finished
    assert len(threads) > n and all(t is not threading.current_thread() for t in threads[n:])


def test_a_ranking_waits_for_background_scores_not_finished_yet():
    import threading
    release = threading.Event()

    def score(features):
        release.wait()
        return np.array(features)[:, None]

    g = GhostDmlpCache(coldest_first, 1, slack_frac=0.0, score=score, background=True)
    g.mirror = False
    for i, p in enumerate([0.9, 0.2, 0.7, 0.5]):
        g.access([f"k{i}"], None, float(i), features=[p])
    ranker = threading.Thread(target=g.fit, args=(3, {"k3"}, 3.0))
    ranker.start()
    ranker.join(0.2)
    assert ranker.is_alive() and len(g) == 4     # it cannot rank before the scores exist
    release.set()
    ranker.join(10.0)
    assert not ranker.is_alive() and "k1" not in g and len(g) == 3 and g.waits == 1
