"""The trainer's default time scale: chosen from the trace, recorded, and flat labels flagged."""
import json
import logging
import os

import numpy as np
import pytest

from stratum_jax import train_dmlp
from training.dataset import train_val_examples
from training.time_scale import RATE_BAND, choose_time_scale, flat_labels, headline_target
from training.traces import read_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(ROOT, "..", "shared", "traces", "mooncake_conversation.jsonl")
H = (10.0, 50.0, 100.0, 200.0, 500.0)
EVERY = 8     # keep one conversation in EVERY: the whole hour of the trace, an eighth of its accesses


@pytest.fixture(scope="module")
def mooncake_sample(tmp_path_factory):
    """Whole conversations of the shared Mooncake trace, over its full hour. A conversation's turns share
    their leading blocks, so the sample keeps a request by its first block after the shared system
    prompt (hash_ids[1]); a prefix of the file instead would shorten the timeline the scale depends on."""
    if not os.path.exists(TRACE):
        pytest.skip(f"the shared Mooncake trace is not at {TRACE}")
    path = str(tmp_path_factory.mktemp("mooncake") / "sample.jsonl")
    with open(TRACE) as src, open(path, "w") as dst:
        for line in src:
            ids = json.loads(line)["hash_ids"]
            if ids[min(1, len(ids) - 1)] % EVERY == 0:
                dst.write(line)
    return path


def test_flat_labels():
    assert flat_labels([0.001, 0.005, 0.019])
    assert flat_labels([0.99, 0.999])
    assert flat_labels([0.01, 0.99])              # no horizon informative
    assert not flat_labels([0.01, 0.015, 0.3])    # one informative horizon is enough
    assert not flat_labels([0.02, 0.5, 0.98])


def test_headline_target():
    assert headline_target(H) == 500.0
    assert headline_target((50.0, 1000.0, 200.0)) == 200.0
    assert headline_target((800.0, 2000.0)) == 800.0


def test_chosen_scale_balances_the_training_labels(mooncake_sample):
    streams = read_traces([mooncake_sample], "mooncake", 1.0)
    choice = choose_time_scale(streams, H, 0.2)
    assert choice.horizon_ms == 500.0 and choice.in_band
    # Checked with the examples the trainer makes from the trace read at that scale.
    for scale, inside in ((choice.scale, True), (1.0, False)):
        tr, _, _ = train_val_examples(read_traces([mooncake_sample], "mooncake", scale), H, 0.2)
        k = tr.known[:, -1] > 0
        rate = tr.labels[k, -1].mean()
        assert (RATE_BAND[0] <= rate <= RATE_BAND[1]) == inside, (scale, rate)


def test_default_run_beats_lru(mooncake_sample, tmp_path, capsys):
    out = str(tmp_path / "run")
    rc = train_dmlp.main(["--traces", mooncake_sample, "--format", "mooncake", "--out", out,
                          "--epochs", "1", "--seed", "0", "--capacity-fracs", "0.1"])
    assert rc == 0
    report = json.load(open(os.path.join(out, "report.json")))
    meta = json.load(open(os.path.join(out, "checkpoint", "meta.json")))
    scale = meta["extra"]["time_scale"]
    assert meta["extra"]["time_scale_choice"]["source"] == "chosen from the trace"
    assert report["time_scale"] == scale
    assert f"time scale {scale:g} (chosen from the trace" in capsys.readouterr().out
    assert report["labels_flat"] == []
    assert RATE_BAND[0] <= report["train"]["positive_rate"][-1] <= RATE_BAND[1]
    hit = report["policy"]["hit_rate"]
    assert hit["dmlp"][0] > hit["lru"][0] + 0.02, hit


def test_flat_labels_warn_and_are_reported(tmp_path, capsys, caplog):
    # One block reused every 10 s: at scale 1 no horizon (<= 500 ms) ever sees a reuse.
    trace = tmp_path / "slow.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 10_000 * i, "input_length": 1024, "output_length": 1,
                                         "hash_ids": [i % 7, 100 + i]}) + "\n" for i in range(1200)))
    out = str(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="training.time_scale"):
        rc = train_dmlp.main(["--traces", str(trace), "--format", "mooncake", "--out", out,
                              "--time-scale", "1", "--epochs", "1", "--batch-size", "64",
                              "--capacity-fracs", "0.2"])
    assert rc == 0
    report = json.load(open(os.path.join(out, "report.json")))
    assert sorted(report["labels_flat"]) == ["evaluation", "training"]
    assert np.max(report["val"]["positive_rate"]) < 0.02
    assert "labels are flat" in capsys.readouterr().err
    assert any(r.levelno == logging.WARNING and "labels are flat" in r.getMessage() for r in caplog.records)
