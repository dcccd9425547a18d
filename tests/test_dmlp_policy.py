"""Eviction, prefetch, page size and the confidence threshold of the DMLP policy (with a stub model)."""
import numpy as np
import pytest

from stratum_jax.dmlp.features import FEATURE_NAMES, BlockInfo
from stratum_jax.dmlp.model import DmlpConfig
from stratum_jax.cache_policy import LruPolicy
from stratum_jax.dmlp.policy import ConfidenceThreshold, DmlpPolicy, curve_at, reuse_within
from stratum_jax.page_size import DefaultPageSizeRule, PageSizeHints

H = (10.0, 50.0, 100.0)
DEPTH = FEATURE_NAMES.index("depth")


class StubPredictor:
    """Reuse curve chosen by the block's depth: depth 0 = hot, 1 = warm, 2 = dead."""
    config = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H)
    CURVES = {0: [0.6, 0.9, 0.95], 1: [0.1, 0.3, 0.5], 2: [0.0, 0.001, 0.002]}

    def __init__(self):
        self.calls = 0

    def predict(self, raw):
        self.calls += 1
        return np.array([self.CURVES[int(d)] for d in raw[:, DEPTH]], np.float32).reshape(len(raw), 3)


def block(i, depth, last, running=False):
    return BlockInfo(block_id=i, last_access_ms=last, access_count=1, depth=depth, needed_by_running=running)


def test_curve_interpolation():
    c = np.array([[0.2, 0.6, 0.8]])
    assert curve_at(c, H, 5.0)[0] == pytest.approx(0.1)          # halfway from F(0)=0 to F(10)
    assert curve_at(c, H, 30.0)[0] == pytest.approx(0.4)
    assert curve_at(c, H, 1000.0)[0] == pytest.approx(0.8)       # flat past the last horizon
    # Idle 10 ms (F = 0.2); next 40 ms reach F(50) = 0.6: (0.6 - 0.2) / 0.8 = 0.5.
    assert reuse_within(c, H, np.array([10.0]), 40.0)[0] == pytest.approx(0.5)
    # Idle past the last horizon: nothing more is known, score 0.
    assert reuse_within(c, H, np.array([150.0]), 40.0)[0] == 0.0


def test_evicts_lowest_predicted_reuse_and_spares_running_blocks():
    pol = DmlpPolicy(StubPredictor())
    now = 20.0
    blocks = [block("hot", 0, now), block("warm", 1, now), block("dead", 2, now),
              block("dead-running", 2, now - 5, running=True)]
    pol.observe_access(blocks)
    assert pol.choose_victims(blocks, 2, now + 1) == ["dead", "warm"]
    assert pol.choose_victims(blocks, 10, now + 1) == ["dead", "warm", "hot"]


def test_beyond_the_horizons_it_is_lru():
    stub = StubPredictor()
    pol = DmlpPolicy(stub)
    blocks = [block("hot-old", 0, 0.0), block("hot-older", 0, -50.0), block("dead-young", 2, 190.0)]
    # The two hot blocks are idle past 100 ms: score 0, oldest first; the young dead one scores > 0.
    assert pol.choose_victims(blocks, 3, 200.0) == ["hot-older", "hot-old", "dead-young"]
    assert stub.calls == 1                    # curves were missing: scored once, then reused


def test_prefetch_order_and_hot_blocks():
    pol = DmlpPolicy(StubPredictor(), threshold=ConfidenceThreshold(0.75))
    blocks = [block("warm", 1, 0.0), block("dead", 2, 0.0), block("hot", 0, 0.0)]
    assert pol.prefetch_order(blocks, 0.0) == ["hot", "warm", "dead"]
    assert pol.is_hot(blocks, 0.0).tolist() == [False, False, True]


def test_page_size_moves_one_class_from_the_default():
    pol = DmlpPolicy(StubPredictor())
    hints = PageSizeHints(expected_tokens=2048)
    base = DefaultPageSizeRule()(hints)
    assert pol.page_size_for(hints) == base
    assert pol.page_size_for(hints, [block("h", 0, 0.0)], 0.0) == base // 2
    assert pol.page_size_for(hints, [block("d", 2, 0.0)], 0.0) == base * 2
    assert LruPolicy().page_size_for(hints) == base


def test_lru_policy():
    blocks = [block("a", 0, 5.0), block("b", 0, 1.0), block("c", 0, 3.0, running=True)]
    assert LruPolicy().choose_victims(blocks, 2, 10.0) == ["b", "a"]
    assert LruPolicy().prefetch_order(blocks, 10.0) == ["a", "c", "b"]


def test_confidence_calibrates_within_bounds():
    t = ConfidenceThreshold(0.75, low=0.5, high=0.95, step=0.05)
    probs = np.linspace(0, 1, 101)
    reused = (probs >= 0.55).astype(float)       # the best threshold is 0.55
    assert t.calibrate(probs, reused) == pytest.approx(0.70)   # one step of at most 0.05
    for _ in range(10):
        t.calibrate(probs, reused)
    assert t.value == pytest.approx(0.55)
    for _ in range(20):
        t.calibrate(probs, probs >= 0.1)         # wants 0.1: stops at the lower bound
    assert t.value == pytest.approx(0.5)
    with pytest.raises(ValueError):
        ConfidenceThreshold(0.3)


def test_on_access_hook_gets_the_scored_features():
    seen = []
    pol = DmlpPolicy(StubPredictor(), on_access=lambda ids, raw, now: seen.append((ids, raw.shape, now)))
    pol.observe_access([block("x", 1, 7.0), block("y", 2, 7.0)])
    pol.choose_victims([block("z", 1, 1.0)], 1, 9.0)      # scoring for eviction is not an access
    assert seen == [(["x", "y"], (2, len(FEATURE_NAMES)), 7.0)]


@pytest.mark.parametrize("score_on_access", [True, False])
def test_only_the_tracked_share_of_blocks_reaches_on_access(score_on_access):
    """track_fraction samples blocks by id: every access of a tracked block is handed over (so its labels
    stay exact), none of an untracked one, and the rows are those blocks' own features."""
    from stratum_jax.dmlp.policy import tracked_block
    seen = []
    pol = DmlpPolicy(StubPredictor(), on_access=lambda ids, raw, now: seen.append((list(ids), raw.copy())),
                     score_on_access=score_on_access, track_fraction=0.25)
    blocks = [block(i, i % 3, 5.0) for i in range(400)]
    for t in (5.0, 6.0):                                    # the same blocks, accessed twice
        pol.observe_access([block(b.block_id, b.depth, t) for b in blocks])
    tracked = [b.block_id for b in blocks if tracked_block(b.block_id, 0.25)]
    assert 60 <= len(tracked) <= 140                        # about a quarter
    assert [ids for ids, _ in seen] == [tracked, tracked]
    depths = seen[0][1][:, DEPTH]
    assert depths.tolist() == [float(i % 3) for i in tracked]
    with pytest.raises(ValueError, match="track_fraction"):
        DmlpPolicy(StubPredictor(), track_fraction=0.0)
