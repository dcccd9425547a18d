"""pallas_kernels/decode_matmul.py (the weight-streaming decode GEMM, run in the Mosaic GPU interpreter) and
stratum_jax/model/projection.py (which projections use it, and the engine's --projections choice)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode_matmul import (TuningConfig, decode_gated_matmul, decode_gated_matmul_reference,
                                          decode_matmul, decode_matmul_reference, default_k_splits, supports)
from stratum_jax.config import RuntimeConfig
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fuse_layer
from stratum_jax.model.projection import (KERNEL_CONFIG, LONG_K_CONFIG, ONE_WAVE_CONFIG, DecodeKernelMatmul,
                                          gated_kernel_takes, kernel_config, kernel_takes, resolve_projections,
                                          xla_gated)


def _operands(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    return x, w


@pytest.mark.parametrize("m,n,k,config", [
    (64, 256, 512, TuningConfig(tile_n=128, num_stages=3, k_splits=1)),     # one split, a full row tile
    (5, 128, 1024, TuningConfig(tile_n=64, num_stages=2, k_splits=4)),      # few rows (padded), split-K
    (100, 128, 256, TuningConfig(tile_n=64, num_stages=4, k_splits=None)),  # two row tiles, default split
    (64, 192, 512, TuningConfig(tile_n=96, num_stages=3, k_splits=2)),      # a tile width that is not a power of 2
])
def test_the_kernel_computes_x_times_w_transposed(m, n, k, config):
    x, w = _operands(m, n, k)
    got = decode_matmul(x, w, config=config, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    # Exact up to the one final bf16 rounding: both sum in fp32 (in a different order).
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(decode_matmul_reference(x, w), np.float32),
                               rtol=2e-2, atol=2e-2)
    # ... and it is not the reference by accident: a changed weight column changes that output column only.
    w2 = w.at[3].set(-w[3])
    got2 = decode_matmul(x, w2, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(got2[:, 3], np.float32), -np.asarray(got[:, 3], np.float32), atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got2[:, 4:]), np.asarray(got[:, 4:]))


def test_split_k_sums_in_fp32_before_rounding():
    x, w = _operands(8, 64, 2048, seed=1)
    split = decode_matmul(x, w, out_dtype=jnp.float32, config=TuningConfig(tile_n=64, k_splits=8), interpret=True)
    ref = decode_matmul_reference(x, w, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(split), np.asarray(ref), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,i,k,config", [
    (5, 128, 256, TuningConfig(tile_n=64, num_stages=2)),       # few rows (padded), two column tiles
    (64, 256, 512, TuningConfig(tile_n=128, num_stages=3)),     # a full row tile, 128-column tiles
    (100, 64, 256, TuningConfig(tile_n=64, num_stages=4)),      # two row tiles
    (16, 224, 256, TuningConfig(tile_n=112, num_stages=3)),     # llama-8b's tile width, two column tiles
])
def test_the_gated_kernel_computes_silu_of_gate_times_up(m, i, k, config):
    """decode_gated_matmul against silu(x @ gate.T) * (x @ up.T) with each product rounded to bf16 first (the
    unfused path's numerics); then each half of the weight moves only its own output column."""
    x, w = _operands(m, 2 * i, k, seed=2)
    got = decode_gated_matmul(x, w, config=config, interpret=True)
    assert got.shape == (m, i) and got.dtype == jnp.bfloat16
    want = np.asarray(decode_gated_matmul_reference(x, w), np.float32)
    # The same bf16 products (fp32 sums in another order) and the same activation: equal up to one bf16 rounding.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    assert np.abs(want).max() > 0.3
    # Negating up row 3 negates output column 3 alone; negating gate row 5 changes column 5 alone.
    up_flipped = decode_gated_matmul(x, w.at[i + 3].set(-w[i + 3]), config=config, interpret=True)
    np.testing.assert_array_equal(np.asarray(up_flipped[:, 3], np.float32), -np.asarray(got[:, 3], np.float32))
    np.testing.assert_array_equal(np.asarray(up_flipped[:, 4:]), np.asarray(got[:, 4:]))
    gate_flipped = decode_gated_matmul(x, w.at[5].set(-w[5]), config=config, interpret=True)
    assert not np.array_equal(np.asarray(gate_flipped[:, 5]), np.asarray(got[:, 5]))
    np.testing.assert_array_equal(np.asarray(gate_flipped[:, 6:]), np.asarray(got[:, 6:]))


def test_the_gated_kernel_refuses_what_it_cannot_compute():
    x = jnp.zeros((4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"\[2I, K\]"):
        decode_gated_matmul(x, jnp.zeros((129, 128), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="whole sums"):
        decode_gated_matmul(x, jnp.zeros((256, 128), jnp.bfloat16), config=TuningConfig(k_splits=2), interpret=True)
    with pytest.raises(ValueError, match="multiple of tile_n"):
        decode_gated_matmul(x, jnp.zeros((192, 128), jnp.bfloat16), config=TuningConfig(tile_n=64), interpret=True)


def test_the_gated_projection_falls_back_to_xla_where_the_kernel_does_not_take_it():
    x32 = jnp.asarray(np.random.default_rng(4).standard_normal((3, 128)), jnp.float32)
    w32 = jnp.asarray(np.random.default_rng(5).standard_normal((256, 128)) / 12, jnp.float32)
    assert not gated_kernel_takes(3, 128, 128, jnp.float32)
    np.testing.assert_array_equal(np.asarray(DecodeKernelMatmul(interpret=True).gated(x32, w32)),
                                  np.asarray(xla_gated(x32, w32)))


@pytest.mark.parametrize("n,k", [(3072, 2048), (6144, 4096)])
def test_the_96_column_tiles_lower_to_mosaic_gpu_at_llama_qkv_shapes(n, k):
    """llama-1b's and 8b's q/k/v on ONE_WAVE_CONFIG at batch 64, lowered for CUDA on this CPU."""
    fn = jax.jit(lambda x, w: decode_matmul(x, w, config=kernel_config(64, n, k)))
    text = fn.trace(jax.ShapeDtypeStruct((64, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert f"decode_matmul_{n}x{k}_mosaic_gpu" in text


@pytest.mark.parametrize("i,k", [(8192, 2048), (14336, 4096)])
def test_the_gated_kernel_lowers_to_mosaic_gpu_at_llama_shapes(i, k):
    """llama-1b's and 8b's gate/up at batch 64, lowered for CUDA on this CPU (Mosaic GPU's passes all run)."""
    from stratum_jax.model.projection import gated_kernel_config
    fn = jax.jit(lambda x, w: decode_gated_matmul(x, w, config=gated_kernel_config(i, 64, k)))
    text = fn.trace(jax.ShapeDtypeStruct((64, k), jnp.bfloat16), jax.ShapeDtypeStruct((2 * i, k), jnp.bfloat16)
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert f"decode_gated_matmul_{i}x{k}_mosaic_gpu" in text       # the kernel's name in a trace tells its shape


@pytest.mark.parametrize("x_shape,w_shape,dtype,config,match", [
    ((4, 128), (64, 128), jnp.float32, None, "bfloat16"),
    ((4, 100), (64, 100), jnp.bfloat16, None, "multiple of 64"),
    ((4, 128), (96, 128), jnp.bfloat16, TuningConfig(tile_n=64), "multiple of tile_n"),
    ((300, 128), (128, 128), jnp.bfloat16, None, r"M must be in \[1, 256\]"),
    ((4, 128), (128, 256), jnp.bfloat16, None, "K mismatch"),
    ((4, 192), (128, 192), jnp.bfloat16, TuningConfig(k_splits=2), "multiple of k_splits"),
])
def test_bad_shapes_are_refused_with_what_to_fix(x_shape, w_shape, dtype, config, match):
    with pytest.raises(ValueError, match=match):
        decode_matmul(jnp.zeros(x_shape, dtype), jnp.zeros(w_shape, dtype), config=config, interpret=True)


def test_configs_that_would_not_fit_a_cta_on_the_gpu_are_refused_before_compiling():
    """The interpreter has no SMEM or register limit; the GPU's compile would fail: both entries say what to lower,
    and `supports` says no (so the engine's projections fall back to XLA's dot)."""
    x, w = _operands(256, 128, 1024)
    with pytest.raises(ValueError, match="KB of SMEM.*lower num_stages or tile_n"):      # 6 x (256 + 128) rows
        decode_matmul(x, w, config=TuningConfig(tile_n=128, num_stages=6, k_splits=1), interpret=True)
    assert not supports(256, 128, 1024, TuningConfig(tile_n=128, num_stages=6, k_splits=1))
    assert not supports(256, 128, 1024, TuningConfig(tile_n=128, num_stages=2, k_splits=1))   # [256, 128] fp32 acc
    assert supports(256, 128, 1024, TuningConfig(tile_n=64, num_stages=2, k_splits=1))
    x, w = _operands(128, 256, 256)
    with pytest.raises(ValueError, match="accumulator registers.*lower tile_n"):        # 2 x [128, 128] fp32
        decode_gated_matmul(x, w, config=TuningConfig(tile_n=128, num_stages=2), interpret=True)
    assert not supports(128, 128, 256, TuningConfig(tile_n=128, num_stages=2), gated=True)
    assert supports(64, 128, 256, TuningConfig(tile_n=128, num_stages=2), gated=True)


def test_bad_configs_are_refused():
    for tile_n in (100, 0, 264):       # WGMMA's N: a multiple of 8 up to 256
        with pytest.raises(ValueError, match="tile_n"):
            TuningConfig(tile_n=tile_n)
    with pytest.raises(ValueError, match="num_stages"):
        TuningConfig(num_stages=1)
    with pytest.raises(ValueError, match="k_splits"):
        TuningConfig(k_splits=0)


def test_default_split_fills_the_gpu_only_where_the_columns_do_not():
    # llama-1b with 64-column tiles: o/down (N = 2048, 32 tiles) split K 4 ways (128 CTAs); gate/up (256 tiles)
    # is not split; a short K keeps at least 4 tiles of 64 per split.
    assert default_k_splits(2048, 8192, 64) == 4
    assert default_k_splits(2048, 2048, 64) == 4
    assert default_k_splits(16384, 2048, 64) == 1
    assert default_k_splits(128, 256, 64) == 1
    assert default_k_splits(3072, 2048, 64) == 4     # 48 tiles: 2 splits would give 96 CTAs


def test_which_projections_take_the_kernel():
    # llama-1b's and 8b's q/k/v, o and down at a decode batch; not gate/up or the LM head (XLA streams those
    # as fast), not a prefill chunk's rows, not fp32.
    for n, k in ((3072, 2048), (2048, 2048), (2048, 8192), (6144, 4096), (4096, 4096), (4096, 14336)):
        assert kernel_takes(64, n, k, jnp.bfloat16)
    assert not kernel_takes(64, 16384, 2048, jnp.bfloat16)
    assert not kernel_takes(64, 128256, 2048, jnp.bfloat16)
    assert not kernel_takes(512, 2048, 2048, jnp.bfloat16)
    assert not kernel_takes(64, 2048, 2048, jnp.float32)
    # llama-8b's down (K >= 3 N, N >= 4096) on 128-column tiles split 4 ways where they fit a CTA: at 64 rows, not at
    # 128 (their SMEM); every other llama projection on 64-column tiles.
    assert kernel_config(64, 4096, 14336) == LONG_K_CONFIG and kernel_config(128, 4096, 14336) == KERNEL_CONFIG
    for n, k in ((2048, 2048), (2048, 8192), (4096, 4096)):
        assert kernel_config(64, n, k) == KERNEL_CONFIG
    # q/k/v (1b: 3072 x 2048, 8b: 6144 x 4096): 64-column tiles would give 192 CTAs, 96-column ones 128.
    for n, k in ((3072, 2048), (6144, 4096)):
        assert kernel_config(64, n, k) == ONE_WAVE_CONFIG
        assert n // 96 * default_k_splits(n, k, 96) == 128 and n // 64 * default_k_splits(n, k, 64) == 192
    # The gated kernel takes llama-1b's and 8b's gate/up (the activation moves into its epilogue).
    assert gated_kernel_takes(64, 8192, 2048, jnp.bfloat16) and gated_kernel_takes(64, 14336, 4096, jnp.bfloat16)
    assert not gated_kernel_takes(512, 8192, 2048, jnp.bfloat16)
    # One wave of one CTA an SM: llama-1b's 8192 columns as 128 tiles of 64, llama-8b's 14336 as 128 of 112; a width
    # that 112 does not divide (11008 = 86 x 128) keeps 128-column tiles.
    from stratum_jax.model.projection import gated_kernel_config
    assert gated_kernel_config(8192, 64, 2048) == TuningConfig(tile_n=64, num_stages=6)
    assert gated_kernel_config(14336, 64, 4096) == TuningConfig(tile_n=112, num_stages=5)
    assert gated_kernel_config(11008, 64, 4096) == TuningConfig(tile_n=128, num_stages=4)
    # 128 rows: the wide tile's two accumulators would need 256 registers a thread, so the narrow tile, which fits.
    assert gated_kernel_config(14336, 128, 4096) == TuningConfig(tile_n=64, num_stages=6)
    assert gated_kernel_takes(128, 14336, 4096, jnp.bfloat16)


def test_the_model_on_the_kernel_computes_what_xlas_dot_does():
    """A tiny bf16 model's forward with its projections on the kernel (interpreter) against XLA's dot."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16")
    params = llama.init_params(cfg, seed=3)
    params = {k: fuse_layer(v, 1) if k.startswith("layers_") else v for k, v in params.items()}
    q_out = cfg.num_heads * cfg.head_dim
    for n, k in (((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
                 (cfg.hidden_size, q_out), (cfg.hidden_size, cfg.intermediate_size)):
        assert kernel_takes(8, n, k, jnp.bfloat16)
    assert gated_kernel_takes(8, cfg.intermediate_size, cfg.hidden_size, jnp.bfloat16)     # gate/up + activation
    tokens = jnp.asarray([5, 17, 99, 3, 250, 7, 1, 42], jnp.int32)
    pos = jnp.arange(8, dtype=jnp.int32)

    def run(matmul):
        cache = [(jnp.zeros((cfg.num_kv_heads, 64, cfg.head_dim), jnp.bfloat16),) * 2 for _ in range(cfg.num_layers)]
        # One jitted program, awaited: the interpreter's callbacks run jax ops on the CPU client, and an eager
        # forward kept dispatching its next ops meanwhile; on CI's 2 cores the two deadlocked once (2026-12-02).
        forward = jax.jit(lambda p, c: llama.forward(
            p, cfg, tokens, pos, c, pos, lambda layer, q, k, v: llama.attend_dense_causal(q, k, v, pos), matmul)[0])
        return np.asarray(forward(params, cache), np.float32)

    kernel, xla = run(DecodeKernelMatmul(interpret=True)), run(None)
    # bf16 activations through 2 layers: the two sum in a different order, so allow bf16 rounding steps.
    np.testing.assert_allclose(kernel, xla, rtol=0.05, atol=0.05)
    assert np.mean(np.abs(kernel - xla)) < 0.01 * np.mean(np.abs(xla))


def test_projections_choice():
    bf16, fp32 = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16"), PRESETS["tiny"]
    auto = RuntimeConfig(model="tiny")
    assert resolve_projections(auto, bf16, on_hopper=True, tensor_parallel=1) == "kernel"
    assert resolve_projections(auto, bf16, on_hopper=False, tensor_parallel=1) == "xla"
    assert resolve_projections(auto, bf16, on_hopper=True, tensor_parallel=2) == "xla"
    assert resolve_projections(auto, fp32, on_hopper=True, tensor_parallel=1) == "xla"
    kernel = RuntimeConfig(model="tiny", projections="kernel")
    with pytest.raises(ValueError, match="--interpret-kernels"):
        resolve_projections(kernel, bf16, on_hopper=False, tensor_parallel=1)
    with pytest.raises(ValueError, match="--dtype bfloat16"):
        resolve_projections(kernel, fp32, on_hopper=True, tensor_parallel=1)
    with pytest.raises(ValueError, match="--tensor-parallel 2"):
        resolve_projections(kernel, bf16, on_hopper=True, tensor_parallel=2)
    with pytest.raises(ValueError, match="--projections must be one of"):
        RuntimeConfig(model="tiny", projections="cublas")


def test_the_engine_hands_its_choice_to_the_step():
    from stratum_jax.engine import Engine
    from stratum_jax.model.projection import step_matmul
    engine = Engine(RuntimeConfig(model="tiny", dtype="bfloat16", projections="kernel", interpret_kernels=True,
                                  max_batch_size=2, max_context=256, kv_pool_tokens=4096))
    geo = engine.runner.geo
    assert engine.projections == geo.projections == "kernel" and geo.interpret
    assert step_matmul(geo.projections, interpret=geo.interpret) == DecodeKernelMatmul(interpret=True)
    assert Engine(RuntimeConfig(model="tiny", max_batch_size=2, max_context=256,
                                kv_pool_tokens=4096)).runner.geo.projections == "xla"      # auto, on CPU
