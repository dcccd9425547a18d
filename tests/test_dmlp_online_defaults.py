"""The server and the cache simulator's online replay decide and label with the same settings (issue #15).

Both wire their policy through `stratum_jax.dmlp.wiring.wire_policy` from `OnlineConfig`; these tests read
the settings back from the objects each one actually built, so a path that builds its own tracker or policy
again (as the replay did before, with its own `hold_reuse`) fails here.
"""
import dataclasses

import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.dmlp.checkpoint import load_checkpoint
from stratum_jax.dmlp.learner import Learner, OnlineConfig, decision_index
from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp.policy import ConfidenceThreshold
from stratum_jax.dmlp.runtime import build_dmlp
from tests.dmlp_checkpoint import HORIZONS_MS, write_checkpoint
from training.dataset import eval_examples
from training.online_replay import online_run
from training.synthetic import conversation_trace, write_jsonl
from training.traces import read_timeline


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dmlp") / "ckpt")


def server_settings(ckpt, online_dir, online: bool) -> dict:
    kw = dict(dmlp_online=True, dmlp_online_dir=str(online_dir)) if online else {}
    wired, tuner = build_dmlp(RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, **kw))
    assert (tuner is not None) == online
    return wired.settings()


def replay_settings(ckpt, tmp_path, config: OnlineConfig = OnlineConfig()) -> dict:
    path = str(tmp_path / "trace.jsonl")
    write_jsonl(path, conversation_trace(30, seed=1))
    _, rep = eval_examples(read_timeline([path], "mooncake", 100.0), 0, HORIZONS_MS)
    c = load_checkpoint(ckpt)
    return online_run(rep, Predictor(c.config, c.params, c.normalizer), config, round_ms=1.0).settings


def test_server_and_replay_build_the_same_decision_horizon_and_label_rule(ckpt, tmp_path):
    server = server_settings(ckpt, tmp_path / "online", online=True)
    replay = replay_settings(ckpt, tmp_path)
    assert server == replay
    # ... and they are OnlineConfig's: the learner judges at the horizon the policy decides at.
    default = OnlineConfig()
    assert server == {"decision_horizon_ms": HORIZONS_MS[decision_index(HORIZONS_MS, default.decision_horizon_ms)],
                      "hold_reuse": default.hold_reuse}
    # A server without online fine-tuning still decides (hot/cold, prefetch) at that horizon.
    assert server_settings(ckpt, tmp_path / "x", online=False) == {"decision_horizon_ms": server["decision_horizon_ms"]}


def test_the_replay_follows_its_config_not_a_setting_of_its_own(ckpt, tmp_path):
    # The test above can only fail if the replay's settings come from its config: change the config, and
    # what the replay built changes with it.
    other = dataclasses.replace(OnlineConfig(), decision_horizon_ms=500.0, hold_reuse=not OnlineConfig().hold_reuse)
    assert replay_settings(ckpt, tmp_path, other) == {"decision_horizon_ms": 500.0, "hold_reuse": other.hold_reuse}


def test_decision_index_picks_the_longest_horizon_not_longer_and_the_learner_uses_it(ckpt):
    assert decision_index(HORIZONS_MS, 200.0) == 3
    assert decision_index(HORIZONS_MS, 350.0) == 3
    assert decision_index(HORIZONS_MS, 1e6) == 4
    assert decision_index(HORIZONS_MS, 1.0) == 0       # all longer: the shortest
    c = load_checkpoint(ckpt)
    learner = Learner(c.config, c.params, c.normalizer, OnlineConfig(decision_horizon_ms=100.0), ConfidenceThreshold())
    assert learner.decision == 2
    with pytest.raises(ValueError, match="decision_horizon_ms must be > 0"):
        OnlineConfig(decision_horizon_ms=0.0)

