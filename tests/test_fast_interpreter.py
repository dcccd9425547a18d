"""tests/fast_interpreter.py (installed for the whole suite by conftest.py) changes how fast the Mosaic GPU
interpreter runs, not what it computes: a kernel gives the same bits both ways, and other io_callbacks keep jax's
own path."""
import os

import numpy as np
import pytest

import fast_interpreter
import jax
import jax.numpy as jnp
from pallas_kernels.swapped_decode_attention import SwappedConfig, swapped_paged_attention
from pallas_kernels.testing import random_paged_case

pytestmark = pytest.mark.skipif(os.environ.get("STRATUM_PLAIN_INTERPRETER") == "1",
                                reason="the suite runs on jax's own interpreter path")


def test_it_is_installed_for_the_suite():
    assert fast_interpreter.install() is None, fast_interpreter.unsupported_reason()


def test_a_kernel_gives_the_same_bits_both_ways(monkeypatch):
    """The swapped kernel (TMA copies, barriers, WGMMAs, split-K 2, score stats, fp8 pools with q parts): every
    interpreter callback kind a decode attention kernel makes, on the fast path and on jax's."""
    verdicts = []
    real_check = fast_interpreter.is_interpreter_callback
    monkeypatch.setattr(fast_interpreter, "is_interpreter_callback",
                        lambda callback: verdicts.append(real_check(callback)) or verdicts[-1])
    case = random_paged_case(3, lengths=[0, 9, 70], page_sizes=[8, 16, 64], num_q_heads=4, num_kv_heads=1,
                             head_dim=64)
    for pool_dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        pools = {k: case[k].astype(pool_dtype) for k in ("k_pool", "v_pool")}
        config = SwappedConfig(block_kv=64, num_stages=2, num_splits=2)

        def run():
            out, var = swapped_paged_attention(**{**case, **pools}, config=config, interpret=True,
                                               return_score_stats=True)
            return np.asarray(out.astype(jnp.float32)), np.asarray(var)
        fast = run()
        assert sum(verdicts) > 100, "the kernel did not take the fast path"
        verdicts.clear()
        with fast_interpreter.plain_interpreter():
            plain = run()
        assert not verdicts, "jax's own path went through the fast one"
        for a, b in zip(fast, plain, strict=True):
            np.testing.assert_array_equal(a, b)
        assert np.isfinite(fast[0]).all() and np.abs(fast[0]).max() > 0


def test_other_io_callbacks_keep_jax_arrays():
    seen = []

    def record(x):
        seen.append(type(x))
        return np.asarray(x) + 1

    out = jax.jit(lambda x: jax.experimental.io_callback(record, jax.ShapeDtypeStruct((2,), jnp.int32), x))(
        jnp.arange(2, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), [1, 2])
    assert seen and all(issubclass(t, jax.Array) for t in seen), seen
    assert not fast_interpreter.is_interpreter_callback(record)
