"""The replay's fast eviction path gives the same victims as the straightforward one: the one-pass score
(`reuse_before_eviction`) is bit-identical to five `curve_at` calls, `first_n` to a full lexsort, and
`Predicted`'s per-slot copies of curves and times to gathering them by event. Checked on random
inputs and on whole replays (offline and guarded) of a small synthetic trace."""
import numpy as np
import pytest

from stratum_jax.dmlp import policy as policy_mod
from stratum_jax.dmlp.guard import ShadowLruGuard
from stratum_jax.dmlp.model import DmlpConfig
from stratum_jax.dmlp.features import FEATURE_NAMES
from stratum_jax.dmlp.policy import EVICTION_WINDOW_MULTIPLES, DmlpPolicy, curve_at, first_n, reuse_before_eviction
from training.simulator import Predicted, replay
from training.synthetic import conversation_trace, write_jsonl
from training.traces import read_timeline

H = (10.0, 50.0, 100.0, 200.0, 500.0)


def per_call_score(curves, horizons_ms, idle_ms, residency_ms, multiples=EVICTION_WINDOW_MULTIPLES):
    """The score as first written: one `curve_at` per time."""
    f0 = curve_at(curves, horizons_ms, idle_ms)
    gain = np.mean([curve_at(curves, horizons_ms, idle_ms + residency_ms * k) for k in multiples], axis=0) - f0
    return gain / np.maximum(1.0 - f0, 1e-9)


def full_sort(keys, n):
    return np.lexsort(keys)[:n]


def monotone_curves(rng, n):
    """float32 [n, H], nondecreasing along H as the model's are, with some flat and some all-zero rows."""
    c = np.sort(rng.uniform(0, 1, (n, len(H))), axis=1).astype(np.float32)
    c[rng.random(n) < 0.1] = 0.0
    flat = rng.random(n) < 0.1
    c[flat] = c[flat, :1]
    return c


@pytest.mark.parametrize("seed", range(6))
def test_score_and_selection_match_the_straightforward_forms_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    n = 2000
    curves = monotone_curves(rng, n)
    # Idle times in the open, exactly on horizons, and past the longest one.
    idle = np.where(rng.random(n) < 0.3, rng.choice([0.0, *H, 900.0], n), rng.uniform(0, 700, n))
    for residency in (0.0, 3.7, 120.0, 1e4):
        fast = reuse_before_eviction(curves, H, idle, residency)
        assert np.array_equal(fast, per_call_score(curves, H, idle, residency))
        seq = rng.permutation(n).astype(np.float64)
        coarse = np.round(fast, 1)          # many ties on the primary key, broken by idle then seq
        for k in (0, 1, 7, 500, n, n + 3):
            assert np.array_equal(first_n((seq, -idle, coarse), k), full_sort((seq, -idle, coarse), k))
            assert np.array_equal(first_n((seq, -idle), k), full_sort((seq, -idle), k))


class _Model:
    config = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H)
    params = None


def _replay(stream, curves, capacity, guarded, checked):
    """Hits, host hits, the hit events and the guard's trips of one replay. `checked` collects each
    victim call's arguments against the stream's own arrays (the per-slot copies must equal them)."""
    # A guard that trips at any trailing window, so that a small replay also takes the LRU-order path.
    guard = ShadowLruGuard(window=64, margin=0.0, z=0.0, confirm=1) if guarded else None
    pol = DmlpPolicy(_Model(), guard=guard)

    def order(c, idle, n, now, cached, seq):
        checked.append(np.array_equal(c, curves[seq]) and np.array_equal(idle, now - stream.t_ms[seq]))
        return pol.order_victims(c, idle, n, now, cached, seq)

    hits = np.zeros(stream.num_events, bool)
    res = replay(stream, capacity, Predicted(curves, stream.t_ms, order, capacity, observer=pol if guarded else None),
                 host_capacity=capacity // 2, hit_events=hits)
    return res.hits, res.host_hits, hits, pol.guard.trips if guarded else 0


def test_replays_are_identical_with_the_straightforward_score_and_sort(tmp_path, monkeypatch):
    path = str(tmp_path / "t.jsonl")
    write_jsonl(path, conversation_trace(250, seed=1, rate_per_s=4.0, think_median_s=30.0))
    stream = read_timeline([path], "mooncake", 100.0)
    # Random curves: a policy that ranks by them makes many different choices than LRU would, so a
    # difference in the score or the sort shows up in the victims.
    curves = monotone_curves(np.random.default_rng(0), stream.num_events)
    unique = len(np.unique(stream.block))
    runs = [(round(0.05 * unique), False), (round(0.2 * unique), True)]
    checked: list[bool] = []
    fast = [_replay(stream, curves, cap, g, checked) for cap, g in runs]
    monkeypatch.setattr(policy_mod, "reuse_before_eviction", per_call_score)
    monkeypatch.setattr(policy_mod, "first_n", full_sort)
    slow = [_replay(stream, curves, cap, g, []) for cap, g in runs]
    assert checked and all(checked)
    for (cap, g), a, b in zip(runs, fast, slow):
        assert a[:2] == b[:2] and np.array_equal(a[2], b[2]) and a[3] == b[3], (cap, g, a[:2], b[:2])
    assert any(t > 0 for *_, t in fast)     # the guarded replays took the LRU-order path too
