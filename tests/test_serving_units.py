"""The serving layer's pure parts: request translation, headers, keys, cost model, metrics, hardware info."""
from __future__ import annotations

import types

import pytest

from serving import cost, hardware, profiling
from serving.auth import load_keys
from serving.headers import parse_headers
from serving.options import ServerOptions
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.translate import Limits, Translator, delta_event
from stratum_jax.engine_stats import EngineStats
from stratum_jax.metrics import METRICS, ServingMetrics, markdown_table
from stratum_jax.request import InvalidRequestError, StepOutput, TokenLogprob


class ByteTemplate:
    """One token per byte of "role: content\\n" lines: enough to check lengths and limits."""

    def apply_chat_template(self, messages, system=None, add_generation_prompt=True):
        text = (f"system: {system}\n" if system else "") + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return list((text + ("assistant: " if add_generation_prompt else "")).encode())


def translator(**limits) -> Translator:
    return Translator(ByteTemplate(), Limits(**{"model_name": "tiny", "max_context": 100, "max_tokens_cap": 50,
                                                **limits}))


def request(content="hi", **kw) -> pb.MessagesRequest:
    kw.setdefault("max_tokens", 5)
    return pb.MessagesRequest(messages=[pb.Message(role="user", content=content)], **kw)


# ---- translation ----

def test_defaults_and_explicit_sampling_values():
    ids, params = translator().messages_request(request())
    assert ids == list(b"user: hi\nassistant: ")
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (1.0, 1.0, 0, None)
    _, params = translator().messages_request(request(temperature=0.0, top_p=0.5, top_k=3, seed=9,
                                                      stop_sequences=["\n\n"], logprobs=2))
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.0, 0.5, 3, 9)
    assert params.stop_strings == ("\n\n",) and params.logprobs == 2


@pytest.mark.parametrize("req, needle", [
    (pb.MessagesRequest(max_tokens=5), "messages is empty"),
    (pb.MessagesRequest(messages=[pb.Message(role="bot")], max_tokens=5), "messages[0].role is 'bot'"),
    (request(max_tokens=0), "max_tokens must be a positive integer"),
    (request(max_tokens=51), "over this server's cap of 50"),
    (request("x" * 100), "over this server's context of 100"),
    (request("x" * 60, max_tokens=50), "lower max_tokens to at most"),
    (request(top_p=1.5), "top_p must be in (0, 1]"),
    (request(stop_sequences=["a"] * 17), "at most 16"),
    (request(model="other"), "send model 'tiny'"),
    (request(request_id="a b"), "request_id"),
])
def test_bad_requests_say_what_to_fix(req, needle):
    with pytest.raises(InvalidRequestError) as e:
        translator().messages_request(req)
    assert needle in str(e.value)


def test_delta_event_carries_tokens_text_and_logprobs():
    out = StepOutput("r", [5, 6], "ab", logprobs=[[TokenLogprob(5, -0.1), TokenLogprob(5, -0.1), TokenLogprob(9, -2.0)],
                                                  [TokenLogprob(6, -0.5)]])
    delta = delta_event(out).delta
    assert list(delta.token_ids) == [5, 6] and delta.text == "ab"
    assert [(lp.token_id, [t.token_id for t in lp.top]) for lp in delta.logprobs] == [(5, [5, 9]), (6, [])]
    assert delta_event(StepOutput("r", [], "")) is None


# ---- headers and keys ----

def test_headers():
    assert parse_headers([]).route == "default" and parse_headers([]).weight is None
    h = parse_headers([("x-stratum-weight", " 0.25 "), ("x-stratum-route", "long-context")])
    assert (h.weight, h.route) == (0.25, "long-context")
    for bad in (("x-stratum-weight", "nan"), ("x-stratum-weight", "-0.1"), ("x-stratum-weight", ""),
                ("x-stratum-route", "LONG")):
        with pytest.raises(InvalidRequestError, match=bad[0]):
            parse_headers([bad])


