"""The pure parts of benchmarks/serving.py: prompts from hash ids, arrival scaling, percentiles and goodput.

No server is started here (the benchmark's own smoke run does that; it is too slow for CI).
"""
import importlib
import json

import numpy as np
import pytest

from benchmark_module import forget, load_benchmark


@pytest.fixture(scope="module")
def bench():
    # Under another name: "serving" is also the gRPC package's name.
    yield load_benchmark("serving.py", "serving_bench")
    forget("serving_bench")


# The replay's pure parts, each in its own module beside benchmarks/serving.py (which puts the repo on sys.path).
def _module_fixture(name):
    @pytest.fixture(scope="module", name=name)
    def module(bench):
        return importlib.import_module(f"benchmarks.{name}")
    return module


serving_trace, serving_stats, serving_prometheus, serving_report = map(
    _module_fixture, ("serving_trace", "serving_stats", "serving_prometheus", "serving_report"))


def test_the_serving_package_still_imports_after_loading_the_benchmark(bench):
    from serving.proto.stratum.v1 import stratum_pb2
    assert stratum_pb2.DESCRIPTOR.services_by_name["Stratum"] is not None


def test_shared_hash_ids_give_a_shared_prefix_and_lengths_match(serving_trace):
    block = 7
    a = serving_trace.build_prompt([0, 1, 2, 3], 25, block, "s", request_key=1)
    b = serving_trace.build_prompt([0, 1, 9, 3], 26, block, "s", request_key=2)
    assert (len(a), len(b)) == (25, 26)
    assert a[: 2 * block] == b[: 2 * block]                 # ids 0, 1 shared
    assert a[2 * block: 3 * block] != b[2 * block: 3 * block]   # id 2 vs 9
    # The same id gives the same block wherever it appears, and a prompt is a prefix of its longer self.
    tail = a[3 * block:] + serving_trace.block_text("s", 3, block)[4:]
    assert serving_trace.build_prompt([3], block, block, "s", 0) == tail
    assert serving_trace.build_prompt([0, 1, 2, 3], 10, block, "s", 1) == a[:10]


def test_salt_changes_every_block(serving_trace):
    assert serving_trace.block_text("rate0", 5, 64) != serving_trace.block_text("rate1", 5, 64)
    assert serving_trace.block_text("rate0", 5, 64) == serving_trace.block_text("rate0", 5, 64)
    assert serving_trace.block_text("rate0", 5, 64).isascii()


def test_too_few_blocks_are_filled_with_text_unique_to_the_request(serving_trace):
    a = serving_trace.build_prompt([0], 20, 8, "s", request_key=1)
    b = serving_trace.build_prompt([0], 20, 8, "s", request_key=2)
    assert len(a) == len(b) == 20 and a[:8] == b[:8] and a[8:] != b[8:]


def test_scaled_lengths_scale_then_clip_to_the_context(serving_trace):
    shape = serving_trace.Shape(length_scale=0.5, block_tokens=256, bytes_per_token=1.0, template_tokens=10,
                                max_context=1000, max_tokens_cap=100)
    r = serving_trace.TraceRequest(0, 0, input_length=600, output_length=80, hash_ids=(0, 1))
    assert serving_trace.scaled_lengths(r, shape) == (300, 40, False)
    long = serving_trace.TraceRequest(1, 0, input_length=3000, output_length=500, hash_ids=(0,) * 6)
    n_in, n_out, clipped = serving_trace.scaled_lengths(long, shape)
    assert (n_out, n_in, clipped) == (100, 900, True)       # the cap, then the context left over


def test_prompt_text_has_the_target_tokens_less_the_template(serving_trace):
    shape = serving_trace.Shape(length_scale=0.1, block_tokens=52, bytes_per_token=2.0, template_tokens=12,
                                max_context=4096, max_tokens_cap=256)
    r = serving_trace.TraceRequest(3, 0, input_length=6758, output_length=500, hash_ids=tuple(range(14)))
    text, n_in, n_out, _ = serving_trace.prompt_for(r, shape, "s")
    assert (n_in, n_out) == (676, 50)
    assert len(text) == (676 - 12) * 2
    assert text[:104] == serving_trace.block_text("s", 0, 104)


