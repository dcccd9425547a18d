"""The device idle meter behind the DMLP's gpu_idle_frac feature and the stratum_gpu_idle_* metrics."""
import pytest

from stratum_jax.gpu_idle import DeviceTimeline, GpuIdleMeter


def test_idle_fraction_over_the_window_and_last_gap():
    m = GpuIdleMeter(window_ms=100.0)
    assert m.idle_fraction(5.0) is None and m.last_gap_ms is None
    m.step(0.0, 30.0)                     # busy 0-30
    assert m.idle_fraction(30.0) == pytest.approx(0.0)
    assert m.idle_fraction(60.0) == pytest.approx(0.5)          # 30 busy of 60 since the first step
    m.step(70.0, 80.0)                    # idle gap 30-70
    assert m.last_gap_ms == pytest.approx(40.0)
    assert m.idle_fraction(100.0) == pytest.approx(0.6)         # busy 30 + 10 of 100
    # The window slides: at 190 only [90, 190] counts, and nothing ran there.
    assert m.idle_fraction(190.0) == pytest.approx(1.0)
    m.step(190.0, 290.0)
    assert m.idle_fraction(290.0) == pytest.approx(0.0)


def test_a_step_straddling_the_window_edge_counts_only_its_inside_part():
    m = GpuIdleMeter(window_ms=100.0)
    m.step(0.0, 150.0)
    assert m.idle_fraction(200.0) == pytest.approx(0.5)         # window [100, 200]: busy 100-150


class _Step:
    """A dispatched step whose completion the test decides."""

    def __init__(self):
        self.done = False

    def is_ready(self):
        return self.done


def test_timeline_overlapped_steps_leave_no_idle_time():
    """Async scheduling: step 2 is dispatched while step 1 runs, so it starts when step 1 ends, and the
    host waiting for step 1 (the wait returns at its end) sees no gap."""
    m = GpuIdleMeter(window_ms=1000.0)
    t = DeviceTimeline(m)
    s1, s2 = _Step(), _Step()
    t.dispatched(s1, 0.0)
    t.watch(s1, 5.0)                          # still running at 5
    assert t.idle_since_ms(s1) is None
    t.dispatched(s2, 6.0)                     # queued behind s1
    assert t.read(s1, 10.0, was_done=False) == (0.0, 10.0)    # the wait returned at 10: s1 ended then
    s2.done = True
    t.watch(s2, 12.0)                         # first look at s2: already finished, never seen running
    assert t.idle_since_ms(s2) == 10.0        # it started at 10, the latest time it can have ended
    assert t.read(s2, 13.0, was_done=True) == (10.0, 10.0)
    assert m.idle_fraction(13.0) == pytest.approx(3.0 / 13.0)


def test_timeline_counts_idle_from_the_last_time_the_step_was_seen_running():
    """A step found finished by a poll ended at some time after the host last saw it running: the
    timeline takes that time, so the idle time it reports is an upper bound."""
    m = GpuIdleMeter(window_ms=1000.0)
    t = DeviceTimeline(m)
    s1 = _Step()
    t.dispatched(s1, 0.0)
    t.watch(s1, 4.0)
    s1.done = True
    t.watch(s1, 9.0)
    assert t.idle_since_ms(s1) == 4.0
    assert t.read(s1, 9.5, was_done=True) == (0.0, 4.0)
    assert t.idle_since_ms(None) == 4.0
    s2 = _Step()
    t.dispatched(s2, 12.0)                    # 8 ms idle before it
    assert t.read(s2, 20.0, was_done=False) == (12.0, 20.0)
    assert m.last_gap_ms == pytest.approx(8.0)
