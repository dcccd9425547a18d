"""The offline trainer and its CLI on a small synthetic conversation trace."""
import json
import os

import jax
import numpy as np
import pytest

from stratum_jax import train_dmlp
from stratum_jax.dmlp.model import Predictor
from stratum_jax.dmlp import checkpoint as ckpt_mod
from stratum_jax.dmlp.checkpoint import CheckpointError, DmlpCheckpoint, load_checkpoint, save_checkpoint
from training.dataset import eval_examples, train_val_examples
from training.pipeline import EvalOptions, evaluation_report
from training.synthetic import conversation_trace, write_jsonl
from training.trainer import TrainConfig, train
from training.traces import read_timeline, read_traces

H = (10.0, 50.0, 100.0, 200.0, 500.0)
SCALE = 100.0      # the synthetic trace spans ~6 min: 1 trace second = 10 simulated ms
SMALL = TrainConfig(epochs=2, hidden=(64, 64), batch_size=256, learning_rate=1e-3)
OPTS = EvalOptions(capacity_fracs=(0.05, 0.1, 0.2, 0.4), host_frac=0.1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    records = conversation_trace(1600, seed=3, rate_per_s=4.0, think_median_s=30.0)
    cut = len(records) * 2 // 3
    paths = {"train": str(d / "train.jsonl"), "eval": str(d / "eval.jsonl")}
    write_jsonl(paths["train"], records[:cut])
    write_jsonl(paths["eval"], records[cut:])
    return paths


@pytest.fixture(scope="module")
def data(traces):
    return train_val_examples(read_traces([traces["train"]], "mooncake", SCALE), H, 0.25)


def test_same_seed_same_weights(data):
    tr, va, _ = data
    a, b = train(tr, va, H, SMALL), train(tr, va, H, SMALL)
    c = train(tr, va, H, TrainConfig(**{**SMALL.__dict__, "seed": 1}))
    leaves = lambda r: jax.tree_util.tree_leaves(r.params)
    assert all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b)))
    assert not all(np.array_equal(x, y) for x, y in zip(leaves(a), leaves(c)))
    assert len(a.epochs) == 2 and a.epochs[0]["val_loss"] > 0 and 1 <= a.best_epoch <= 2


def test_checkpoint_reload_gives_the_same_report(data, traces, tmp_path):
    tr, va, _ = data
    res = train(tr, va, H, SMALL)
    ckpt = DmlpCheckpoint(res.config, res.params, res.normalizer, {"time_scale": SCALE})
    stream = read_timeline([traces["train"], traces["eval"]], "mooncake", SCALE)
    ex, rep = eval_examples(stream, stream.file_starts[1], H)
    before = evaluation_report(Predictor(res.config, res.params, res.normalizer), ckpt, ex, [rep], OPTS)
    save_checkpoint(str(tmp_path / "ck"), ckpt)
    loaded = load_checkpoint(str(tmp_path / "ck"))
    after = evaluation_report(Predictor(loaded.config, loaded.params, loaded.normalizer), loaded, ex, [rep], OPTS)
    assert json.dumps(before, sort_keys=True) == json.dumps(after, sort_keys=True)


def test_checkpoint_write_is_atomic(data, tmp_path, monkeypatch):
    tr, va, _ = data
    res = train(tr, va, H, TrainConfig(epochs=1, hidden=(8,), batch_size=256))
    ck = DmlpCheckpoint(res.config, res.params, res.normalizer, {"run": 1})
    path = str(tmp_path / "ck")
    save_checkpoint(path, ck)

    def crash(*a, **k):
        raise OSError("disk on fire")
    monkeypatch.setattr(ckpt_mod.ocp.StandardCheckpointer, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint(path, DmlpCheckpoint(res.config, res.params, res.normalizer, {"run": 2}))
    assert load_checkpoint(path).extra == {"run": 1}              # the old one, intact
    assert os.listdir(tmp_path) == ["ck"]                          # no half-written leftovers


def test_bad_checkpoints_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="meta.json: missing"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "meta.json").write_text('{"format": "stratum-dmlp",\n "version": ')
    with pytest.raises(CheckpointError, match=r"meta.json:2: not valid JSON"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "meta.json").write_text(json.dumps({"format": "stratum-dmlp", "version": 1,
                                                    "feature_names": ["x"]}))
    with pytest.raises(CheckpointError, match="trained on features"):
        load_checkpoint(str(tmp_path))


def test_cli_train_then_eval(traces, tmp_path, capsys):
    out = str(tmp_path / "run")
    rc = train_dmlp.main(["--traces", traces["train"], "--format", "mooncake", "--out", out,
                          "--time-scale", str(SCALE), "--epochs", "1", "--val-fraction", "0.25"])
    assert rc == 0
    report = json.load(open(os.path.join(out, "report.json")))
    assert report["params"] == 1_219_333 and report["horizons_ms"] == list(H)
    assert set(report["train"]) >= {"examples", "seconds"} and report["train"]["examples"] > 0
    for k in ("positive_rate", "accuracy", "majority_accuracy", "auc", "brier"):
        assert len(report["val"][k]) == len(H)
    pol = report["policy"]
    assert pol["capacity_frac"] == [0.05, 0.1, 0.2, 0.4]
    assert set(pol["hit_rate"]) == {"lru", "lfu", "dmlp", "belady", "dmlp_guarded"}   # the guard is on by default
    assert all(len(v) == 4 for v in pol["hit_rate"].values())
    # Belady is the optimum: no policy beats it.
    for name in ("lru", "lfu", "dmlp"):
        assert all(x <= b + 1e-12 for x, b in zip(pol["hit_rate"][name], pol["hit_rate"]["belady"]))
    rpath = str(tmp_path / "eval.json")
    rc = train_dmlp.main(["--eval-only", "--checkpoint", out, "--traces",   # the --out dir works too
                          traces["eval"], "--warmup-traces", traces["train"], "--format", "mooncake",
                          "--report", rpath])
    assert rc == 0
    ev = json.load(open(rpath))
    assert ev["time_scale"] == SCALE            # taken from the checkpoint
    assert ev["train"]["examples"] == report["train"]["examples"]
    assert ev["val"]["count"][0] > 0
    # A --time-scale that disagrees with the checkpoint's is used, but said loudly and recorded.
    capsys.readouterr()
    rc = train_dmlp.main(["--eval-only", "--checkpoint", out, "--traces", traces["eval"], "--format",
                          "mooncake", "--report", rpath, "--time-scale", "1"])
    assert rc == 0
    ev = json.load(open(rpath))
    assert ev["time_scale"] == 1.0 and ev["checkpoint_time_scale"] == SCALE
    assert f"--time-scale 1 differs from the checkpoint's {SCALE:g}" in capsys.readouterr().err


def test_cli_malformed_trace_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"timestamp": 1,\n')
    rc = train_dmlp.main(["--traces", str(bad), "--format", "mooncake", "--out", str(tmp_path / "o")])
    assert rc == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err
