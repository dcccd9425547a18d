"""Score-ahead (DmlpPolicy(score_ahead=True), the server's wiring): each step's accesses are dispatched to the
model without waiting, and decisions read the curves later. Checked here: the victims are the ones lazy
scoring picks, a ranking runs no model call of its own once the curves were dispatched, a read waits only
for a batch the device has not finished (and is counted), a page-size choice never waits, and the real
predictor's dispatch gives what predict gives with its params placed once on its device."""
import random

import jax
import numpy as np
import pytest

from stratum_jax.block_info import BlockInfo
from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer, num_inputs
from stratum_jax.dmlp.model import DmlpConfig, Predictor, init_params
from stratum_jax.dmlp.policy import DmlpPolicy
from stratum_jax.page_size import PageSizeHints

H = (10.0, 50.0, 100.0, 200.0, 500.0)
INPUT, COUNT = FEATURE_NAMES.index("input_tokens"), FEATURE_NAMES.index("access_count")


class Handle:
    """A dispatched prediction whose device finishes when the test says so."""

    def __init__(self, value, done):
        self.value, self.done, self.waited = value, done, False

    def ready(self):
        return self.done

    def result(self):
        self.waited |= not self.done
        self.done = True
        return self.value


class FakePredictor:
    """A deterministic reuse curve from two features; counts synchronous calls and dispatched rows.
    `finish_at_once`: whether a dispatched batch is done by the time anyone asks."""
    config = DmlpConfig(num_inputs=num_inputs(), horizons_ms=H)
    normalizer = Normalizer(np.zeros(len(FEATURE_NAMES), np.float32), np.ones(len(FEATURE_NAMES), np.float32))
    params = None

    def __init__(self, finish_at_once=True):
        self.finish_at_once = finish_at_once
        self.sync_calls = self.dispatched_rows = 0
        self.handles = []

    def curves(self, raw):
        size = np.nan_to_num(raw[:, INPUT]) % 7 / 7.0
        count = np.minimum(np.nan_to_num(raw[:, COUNT]), 5) / 5.0
        base = 0.05 + 0.6 * size * (0.5 + 0.5 * count)
        return np.clip(base[:, None] * np.linspace(0.4, 1.0, len(H))[None, :], 0, 0.99).astype(np.float32)

    def predict(self, raw):
        self.sync_calls += 1
        return self.curves(raw)

    def dispatch(self, raw):
        self.dispatched_rows += len(raw)
        handle = Handle(self.curves(raw), self.finish_at_once)
        self.handles.append(handle)
        return handle


def block(i, t, count, rng):
    return BlockInfo(block_id=f"b{i}", last_access_ms=t, access_count=count, depth=i % 5,
                     input_tokens=rng.randrange(100, 2000), max_tokens=64, fill=1.0)


def replay(policy, seed=0, rounds=40, per_round=12, capacity=60):
    """Accesses in rounds (a step's batch each), then evictions down to `capacity`; returns the victims
    in order. The same draws for every policy."""
    rng = random.Random(seed)
    cached: dict[str, BlockInfo] = {}
    counts: dict[int, int] = {}
    victims, t, next_id = [], 0.0, 0
    for _ in range(rounds):
        t += rng.uniform(2.0, 30.0)
        batch = []
        for _ in range(per_round):
            i = rng.randrange(max(1, next_id)) if cached and rng.random() < 0.4 else next_id
            next_id += i == next_id
            counts[i] = counts.get(i, 0) + 1
            batch.append(block(i, t, counts[i], rng))
        batch = list({b.block_id: b for b in batch}.values())
        cached.update((b.block_id, b) for b in batch)
        policy.observe_access(batch)
        t += rng.uniform(1.0, 8.0)
        over = len(cached) - capacity
        if over > 0:
            chosen = policy.choose_victims(list(cached.values()), over, t)
            victims += chosen
            for v in chosen:
                del cached[v]
            policy.forget(chosen)
    return victims


def test_score_ahead_evicts_exactly_what_lazy_scoring_evicts_with_no_model_call_at_a_ranking():
    lazy_pred, ahead_pred = FakePredictor(), FakePredictor()
    lazy = replay(DmlpPolicy(lazy_pred, score_on_access=False))
    ahead_policy = DmlpPolicy(ahead_pred, score_on_access=False, score_ahead=True)
    ahead = replay(ahead_policy)
    assert len(lazy) > 100 and ahead == lazy
    # Each access was dispatched once, and nothing was scored synchronously or waited for.
    assert ahead_pred.sync_calls == 0 and ahead_policy.score_stats.sync_calls == 0
    assert ahead_policy.score_stats.blocking_reads == 0
    assert ahead_pred.dispatched_rows == ahead_policy.score_stats.ahead_rows <= 40 * 12
    assert lazy_pred.sync_calls > 10          # lazy scoring called the model at rankings