def test_keys_file(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# comment\n\nalpha\n  beta  \n")
    assert load_keys(good) == ("alpha", "beta")
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no keys"):
        load_keys(tmp_path / "empty")
    (tmp_path / "spaces").write_text("ok\ntwo words\n")
    with pytest.raises(ValueError, match="spaces:2"):
        load_keys(tmp_path / "spaces")
    with pytest.raises(ValueError, match="cannot read"):
        load_keys(tmp_path / "missing")


def test_server_options_validate(tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key"):
        ServerOptions(tls_cert=str(tmp_path))
    with pytest.raises(ValueError, match="--keys-file"):
        ServerOptions(keys_file=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--gpu-usd-per-hour"):
        cost.Prices(gpu_usd_per_hour=-1)
    assert ServerOptions().is_loopback and not ServerOptions(host="0.0.0.0").is_loopback


# ---- cost model ----

def test_cost_formula_by_hand():
    prices = cost.Prices(gpu_usd_per_hour=3600.0, transfer_usd_per_gb=1e9, hbm_usd_per_gb_hour=3600e9)
    measured = cost.Measured(decode_step_ms=10.0, prefill_tokens_per_s=1000.0, decode_batch=4.0)
    c = cost.estimate(prompt_tokens=100, max_tokens=20, request_bytes=50, kv_bytes=2, measured=measured,
                      prices=prices)
    t_prefill, t_decode = 0.1, 0.2
    assert c.compute_seconds == pytest.approx(t_prefill + t_decode / 4)
    assert c.compute_usd == pytest.approx(c.compute_seconds)              # $1 per GPU-second
    kv_token_s = 50 * t_prefill + 110 * t_decode
    assert c.hbm_usd == pytest.approx(2 * kv_token_s)                     # $1 per byte-second
    assert c.transfer_usd == pytest.approx(50 + 20 * cost.BYTES_PER_STREAMED_TOKEN)   # $1 per byte
    assert c.estimated_cost_usd == pytest.approx(c.compute_usd + c.hbm_usd + c.transfer_usd)
    with pytest.raises(ValueError, match="not measured"):
        cost.estimate(1, 1, 1, 1, cost.Measured(0.0, 0.0, 1.0), prices)


def test_kv_bytes_per_token():
    mc = types.SimpleNamespace(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert cost.kv_bytes_per_token(mc) == 2 * 32 * 8 * 128 * 2      # 128 KiB: Llama-3.1-8B in bf16


# ---- metrics ----

def Stats(**overrides) -> EngineStats:
    """A small engine snapshot (the metrics read `EngineStats`, nothing looser)."""
    base = dict(queued=1, running=2, kv_pages_total=10, kv_pages_free=7, kv_tokens_total=80, kv_tokens_used=24,
                kv_tokens_written=20, prefix_cache_hits=3, prefix_cache_queries=4, preemptions=0, steps=5,
                decode_step_ms=2.0, prefill_tokens_per_s=100.0)
    return EngineStats(**{**base, **overrides})


def test_engine_counters_advance_by_deltas():
    m = ServingMetrics()
    m.observe_engine(Stats())
    m.observe_engine(Stats(prefix_cache_hits=5, prefix_cache_queries=8, steps=9, untimed_steps=3, estimated_steps=2))
    m.observe_engine(Stats(prefix_cache_hits=5, prefix_cache_queries=8, steps=9, untimed_steps=3, estimated_steps=2))
    value = m.value
    assert value("stratum_untimed_steps_total", {"billed": "estimated"}) == 2
    assert value("stratum_untimed_steps_total", {"billed": "none"}) == 1
    assert value("stratum_prefix_cache_hits_total") == 5
    assert value("stratum_prefix_cache_queries_total") == 8
    assert value("stratum_engine_steps_total") == 9
    assert value("stratum_cache_hit_rate") == pytest.approx(5 / 8)
    assert value("stratum_kv_pages_used", {"tier": "device"}) == 3


def test_host_tier_figures_only_with_a_host_tier():
    m = ServingMetrics()
    m.observe_engine(Stats())                                  # no host tier: no host series
    value = m.value
    assert value("stratum_kv_tokens_total", {"tier": "host"}) is None
    host = dict(kv_host_tokens_total=4096, kv_host_tokens_used=1024, kv_host_hits=3, kv_prefetched_pages=2,
                kv_offloaded_pages=7)
    m.observe_engine(Stats(**host))
    m.observe_engine(Stats(**{**host, "kv_host_hits": 5}))
    assert value("stratum_kv_tokens_total", {"tier": "host"}) == 4096
    assert value("stratum_kv_tokens_used", {"tier": "host"}) == 1024
    assert value("stratum_kv_pages_free", {"tier": "host"}) == 384
    assert value("stratum_kv_host_hits_total") == 5 and value("stratum_kv_offloaded_pages_total") == 7
    assert value("stratum_kv_prefetched_pages_total") == 2


def test_request_figures_and_table():
    m = ServingMetrics()
    m.request_completed(stop_reason="max_tokens", output_tokens=11, ttft_s=0.5, e2e_s=1.5)
    m.request_ended("ok")
    m.record_tokens(7, 2, 11)
    value = m.value
    assert value("stratum_tpot_seconds_sum") == pytest.approx(0.1)
    assert value("stratum_requests_total", {"status": "ok"}) == 1
    assert m.token_counts() == (7, 11) and m.recent_e2e.summary().p50_s == 1.5
    assert all(f"`{name}`" in markdown_table() for name in METRICS)


# ---- hardware and profiles ----

def test_cuda_version_from_the_backend():
    def device(text):
        return types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(platform_version=text))

    assert hardware._cuda_version(device("cuda 12080")) == "12.8"
    assert hardware._cuda_version(device("CUDA 13000")) == "13.0"
    assert hardware._cuda_version(device("rocm 6")) == ""
    assert hardware._cuda_version(types.SimpleNamespace(platform="cpu")) == ""


def test_profile_names_stay_inside_the_profile_dir(tmp_path):
    assert profiling.trace_dir_for(tmp_path, "run1") == tmp_path / "run1"
    (tmp_path / "run1").mkdir()
    assert profiling.trace_dir_for(tmp_path, "run1") == tmp_path / "run1-2"
    for bad in ("../up", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="profile name"):
            profiling.trace_dir_for(tmp_path, bad)
    assert profiling.check_request(0, 0) == (profiling.DEFAULT_STEPS, profiling.DEFAULT_TIMEOUT_S)
    with pytest.raises(ValueError, match="num_steps"):
        profiling.check_request(10**6, 1)


# ---- the prefill rate the cost model bills with ----

def _step(kind, tokens, seconds):
    """A StepTiming-like record: `tokens` prompt tokens (none for a decode step)."""
    return types.SimpleNamespace(kind=kind, num_tokens=tokens, seconds=seconds,
                                 prefill_tokens=0 if kind == "decode" else tokens)


def test_prefill_rate_ignores_small_and_decode_steps():
    """The 3-token warm-up prefill (16.7 tok/s) must never become the billed rate."""
    rate = cost.PrefillRate(min_tokens=64)
    for step in (None, _step("prefill", 3, 0.18), _step("decode", 128, 0.01), _step("prefill", 63, 0.01)):
        rate.observe(step)
    assert rate.tokens_per_s == 0.0
    measured = cost.Measured(decode_step_ms=5.0, prefill_tokens_per_s=rate.tokens_per_s, decode_batch=1.0)
    with pytest.raises(ValueError, match="representative"):
        cost.estimate(22, 10, 100, 1024, measured, cost.Prices())
    rate.observe(_step("prefill", 128, 0.01))
    rate.observe(_step("prefill", 3, 0.18))
    assert rate.tokens_per_s == pytest.approx(12800.0)
    rate.observe(_step("prefill", 256, 0.01))
    assert rate.tokens_per_s == pytest.approx((12800.0 + 25600.0) / 2)   # the median of the two


def test_client_summary_labels_the_stop_reason():
    from stratum_jax.client import stop_summary
    line = stop_summary(pb.MessageStop(stop_reason=pb.MAX_TOKENS, usage=pb.Usage(input_tokens=5, output_tokens=8)))
    assert line.startswith("[stop: max_tokens] input 5 tokens") and "output 8 tokens" in line