def test_arrivals_are_compressed_by_the_rate(serving_trace):
    ts = [1000, 1000, 3000, 9000]
    assert serving_trace.arrival_offsets(ts, 1) == [0.0, 0.0, 2.0, 8.0]
    assert serving_trace.arrival_offsets(ts, 4) == [0.0, 0.0, 0.5, 2.0]
    with pytest.raises(ValueError, match="rate"):
        serving_trace.arrival_offsets(ts, 0)


def test_slot_arrivals_spread_each_timestamp_over_its_slot_the_same_way_for_every_config(serving_trace):
    ts = [0] * 40 + [3000] * 40
    spread = serving_trace.arrival_offsets(ts, 2, slot_ms=3000, keys=range(80), salt="rate1")
    first, second = np.array(spread[:40]), np.array(spread[40:])
    # Each request stays inside its own slot, compressed by the rate (3 s slots at 2x: 1.5 s wide) ...
    assert first.min() >= 0 and first.max() < 1.5 and second.min() >= 1.5 and second.max() < 3.0
    # ... and is spread across it, not stacked at its start (40 uniform draws: the chance that all 40 fall in
    # one half of a slot is 2 * 2**-40).
    assert (first < 0.75).any() and (first >= 0.75).any() and len(set(spread)) == 80
    # Deterministic per (salt, key): a second config replaying this rate gets the same arrivals; another
    # rate's salt gets others; keys follow the request, not its position in the list.
    assert serving_trace.arrival_offsets(ts, 2, slot_ms=3000, keys=range(80), salt="rate1") == spread
    assert serving_trace.arrival_offsets(ts, 2, slot_ms=3000, keys=range(80), salt="rate2") != spread
    assert serving_trace.arrival_offsets(ts[1:2], 2, slot_ms=3000, keys=[1], salt="rate1") == [spread[1]]
    # burst: a slot's requests at one instant
    assert serving_trace.arrival_offsets(ts, 2) == [0.0] * 40 + [1.5] * 40
    with pytest.raises(ValueError, match="slot"):
        serving_trace.arrival_offsets(ts, 2, slot_ms=-1)


def test_the_shared_trace_is_stamped_in_three_second_slots(bench, serving_trace):
    if not bench.TRACE.exists():
        pytest.skip(f"{bench.TRACE} is not here")
    window = serving_trace.load_trace(bench.TRACE, 0, 500)
    assert serving_trace.trace_slot_ms([r.timestamp_ms for r in window]) == pytest.approx(3000, abs=3)
    assert serving_trace.trace_slot_ms([5, 5, 5]) is None
    assert serving_trace.trace_slot_ms([0, 0, 100, 200, 400]) == 100


def test_plan_orders_by_arrival_and_keeps_trace_indices(bench, serving_trace, serving_stats, tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": t, "input_length": 600, "output_length": 20, "hash_ids": [0, i]}
            for i, t in enumerate([500, 100, 900, 100])]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    window = serving_trace.load_trace(trace, 1, 3)
    assert [r.index for r in window] == [1, 2, 3]
    shape = serving_trace.Shape(1.0, 512, 1.0, 5, 4096, 256)
    planned, clipped = bench.plan(window, shape, 2, "s")
    assert [p.result.index for p in planned] == [1, 3, 2] and clipped == 0
    assert [p.result.arrival_s for p in planned] == [0.0, 0.0, 0.4]
    with pytest.raises(ValueError, match="past its end"):
        serving_trace.load_trace(trace, 2, 5)
    spread, _ = bench.plan(window, shape, 2, "s", slot_ms=400)
    arrivals = [p.result.arrival_s for p in spread]
    assert arrivals == sorted(arrivals) and 0.4 <= dict(zip([p.result.index for p in spread], arrivals))[2] < 0.6


def _result(serving_stats, ttft, step, n, status="OK"):
    times = [ttft + i * step for i in range(n)]
    return serving_stats.RequestResult(0, 0.0, 10, n, status=status, output_tokens=n, token_times=times,
                                       prompt_tokens=10, send_lag_s=0.0)


