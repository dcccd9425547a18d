"""benchmarks/tp_profile_split.py: GPU kernel time inside the profiled decode calls, split into compute and
communication per decode step (synthetic GPU traces), and benchmarks/e2e_decode.py's profile (a real CPU
trace): one annotation per traced call, each a full-batch decode call, as its window file says."""
import gzip
import json
import pathlib

import pytest

from benchmark_module import load_benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tps():
    return load_benchmark("tp_profile_split.py", "tp_profile_split")


META = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]


def test_collectives_count_as_communication_and_overlap_once_in_busy_time(tps):
    kernels = [{"ph": "X", "pid": 1, "name": "fusion.3", "ts": 0, "dur": 10},
               {"ph": "X", "pid": 1, "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 5, "dur": 10},
               {"ph": "X", "pid": 1, "name": "all-gather-start.1", "ts": 30, "dur": 2},
               {"ph": "X", "pid": 2, "name": "all-reduce on the host", "ts": 0, "dur": 99}]
    got = tps.split(META + kernels)
    assert list(got) == ["/device:GPU:0"]
    assert got["/device:GPU:0"] == {"compute_us": 10.0, "communication_us": 12.0, "busy_us": 17.0}


def _decode_trace(prefill_us: float) -> list[dict]:
    """A prefill call (`prefill_us` of kernels, outside any annotation), then two annotated decode calls
    of 4 steps, each 100 us of compute and 20 us of all-reduce on GPU 0, with an "XLA Ops" summary line
    repeating the kernels (as some converters add)."""
    events = META + [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #7(Kernels)"}},
                     {"ph": "M", "name": "thread_name", "pid": 1, "tid": 9, "args": {"name": "XLA Ops"}},
                     {"ph": "X", "pid": 1, "tid": 7, "name": "prefill_fusion", "ts": 0, "dur": prefill_us}]
    for start in (10_000, 20_000):
        events += [{"ph": "X", "pid": 2, "tid": 1, "name": "e2e_decode_call", "ts": start, "dur": 500},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "fusion", "ts": start + 50, "dur": 100},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "all-reduce-start", "ts": start + 150, "dur": 20},
                   {"ph": "X", "pid": 1, "tid": 9, "name": "fusion", "ts": start + 50, "dur": 100}]
    return events


WINDOW = {"annotation": "e2e_decode_call", "calls": [{"kind": "decode", "steps": 4, "seconds": 0.0008}] * 2}


def test_per_step_counts_only_the_decode_calls_and_divides_by_their_steps(tps):
    got = tps.per_step(_decode_trace(prefill_us=5_000), WINDOW)
    assert got["steps"] == 8 and got["calls"] == 2
    assert got["wall_ms_per_step_median"] == pytest.approx(0.2)
    # 2 x (100 + 20) us over 8 steps: the prefill's 5 ms and the summary line's repeats stay out.
    assert got["per_step"]["/device:GPU:0"] == pytest.approx(
        {"compute_ms_per_step": 0.025, "communication_ms_per_step": 0.005, "busy_ms_per_step": 0.030})
    # The whole trace, as the split was read before (no window): the prefill counts.
    assert tps.split(_decode_trace(prefill_us=5_000))["/device:GPU:0"]["compute_us"] == 5_200


def test_a_kernel_crossing_the_window_edge_counts_only_inside(tps):
    events = META + [{"ph": "X", "pid": 1, "name": "fusion", "ts": 90, "dur": 20}]
    assert tps.split(events, [(100, 200)])["/device:GPU:0"]["compute_us"] == 10.0


@pytest.mark.parametrize("window, message", [
    ({**WINDOW, "calls": WINDOW["calls"][:1]}, "1 calls in decode_window.json"),
    ({**WINDOW, "calls": [{"kind": "prefill", "steps": 1, "seconds": 0.1}, WINDOW["calls"][0]]},
     "not all decode calls"),
])
def test_a_window_that_does_not_fit_the_trace_is_refused(tps, window, message):
    with pytest.raises(ValueError, match=message):
        tps.per_step(_decode_trace(prefill_us=10), window)


