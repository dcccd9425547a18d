"""benchmarks/serving_bounds.py: the saturation prefill-share bound and the ideal-server TTFT, on hand cases."""
import json

import numpy as np
import pytest

from benchmark_module import forget, load_benchmark


@pytest.fixture(scope="module")
def bounds():
    yield load_benchmark("serving_bounds.py", "serving_bounds")
    forget("serving_bounds")


def test_kv_bytes_per_token_count_k_and_v_of_every_layer(bounds):
    # llama-1b: 16 layers x 8 kv heads x 64 dims, K and V, bf16
    assert bounds.kv_bytes_per_token("llama-1b", 2.0) == 2 * 16 * 8 * 64 * 2
    with pytest.raises(ValueError, match="preset"):
        bounds.kv_bytes_per_token("llama-nope", 2.0)


def test_the_prefill_share_leaves_time_for_every_decode_read(bounds):
    requests = [{"prompt_tokens": 100, "cached_tokens": 20, "output_tokens": 3},
                {"prompt_tokens": 50, "cached_tokens": 0, "output_tokens": 1}]
    b = bounds.prefill_share_bound(requests, prefill_tok_s=100.0, kv_token_bytes=10.0, read_bytes_s=1000.0)
    # prefill: 130 new tokens at 100/s = 1.3 s; decode reads 100 + 101 + 102 + 50 = 353 tokens x 10 B at 1000 B/s
    assert b["prefill_s"] == pytest.approx(1.3) and b["decode_kv_read_s"] == pytest.approx(3.53)
    assert b["max_prefill_fraction"] == pytest.approx(1.3 / 4.83, abs=1e-4)
    half = bounds.prefill_share_bound(requests, 100.0, 5.0, 1000.0)        # half the KV bytes: a higher bound
    assert half["max_prefill_fraction"] > b["max_prefill_fraction"]


def test_the_ideal_server_runs_the_shortest_remaining_prompt_first(bounds):
    # t=0: A (1 s of prefill) and B (0.5 s); B first. At t=1 C (0.1 s) preempts A's last 0.5 s.
    ttft = bounds.ideal_ttft_s([0.0, 0.0, 1.0], [100, 50, 10], prefill_tok_s=100.0)
    np.testing.assert_allclose(ttft, [1.6, 0.5, 0.1], atol=1e-9)
    # An idle gap: the second request starts at its own arrival.
    np.testing.assert_allclose(bounds.ideal_ttft_s([0.0, 5.0], [100, 100], 100.0), [1.0, 1.0])


def test_a_result_file_gives_one_row_per_config_and_rate(bounds, tmp_path):
    fields = ["index", "arrival_s", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_ms"]
    rows = [[0, 0.0, 1000, 0, 10, 50.0], [1, 0.0, 2000, 512, 4000, 80.0], [2, 0.5, 300, 0, None, None]]
    result = {"notes": "arrivals: slot", "configs": [{"name": "hab", "rates": {
        "1": {"per_request": {"fields": fields, "rows": rows},
              "metric_samples": {"prefill_tokens_per_s_while_queued": 1234.5}},
        "2": {"skipped": "the --run-timeout passed"}}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    out = bounds.analyse(result, "llama-1b", 1000.0, 4.4)
    assert len(out) == 1 and out[0]["requests"] == 2 and out[0]["measured_prefill_tok_s_while_queued"] == 1234.5
    assert out[0]["measured_ttft_ms"] == {"p50": 65.0, "p95": 78.5}
    # The ideal server at 1000 tok/s: 1000 then 1488 new tokens from t=0, shortest first: 1.0 s and 2.488 s.
    assert out[0]["ideal_ttft_ms"] == {"p50": 1744.0, "p95": 2413.6, "within_slo": 1}
    # At S x the bf16 share bound the same prompts take longer, so no more of them meet the SLO.
    share = out[0]["prefill_share_bound"]["bf16"]["max_prefill_fraction"]
    assert 0 < share < 1 and out[0]["ideal_ttft_ms_decoding"]["p50"] == pytest.approx(1744.0 / share, abs=0.1)
    assert out[0]["ideal_ttft_ms_decoding"]["within_slo"] == 0
    assert bounds.analyse(result, "llama-1b", 1000.0, 4.4, ttft_slo_ms=2488.0)[0]["ideal_ttft_ms"]["within_slo"] == 2
    assert bounds.main([str(path), "--out", "b", "--results-dir", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "b.json").read_text())["files"]["r.json"]["rows"][0]["rate"] == "1"
    with pytest.raises(SystemExit):
        bounds.main([str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):
        bounds.main([str(path), "--ttft-slo-ms", "0"])
