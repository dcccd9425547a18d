"""benchmarks/kernels.py --delta: #12's speed bars are judged on the worst page layout of each context >= 4K,
and a layout whose every config failed counts as a miss; each timing method (the headline, the device chain
slope, the Pallas kernels alone from a profile) is judged on its own figures."""
import math
import sys

import pytest

from benchmark_module import load_benchmark

kernels = load_benchmark("kernels.py", "bench_kernels")
delta_kernels = sys.modules["delta_kernels"]       # the --delta mode (loaded beside it: benchmark_module.py)
delta_targets = delta_kernels.delta_targets


def _run(x, device=None, pallas=None):
    """A delta run whose headline ratio is x; device / pallas: its device seconds / Pallas us (the paged
    kernel's are 1.0 and 100.0 in `_shape`)."""
    timing = {}
    if device is not None:
        timing["device"] = dict(seconds=device)
    if pallas is not None:
        timing["profile"] = dict(pallas_us=pallas)
    return dict(ok=True, ms=x, x_paged=x, timing=timing)


def _shape(ctx, **runs_by_precision):
    paged = dict(ms=1.0, timing=dict(device=dict(seconds=1.0), profile=dict(pallas_us=100.0)))
    return dict(context=ctx, paged=paged, delta=[dict(precision=p.replace("_", "-"), anchor_len=1, runs=runs)
                                                 for p, runs in runs_by_precision.items()])


def test_worst_layout_per_context_and_failures_miss():
    failed = [dict(ok=False, error="boom")]
    shapes = [_shape(1024, fp8_delta=[_run(3.0)]),                                   # below 4K: not judged
              _shape(4096, fp8_delta=[_run(0.55), _run(0.9)], fp16_delta=failed),
              _shape(4096, fp8_delta=[_run(0.65)], fp16_delta=[_run(1.0)]),
              _shape(16384, fp8_delta=[_run(0.5)], fp16_delta=[_run(1.1)])]
    got = {(t["precision"], t["context"]): (t["worst_x_paged"], t["met"]) for t in delta_targets(shapes)}
    assert got == {("fp8-delta", 4096): (0.65, False), ("fp8-delta", 16384): (0.5, True),
                   ("fp16-delta", 4096): (math.inf, False), ("fp16-delta", 16384): (1.1, True)}


def test_each_timing_method_is_judged_on_its_own_figures():
    shapes = [_shape(4096, fp8_delta=[_run(0.68, device=0.63, pallas=58.0), _run(0.70, device=0.61, pallas=61.0)]),
              _shape(4096, fp8_delta=[_run(0.62, device=0.64, pallas=57.0)])]
    by = {t["timing"]: (t["worst_x_paged"], t["met"])
          for m in delta_kernels.TIMINGS for t in delta_targets(shapes, m)}
    # Per layout the best run by that method, then the worst layout: headline max(0.68, 0.62), device
    # max(0.61, 0.64), pallas max(0.58, 0.57).
    assert by == {"headline": (0.68, False), "device": (pytest.approx(0.64), False),
                  "pallas": (pytest.approx(0.58), True)}
    # Host-only runs have no device or profile figures: those methods give no target rather than a miss.
    host_only = [_shape(4096, fp8_delta=[_run(0.5)])]
    assert delta_targets(host_only, "device") == [] and delta_targets(host_only, "pallas") == []
    assert delta_targets(host_only)[0]["met"]


def test_fold_configs_are_shown_not_counted():
    """A run from --fold-configs (engine_default False: a config the engine does not run) never decides a bar,
    however fast it is."""
    fast_override = dict(_run(0.40), engine_default=False, config="fold num_splits=1")
    shapes = [_shape(4096, fp8_delta=[_run(0.65), fast_override])]
    (target,) = delta_targets(shapes)
    assert target["worst_x_paged"] == 0.65 and not target["met"]


