"""Shared pytest set-up: the fast Mosaic GPU interpreter (fast_interpreter.py); tests marked `gpu` skip cleanly unless
jax sees an NVIDIA GPU."""
import os

import jax
import pytest

import fast_interpreter

# The Mosaic GPU interpreter without jax's per-callback device_put (fast_interpreter.py): most of CI's time is
# interpreted kernels.
if os.environ.get("STRATUM_PLAIN_INTERPRETER") != "1":
    _why_not = fast_interpreter.install()
    if _why_not:
        print(f"[tests] the interpreter runs as jax ships it: {_why_not}")


# The slowest test files on the 2-core CI machine (their summed durations, slowest first, session 37). CI runs 2
# xdist workers with --dist loadfile, which hands out whole files in collection order: alphabetical order left the
# slowest files (test_tensor_parallel.py: ~1 min of set-up, test_serving*.py) for the end, where one worker ran
# them while the other sat idle. Handing the long ones out first shortens that tail.
SLOWEST_FILES_FIRST = ("test_swapped_decode_attention.py", "test_l2_prefetch.py", "test_paged_attention.py",
                       "test_engine_kernel.py", "test_host_tier.py", "test_norm_fold_bench.py",
                       "test_tensor_parallel.py", "test_attention_bound_bench.py", "test_delta_attention.py",
                       "test_gpu_preflight.py", "test_residual_rmsnorm.py", "test_fold_norms.py", "test_engine.py",
                       "test_norm_fold.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))      # stable: file order kept otherwise
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.default_backend() is not 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fresh_engine_steps(monkeypatch):
    """The engine steps this test builds are traced and compiled here, not taken from the process's compiled steps
    (stratum_jax/model_runner.py `_EXECUTABLES`, shared by engines of one config, and the step functions' trace
    caches): for a test that counts what a step traces. The other tests' compiled steps are back after it, so the
    files that run later in the worker still reuse them."""
    from stratum_jax import decode, model_runner
    monkeypatch.setattr(model_runner, "_EXECUTABLES", {})
    for step in (decode.packed_step, decode.decode_steps):
        step.clear_cache()


@pytest.fixture
def two_splits(monkeypatch):
    """The paged-attention kernel's default split for tiny grids is 16 CTAs per (row, kv head), which the
    Mosaic GPU interpreter runs slowly; 2 splits still exercise the split-K merge (of outputs and stats)."""
    import pallas_kernels.paged_attention as paged_attention_module
    import pallas_kernels.swapped_decode_attention as swapped_module
    for module in (paged_attention_module, swapped_module):
        monkeypatch.setattr(module, "default_num_splits", lambda batch, num_kv_heads: 2)
