"""stratum_jax/step_work.py: the bytes and FLOPs a step must do, counted on `tiny` against numbers worked out
by hand, and the engine's use of it (each dispatched step's counted work reaches EngineStats as rates)."""
import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.config import PRESETS
from stratum_jax.request import SamplingParams
from stratum_jax.step_work import DevicePeaks, ModelWork, StepWork

TINY = PRESETS["tiny"]   # vocab 512, hidden 128, FFN 384, 2 layers, 4 heads, 2 KV heads, head_dim 32, float32, untied
# Parameters: embedding and LM head 512 x 128 each; per layer q 128x128, k and v 128x64, o 128x128,
# gate / up / down 128x384, two norms of 128; a final norm of 128.
PER_LAYER = 128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 384 + 2 * 128      # 196,864
WEIGHT_BYTES = 4 * (2 * 512 * 128 + 2 * PER_LAYER + 128)                          # 2,099,712
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4          # K and V x layers x KV heads x head_dim x float32 = 1,024


@pytest.fixture
def work():
    return ModelWork.of(TINY, WEIGHT_BYTES, KV_BYTES_PER_TOKEN, dtype_bytes=4)


def test_a_decode_step_by_hand(work):
    got = work.step(decode_contexts=[10, 20])
    # Weights: all but the untied input embedding (512 x 128 x 4 B), of which only 2 rows are read.
    weights = WEIGHT_BYTES - 512 * 128 * 4 + 2 * 128 * 4                     # 1,838,592
    kv = (10 + 20) * 1024 + 2 * 1024                                           # read + written
    assert got.bytes_moved == weights + kv == 1_871_360
    linear = 2 * 2 * (128 * (128 + 2 * 64) + 128 * 128 + 3 * 128 * 384)        # per token: 786,432
    lm_head = 2 * 512 * 128                                                    # per row: 131,072
    attention = 4 * 2 * 4 * 32 * (10 + 20)                                     # per key: 1,024
    assert got.flops == 2 * linear + 2 * lm_head + attention == 1_865_728


def test_a_prefill_chunk_reads_its_context_and_sees_a_triangle_of_keys(work):
    got = work.step(chunks=[(5, 3)])          # 3 prompt tokens after 5 cached: they see 6, 7 and 8 keys
    weights = WEIGHT_BYTES - 512 * 128 * 4 + 3 * 128 * 4
    assert got.bytes_moved == weights + (5 + 3) * 1024 + 3 * 1024
    assert got.flops == 3 * 786_432 + 131_072 + 1024 * (6 + 7 + 8)


def test_a_decode_call_counts_each_step_and_stops_a_row_at_its_steps(work):
    got = work.decode_call(contexts=[10, 20], steps=[2, 1])
    assert got == work.step([10, 20]) + work.step([11])
    assert work.scheduled([10, 20], [2, 1], chunks=[]) == got
    mixed = work.scheduled([10], [1], chunks=[(0, 4)])
    assert mixed == work.step([10], [(0, 4)])
    assert work.step() == StepWork(0, 0)


def test_a_tied_table_is_read_whole_by_the_lm_head():
    cfg = PRESETS["llama-1b"]
    tied = ModelWork.of(cfg, weight_bytes=10**9, kv_bytes_per_token=0, dtype_bytes=2)
    assert tied.step([1] * 64).bytes_moved == 10**9


def test_utilization_is_counted_work_over_time_against_the_peaks():
    peaks = DevicePeaks(read_bytes_per_s=4e12, matmul_flops_per_s=8e14)
    assert peaks.utilization(StepWork(bytes_moved=2 * 10**9, flops=2 * 10**11), 1e-3) == pytest.approx((0.5, 0.25))
    assert peaks.utilization(StepWork(1, 1), 0.0) == (0.0, 0.0)


def test_the_engine_counts_each_step_it_dispatches(monkeypatch):
    engine = Engine(RuntimeConfig(model="tiny", max_batch_size=2, max_context=256, kv_pool_tokens=4096,
                                  decode_steps=2))
    seen = []
    record = engine.recorder.record_timing
    monkeypatch.setattr(engine.recorder, "record_timing",
                        lambda batch, device_s, work=None: (seen.append(work), record(batch, device_s, work)))
    engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    per_token = engine.work.kv_bytes_per_token
    assert per_token == KV_BYTES_PER_TOKEN and engine.work.weight_bytes == WEIGHT_BYTES
    # Step 1 prefills the 5-token prompt (and samples token 1); step 2 decodes tokens 2-3 from position 5.
    assert seen[0] == engine.work.step(chunks=[(0, 5)])
    assert seen[1] == engine.work.decode_call(contexts=[6], steps=[2])
    stats = engine.stats()
    assert stats.step_bytes_per_s > 0 and stats.step_flops_per_s > 0


def test_the_utilization_gauges_divide_the_engines_rates_by_the_start_up_peaks():
    from stratum_jax.engine_stats import EngineStats
    from stratum_jax.metrics import ServingMetrics
    metrics = ServingMetrics()
    stats = EngineStats(queued=0, running=1, kv_pages_total=8, kv_pages_free=8, kv_tokens_total=64, kv_tokens_used=0,
                        kv_tokens_written=0, prefix_cache_hits=0, prefix_cache_queries=0, preemptions=0, steps=1,
                        decode_step_ms=1.0, prefill_tokens_per_s=0.0, step_bytes_per_s=2e12, step_flops_per_s=2e14)
    metrics.observe_engine(stats)                     # no peaks yet: the gauges stay unset
    assert metrics.value("stratum_hbm_bandwidth_utilization") in (None, 0.0)
    metrics.set_device_peaks(DevicePeaks(read_bytes_per_s=4e12, matmul_flops_per_s=8e14))
    metrics.observe_engine(stats)
    assert metrics.value("stratum_hbm_bandwidth_utilization") == pytest.approx(0.5)
    assert metrics.value("stratum_gpu_compute_utilization") == pytest.approx(0.25)
    assert metrics.value("stratum_read_bandwidth_gbps") == pytest.approx(4000)
