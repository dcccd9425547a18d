"""benchmarks/gpu_clocks.py: nvidia-smi samples parsed and summarised, and the sampler's entry and exit samples,
with a fake nvidia-smi (no GPU, no timing: the background thread may add samples, which change no summary here)."""
import pytest

from benchmark_module import load_benchmark

gpu_clocks = load_benchmark("gpu_clocks.py", "gpu_clocks")


def test_parse_sample_reads_every_field_and_not_available_as_none():
    s = gpu_clocks.parse_sample("1980, 1980, 3201, 612.40, 700.00, 61, 0x0000000000000000")
    assert s == {"sm_mhz": 1980.0, "max_sm_mhz": 1980.0, "mem_mhz": 3201.0, "power_w": 612.4,
                 "power_limit_w": 700.0, "temperature_c": 61.0, "throttle_reasons": "0x0000000000000000"}
    s = gpu_clocks.parse_sample("1755, 1980, 3201, [N/A], 700.00, 58")      # an older driver: no reasons field
    assert s["power_w"] is None and s["sm_mhz"] == 1755.0 and "throttle_reasons" not in s
    with pytest.raises(ValueError, match="comma-separated"):
        gpu_clocks.parse_sample("1980, 3201")


def test_summarize_takes_median_min_max_and_distinct_reasons():
    lines = ["1980, 1980, 3201, 600, 700, 60, 0x0", "1755, 1980, 3201, 690, 700, 66, 0x4",
             "1830, 1980, 3201, 650, 700, 63, 0x4"]
    summary = gpu_clocks.summarize([gpu_clocks.parse_sample(x) for x in lines])
    assert summary == {"samples": 3, "sm_mhz_median": 1830.0, "sm_mhz_min": 1755.0, "sm_mhz_max": 1980.0,
                       "max_sm_mhz": 1980.0, "mem_mhz_median": 3201.0, "power_w_median": 650.0,
                       "power_limit_w": 700.0, "temperature_c_max": 66.0, "throttle_reasons": ["0x0", "0x4"]}
    assert gpu_clocks.summarize([]) is None


def test_sampler_samples_on_entry_and_exit_and_is_inert_without_a_runner():
    calls = []

    def fake_smi():
        calls.append(1)
        return "1500, 1980, 3201, 500, 700, 55, 0x4"
    with gpu_clocks.ClockSampler(runner=fake_smi, interval_s=3600) as clocks:
        assert len(calls) == 1                         # the entry sample, before the work
    assert len(calls) >= 2                             # and the exit sample
    summary = clocks.summary()
    assert summary["samples"] == len(calls) and summary["sm_mhz_median"] == 1500.0
    assert summary["throttle_reasons"] == ["0x4"]
    sampler = gpu_clocks.ClockSampler(runner=None)
    sampler._runner = None                             # as on a machine without nvidia-smi
    with sampler:
        pass
    assert sampler.summary() is None
