"""The engine's step recorder (stratum_jax/engine_stats.py), without a model: per-token decode cost,
prefill rate, untimed steps, and each request's queue wait counted once."""
from stratum_jax.engine_stats import StepRecorder
from stratum_jax.request import SamplingParams
from stratum_jax.scheduler.base import ScheduledBatch
from stratum_jax.sequence import Sequence


def _seq(rid: str, arrival: float, admit: float | None) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4), seed=0,
                    detokenizer=None, arrival_time=arrival, admit_time=admit)


def test_step_costs_are_medians_per_decode_step_and_per_prompt_token():
    rec = StepRecorder()
    assert rec.decode_ms_per_step() is None and rec.prefill_tokens_per_s() is None
    a, b = _seq("a", 0.0, 0.0), _seq("b", 0.0, 0.0)
    rec.record_timing(ScheduledBatch([a, b], [4, 2], [], []), 0.008)      # 4 steps in 8 ms
    rec.record_timing(ScheduledBatch([a], [1], [], []), 0.003)
    rec.record_timing(ScheduledBatch([a], [1], [], []), 0.0025)
    assert rec.decode_ms_per_step() == 2.5                                 # median of 2, 3, 2.5 ms
    rec.record_timing(ScheduledBatch([a], [1], [b], [300]), 0.1)          # a mixed step: prompt tokens / s
    assert rec.prefill_tokens_per_s() == 3000 and rec.decode_ms_per_step() == 2.5
    rec.record_timing(ScheduledBatch([], [], [b], [50]), 0.0)             # untimed: reported, not averaged
    assert rec.prefill_tokens_per_s() == 3000
    assert (rec.last_step.kind, rec.last_step.prefill_tokens, rec.last_step.num_seqs) == ("prefill", 50, 1)


def test_an_untimed_step_is_billed_at_recent_rates_and_marked_estimated():
    """A step read back with no measured time charges its rows what it would take at the recent medians (kept
    apart as estimated_device_s, and out of the medians); before any measured step of its kind, nothing."""
    import pytest
    rec = StepRecorder()
    a, b = _seq("a", 0.0, 0.0), _seq("b", 0.0, 0.0)
    rec.record_timing(ScheduledBatch([a], [2], [], []), 0.0)              # nothing measured yet
    rec.record_timing(ScheduledBatch([], [], [b], [100]), 0.0)
    assert a.usage.device_s == 0 and b.usage.device_s == 0 and a.usage.decode_tokens == 0
    assert (rec.untimed_steps, rec.estimated_steps) == (2, 0)
    rec.record_timing(ScheduledBatch([a], [1], [], []), 0.004)            # measured: 4 ms a decode step
    rec.record_timing(ScheduledBatch([], [], [b], [200]), 0.1)            # measured: 2000 prompt tokens / s
    measured = a.usage.device_s, b.usage.device_s
    rec.record_timing(ScheduledBatch([a], [3], [], []), 0.0)              # 3 steps at 4 ms
    rec.record_timing(ScheduledBatch([a], [1], [b], [100]), 0.0)          # mixed: 100 prompt tokens at 2000/s
    assert a.usage.decode_device_s == pytest.approx(measured[0] + 0.012 + 0.05 / 101)
    assert b.usage.prefill_device_s == pytest.approx(measured[1] + 0.05 * 100 / 101)
    assert a.usage.estimated_device_s == pytest.approx(0.012 + 0.05 / 101)
    assert b.usage.estimated_device_s == pytest.approx(0.05 * 100 / 101)
    assert (rec.untimed_steps, rec.estimated_steps) == (4, 2)
    assert rec.decode_ms_per_step() == 4.0 and rec.prefill_tokens_per_s() == 2000.0     # medians untouched


def test_queue_wait_counted_once_per_request_and_steps_counted():
    rec = StepRecorder()
    early, late, queued = _seq("e", 1.0, 1.5), _seq("l", 2.0, 4.0), _seq("q", 3.0, None)
    rec.record_postprocessed(ScheduledBatch([early], [1], [queued], [2]))
    assert rec.mean_queue_ms == 500.0
    for _ in range(3):          # `early` again in later steps: its wait is not counted again
        rec.record_postprocessed(ScheduledBatch([early], [1], [late], [2]))
    assert rec.mean_queue_ms == 1250.0 and rec.steps == 4
    assert not queued.queue_wait_recorded