def test_fold_configs_parse_over_the_folds_default(tmp_path):
    """--fold-configs: each ';' item is SwappedConfig overrides of the fold's default for that context and pool
    dtype; a field the config lacks says what to fix."""
    import argparse
    import jax.numpy as jnp
    a = argparse.Namespace(fold_configs="num_splits=1,shared_smem=True; split_merge_in_kernel=True")
    (s1, c1), (s2, c2) = delta_kernels.fold_configs(a, 128, 4096, jnp.float8_e4m3fn)
    assert (s1, c1.num_splits, c1.shared_smem, c1.block_kv) == ("num_splits=1,shared_smem=True", 1, True, 64)
    # overrides of the engine's fp8 default: its other fields (q split in the kernel) kept
    assert c2.split_merge_in_kernel and c2.fp8_q_in_kernel and c2.num_splits is None
    assert delta_kernels.fold_configs(argparse.Namespace(fold_configs=""), 128, 4096, jnp.float8_e4m3fn) == []
    with pytest.raises(SystemExit, match="not field=value"):
        delta_kernels.fold_configs(argparse.Namespace(fold_configs="splits=1"), 128, 4096, jnp.float8_e4m3fn)


def test_delta_dry_run_times_the_fold_configs_beside_the_default(tmp_path, monkeypatch):
    """kernels.py --delta --fold-configs in the interpreter: the engine's fp8 fold with per-granule scales (the
    default, "fold", counted for the bar), the fixed per-head scales' fold ("fold head", `--fp8-scale head`: shown
    beside, not counted) and the override (the
    fold path with that config: not the default, not the best), each checked against the same truth over its own
    scales. (The delta kernel's runs are left out here: other tests
    interpret it.)"""
    import json
    monkeypatch.setattr(delta_kernels, "delta_configs", lambda *a, **k: [])
    spec = "num_splits=1,shared_smem=True,out_affine_in_kernel=True"
    out = tmp_path / "d.json"
    assert kernels.main(["--delta", "--dry-run", "--precisions", "fp8-delta", "--fold-configs", spec,
                         "--out", str(out)]) == 0
    (shape,) = json.loads(out.read_text())["shapes"]
    (delta,) = shape["delta"]
    by_config = {r["config"]: r for r in delta["runs"]}
    assert set(by_config) == {"fold", "fold head", f"fold {spec}"}
    extra = by_config[f"fold {spec}"]
    assert extra["ok"] and extra["engine_default"] is False and extra["swapped_config"]["num_splits"] == 1
    assert by_config["fold"]["ok"] and "engine_default" not in by_config["fold"]
    assert by_config["fold head"]["ok"] and by_config["fold head"]["engine_default"] is False
    assert delta["best"]["config"] == "fold"


def test_device_time_is_the_verdict_where_a_run_has_it():
    """The bars are judged on device time (delta_kernels.VERDICT_TIMING: the chain slope, the kernel's time); the
    host-timed headline decides only a run without device figures, and the other methods are shown beside."""
    shapes = [_shape(4096, fp8_delta=[_run(0.63, device=0.59, pallas=56.0)]),
              _shape(16384, fp8_delta=[_run(0.58)])]          # host-timed only at 16K
    targets = delta_kernels.verdict_targets(
        [t for m in delta_kernels.TIMINGS for t in delta_targets(shapes, m)])
    verdicts = {(t["context"], t["timing"]): (t["met"], t["verdict"]) for t in targets}
    assert verdicts == {(4096, "headline"): (False, False), (4096, "device"): (True, True),
                        (4096, "pallas"): (True, False), (16384, "headline"): (True, True)}
    # exactly one verdict per bar
    assert sorted(t["context"] for t in targets if t["verdict"]) == [4096, 16384]


def test_delta_times_both_ways_unless_told(monkeypatch):
    """kernels.py --delta defaults to --timing both (its bars need device time); the interpreter's dry run stays
    host-timed, and a given --timing is kept."""
    seen = []

    def fake_run_delta(a):
        seen.append(a.timing)
        return 0
    monkeypatch.setattr(kernels, "run_delta", fake_run_delta)
    for argv in (["--delta"], ["--delta", "--dry-run"], ["--delta", "--timing", "device"]):
        assert kernels.main(argv) == 0
    assert seen == ["both", "host", "device"]


