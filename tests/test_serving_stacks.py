"""The baseline stack in the same server (issue #13): the x-stratum-weight split, long-context routing with
the prompt-length entropy, and cost estimates and metered usage per stack.

Units first (no model), then one module-scoped server on loopback (`tiny`, three pools over one copy of the
weights) that the end-to-end tests share.
"""
from __future__ import annotations

import dataclasses
import math
import random
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import cost
from serving.background import BackgroundServer
from serving.headers import parse_headers
from serving.options import ServerOptions
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from serving.routing import (PromptLengthEntropy, Router, entropy_bits, goes_to_stratum, length_bin,
                             split_point)
from serving.stacks import BASELINE_PAGE_SIZE, baseline_config, long_context_config, parse_stacks
from stratum_jax.config import RuntimeConfig
from stratum_jax.request import InvalidRequestError


# ---- the split ----

@pytest.mark.parametrize("weight", [0.1, 0.5, 0.9])
def test_split_share_is_within_3_percent_of_the_weight_over_2000_requests(weight):
    share = sum(goes_to_stratum(f"req-{i}", weight) for i in range(2000)) / 2000
    assert abs(share - weight) <= 0.03


def test_split_is_deterministic_per_key_and_total_at_the_ends():
    for key in ("a", "session-42", "0f" * 16):
        u = split_point(key)
        assert 0.0 <= u < 1.0 and split_point(key) == u          # a retry lands where the first try did
        assert goes_to_stratum(key, 1.0) and not goes_to_stratum(key, 0.0)
        assert goes_to_stratum(key, 0.5) == (u < 0.5)
    # Monotone in w: a key on Stratum at w stays there at any larger w (a roll-out step moves keys one way).
    keys = [f"k{i}" for i in range(500)]
    at = {w: {k for k in keys if goes_to_stratum(k, w)} for w in (0.1, 0.5, 1.0)}
    assert at[0.1] <= at[0.5] <= at[1.0]


def test_session_header_is_read_and_checked():
    assert parse_headers([("x-stratum-session", "user-7")]).session == "user-7"
    assert parse_headers([]).session is None
    for bad in ("", "has space", "x" * 129):
        with pytest.raises(InvalidRequestError, match="x-stratum-session"):
            parse_headers([("x-stratum-session", bad)])


# ---- the entropy and the router ----

def test_entropy_on_hand_made_distributions():
    assert entropy_bits([]) == 0.0 and entropy_bits([5]) == 0.0
    assert entropy_bits([3, 3]) == pytest.approx(1.0)
    assert entropy_bits([1, 1, 1, 1]) == pytest.approx(2.0)
    assert entropy_bits([1] * 8) == pytest.approx(3.0)
    assert entropy_bits([2, 1, 1]) == pytest.approx(1.5)
    assert entropy_bits([1, 0, 1]) == pytest.approx(1.0)                    # empty bins add nothing
    p = [0.7, 0.2, 0.1]
    assert entropy_bits([70, 20, 10]) == pytest.approx(-sum(x * math.log2(x) for x in p))


