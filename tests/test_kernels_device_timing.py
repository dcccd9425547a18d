"""benchmarks/kernels.py --timing device: the chained calls really run (none folded or merged), the
per-call device time is the slope between two chain lengths, --configs parses into TuningConfigs, and
--swapped-configs / --kernels into SwappedConfigs and kernel names."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from benchmark_module import load_benchmark
from pallas_kernels.paged_attention import TuningConfig, default_config

kernels = load_benchmark("kernels.py", "bench_kernels_timing")


def _layer(x, w):
    """A stand-in for a decode kernel: x [4, 8] -> [4, 8], same shape and dtype as its first input."""
    return jnp.tanh(x @ w)


def test_chain_runs_every_call_in_order_in_one_executable():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 8)) / 3, jnp.float32)
    want = x
    for _ in range(5):
        want = _layer(want, w)
    run = kernels.chained(_layer, 5)
    np.testing.assert_allclose(np.asarray(run(x, w)), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Five dots survive XLA's optimisation: no call was dropped or merged into another.
    hlo = run.lower(x, w).compile().as_text()
    assert hlo.count(" dot(") == 5, hlo


def test_device_time_is_the_slope_between_chain_lengths(monkeypatch):
    # A fake clock: an executable of n chained calls takes 70 us of dispatch and sync plus 30 us per call.
    monkeypatch.setattr(kernels, "chained", lambda fn, calls: calls)
    monkeypatch.setattr(kernels, "bench", lambda n, args, **kw: 70e-6 + 30e-6 * n)
    got = kernels.device_time(None, (), short=8, long=40, reps=1, rounds=1)
    assert got["seconds"] == pytest.approx(30e-6)
    assert got["per_call_long"] == pytest.approx((70e-6 + 40 * 30e-6) / 40)


def test_configs_parse_into_tuning_configs():
    got = kernels.parse_configs("default;block_kv=128;num_stages=3,num_splits=2,no_auto_barriers=False", 128)
    assert got == [TuningConfig(), TuningConfig(block_kv=128),
                   TuningConfig(num_stages=3, num_splits=2, no_auto_barriers=False)]
    # Overrides apply to the head dim's default.
    assert kernels.parse_configs("default;num_stages=3", 64) == [default_config(64),
                                                                 dataclasses.replace(default_config(64), num_stages=3)]
    with pytest.raises(SystemExit, match="stages=3"):
        kernels.parse_configs("stages=3", 128)
    with pytest.raises(SystemExit, match="must be an int"):
        kernels.parse_configs("block_kv=big", 128)


def test_swapped_configs_and_kernel_names_parse():
    from pallas_kernels.swapped_decode_attention import SwappedConfig, default_swapped_config
    got = kernels.parse_swapped_configs("default;block_kv=64,num_stages=3", 64)
    assert got == [default_swapped_config(64), SwappedConfig(block_kv=64, num_stages=3)]
    assert kernels.parse_swapped_configs("default", 128) == [default_swapped_config(128)]
    with pytest.raises(SystemExit, match="block_kv"):
        kernels.parse_swapped_configs("block_kv=32", 64)       # SwappedConfig refuses it
    assert kernels.parse_kernels("paged,swapped") == ("paged", "swapped")
    assert kernels.parse_kernels("swapped") == ("swapped",)
    with pytest.raises(SystemExit, match="--kernels"):
        kernels.parse_kernels("paged,triton")


def test_delta_mode_times_by_the_timing_flag(monkeypatch):
    """--delta's kernels and their bf16 baseline are timed by --timing: host (`bench`), device (the chain slope)
    or both (host is the headline, as in the other modes), each method's figures kept."""
    import argparse
    monkeypatch.setattr(kernels, "chained", lambda fn, calls: calls)
    monkeypatch.setattr(kernels, "bench", lambda fn, args, **kw: 5e-3 if fn == "kernel" else 70e-6 + 30e-6 * fn)
    a = argparse.Namespace(timing="host", chain_lengths=(8, 40), reps=1, inner=1, rounds=1)
    assert kernels.seconds_per_call("kernel", (), a) == (5e-3, {"host": {"seconds": 5e-3}})
    a.timing = "device"
    seconds, timing = kernels.seconds_per_call("kernel", (), a)
    assert seconds == pytest.approx(30e-6) and set(timing) == {"device"}
    a.timing = "both"
    seconds, timing = kernels.seconds_per_call("kernel", (), a)
    assert seconds == 5e-3 and timing["device"]["seconds"] == pytest.approx(30e-6)
