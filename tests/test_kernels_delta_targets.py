"""benchmarks/kernels.py --delta: #12's speed bars are judged on the worst page layout of each context >= 4K,
and a layout whose every config failed counts as a miss; each timing method (the headline, the device chain
slope, the Pallas kernels alone from a profile) is judged on its own figures."""
import math
import sys

import pytest

from benchmark_module import load_benchmark

load_benchmark("kernels.py", "bench_kernels")
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
