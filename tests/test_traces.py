"""Trace readers: Mooncake and the engine's event log; every malformed line names its file and line."""
import json
import math

import numpy as np
import pytest

from stratum_jax.dmlp.features import SEED_FEATURES
from stratum_jax.kv.event_log import StratumEventLogWriter
from training.traces import (TraceFormatError, read_mooncake, read_stratum_log,
                             read_timeline)


def write(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return str(path)


def test_mooncake_blocks_in_prompt_order(tmp_path):
    p = write(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 3000, "input_length": 1024, "output_length": 9, "hash_ids": [7, 9]},
    ])
    s = read_mooncake(p, time_scale=1000.0)
    assert s.t_ms.tolist() == [0.0, 0.0, 3.0, 3.0]            # 3000 trace ms at 1000x = 3 ms
    assert s.block.tolist() == [0, 1, 0, 2]                   # ids 7, 8, 7, 9 mapped densely
    assert s.block_ids == [7, 8, 9]
    assert s.request.tolist() == [0, 0, 1, 1]
    assert s.depth.tolist() == [0, 1, 0, 1]
    assert s.blocks_after.tolist() == [1, 0, 1, 0]
    assert s.fill.tolist() == [1.0, (1000 - 512) / 512, 1.0, 1.0]
    assert s.max_tokens.tolist() == [5, 5, 9, 9]
    assert np.isnan(s.seed).all() and s.seed.shape == (4, len(SEED_FEATURES))
    assert s.t_end_ms == 3.0


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "'timestamp'"),
    ({"timestamp": 5, "input_length": 0, "output_length": 1, "hash_ids": [1]}, "'input_length'"),
    ({"timestamp": 5, "input_length": 10, "output_length": 1.5, "hash_ids": [1]}, "'output_length'"),
    ({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": []}, "'hash_ids'"),
    ({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}, "'hash_ids'"),
    ({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}, "2 hash_ids for input_length 10"),
    ({"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "goes back in time"),
])
def test_mooncake_malformed_line_names_file_and_line(tmp_path, line, message):
    good = {"timestamp": 2, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    p = write(tmp_path / "bad.jsonl", [good, "", line])
    with pytest.raises(TraceFormatError) as e:
        read_mooncake(p)
    assert str(e.value).startswith(f"{p}:3: ") and message in str(e.value)
    assert e.value.line == 3


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(TraceFormatError, match="nope.jsonl:0: cannot open"):
        read_mooncake(str(tmp_path / "nope.jsonl"))
    with pytest.raises(TraceFormatError, match="empty.jsonl:0: no block accesses"):
        read_mooncake(write(tmp_path / "empty.jsonl", []))


def test_event_log_round_trip(tmp_path):
    path = str(tmp_path / "events.jsonl")
    with StratumEventLogWriter(path) as w:
        w.write("created", 1.0, "b0", "r1", {"depth": 0, "fill": 1.0, "gen_frac": 0.0, "attn_var5": None,
                                              "kv_hbm_frac": np.float32(0.5), "queue_wait_ms": 2})
        w.write("created", 1.0, "b1", "r1", {"depth": 1, "fill": 0.25, "attn_var5": float("nan")})
        w.write("evicted", 4.0, "b1")
        w.write("accessed", 9.0, "b0", "r2", {"depth": 0})
        w.write("freed", 12.5, "b0")
    s = read_stratum_log(path)
    assert s.block.tolist() == [0, 1, 0] and s.request.tolist() == [0, 0, 1]
    assert s.t_ms.tolist() == [1.0, 1.0, 9.0] and s.t_end_ms == 12.5
    assert s.depth.tolist() == [0, 1, 0]
    assert s.fill[1] == 0.25 and math.isnan(s.fill[2])
    seed0 = dict(zip(SEED_FEATURES, s.seed[0]))
    assert seed0["kv_hbm_frac"] == 0.5 and seed0["queue_wait_ms"] == 2 and math.isnan(seed0["attn_var5"])
    with pytest.raises(ValueError, match="unknown features"):
        StratumEventLogWriter(str(tmp_path / "x.jsonl")).write("accessed", 0, "b", "r", {"dept": 1})


@pytest.mark.parametrize("line, message", [
    ({"event": "touched", "timestamp_ms": 1, "block_id": "b"}, "'event' must be one of"),
    ({"event": "accessed", "timestamp_ms": "soon", "block_id": "b"}, "'timestamp_ms'"),
    ({"event": "accessed", "timestamp_ms": 1, "block_id": 1.5}, "'block_id'"),
    ({"event": "accessed", "timestamp_ms": 1, "block_id": "b", "features": {"depth": 0}}, "needs 'request_id'"),
    ({"event": "accessed", "timestamp_ms": 1, "block_id": "b", "request_id": "r"}, "needs features.depth"),
    ({"event": "accessed", "timestamp_ms": 1, "block_id": "b", "request_id": "r",
      "features": {"depth": 0, "colour": 3}}, "unknown feature 'colour'"),
    ({"event": "accessed", "timestamp_ms": 1, "block_id": "b", "request_id": "r",
      "features": {"depth": 0, "fill": "full"}}, "feature 'fill' must be"),
])
def test_event_log_malformed_line(tmp_path, line, message):
    ok = {"event": "evicted", "timestamp_ms": 0, "block_id": "a"}
    p = write(tmp_path / "log.jsonl", [ok, line])
    with pytest.raises(TraceFormatError) as e:
        read_stratum_log(p)
    assert str(e.value).startswith(f"{p}:2: ") and message in str(e.value)


def test_timeline_shares_ids_and_checks_time_across_files(tmp_path):
    a = write(tmp_path / "a.jsonl", [{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}])
    b = write(tmp_path / "b.jsonl", [{"timestamp": 10, "input_length": 600, "output_length": 1, "hash_ids": [1, 3]}])
    s = read_timeline([a, b], "mooncake")
    assert s.block.tolist() == [0, 1, 0, 2] and s.file_starts == [0, 2]
    with pytest.raises(TraceFormatError, match=r"a.jsonl:1: timestamp goes back in time across files"):
        read_timeline([b, a], "mooncake")