def test_percentiles_and_goodput_on_hand_made_timings(serving_stats):
    rs = [_result(serving_stats, 0.2, 0.02, 11),      # good
          _result(serving_stats, 0.5, 0.04, 6),       # good
          _result(serving_stats, 1.5, 0.01, 5),       # TTFT over 1 s
          _result(serving_stats, 0.3, 0.08, 3),       # TPOT over 50 ms
          _result(serving_stats, 0.9, 0.0, 1),        # one token: no TPOT, TTFT fine -> good
          _result(serving_stats, 0.1, 0.01, 4, status="UNAVAILABLE")]
    s = serving_stats.summarize(rs, duration_s=2.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert (s["requests"], s["finished"], s["failed"]) == (6, 5, 1)
    assert s["failed_by_status"] == {"UNAVAILABLE": 1}
    assert s["good_requests"] == 3 and s["goodput_rps"] == 1.5
    ttfts = np.array([0.2, 0.5, 1.5, 0.3, 0.9])
    for q in (50, 95, 99):
        assert s["ttft_ms"][f"p{q}"] == pytest.approx(np.percentile(ttfts, q) * 1e3, abs=1e-3)
    assert s["tpot_ms"]["p50"] == pytest.approx(np.percentile([0.02, 0.04, 0.01, 0.08], 50) * 1e3, abs=1e-3)
    assert s["itl_ms"]["p99"] == pytest.approx(np.percentile([0.02] * 10 + [0.04] * 5 + [0.01] * 4 + [0.08] * 2, 99)
                                               * 1e3, abs=1e-3)
    assert s["output_tokens"] == 11 + 6 + 5 + 3 + 1
    assert s["output_tokens_per_s"] == pytest.approx(26 / 2.0)
    assert s["input_tokens_per_s"] == pytest.approx(50 / 2.0)


def test_tpot_counts_tokens_not_deltas(serving_stats):
    r = serving_stats.RequestResult(0, 0.0, 10, 5, status="OK", output_tokens=5, token_times=[0.1, 0.3])
    assert r.tpot_s == pytest.approx(0.05)
    assert serving_stats.percentiles_ms([]) is None


def test_histogram_diff_and_missing_metrics(serving_stats, serving_prometheus):
    text = ('# TYPE stratum_gpu_idle_ms histogram\n'
            'stratum_gpu_idle_ms_bucket{le="1.0"} 3\nstratum_gpu_idle_ms_bucket{le="+Inf"} 5\n'
            'stratum_gpu_idle_ms_sum 7.5\nstratum_gpu_idle_ms_count 5\n')
    later = text.replace("} 3", "} 4").replace("} 5", "} 9").replace("7.5", "20").replace("count 5", "count 9")
    before, after = serving_prometheus.parse_metrics(text), serving_prometheus.parse_metrics(later)
    d = serving_stats.histogram_diff(serving_prometheus.histogram(before, "stratum_gpu_idle_ms"),
                                     serving_prometheus.histogram(after, "stratum_gpu_idle_ms"))
    assert d == {"buckets": {"1.0": 1, "+Inf": 4}, "sum": 12.5, "count": 4}
    assert serving_prometheus.counter_total(after, "stratum_jit_compilations_total") is None


def test_configs_parse_and_own_flags_are_refused(bench):
    assert bench.parse_configs("hab=--scheduler hab;fcfs=--scheduler fcfs") == [
        ("hab", ["--scheduler", "hab"]), ("fcfs", ["--scheduler", "fcfs"])]
    assert bench.parse_configs("a=;b=") == [("a", []), ("b", [])]
    for bad in ("noequals", "a=;a=", ""):
        with pytest.raises(ValueError, match="configs"):
            bench.parse_configs(bad)
    with pytest.raises(ValueError, match="--host"):
        bench.check_server_flags(["--host", "0.0.0.0"])


def test_saturation_figures_count_only_intervals_with_requests_queued(serving_prometheus):
    # [t_s, idle fraction, queue length, running, prefill tokens total]
    rows = [[0.0, 0.9, 0, 0, 0], [0.5, 0.2, 3, 8, 1000],      # queue fills: the interval before is not counted
            [1.0, 0.0, 5, 8, 6000], [1.5, 0.1, 2, 8, 9000],  # two queued intervals: 8000 tokens in 1 s
            [2.0, 0.8, 0, 4, 9500], [2.5, None, 1, 4, None]]
    out = serving_prometheus.while_queued(rows)
    assert out == {"queued_seconds": 1.0, "gpu_idle_fraction_while_queued": 0.05,
                   "prefill_tokens_per_s_while_queued": 8000.0}
    assert serving_prometheus.while_queued(rows[:1] + rows[4:]) == {
        "queued_seconds": 0.0, "gpu_idle_fraction_while_queued": None, "prefill_tokens_per_s_while_queued": None}


def test_utilization_counts_only_samples_with_requests_running(serving_prometheus):
    # [t_s, idle, queue, running, prefill total, HBM utilization, compute utilization]
    rows = [[0.0, 0.9, 0, 0, 0, 0.9, 0.9],          # idle: the gauges still show the last steps' figures
            [0.5, 0.1, 2, 8, 100, 0.5, 0.1], [1.0, 0.1, 0, 4, 200, 0.7, 0.3]]
    out = serving_prometheus.utilization_while_running(rows)
    assert out["hbm_bandwidth_utilization_while_running"]["p50"] == pytest.approx(0.6)
    assert out["gpu_compute_utilization_while_running"]["n"] == 2
    assert serving_prometheus.utilization_while_running(rows[:1])["hbm_bandwidth_utilization_while_running"] is None


def test_hab_is_compared_at_the_highest_rate_where_fcfs_holds_half(serving_report):
    def rate(good, goodput, n=10):
        return {"requests": n, "good_requests": good, "goodput_rps": goodput}
    report = {"configs": [
        {"name": "hab", "rates": {"1": rate(10, 2.0), "2": rate(9, 3.0), "3": rate(8, 3.6), "4": rate(6, 2.4)}},
        {"name": "fcfs", "rates": {"1": rate(10, 2.0), "2": rate(8, 2.5), "3": rate(5, 3.0), "4": rate(4, 1.0),
                                   "8": {"skipped": "the --run-timeout passed"}}},
        {"name": "ds2", "rates": {"1": rate(10, 2.1)}}]}
    cmp = serving_report.compare_at_fcfs_capacity(report)
    # 3x: exactly half met (5 of 10) still counts; 4x (4 of 10) does not; the skipped rate is ignored.
    assert cmp["rate"] == 3.0 and cmp["baseline_good_fraction"] == 0.5
    assert cmp["goodput_ratio"] == {"hab": 1.2, "ds2": None}
    assert cmp["rates_tried"] == [1.0, 2.0, 3.0, 4.0]
    report["configs"][1]["rates"] = {"1": rate(4, 1.0)}
    assert serving_report.compare_at_fcfs_capacity(report) is None           # fcfs never held half
    assert serving_report.compare_at_fcfs_capacity({"configs": report["configs"][:1]}) is None   # no fcfs run


def test_slot_arrivals_need_a_slot_width_when_the_window_has_one_timestamp(bench, tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 700, "input_length": 60, "output_length": 2,
                                           "hash_ids": [i]}) for i in range(3)) + "\n")
    with pytest.raises(SystemExit):
        bench.main(["--trace", str(trace), "--num-requests", "3", "--out-prefix", "never_written"])
    assert "--arrival-slot-ms" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--trace", str(trace), "--num-requests", "3", "--arrival-slot-ms", "-5"])
    assert not (bench.RESULTS / "never_written.json").exists()


