"""Host wall time by phase (stratum_jax/phase_times.py). The engine's breakdown of a recall is tested in
tests/test_host_tier.py (`test_recalls_after_the_first_compile_nothing_...`)."""
import pytest

from stratum_jax.phase_times import PhaseTimes, top_level_total


def test_spans_sum_per_name_and_count_when_the_body_raises():
    phases = PhaseTimes()
    phases.add("a", 0.25)
    phases.add("a.part", 0.125)
    phases.add("a", 0.5)
    with pytest.raises(RuntimeError):
        with phases.span("b"):
            raise RuntimeError("boom")
    assert phases.seconds["a"] == 0.75 and phases.calls["a"] == 2
    assert phases.calls["b"] == 1 and phases.seconds["b"] >= 0.0
    # Dotted names are parts of their phase: not added again.
    assert top_level_total({"a": 0.75, "a.part": 0.125, "b": 0.5}) == 1.25


def test_since_returns_only_what_grew():
    phases = PhaseTimes()
    phases.add("a", 1.0)
    before = phases.snapshot()
    phases.add("b", 0.5)
    assert phases.since(before) == {"b": 0.5}


@pytest.mark.parametrize("name", ["", ".a", "a."])
def test_bad_phase_names_are_refused(name):
    with pytest.raises(ValueError, match="phase name"):
        PhaseTimes().add(name, 1.0)