def test_prompt_lengths_go_in_log2_bins_over_a_window():
    assert [length_bin(n) for n in (0, 1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 0, 1, 1, 2, 2, 3, 9, 10]
    h = PromptLengthEntropy(window=4)
    assert h.add(100) == 0.0
    h.add(120)                                      # same bin (64..127): still 0 bits
    assert h.bits() == 0.0
    h.add(1000)
    assert h.add(5000) == pytest.approx(1.5)        # bins {6: 2, 9: 1, 12: 1}
    h.add(5)                                        # the window drops the first 100
    assert h.bits() == pytest.approx(2.0)           # bins {6, 9, 12, 2}: one each


def _spread(router: Router, lengths) -> None:
    for n in lengths:
        router.decide("default", n, None)


def test_routing_follows_the_entropy_and_length_thresholds():
    router = Router(long_context=True, entropy_threshold_bits=2.1, long_prompt_tokens=1000, window=16)
    # One length class: entropy 0, below the threshold, so even a long prompt stays in the default pool.
    _spread(router, [200] * 15)
    d = router.decide("default", 4000, None)
    assert (d.route, d.reason) == ("default", "low_entropy") and d.entropy_bits < 2.1
    # Lengths over 8 log2 bins: 3 bits > 2.1, so requests are classified by length.
    _spread(router, [2 ** k for k in range(3, 11)] * 2)
    assert router.lengths.bits() > 2.1
    assert (router.decide("default", 999, None).route, router.decide("default", 1000, None).route) == \
        ("default", "long-context")
    assert router.decide("default", 5000, None).reason == "length"
    assert router.decide("default", 20, None).reason == "short"
    # The header wins whatever the entropy.
    assert router.decide("long-context", 10, None).reason == "header"
    # No long-context pool: everything stays.
    alone = Router(long_context=False, long_prompt_tokens=10, window=16)
    _spread(alone, [2 ** k for k in range(12)])
    assert alone.decide("default", 5000, None).route == "default"


def test_routing_by_regex_when_classifying():
    router = Router(long_context=True, entropy_threshold_bits=1.0, prompt_regex="contract|agreement|nda", window=8)
    _spread(router, [8, 64, 512, 4096])                       # 2 bits > 1.0
    assert router.decide("default", 30, "Review this NDA please").route == "long-context"
    assert router.decide("default", 30, "Review this poem").route == "default"
    assert router.decide("default", 30, None).route == "default"       # token-id prompts have no text


# ---- stacks and flags ----

def test_baseline_config_turns_the_four_pillars_off():
    config = RuntimeConfig(model="tiny", scheduler="hab", kv_precision="fp16-delta", kv_host_tokens=4096,
                           kv_pool_tokens=8192, max_batch_size=16)
    b = baseline_config(config)
    assert (b.scheduler, b.page_size, b.cache_policy, b.kv_precision, b.kv_host_tokens) == \
        ("fcfs", BASELINE_PAGE_SIZE, "lru", "bf16", 0)
    assert b.enable_prefix_caching and b.kv_pool_tokens == 8192 and b.max_batch_size == 16
    assert baseline_config(config, kv_pool_tokens=1024).kv_pool_tokens == 1024
    lc = long_context_config(config, page_size=256, max_context=4096, kv_pool_tokens=None)
    assert (lc.page_size, lc.max_context, lc.scheduler, lc.kv_precision) == (256, 4096, "hab", "fp16-delta")


def test_stack_flags_are_checked_with_a_message_naming_the_flag():
    assert parse_stacks("baseline, stratum") == ("stratum", "baseline")
    assert ServerOptions(stacks="stratum,baseline", stratum_weight=0.5).stacks == ("stratum", "baseline")
    for text in ("baseline", "stratum,fast", ""):
        with pytest.raises(ValueError, match="--stacks"):
            parse_stacks(text)
    cases = [(dict(stratum_weight=1.5, stacks="stratum,baseline"), "--stratum-weight"),
             (dict(stratum_weight=0.5), "add baseline to --stacks"),
             (dict(stacks="stratum,baseline", baseline_kv_pool_tokens=10, baseline_kv_memory_share=0.2),
              "give one"),
             (dict(baseline_kv_memory_share=1.5), "--baseline-kv-memory-share"),
             (dict(long_context_page_size=100), "--long-context-page-size"),
             (dict(route_regex="(unclosed"), "--route-regex"),
             (dict(route_long_prompt_tokens=100), "add long-context to --stacks"),
             (dict(route_entropy_bits=-1.0), "--route-entropy-bits")]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            ServerOptions(**kwargs)


def test_serve_cli_refuses_bad_stack_flags_naming_them(capsys):
    from stratum_jax.serve import main
    for argv, flag in ((["--stacks", "stratum,fast"], "--stacks"), (["--stratum-weight", "0.5"], "--stacks"),
                       (["--route-regex", "[", "--stacks", "stratum,long-context"], "--route-regex")):
        with pytest.raises(SystemExit) as e:
            main(["--model", "tiny", *argv])
        assert e.value.code == 2 and flag in capsys.readouterr().err


# ---- cost: estimate and metered usage ----

def test_estimate_and_metered_usage_agree_within_0_3_percent_over_1000_varied_requests():
    """The bill of a request that ran as estimated (no prefix-cache hit, ran to max_tokens) under each
    stack's own measured step times, against its estimate. The bill of one that stopped early or hit the
    cache is lower, never higher."""
    rng = random.Random(13)
    prices = cost.Prices()
    errors = []
    for _ in range(1000):
        p, m = rng.randint(1, 30000), rng.randint(1, 4096)
        measured = cost.Measured(decode_step_ms=rng.uniform(2, 60), prefill_tokens_per_s=rng.uniform(2e3, 6e4),
                                 decode_batch=rng.uniform(1, 64))
        kv, size = rng.choice([32768, 65536, 131072]), rng.randint(50, 200000)
        estimated = cost.estimate(p, m, size, kv, measured, prices).estimated_cost_usd
        metered = cost.meter(p, 0, m, size, kv, measured, prices).estimated_cost_usd
        errors.append(abs(metered - estimated) / estimated)
        cached, stopped = rng.randint(0, p), rng.randint(1, m)
        assert cost.meter(p, cached, stopped, size, kv, measured, prices).estimated_cost_usd <= estimated * (1 + 1e-12)
    assert sum(errors) / len(errors) <= 0.003


def test_metered_usage_bills_no_prefill_for_cached_tokens():
    prices = cost.Prices(gpu_usd_per_hour=3600.0, transfer_usd_per_gb=0.0, hbm_usd_per_gb_hour=0.0)
    measured = cost.Measured(decode_step_ms=10.0, prefill_tokens_per_s=1000.0, decode_batch=1.0)
    full = cost.meter(1000, 0, 10, 0, 2, measured, prices)
    half = cost.meter(1000, 500, 10, 0, 2, measured, prices)
    assert full.compute_seconds == pytest.approx(1.0 + 0.1) and half.compute_seconds == pytest.approx(0.5 + 0.1)


def test_a_bill_says_how_much_of_its_compute_was_charged_at_recent_rates():
    """RequestUsage.estimated_device_s (steps the engine could not time, billed at its recent rates) reaches the
    bill as estimated_compute_seconds, a part of compute_seconds."""
    from stratum_jax.request_usage import RequestUsage
    usage = RequestUsage(prefill_tokens=10, decode_tokens=4, prefill_device_s=0.2, decode_device_s=0.05,
                         prefill_step_s=0.2, decode_step_s=0.4, estimated_device_s=0.03)
    c = cost.bill(10, 0, 4, 100, 2, usage, cost.Prices())
    assert c.compute_seconds == pytest.approx(0.25) and c.estimated_compute_seconds == pytest.approx(0.03)
    assert cost.bill(10, 0, 4, 100, 2, RequestUsage(prefill_device_s=0.2), cost.Prices()).estimated_compute_seconds == 0


def test_default_prices_are_the_designs():
    p = cost.Prices()
    assert (p.gpu_usd_per_hour, p.transfer_usd_per_gb, p.hbm_usd_per_gb_hour) == (3.92, 0.01, 0.00012)


# ---- end to end: three pools in one server ----

# Small: each of the three engines compiles its own step shapes at start-up (the fixture's whole cost).
CONFIG = RuntimeConfig(model="tiny", max_batch_size=2, max_queue=64, max_context=256, max_tokens_cap=64,
                       prefill_chunk=32, kv_pool_tokens=2048, max_num_batched_tokens=64, decode_steps=1)
OPTIONS = dict(port=0, metrics_port=0, drain_grace_s=0.0, stacks="stratum,baseline,long-context",
               stratum_weight=0.5, long_context_page_size=64, long_context_max_context=512,
               long_context_kv_pool_tokens=2048, baseline_kv_pool_tokens=1024)


@dataclasses.dataclass
class Stacks:
    bg: BackgroundServer
    stub: pb_grpc.StratumStub


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    options = ServerOptions(profile_dir=str(tmp_path_factory.mktemp("stacks") / "profiles"), **OPTIONS)
    bg = BackgroundServer(CONFIG, options).start()
    channel = grpc.insecure_channel(bg.target)
    try:
        yield Stacks(bg, pb_grpc.StratumStub(channel))
    finally:
        channel.close()
        bg.stop()


def ask(stub, text: str, max_tokens: int = 6, metadata=(), request_id: str = "") -> tuple[list[int], pb.MessageStop]:
    request = pb.MessagesRequest(messages=[pb.Message(role="user", content=text)], max_tokens=max_tokens,
                                 temperature=0.0, request_id=request_id)
    tokens, stop = [], None
    for event in stub.Messages(request, metadata=metadata, timeout=120):
        if event.WhichOneof("event") == "delta":
            tokens += event.delta.token_ids
        elif event.WhichOneof("event") == "stop":
            stop = event.stop
    return tokens, stop


def test_the_pools_share_one_copy_of_the_weights(stacks):
    pools = stacks.bg.server.frontend.served.pools
    assert list(pools) == ["stratum", "baseline", "long-context"]
    engines = [pool.runner.engine for pool in pools.values()]
    assert all(e.model is engines[0].model for e in engines)          # one LoadedModel, one set of params
    stratum, baseline, long_context = (e.config for e in engines)
    assert (baseline.scheduler, baseline.page_size, baseline.kv_precision) == ("fcfs", 16, "bf16")
    assert (stratum.scheduler, stratum.page_size) == ("hab", None)
    assert (long_context.page_size, long_context.max_context) == (64, 512)
    assert baseline.kv_pool_slots == 1024 and stratum.kv_pool_slots == 2048
    # Start-up calibration timed a prefill and a decode step on every pool, so each can be priced before
    # it has served a request (the Stratum stack at --stratum-weight 0).
    assert all(pool.measured().decode_step_ms > 0 and pool.measured().prefill_tokens_per_s > 0
               for pool in pools.values())


def test_weight_picks_the_stack_and_both_give_the_same_greedy_tokens(stacks):
    on_baseline, stop_b = ask(stacks.stub, "Same request on both", metadata=(("x-stratum-weight", "0"),))
    on_stratum, stop_s = ask(stacks.stub, "Same request on both", metadata=(("x-stratum-weight", "1"),))
    assert (stop_b.stack, stop_s.stack) == ("baseline", "stratum")
    assert on_baseline == on_stratum and len(on_stratum) == stop_s.usage.output_tokens > 0


def test_session_key_sticks_to_one_stack(stacks):
    # Under w=0.5 a session's requests (each with its own request id) all land where the session hashes.
    for session in ("alice", "bob", "carol"):
        expected = "stratum" if goes_to_stratum(session, 0.5) else "baseline"
        for i in range(2):
            _, stop = ask(stacks.stub, f"turn {i}", max_tokens=2, request_id=f"{session}-{i}",
                          metadata=(("x-stratum-session", session),))
            assert stop.stack == expected
    # Without a session the request id is the key (the server default weight, 0.5, applies).
    for rid in ("rid-1", "rid-2", "rid-3"):
        _, stop = ask(stacks.stub, "by id", max_tokens=2, request_id=rid)
        assert stop.stack == ("stratum" if goes_to_stratum(rid, 0.5) else "baseline")


def test_long_context_route_goes_to_its_own_pool(stacks):
    _, stop = ask(stacks.stub, "a long document", max_tokens=2, metadata=(("x-stratum-route", "long-context"),))
    assert (stop.stack, stop.route) == ("long-context", "long-context")
    # The long-context pool's context cap is higher than the default pools': a prompt that fits only there.
    long_prompt = "x" * 300
    with pytest.raises(grpc.RpcError) as e:
        ask(stacks.stub, long_prompt, max_tokens=2, metadata=(("x-stratum-weight", "1"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context" in e.value.details()
    _, stop = ask(stacks.stub, long_prompt, max_tokens=2, metadata=(("x-stratum-route", "long-context"),))
    assert stop.stack == "long-context" and stop.usage.input_tokens > 256


def test_cost_estimate_has_one_breakdown_per_stack_and_metered_usage_matches_the_formula(stacks):
    # Start-up calibrates each pool's prefill rate; a decode step time needs a request that decodes.
    for header in (("x-stratum-weight", "0"), ("x-stratum-weight", "1"), ("x-stratum-route", "long-context")):
        ask(stacks.stub, "warm the step times", max_tokens=4, metadata=(header,))
    request = pb.CostEstimateRequest(messages=[pb.Message(role="user", content="price me " * 10)], max_tokens=8)
    r = stacks.stub.CostEstimate(request, timeout=30)
    assert [b.stack for b in r.stacks] == ["stratum", "baseline", "long-context"]
    assert r.breakdown.stack == "stratum" and r.estimated_cost_usd == r.stacks[0].cost_usd
    for b in r.stacks:
        assert b.cost_usd == pytest.approx(b.compute_usd + b.hbm_usd + b.transfer_usd) and b.cost_usd > 0
        assert b.decode_step_ms > 0 and b.prefill_tokens_per_s > 0 and b.billed_output_tokens == 8
        assert b.estimated_compute_seconds == 0.0          # an estimate has no untimed steps
    # The bill on the final event is what the request was charged of its steps; the rates it reports give it
    # back through the formula.
    _, stop = ask(stacks.stub, "bill me", max_tokens=5, metadata=(("x-stratum-weight", "0"),))
    m = stop.metered
    assert m.stack == "baseline" and m.billed_output_tokens == stop.usage.output_tokens
    assert m.compute_seconds > 0 and m.decode_batch >= 1 and m.prefill_batch >= 1
    assert 0.0 <= m.estimated_compute_seconds <= m.compute_seconds
    # A step the host reads only after it finished has no measured end: the engine bills it at its recent
    # measured rates (engine_stats.record_timing), or, before any step of its kind was measured on this stack,
    # not at all. On a loaded 2-core CI host all of an early request's decode steps, or its prefill step, were
    # read that way (2026-12-02): its bill then lacks that rate for the formula.
    if m.decode_step_ms > 0 and m.prefill_tokens_per_s > 0:
        again = cost.meter(stop.usage.input_tokens, stop.usage.cached_input_tokens, stop.usage.output_tokens,
                           0, m.kv_bytes_per_token,
                           cost.Measured(m.decode_step_ms, m.prefill_tokens_per_s, m.decode_batch, m.prefill_batch),
                           cost.Prices())
        assert m.compute_usd == pytest.approx(again.compute_usd) and m.hbm_usd == pytest.approx(again.hbm_usd)
    # The next estimate on the baseline is priced from its bills' rates.
    baseline = stacks.bg.server.frontend.served.pools["baseline"]
    assert len(baseline.recent) >= 2
    b = stacks.stub.CostEstimate(request, timeout=30).stacks[1]
    assert b.stack == "baseline" and b.decode_step_ms == pytest.approx(baseline.recent.measured(
        baseline.calibrated()).decode_step_ms)


def test_every_metric_has_a_stack_label(stacks):
    ask(stacks.stub, "count me", max_tokens=2, metadata=(("x-stratum-weight", "0"),))
    ask(stacks.stub, "count me too", max_tokens=2, metadata=(("x-stratum-weight", "1"),))
    metrics = stacks.bg.server.metrics
    for stack in ("stratum", "baseline"):
        series = metrics.for_stack(stack) if stack != metrics.stack else metrics
        assert series.value("stratum_requests_total", {"status": "ok"}) >= 1
        assert series.value("stratum_engine_steps_total") > 0
        assert series.value("stratum_metered_output_tokens_total") > 0
        decisions = [sample for family in metrics.registry.collect() for sample in family.samples
                     if sample.name == "stratum_route_decisions_total" and sample.labels["stack"] == stack]
        assert sum(s.value for s in decisions) >= 1
    value = stacks.bg.server.metrics.registry.get_sample_value
    assert value("stratum_kv_tokens_total", {"stack": "baseline", "tier": "device"}) == 1024


def _scrape(stacks) -> list:
    """Every sample of the server's Prometheus endpoint, as served over HTTP."""
    text = urllib.request.urlopen(stacks.bg.metrics_url, timeout=10).read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_what_happens_before_routing_is_counted_under_the_router_label(stacks):
    """A call refused before a stack is chosen, and the prompt-length entropy, belong to no stack: they are
    exported under stack="router", and those two are the only series there."""
    router_before = stacks.bg.server.frontend.router_metrics.status_counts().get("invalid_argument", 0)
    with pytest.raises(grpc.RpcError) as e:
        ask(stacks.stub, "weighed wrong", metadata=(("x-stratum-weight", "lots"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ask(stacks.stub, "routed", max_tokens=2, metadata=(("x-stratum-weight", "1"),))
    samples = _scrape(stacks)
    router = {(s.name, s.labels.get("status")): s.value for s in samples
              if s.labels.get("stack") == "router" and not s.name.endswith("_created")}
    assert set(router) == {("stratum_requests_total", "invalid_argument"),
                           ("stratum_prompt_length_entropy_bits", None)}
    assert router[("stratum_requests_total", "invalid_argument")] == router_before + 1
    assert router[("stratum_prompt_length_entropy_bits", None)] >= 0
    entropy = [s for s in samples if s.name == "stratum_prompt_length_entropy_bits"]
    assert [s.labels for s in entropy] == [{"stack": "router"}]
    # Every series of the stratum_* families still has the label (one label set per metric name).
    assert all("stack" in s.labels for s in samples if s.name.startswith("stratum_") and
               not s.name.startswith("stratum_dmlp_"))


def test_get_metrics_reports_every_stack(stacks):
    ask(stacks.stub, "on the baseline", max_tokens=3, metadata=(("x-stratum-weight", "0"),))
    ask(stacks.stub, "on stratum", max_tokens=3, metadata=(("x-stratum-weight", "1"),))
    with pytest.raises(grpc.RpcError):
        ask(stacks.stub, "refused", metadata=(("x-stratum-route", "nowhere"),))
    snap = stacks.stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
    assert [s.stack for s in snap.stacks] == ["stratum", "baseline", "long-context"]
    pools = stacks.bg.server.frontend.served.pools
    for s in snap.stacks:
        pool = pools[s.stack]
        assert (s.kv_tokens_total, s.accepted, s.finished) == (pool.runner.stats.kv_tokens_total,
                                                               pool.runner.accepted, pool.runner.finished)
        assert dict(s.requests_by_status) == pool.metrics.status_counts()
        assert not s.stacks and not s.router_requests_by_status
    stratum, baseline = snap.stacks[0], snap.stacks[1]
    assert (stratum.kv_tokens_total, baseline.kv_tokens_total) == (2048, 1024)
    assert baseline.requests_by_status["ok"] >= 1 and baseline.output_tokens >= 3 and baseline.ttft.count >= 1
    assert baseline.accepted >= 1 and baseline.steps > 0
    # The top level: the Stratum stack's figures (as a one-stack server answers), with the server's counts.
    assert snap.stack == "stratum" and snap.kv_tokens_total == 2048 and snap.accepted == stratum.accepted
    assert snap.router_requests_by_status["invalid_argument"] >= 1
    for status, count in snap.requests_by_status.items():
        assert count == sum(s.requests_by_status.get(status, 0) for s in snap.stacks) + \
            snap.router_requests_by_status.get(status, 0)
    assert snap.prompt_length_entropy_bits == stacks.bg.server.frontend.served.router.lengths.bits()


def test_calibration_runs_prompts_until_it_has_timed_a_prefill_and_a_decode_step(monkeypatch):
    """A step the engine could not time (0 s) measures nothing; on a loaded host every step of a calibration prompt
    can come back so. Calibration then runs another prompt, until it has both rates (the engine is made to miss
    the timings of the first steps here)."""
    from serving import server as server_module
    from stratum_jax.engine import Engine
    from stratum_jax.engine_stats import StepRecorder
    real, seen = StepRecorder.record_timing, []

    def record(self, batch, device_s, work=None):
        seen.append(batch.kind)
        return real(self, batch, 0.0 if len(seen) <= 12 else device_s, work)     # the first 12 steps untimed
    monkeypatch.setattr(StepRecorder, "record_timing", record)
    engine = Engine(CONFIG)
    rate = cost.PrefillRate(min_tokens=16)
    server_module._calibrate(engine, rate)
    assert len(seen) > 12 and rate.tokens_per_s > 0 and engine.stats().decode_step_ms > 0
