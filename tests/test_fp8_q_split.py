"""pallas_kernels/fp8_q_split.py: q's fp8 parts in one kernel, bit for bit `split_rows_fp8` (+ `stack_q_parts`) in
the Mosaic GPU interpreter; the swapped kernel's float8 path with it (`SwappedConfig.fp8_q_kernel`) against
without; its lowering at llama-8b's decode shape; and, on a GPU, the compiled kernel against XLA's ops."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.fp8_q_split import fp8_q_split, reduce_precision_e4m3_bits
from pallas_kernels.swapped_decode_attention import (SwappedConfig, split_rows_fp8, stack_q_parts,
                                                     swapped_paged_attention)
from pallas_kernels.testing import random_paged_case

F8 = jnp.float8_e4m3fn


def _rows(seed, rows, d, dtype):
    """q rows over a wide range of magnitudes, with a zero row, a row of tiny values (under e4m3's smallest normal
    after the row scale: flushed by the first parts) and one huge row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * np.exp(rng.uniform(-8, 8, (rows, 1)))
    x[1] = 0.0
    x[2, : d // 2] = 1e-9
    x[5] *= 1e20
    return jnp.asarray(x, dtype)


def _xla(x, scale, terms, stacked):
    """The XLA path the kernel replaces: fp32 q times its row's scale, `split_rows_fp8`, `stack_q_parts`."""
    rows = x.shape[0]
    xs = x.astype(jnp.float32) * jnp.tile(scale, rows // scale.shape[0])[:, None]
    parts, unscale = split_rows_fp8(xs, terms)
    return (stack_q_parts(parts) if stacked else parts), unscale


def test_reduce_precision_bits_are_xlas():
    """The bit-level e4m3 rounding against lax.reduce_precision: ties to even, carries into the exponent, the
    flush under 2^-6 and the overflow past 240, both signs."""
    rng = np.random.default_rng(0)
    grid = np.ldexp(1.0 + np.arange(0, 64) / 64.0, -1)[None, :] * np.exp2(np.arange(-10, 10))[:, None]
    ties = (1.0 + (2 * np.arange(8) + 1) / 16.0) * 4.0        # exactly between two 3-bit mantissas
    vals = np.concatenate([grid.ravel(), ties, rng.standard_normal(4096) * 50, [2.0 ** -6, 2.0 ** -6 * 0.99, 239.9,
                                                                               247.9, 248.0, 1e6, 0.0]])
    x = jnp.asarray(np.concatenate([vals, -vals]), jnp.float32)
    want = lax.reduce_precision(x, exponent_bits=4, mantissa_bits=3)
    np.testing.assert_array_equal(np.asarray(reduce_precision_e4m3_bits(x)), np.asarray(want))


@pytest.mark.parametrize("d,dtype,terms,stacked,period", [
    (64, jnp.bfloat16, 2, True, 16),      # the engine's: bf16 q, per-head scales (period Hq), stacked parts
    (128, jnp.float32, 3, True, 32),
    (64, jnp.float32, 1, False, 32),      # one part (a plain cast), unstacked
    (128, jnp.bfloat16, 4, False, 8),
])
def test_the_kernel_is_split_rows_fp8_bit_for_bit(d, dtype, terms, stacked, period):
    rows = 32
    x = _rows(1, rows, d, dtype)
    scale = jnp.asarray(np.random.default_rng(2).uniform(0.01, 4.0, period), jnp.float32)
    parts, unscale = fp8_q_split(x, scale, terms=terms, stacked=stacked, interpret=True)
    want_parts, want_unscale = _xla(x, scale, terms, stacked)
    assert parts.shape == want_parts.shape and parts.dtype == F8
    np.testing.assert_array_equal(np.asarray(unscale), np.asarray(want_unscale))
    np.testing.assert_array_equal(np.asarray(parts.astype(jnp.float32)), np.asarray(want_parts.astype(jnp.float32)))
    # ... and the parts carry q: their sum times the unscale is q to ~2^-(4 terms + 1) of each row's largest |q|.
    p = np.asarray(parts.astype(jnp.float32)).reshape(-1, terms, 8, d) if stacked else \
        np.moveaxis(np.asarray(parts.astype(jnp.float32)), 0, 1).reshape(-1, 8, terms, d).swapaxes(1, 2)
    approx = p.sum(axis=1).reshape(rows, d) * np.asarray(unscale)[:, None]
    xs = np.asarray(x, np.float32) * np.tile(np.asarray(scale), rows // period)[:, None]
    assert np.all(np.abs(approx - xs) <= 2.0 ** -(4 * terms) * np.abs(xs).max(axis=1, keepdims=True) + 1e-30)


@pytest.mark.parametrize("x_shape,scale_shape,terms,match", [
    ((12, 64), (4,), 2, "multiple of 8"),
    ((16, 96), (8,), 2, "one of"),
    ((32, 64), (12,), 2, "row_scale"),
    ((32, 64), (8,), 5, "terms"),
])
def test_bad_inputs_say_what_to_fix(x_shape, scale_shape, terms, match):
    with pytest.raises(ValueError, match=match):
        fp8_q_split(jnp.zeros(x_shape, jnp.bfloat16), jnp.ones(scale_shape, jnp.float32), terms=terms, stacked=True,
                    interpret=True)


def test_the_swapped_kernel_gives_the_same_output_with_it():
    """`SwappedConfig.fp8_q_kernel`: q's parts from the kernel instead of XLA's ops, the per-head q_scale inside it,
    an fp32 output: the same attention output bit for bit (float8 pools with NaN in every stale slot, every page
    size, split-K 2). q_scale is refused for other pools."""
    case = random_paged_case(13, lengths=[1, 7, 0, 65, 129, 300, 63, 127], page_sizes=[8, 8, 16, 64, 128, 256, 32, 16],
                             num_q_heads=8, num_kv_heads=2, head_dim=64)
    f8 = {**case, "k_pool": case["k_pool"].astype(F8), "v_pool": case["v_pool"].astype(F8)}
    q_scale = jnp.asarray([0.5, 2.0, 0.25, 1.0, 3.0, 0.125, 1.5, 0.75], jnp.float32)
    config = SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2)
    kw = dict(q_scale=q_scale, out_dtype=jnp.float32, interpret=True)
    xla = swapped_paged_attention(**f8, config=config, **kw)
    kernel = swapped_paged_attention(**f8, config=dataclasses.replace(config, fp8_q_kernel=True), **kw)
    assert kernel.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(xla))
    # q_scale is q times its head's factor: the same as scaling q first.
    scaled = {**f8, "q": (f8["q"].astype(jnp.float32) * q_scale[None, :, None])}
    np.testing.assert_array_equal(np.asarray(swapped_paged_attention(**scaled, config=config, interpret=True)),
                                  np.asarray(xla))
    with pytest.raises(ValueError, match="q_scale"):
        swapped_paged_attention(**case, q_scale=q_scale, interpret=True)


def test_lowers_to_mosaic_gpu_at_llama_8b_shapes():
    """B=64, Hq=32, Hkv=8, D=128, the float8 default with the kernel: both kernels lowered for CUDA on this CPU."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    config = dataclasses.replace(SwappedConfig(block_kv=64, num_stages=2, fp8_q_terms=2, refill_under_pv=True),
                                 fp8_q_kernel=True)
    fn = jax.jit(lambda *a: swapped_paged_attention(*a, config=config, out_dtype=jnp.float32))
    text = fn.trace(shape(64, 32, 128), shape(8, 1 << 16, 128, dt=F8), shape(8, 1 << 16, 128, dt=F8),
                    shape(64, dt=jnp.int32), shape(64, 512, dt=jnp.int32), shape(64, dt=jnp.int32),
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_q_split_mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
def test_gpu_matches_xlas_ops_at_llama_8b_shapes():
    """The compiled kernel against XLA's split at the engine's shape (B=64, Hq=32, D=128, bf16 q, per-head scales):
    the same parts and unscales bit for bit."""
    x = _rows(3, 64 * 32, 128, jnp.bfloat16)
    scale = jnp.asarray(np.random.default_rng(4).uniform(0.01, 4.0, 32), jnp.float32)
    parts, unscale = jax.jit(lambda x, s: fp8_q_split(x, s, terms=2, stacked=True))(x, scale)
    want_parts, want_unscale = jax.jit(lambda x, s: _xla(x, s, 2, True))(x, scale)
    np.testing.assert_array_equal(np.asarray(unscale), np.asarray(want_unscale))
    np.testing.assert_array_equal(np.asarray(parts.astype(jnp.float32)), np.asarray(want_parts.astype(jnp.float32)))