def test_command_line_reads_the_trace_and_window_file_and_writes_the_split(tps, tmp_path, capsys):
    run = tmp_path / "plugins" / "profile" / "run1"
    run.mkdir(parents=True)
    with gzip.open(run / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": _decode_trace(prefill_us=5_000)}, f)
    assert tps.main([str(tmp_path)]) == 2                      # no window file: refused, saying why
    assert "no decode_window.json" in capsys.readouterr().err
    (tmp_path / tps.WINDOW_FILE).write_text(json.dumps(WINDOW))
    assert tps.main([str(tmp_path), "--out", str(tmp_path / "split.json")]) == 0
    written = json.loads((tmp_path / "split.json").read_text())
    assert written["steps"] == 8
    assert written["per_step"]["/device:GPU:0"]["busy_ms_per_step"] == pytest.approx(0.030)


def test_e2e_decode_profile_annotates_each_traced_full_batch_decode_call(tps, tmp_path, monkeypatch):
    """A real (CPU) profile from e2e_decode.py: the trace holds one annotation per call of its window file,
    every traced call is a decode call of the whole batch, and the calls sit around the timed pass's median
    context."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))        # e2e_decode imports tp_profile_split
    e2e = load_benchmark("e2e_decode.py", "e2e_decode")
    prof = tmp_path / "prof"
    assert e2e.main(["--model", "tiny", "--batch", "2", "--prompt-len", "16", "--new-tokens", "40",
                     "--decode-steps", "4", "--copy-gb", "0.01", "--out", str(tmp_path / "e.json"),
                     "--profile-dir", str(prof), "--profile-calls", "3"]) == 0
    window = json.loads((prof / tps.WINDOW_FILE).read_text())
    assert [(c["kind"], c["steps"]) for c in window["calls"]] == [("decode", 4)] * 3
    # The traced calls straddle the timed pass's median context (16 + 40 / 2): the first starts within one call of
    # 16 + (40 - 3 x 4) / 2 = 30, so their 12 steps span ~30-42.
    assert 30 <= window["calls"][0]["mean_context"] < 30 + 4
    trace, = prof.rglob("perfetto_trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    spans = tps.annotation_windows(events, window["annotation"])
    assert len(spans) == 3 and all(b > a for a, b in spans)
    # The calls' executions run inside their annotations.
    runs = [float(e["ts"]) for e in events if e.get("ph") == "X" and e.get("name", "").startswith("PjitFunction")]
    assert sum(any(a <= t <= b for a, b in spans) for t in runs) >= 3


@pytest.mark.parametrize("untimed", ["no decode call", "every other decode call", "every decode call"])
def test_e2e_decode_leaves_untimed_steps_out_of_its_rates(monkeypatch, tmp_path, untimed):
    """A step the engine could not time carries 0 s (engine_stats.record_timing). e2e_decode.py leaves such steps
    out of its rates and medians and counts them: with some decode calls untimed the rates stay positive and
    finite; with all of them untimed the decode rates are NaN instead of a division by zero. Every decode call's
    timing is set here: missed, or a fixed 2 ms (on a CPU the engine itself misses a step that finished before
    it was collected, at random, so the real timings would make this test depend on the machine's load); every
    packed step's is a fixed 3 ms, for the same reason. With none missed, the timed calls are exactly the pass's."""
    import math
    from stratum_jax.engine_stats import StepRecorder
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    e2e = load_benchmark("e2e_decode.py", "e2e_decode")
    real, seen = StepRecorder.record_timing, []

    def record(self, batch, device_s, work=None):
        if batch.kind == "decode":
            seen.append(batch)
            device_s = (2e-3 if untimed == "no decode call" else
                        0.0 if untimed == "every decode call" or len(seen) % 2 else 2e-3)
        else:
            device_s = 3e-3
        return real(self, batch, device_s, work)
    monkeypatch.setattr(StepRecorder, "record_timing", record)
    out = tmp_path / "e.json"
    assert e2e.main(["--model", "tiny", "--batch", "2", "--prompt-len", "16", "--new-tokens", "24",
                     "--decode-steps", "2", "--copy-gb", "0.01", "--out", str(out)]) == 0
    r, = json.loads(out.read_text())
    assert seen and (r["untimed_steps"] > 0) == (untimed != "no decode call")   # (seen: the warm-up's calls too)
    if untimed == "every decode call":
        assert math.isnan(r["decode_tokens_per_s"]) and math.isnan(r["decode_step_ms_median"])
        assert math.isnan(r["decode_tokens_per_s_full_batch"])
        assert r["decode_calls"] == []
    # The prefill rate is the listed packed steps' prompt tokens over their time.
    packed = r["prefill_calls"]
    assert packed and all(c["ms"] > 0 and c["kind"] in ("prefill", "mixed") for c in packed)
    assert sum(c["prefill_tokens"] for c in packed) == r["prefill_tokens"]
    assert math.isclose(sum(c["ms"] for c in packed), r["prefill_seconds"] * 1e3)
    assert all(c["ms"] == pytest.approx(3.0) for c in packed)
    # The wall-clock prefill figure counts every prompt token of the timed pass (2 prompts of 16, no prefix shared
    # with the warm-up's), timed or not, over a window inside the pass.
    assert r["prefill_wall_tokens"] == 2 * 16
    assert 0 < r["prefill_wall_seconds"] <= r["wall_seconds"]
    # Only steps of the timed pass are counted: the warm-up's last decode call (still engine.last_step when the
    # pass's first step() only dispatches) is not. Timed, the pass's decode calls hold 2 x 23 tokens (the first
    # of each request's 24 comes from its prefill step); the warm-up's call counted too made it 48.
    if untimed == "no decode call":
        assert sum(c["tokens"] for c in r["decode_calls"]) == 2 * 23
    if untimed != "every decode call":
        assert r["decode_tokens_per_s"] > 0 and r["decode_step_ms_median"] > 0
        # The rate is the listed timed calls' tokens over their time (none of them an untimed 0).
        calls = r["decode_calls"]
        assert calls and all(c["ms"] > 0 for c in calls)
        assert math.isclose(r["decode_tokens_per_s"], sum(c["tokens"] for c in calls) / sum(c["ms"] for c in calls) * 1e3)
        # The full-batch rate: only the calls in which all --batch rows decoded.
        full = [c for c in calls if c["seqs"] == 2]
        assert full and math.isclose(r["decode_tokens_per_s_full_batch"],
                                     sum(c["tokens"] for c in full) / sum(c["ms"] for c in full) * 1e3)
