"""Shifted workloads: deterministic, readable as traces, and each transformation does what it says."""
import json

import numpy as np

from training import shift
from training.shift import ShiftSpec, derive
from training.synthetic import conversation_trace, write_jsonl
from training.traces import read_mooncake


def test_same_seed_same_workload_and_each_shift_holds(tmp_path):
    recs = conversation_trace(300, seed=1)
    spec = ShiftSpec(rate=2.0, system_prompts=4, system_blocks=3, mix=0.5, seed=7)
    a, b = derive(recs, spec), derive(recs, spec)
    assert a == b and a != derive(recs, ShiftSpec(**{**spec.__dict__, "seed": 8}))
    # rate: the span halves.
    fast = derive(recs, ShiftSpec(rate=2.0))
    span = lambda rs: rs[-1]["timestamp"] - rs[0]["timestamp"]
    assert abs(span(fast) - span(recs) / 2) <= 1
    # sharing: every request starts with one of the 4 three-block prompts, a conversation keeps its own.
    shared = derive(recs, ShiftSpec(system_prompts=4, system_blocks=3, seed=7))
    heads = {tuple(r["hash_ids"][:3]) for r in shared}
    assert 1 < len(heads) <= 4
    by_conv = {}
    for r in shared:
        if len(r["hash_ids"]) > 3:
            by_conv.setdefault(r["hash_ids"][3], set()).add(tuple(r["hash_ids"][:3]))
    assert all(len(v) == 1 for v in by_conv.values())
    # mix: half as many synthetic requests again, in time order.
    assert len(derive(recs, ShiftSpec(mix=0.5))) == 450
    assert all(x["timestamp"] <= y["timestamp"] for x, y in zip(a, a[1:]))
    # The result is a valid Mooncake trace (lengths match the block counts).
    path = str(tmp_path / "s.jsonl")
    write_jsonl(path, a)
    assert read_mooncake(path).num_events == sum(len(r["hash_ids"]) for r in a)


def test_cli_writes_the_same_file_twice_and_refuses_bad_specs(tmp_path, capsys):
    src = str(tmp_path / "in.jsonl")
    write_jsonl(src, conversation_trace(100, seed=2))
    outs = [str(tmp_path / f"o{i}.jsonl") for i in range(2)]
    for o in outs:
        assert shift.main(["--trace", src, "--out", o, "--rate", "3", "--mix", "0.2", "--seed", "1"]) == 0
    assert open(outs[0]).read() == open(outs[1]).read()
    assert shift.main(["--trace", src, "--out", outs[0], "--rate", "0"]) == 2
    assert "rate must be > 0" in capsys.readouterr().err