def test_figures_per_stack_and_metered_cost_per_1k_output_tokens(serving_stats, serving_prometheus):
    """A two-stack replay's summary splits by the stack each reply named, and prices output tokens from the
    metered usage on the replies; histograms sum over the stacks' series."""
    def done(stack, usd, tokens, ttft_s):
        r = serving_stats.RequestResult(0, 0.0, 10, tokens, status="OK", output_tokens=tokens, stack=stack,
                                        metered_usd=usd)
        r.token_times = [ttft_s + 0.01 * i for i in range(tokens)]
        return r
    results = [done("stratum", 2e-6, 4, 0.1), done("baseline", 6e-6, 4, 2.0), done("baseline", 2e-6, 2, 0.2)]
    s = serving_stats.summarize(results, 10.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert s["metered_usd_per_1k_output_tokens"] == pytest.approx(1e3 * 10e-6 / 10)
    assert s["by_stack"]["stratum"]["metered_usd_per_1k_output_tokens"] == pytest.approx(1e3 * 2e-6 / 4)
    assert s["by_stack"]["baseline"]["finished"] == 2 and s["by_stack"]["baseline"]["goodput_rps"] == 0.1
    text = ('# TYPE stratum_gpu_idle_ms histogram\n'
            'stratum_gpu_idle_ms_bucket{stack="stratum",le="1.0"} 3\nstratum_gpu_idle_ms_bucket{stack="stratum",le="+Inf"} 5\n'
            'stratum_gpu_idle_ms_bucket{stack="baseline",le="1.0"} 1\nstratum_gpu_idle_ms_bucket{stack="baseline",le="+Inf"} 2\n'
            'stratum_gpu_idle_ms_sum{stack="stratum"} 7.5\nstratum_gpu_idle_ms_count{stack="stratum"} 5\n'
            'stratum_gpu_idle_ms_sum{stack="baseline"} 1.5\nstratum_gpu_idle_ms_count{stack="baseline"} 2\n')
    h = serving_prometheus.histogram(serving_prometheus.parse_metrics(text), "stratum_gpu_idle_ms")
    assert h == {"buckets": {"1.0": 4.0, "+Inf": 7.0}, "sum": 9.0, "count": 7.0}


def test_cost_figures_compare_each_bill_with_its_own_stacks_estimate_term_by_term(bench, serving_stats):
    """cost_figures prices the first finished requests with CostEstimate and keeps, per request, its metered
    breakdown beside its own stack's estimate, so a gap can be traced to a rate; the per-request table carries
    the stack and the metered cost."""
    import asyncio
    import types

    def breakdown(stack, cost, batch):
        return types.SimpleNamespace(stack=stack, cost_usd=cost, compute_seconds=cost * 100,
                                     estimated_compute_seconds=cost * 10, decode_step_ms=2.0,
                                     prefill_tokens_per_s=1e5, decode_batch=batch, prefill_batch=1.0,
                                     billed_input_tokens=10, billed_output_tokens=4)

    class Stub:
        async def CostEstimate(self, request, timeout):
            return types.SimpleNamespace(stacks=[breakdown("stratum", 2e-6, 8.0), breakdown("baseline", 4e-6, 4.0)])

    pb = types.SimpleNamespace(CostEstimateRequest=lambda **kw: types.SimpleNamespace(**kw),
                               Message=lambda **kw: kw)
    planned = []
    for i, (stack, usd) in enumerate([("stratum", 1e-6), ("baseline", 5e-6), (None, None)]):
        r = serving_stats.RequestResult(i, 0.0, 10, 4, status="OK", output_tokens=4, stack=stack, metered_usd=usd,
                                        metered=bench.breakdown_rates(breakdown(stack, usd, 16.0)) if usd else None)
        planned.append(bench.Planned(r, f"prompt {i}"))
    c = asyncio.run(bench.cost_figures(Stub(), pb, planned, samples=8))
    assert c["requests"] == 2                      # the unbilled one is left out
    assert c["metered_vs_estimated"]["mean"] == pytest.approx(((1 - 2) / 2 + (5 - 4) / 4) / 2)
    first, second = c["per_request"]
    assert (first["index"], first["stack"], second["stack"]) == (0, "stratum", "baseline")
    assert first["metered"]["decode_batch"] == 16.0 and first["estimated"]["decode_batch"] == 8.0
    assert second["estimated"]["cost_usd"] == pytest.approx(4e-6)
    table = bench.per_request_table([p.result for p in planned])
    rows = [dict(zip(table["fields"], row)) for row in table["rows"]]
    assert rows[0]["stack"] == "stratum" and rows[0]["metered_usd"] == 1e-6
    assert rows[0]["metered_compute_s"] == pytest.approx(1e-4) and rows[2]["metered_decode_batch"] is None
