"""benchmarks/kernel_timing.py (kernels.py's --timing device and --profile-kernels): the chained calls really run
(none folded or merged), the per-call device time is the slope between two chain lengths, a trace's kernels are
summed per call and split between interleaved pairs; and kernels.py's --configs parses into TuningConfigs,
--swapped-configs / --kernels into SwappedConfigs and kernel names."""
import dataclasses
import json
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from benchmark_module import load_benchmark
from pallas_kernels.paged_attention import TuningConfig, default_config
from pallas_kernels.swapped_decode_attention import SHORT_CONTEXT_KEYS, default_swapped_config

kernels = load_benchmark("kernels.py", "bench_kernels_timing")
timing = sys.modules["kernel_timing"]       # loaded beside it (tests/benchmark_module.py SHARED_HELPERS)
delta_kernels = sys.modules["delta_kernels"]


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
    run = timing.chained(_layer, 5)
    np.testing.assert_allclose(np.asarray(run(x, w)), np.asarray(want), rtol=1e-5, atol=1e-6)
    # Five dots survive XLA's optimisation: no call was dropped or merged into another.
    hlo = run.lower(x, w).compile().as_text()
    assert hlo.count(" dot(") == 5, hlo


def test_device_time_is_the_slope_between_chain_lengths(monkeypatch):
    # A fake clock: an executable of n chained calls takes 70 us of dispatch and sync plus 30 us per call.
    monkeypatch.setattr(timing, "chained", lambda fn, calls: calls)
    monkeypatch.setattr(timing, "bench", lambda n, args, **kw: 70e-6 + 30e-6 * n)
    got = timing.device_time(None, (), short=8, long=40, reps=1, rounds=1)
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
    from pallas_kernels.swapped_decode_attention import SwappedConfig
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
    monkeypatch.setattr(timing, "chained", lambda fn, calls: calls)
    monkeypatch.setattr(timing, "bench", lambda fn, args, **kw: 5e-3 if fn == "kernel" else 70e-6 + 30e-6 * fn)
    a = argparse.Namespace(timing="host", chain_lengths=(8, 40), reps=1, inner=1, rounds=1, profile_kernels=False)
    assert timing.seconds_per_call("kernel", (), a) == (5e-3, {"host": {"seconds": 5e-3}})
    a.timing = "device"
    seconds, figures = timing.seconds_per_call("kernel", (), a)
    assert seconds == pytest.approx(30e-6) and set(figures) == {"device"}
    a.timing = "both"
    seconds, figures = timing.seconds_per_call("kernel", (), a)
    assert seconds == 5e-3 and figures["device"]["seconds"] == pytest.approx(30e-6)


def test_kernel_breakdown_sums_each_kernel_per_call():
    from device_trace import Kernel
    ks = [Kernel("body_mosaic_gpu_kernel", "GPU", 0.0, 50.0), Kernel("loop_multiply_fusion", "GPU", 52.0, 55.0),
          Kernel("body_mosaic_gpu_kernel", "GPU", 60.0, 110.0), Kernel("loop_multiply_fusion", "GPU", 112.0, 115.0),
          Kernel("input_reduce_fusion", "GPU", 113.0, 120.0)]       # overlaps the multiply on another stream
    got = timing.kernel_breakdown(ks, calls=2)
    assert got["kernels"] == {"body_mosaic_gpu_kernel": 50.0, "input_reduce_fusion": 3.5, "loop_multiply_fusion": 3.0}
    assert list(got["kernels"]) == ["body_mosaic_gpu_kernel", "input_reduce_fusion", "loop_multiply_fusion"]
    assert got["pallas_us"] == 50.0                  # the Mosaic GPU kernel only
    assert got["busy_us"] == pytest.approx((50 + 3 + 50 + 8) / 2)      # union: the overlap counted once
    assert got["span_us"] == 60.0