def test_bars_only_dry_run_keeps_what_the_bars_count(tmp_path, monkeypatch):
    """kernels.py --delta --bars-only in the interpreter: at a delta bar's context the engine's fp8 decode paths
    (the delta kernel's default config and the fold), without the fold's per-head-scale run shown beside; the best run is one of those, and the bar is judged."""
    import json
    monkeypatch.setattr(delta_kernels, "DELTA_BAR_MIN_CONTEXT", 512)      # the dry run's context: a delta bar's
    out = tmp_path / "d.json"
    assert kernels.main(["--delta", "--bars-only", "--dry-run", "--precisions", "fp8-delta", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (shape,) = result["shapes"]
    (delta,) = shape["delta"]
    configs = [r["config"] for r in delta["runs"]]
    assert len(configs) == 2 and "fold" in configs and all(isinstance(c, dict) for c in configs if c != "fold")
    assert all(r["ok"] for r in delta["runs"]) and delta["best"] in delta["runs"]
    assert [(t["context"], t["verdict"]) for t in result["targets"]] == [(512, True)]
    assert result["paged_targets"] == []


def test_bars_only_times_the_bf16_kernels_alone_below_4k(tmp_path, monkeypatch):
    """--bars-only below DELTA_BAR_MIN_CONTEXT (the 1K bar): the paged kernel and the engine's swapped kernel alone
    (the swapped one checked against the paged one), each one's % of the read ceiling judged against 80%
    (`paged_targets`: the swapped kernel's is the verdict), no delta run and no delta target."""
    import json
    out = tmp_path / "d.json"
    assert kernels.main(["--delta", "--bars-only", "--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    (shape,) = result["shapes"]
    assert shape["context"] == 512 and shape["delta"] == [] and shape["paged"]["io_bytes"] > 0
    assert shape["swapped"]["ok"] and shape["swapped"]["io_bytes"] == shape["paged"]["io_bytes"]
    assert result["targets"] == []
    # the dry run is host-timed: the headline decides, on the engine's kernel
    by_kernel = {t["kernel"]: t for t in result["paged_targets"]}
    assert set(by_kernel) == {"paged", "swapped"}
    assert by_kernel["swapped"]["verdict"] and not by_kernel["paged"]["verdict"]
    assert all(t["context"] == 512 and t["timing"] == "headline" and t["bar"] == 80.0 for t in by_kernel.values())
    assert by_kernel["swapped"]["by_page"] == {"64": shape["swapped"]["pct_read"]}


def test_paged_targets_take_the_worst_page_and_device_time_decides():
    """`paged_targets`: per context below 4K and kernel, the worst page layout's % of the read ceiling, by host
    and by device time; the verdict is the engine's swapped kernel by device time where the run has them, else the
    paged kernel's; contexts of 4K and more are the delta bars'."""
    def run(pct, device_s=None):
        timing = {"device": {"seconds": device_s}} if device_s else {}
        return dict(pct_read=pct, io_bytes=4e9, timing=timing)
    shapes = [dict(context=1024, page=16, paged=run(83.0, device_s=1e-3), delta=[]),
              dict(context=1024, page=256, paged=run(78.0, device_s=1.1e-3), delta=[]),
              dict(context=4096, page=16, paged=run(50.0), delta=[])]
    targets = delta_kernels.paged_targets(shapes, read_tbps=4.4)
    by = {t["timing"]: t for t in targets}
    assert set(by) == {"headline", "device"} and all(t["context"] == 1024 and t["kernel"] == "paged" for t in targets)
    assert by["headline"]["worst_pct_read"] == 78.0 and not by["headline"]["met"] and not by["headline"]["verdict"]
    # device: 4 GB in 1.1 ms = 3.64 TB/s = 82.6% of 4.4
    assert by["device"]["worst_pct_read"] == pytest.approx(100 * 4e9 / 1.1e-3 / 1e12 / 4.4)
    assert by["device"]["met"] and by["device"]["verdict"]
    # with the swapped kernel timed, its device figure is the verdict, however the paged kernel does
    for rec, pct in zip(shapes[:2], (70.0, 75.0)):
        rec["swapped"] = run(pct, device_s=0.95e-3)
    verdicts = [(t["kernel"], t["timing"]) for t in delta_kernels.paged_targets(shapes, read_tbps=4.4)
                if t["verdict"]]
    assert verdicts == [("swapped", "device")]
    # a kernel whose output failed its check gives no figure for that layout
    shapes[0]["swapped"]["ok"] = False
    swapped = [t for t in delta_kernels.paged_targets(shapes, read_tbps=4.4) if t["kernel"] == "swapped"]
    assert all(set(t["by_page"]) == {"256"} for t in swapped) and len(swapped) == 2


def test_bars_only_needs_delta():
    with pytest.raises(SystemExit):
        kernels.main(["--bars-only"])
