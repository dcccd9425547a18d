"""benchmarks/kernels.py --delta: #12's speed bars are judged on the worst page layout of each context >= 4K,
and a layout whose every config failed counts as a miss."""
import math

from benchmark_module import load_benchmark

delta_targets = load_benchmark("kernels.py", "bench_kernels").delta_targets


def _shape(ctx, **x_by_precision):
    return dict(context=ctx, delta=[dict(precision=p.replace("_", "-"), anchor_len=1,
                                         best=None if x is None else dict(x_paged=x))
                                    for p, x in x_by_precision.items()])


def test_worst_layout_per_context_and_failures_miss():
    shapes = [_shape(1024, fp8_delta=3.0),                                   # below 4K: not judged
              _shape(4096, fp8_delta=0.55, fp16_delta=None),
              _shape(4096, fp8_delta=0.65, fp16_delta=1.0),
              _shape(16384, fp8_delta=0.5, fp16_delta=1.1)]
    got = {(t["precision"], t["context"]): (t["worst_x_paged"], t["met"]) for t in delta_targets(shapes)}
    assert got == {("fp8-delta", 4096): (0.65, False), ("fp8-delta", 16384): (0.5, True),
                   ("fp16-delta", 4096): (math.inf, False), ("fp16-delta", 16384): (1.1, True)}