def test_kernel_profile_traces_the_chain_on_this_backend():
    """A real jax.profiler trace of a chained function (the XLA ops stand in for kernels on CPU): every call's
    dot is seen, so a kernel's time per call is its total over the chain's length."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
    got = timing.kernel_profile(_layer, (x, w), calls=3)
    assert got["calls"] == 3 and got["kernels"], got
    assert got["busy_us"] > 0 and got["span_us"] >= got["busy_us"] - 1e-6
    assert got["pallas_us"] == 0.0                   # no Pallas kernel in this function


def test_profile_kernels_needs_device_timing():
    with pytest.raises(SystemExit):
        kernels.main(["--delta", "--profile-kernels", "--timing", "host", "--dry-run"])


def test_kernel_mode_keeps_every_timing_record_and_the_engine_config(monkeypatch, tmp_path):
    """The paged/swapped mode with --timing device --profile-kernels: the timing record also holds "profile" and
    "gpu_clocks" (no seconds), which the figures must skip (they raised KeyError for every kernel on the H200,
    session 24); and the swapped "default" is the config an engine bounded by the shape's context runs (the
    short-context tile at head_dim 64), not the long-context one."""
    def fake_seconds_per_call(fn, args, a):
        fn(*args)
        return 1e-3, {"device": {"seconds": 1e-3}, "profile": {"pallas_us": 900.0, "kernels": {}},
                      "gpu_clocks": {"sm_mhz_median": 1980.0}}
    monkeypatch.setattr(kernels, "seconds_per_call", fake_seconds_per_call)
    out = tmp_path / "k.json"
    rc = kernels.main(["--kernels", "paged,swapped", "--default-only", "--no-check", "--no-xla", "--timing", "device",
                       "--profile-kernels", "--pages", "64", "--dry-run", "--out", str(out)])
    assert rc == 0
    shape, = json.loads(out.read_text())["shapes"]
    assert shape["context"] <= SHORT_CONTEXT_KEYS
    for run in shape["ours"]:
        assert "error" not in run, run
        assert run["ms"] == pytest.approx(1.0) and run["timing"]["profile"]["pallas_us"] == 900.0
    swapped = [r for r in shape["ours"] if r["kernel"] == "swapped"]
    assert [r["config"] for r in swapped] == [dataclasses.asdict(default_swapped_config(64, shape["context"]))]
    assert swapped[0]["config"]["block_kv"] == 64


def test_pair_breakdown_splits_interleaved_kernels_by_order():
    from device_trace import Kernel
    ks = []
    for i, (base_us, mine_us) in enumerate([(250.0, 150.0), (260.0, 145.0), (240.0, 160.0)]):
        t = 1000.0 * i
        ks += [Kernel("body_mosaic_gpu_kernel", "GPU", t, t + base_us),                    # paged
               Kernel("loop_multiply_fusion", "GPU", t + 300, t + 303),                     # the run's q prep
               Kernel("body_mosaic_gpu_kernel", "GPU", t + 305, t + 305 + mine_us),         # the run's kernel
               Kernel("input_reduce_fusion", "GPU", t + 306 + mine_us, t + 308 + mine_us)]  # its merge
    got = timing.pair_breakdown(ks[::-1], calls=3)       # order in the list does not matter, timestamps do
    assert got["base_pallas_us"] == 250.0 and got["pallas_us"] == 150.0
    assert got["x_pallas"] == pytest.approx(150.0 / 250.0)          # median of 0.6, 0.558, 0.667
    assert got["busy_us"] == pytest.approx(155.0)                   # 3 + 150 + 2, the median pair
    assert got["x_busy"] == pytest.approx(155.0 / 250.0)
    with pytest.raises(ValueError, match="exactly one"):
        timing.pair_breakdown(ks[:-2], calls=3)
    # A run's kernel stamped as starting a little before the paged kernel's end still counts as the run's: pair 0's
    # busy becomes 150 (the kernel, the q prep inside it) + 2, the median of (152, 150, 165).
    skewed = [k if k.start_us != 305.0 else Kernel(k.name, k.device, 249.0, 399.0) for k in ks]
    assert timing.pair_breakdown(skewed, calls=3)["busy_us"] == pytest.approx(152.0)
    # A Pallas GEMM as one side (attention_bound.py --between): a Mosaic GPU kernel whose kind is matmul still counts.
    gemm = [k if k.start_us % 1000 != 305.0 else Kernel("decode_matmul_2048x2048_mosaic_gpu_kernel", k.device,
                                                        k.start_us, k.end_us) for k in ks]
    assert timing.pair_breakdown(gemm, calls=3)["pallas_us"] == 150.0                    # a pair short of its run's kernel


def test_pallas_timing_prefers_the_paired_profile():
    run = dict(x_paged=0.7, timing=dict(profile=dict(pallas_us=62.0), paired=dict(x_pallas=0.58)))
    paged = dict(timing=dict(profile=dict(pallas_us=100.0)))
    assert delta_kernels.x_paged_by(run, paged, "pallas") == 0.58
    del run["timing"]["paired"]
    assert delta_kernels.x_paged_by(run, paged, "pallas") == pytest.approx(0.62)
    assert delta_kernels.x_paged_by(run, paged, "device") is None


def test_seconds_per_call_keeps_the_clocks_sampled_while_it_timed(monkeypatch):
    """Where nvidia-smi exists the SM clock sampled during the timing is kept beside the figures (a ratio of an
    SM-bound kernel to an HBM-bound one moves with it) and printed; without it nothing is added."""
    import argparse

    class FakeSampler:
        entered = False

        def __enter__(self):
            FakeSampler.entered = True
            return self

        def __exit__(self, *exc):
            return None

        def summary(self):
            return {"sm_mhz_median": 1605.0, "power_w_median": 694.0}
    monkeypatch.setattr(timing, "ClockSampler", FakeSampler)
    monkeypatch.setattr(timing, "bench", lambda fn, args, **kw: 5e-3)
    a = argparse.Namespace(timing="host", chain_lengths=(8, 40), reps=1, inner=1, rounds=1, profile_kernels=False)
    seconds, figures = timing.seconds_per_call("kernel", (), a)
    assert FakeSampler.entered and figures["gpu_clocks"]["sm_mhz_median"] == 1605.0 and seconds == 5e-3
    assert delta_kernels.sm_clock(figures) == ", SM 1605 MHz"
    assert delta_kernels.sm_clock({"host": {"seconds": 1.0}}) == ""