def test_a_read_waits_only_for_a_batch_the_device_has_not_finished_and_is_counted():
    pred = FakePredictor(finish_at_once=False)
    policy = DmlpPolicy(pred, score_on_access=False, score_ahead=True)
    rng = random.Random(1)
    old = [block(i, 0.0, 1, rng) for i in range(6)]
    policy.observe_access(old)
    pred.handles[0].done = True               # the device finished the first step's batch
    new = [block(i, 5.0, 1, rng) for i in range(6, 9)]
    policy.observe_access(new)                # read the finished batch, dispatched this one
    assert not pred.handles[0].waited
    policy.choose_victims(old, 2, 6.0)        # only finished curves needed: no wait
    assert policy.score_stats.blocking_reads == 0 and not pred.handles[1].waited
    policy.choose_victims(old + new, 2, 6.0)  # needs the unfinished batch: waits, counted
    assert policy.score_stats.blocking_reads == 1 and pred.handles[1].waited
    assert pred.sync_calls == 0


def test_a_page_size_choice_never_waits_for_the_model():
    pred = FakePredictor(finish_at_once=False)
    policy = DmlpPolicy(pred, score_on_access=False, score_ahead=True)
    rng = random.Random(2)
    prefix = [block(i, 0.0, 1, rng) for i in range(4)]
    policy.observe_access(prefix)             # on the device, not finished
    hints = PageSizeHints(expected_tokens=4000, shared_prefix_tokens=64 * 4)
    from stratum_jax.page_size import DefaultPageSizeRule
    assert policy.page_size_for(hints, prefix, 1.0) == DefaultPageSizeRule()(hints)   # nothing known yet
    assert policy.score_stats.page_size_defaults == 1
    pred.handles[0].done = True
    again = [BlockInfo(**{**b.__dict__, "last_access_ms": 3.0, "access_count": 2}) for b in prefix]
    policy.observe_access(again)              # re-accessed: the new curves are on the device
    policy.page_size_for(hints, again, 4.0)   # judged by the earlier access's curves
    assert policy.score_stats.page_size_older_curves == 4
    assert not any(h.waited for h in pred.handles) and pred.sync_calls == 0


def test_score_ahead_needs_lazy_scoring():
    with pytest.raises(ValueError, match="score_on_access=False"):
        DmlpPolicy(FakePredictor(), score_on_access=True, score_ahead=True)


def test_the_flag_reaches_the_policy_and_is_refused_without_the_dmlp(tmp_path):
    from dmlp_checkpoint import write_checkpoint
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.dmlp.runtime import build_cache_policy

    ckpt = str(write_checkpoint(tmp_path / "ck"))
    for ahead in (True, False):
        policy, _ = build_cache_policy(RuntimeConfig(model="tiny", cache_policy="dmlp", dmlp_checkpoint=ckpt,
                                                     dmlp_score_ahead=ahead))
        assert policy.score_ahead is ahead and policy.score_on_access is False
    with pytest.raises(ValueError, match="--no-dmlp-score-ahead only applies with --cache-policy dmlp"):
        RuntimeConfig(model="tiny", dmlp_score_ahead=False)


def test_predictor_places_its_params_once_and_dispatch_gives_what_predict_gives():
    cfg = DmlpConfig(num_inputs(), hidden=(32, 32))
    norm = Normalizer(np.zeros(len(FEATURE_NAMES), np.float32), np.ones(len(FEATURE_NAMES), np.float32))
    numpy_params = jax.tree_util.tree_map(np.asarray, init_params(cfg, 0))
    pred = Predictor(cfg, numpy_params, norm, device=None)
    assert all(isinstance(a, jax.Array) for a in jax.tree_util.tree_leaves(pred.params))   # not numpy per call
    raw = np.random.default_rng(0).uniform(0, 100, (Predictor.MAX_BATCH + 5, len(FEATURE_NAMES))).astype(np.float32)
    pending = pred.dispatch(raw)
    got = pending.result()
    assert pending.ready() and got.shape == (len(raw), len(H))
    np.testing.assert_array_equal(got, pred.predict(raw))
