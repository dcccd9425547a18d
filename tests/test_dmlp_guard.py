"""The shadow-LRU guard: when it trips (two trailing windows) and returns (only after a weight swap), its metrics, and the CI check of issue #15: a DMLP
trained on one synthetic workload and replayed on a shifted one stays within half a point of LRU at
every capacity with the guard, and does not without it."""
import numpy as np
import prometheus_client as prom
import pytest

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


def ahead_cache(guard, n):
    """n accesses: a cycle of 4 blocks the real cache keeps, each followed by a one-off block it drops at
    once; a ghost LRU of the same size is flushed by the one-offs and misses the cycle."""
    for i in range(n):
        if i % 2 == 0:
            guard.accessed(["wxyz"[(i // 2) % 4]])
        else:
            guard.accessed([("once", i)])
            guard.forget([("once", i)])


def tripped(w, free_probes=0):
    """A guard (window w, confirm 2, backoff 1 up to 4) that has just tripped on two trailing windows."""
    g = ShadowLruGuard(window=w, margin=0.005, z=3.0, confirm=2, backoff=1, max_backoff=4, free_probes=free_probes)
    g.accessed(["p", "q"])
    wrong_cache(g, w - 2)
    assert not g.active and g.lru_hit_rate > g.dmlp_hit_rate == 0.0   # one trailing window is not enough
    wrong_cache(g, w)
    assert g.active and g.trips == 1
    return g


def test_one_trailing_window_between_windows_at_par_does_not_trip():
    w = 40
    g = ShadowLruGuard(window=w, margin=0.005, z=3.0, confirm=2)
    for _ in range(5):
        wrong_cache(g, w)
        par_cache(g, w)
    assert g.trips == 0 and not g.active
    wrong_cache(g, 2 * w)
    assert g.trips == 1 and g.active


def test_an_unchanged_model_that_never_led_gets_its_free_probe_and_then_no_more_so_its_loss_stays_bounded():
    w = 40
    g = tripped(w, free_probes=1)
    assert g.credit < 0
    par_cache(g, 3 * w)                                # in LRU mode, real = ghost
    assert g.active and g.probes == 0                  # an unchanged model waits 4 x backoff windows
    par_cache(g, w)
    assert not g.active and g.probes == 1 and g.free_probes == 0
    wrong_cache(g, w)                                  # still wrong: back to LRU after the one window
    assert g.active and g.trips == 2
    par_cache(g, 200 * w)                              # session 5's rule probed every 4 x backoff windows
    assert g.active and g.probes == 1 and g.trips == 2


def test_an_unchanged_model_is_probed_only_while_the_lead_it_earned_pays_for_a_probe():
    w = 40
    g = ShadowLruGuard(window=w, margin=0.005, z=3.0, confirm=2, backoff=1, max_backoff=4, free_probes=0)
    ahead_cache(g, 8 * w)
    assert g.trips == 0 and g.credit >= 8 * w // 2 - 4          # about half of each window, ghost misses
    wrong_cache(g, 2 * w)
    assert g.active and g.trips == 1 and g.credit >= g._probe_cost > 0
    par_cache(g, 3 * w)                                         # in LRU mode, real = ghost
    assert g.active and g.probes == 0                           # an unchanged model waits 4 x backoff
    par_cache(g, w)
    assert not g.active and g.probes == 1                       # and its credit pays for the probe
    wrong_cache(g, w)
    assert g.active and g.trips == 2 and g.credit < g._probe_cost   # the probe spent the rest
    par_cache(g, 100 * w)
    assert g.active and g.probes == 1


def test_a_weight_swap_is_probed_for_one_window_and_a_failed_probe_doubles_the_wait():
    w = 40
    g = tripped(w)
    g.model_changed()
    wrong_cache(g, w)                                  # backoff 1: probes after one window in LRU mode
    assert not g.active and g.probes == 1
    wrong_cache(g, w)                                  # a probe is judged on its one window
    assert g.active and g.trips == 2 and g.backoff == 2
    g.model_changed()                                  # a swap right after the second trip:
    wrong_cache(g, w)
    assert g.active                                    # backoff 2, so it waits a second window
    wrong_cache(g, w)
    assert not g.active and g.probes == 2
    wrong_cache(g, w)                                  # trails again: backoff 4
    assert g.active and g.trips == 3 and g.backoff == 4
    wrong_cache(g, 10 * w)                             # no swap since: no probe, however long
    assert g.active and g.probes == 2
    g.model_changed()                                  # the trip was long enough ago: probe next window
    wrong_cache(g, w)
    assert not g.active and g.probes == 3
    par_cache(g, w)                                    # the probe holds: the DMLP is back, the wait reset
    assert not g.active and g.backoff == 1 and g.trips == 3


def test_a_cache_as_good_as_lru_never_trips():
    """Real cache = the resident set never shrinks (nothing forgotten): every ghost hit is a real hit."""
    g = ShadowLruGuard(window=16, margin=0.0, z=0.0)
    rng = np.random.default_rng(0)
    g.accessed(rng.integers(0, 50, 4000).tolist())
    assert g.trips == 0 and g.dmlp_hit_rate >= g.lru_hit_rate


def test_exports_its_three_gauges():
    registry = prom.CollectorRegistry()
    g = ShadowLruGuard(window=4)
    g.export(registry)
    for _ in range(4):
        g.accessed(["x"])
    assert registry.get_sample_value("stratum_dmlp_guard_active") == 0.0
    assert registry.get_sample_value("stratum_dmlp_guard_dmlp_hit_rate") == 0.75   # the first access missed
    assert registry.get_sample_value("stratum_dmlp_guard_lru_hit_rate") == 0.75


@pytest.mark.parametrize("kwargs", [dict(window=0), dict(margin=1.0), dict(z=-1), dict(confirm=0), dict(free_probes=-1),
                                    dict(backoff=4, max_backoff=2)])
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
