"""The device idle meter behind the DMLP's gpu_idle_frac feature and the stratum_gpu_idle_* metrics."""
import pytest

from stratum_jax.gpu_idle import GpuIdleMeter


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
