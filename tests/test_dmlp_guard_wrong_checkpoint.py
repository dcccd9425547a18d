"""Issue #15 at the KV cache the engine runs: `--cache-policy dmlp` with a deliberately wrong checkpoint
(it predicts that the most used prefix pages will not be used again) loses prefix-cache hits to
`--cache-policy lru` on the same load, and the shadow-LRU guard (on by default) engages and keeps the
hit rate within half a point of LRU.

The checkpoint, the load and the engine-side replay are training/wrong_checkpoint.py's (shared with
benchmarks/dmlp_guard_wrong_checkpoint.py). The guard returns to the DMLP only when its ghost DMLP cache
(the same model ranking a keys-only cache over the same accesses) leads the real LRU-mode cache; this
model never leads, so after the trip the cache is LRU for the rest of the run and the loss is the
windows before the trip, whatever the run's length (benchmarks/results/dmlp_guard_wrong_checkpoint_cpu.json).
Earlier rules that handed the model real windows to find out (probes) ended 0.53 / 0.88 points below LRU
at 3,000 / 6,000 requests (a probe on a timer), then 0.41 / 0.24 (one free probe, then credit).
"""
import pytest

from stratum_jax.config import RuntimeConfig
from training.wrong_checkpoint import hit_rate, prompts, wrong_checkpoint


def test_guard_engages_on_a_wrong_checkpoint_and_keeps_the_hit_rate_within_half_a_point_of_lru(tmp_path):
    ckpt = wrong_checkpoint(tmp_path / "wrong")
    load = prompts(3000)
    lru, _ = hit_rate(RuntimeConfig(), load)
    wrong, _ = hit_rate(RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_guard=False), load)
    guarded, policy = hit_rate(RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_guard_window=512), load)
    rates = dict(lru=lru, wrong=wrong, guarded=guarded, trips=policy.guard.trips, returns=policy.guard.returns,
                 ghost=policy.guard.ghost_hit_rate)
    assert wrong < lru - 0.015, rates                    # the checkpoint really is wrong
    assert policy.guard.trips >= 1, rates                # the guard engaged (it is on by default)
    assert policy.guard.returns == 0, rates              # its ghost never led the real LRU cache
    assert guarded >= lru - 0.005, rates                 # within half a point of LRU


def test_a_bad_guard_window_is_refused(tmp_path):
    ckpt = wrong_checkpoint(tmp_path / "wrong")
    with pytest.raises(ValueError, match="--dmlp-guard-window must be an integer >= 1"):
        RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_guard_window=0)
