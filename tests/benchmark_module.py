"""Loads a benchmarks/*.py script as a module for tests, from its file.

Not through sys.path: putting benchmarks/ on it would shadow the `serving` package with benchmarks/serving.py.
The module is registered in sys.modules under `name` while it loads (dataclasses look their module up there).
Shared helper modules the scripts import by their bare name (`from device_trace import ...`, found beside a
script run directly) are loaded into sys.modules first, under that name.
"""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
# benchmarks/<name>.py that other scripts import by bare name, loaded in this order (a helper imports only helpers
# listed before it: run_record imports none; kernel_timing imports device_trace and gpu_clocks; delta_kernels
# config_flags, kernel_timing, paged_layout and run_record; norm_fold imports l2_prefetch, which imports device_trace;
# gemm_fixed_cost imports decode_gemm, which imports config_flags, device_trace and kernel_timing).
SHARED_HELPERS = ("run_record", "device_trace", "config_flags", "gpu_clocks", "kernel_timing", "paged_layout",
                  "delta_kernels", "l2_prefetch", "decode_gemm")


def load_benchmark(script: str, name: str):
    """benchmarks/<script> as a module called `name` (left in sys.modules; `forget` removes it)."""
    if name not in SHARED_HELPERS:       # the helpers import no benchmark script
        for helper in SHARED_HELPERS:
            if helper not in sys.modules:
                load_benchmark(f"{helper}.py", helper)
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def forget(name: str) -> None:
    sys.modules.pop(name, None)
