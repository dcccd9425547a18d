"""pallas_kernels/l2_prefetch.py: the norm kernel's L2 prefetch of the next projection's weight. The plan's boxes
cover exactly the region the next GEMM reads first; the kernel with a prefetch gives the same bits as without
(interpreter, where the prefetch is a no-op) and lowers for CUDA with the prefetch in it; the model's boundaries pass
each norm the projection it feeds; bad plans and flags say what to fix. Whether it is faster is an H200 question
(benchmarks/l2_prefetch.py, BENCHMARKS.md #18)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusion_cases import forward_with, greedy_tokens
from pallas_kernels.decode_matmul import default_k_splits
from pallas_kernels.l2_prefetch import L2Prefetch, prefetch_counts, prefetch_plan
from pallas_kernels.residual_rmsnorm import residual_rmsnorm
from stratum_jax.config import RuntimeConfig
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fuse_layer
from stratum_jax.model.projection import DecodeKernelMatmul, NextWeight, kernel_config

EPS = 1e-5


@pytest.mark.parametrize("shape, splits, fraction, prefix", [
    ((3072, 2048), 4, 1.0, 512),        # llama-1b q/k/v, whole (12.6 MB)
    ((6144, 4096), 2, 0.25, 512),       # 8b q/k/v, a quarter of each split
    ((16384, 2048), 1, 0.1, 192),       # 1b gate/up (gated: no split), 10% -> 3 tiles of 64 columns
    ((28672, 4096), 1, 0.001, 64),      # 8b gate/up: at least one tile
    ((200, 512), 2, 1.0, 256),          # rows in boxes of 200 (a multiple of 8 dividing 200)
])
def test_the_plan_covers_each_splits_first_columns_once(shape, splits, fraction, prefix):
    plan = prefetch_plan(shape, splits=splits, fraction=fraction)
    assert plan.prefix == prefix and all(b <= 256 for b in plan.box_shape)
    counts = prefetch_counts(plan)
    want = np.zeros(shape, np.int32)
    for s in range(splits):
        want[:, s * shape[1] // splits: s * shape[1] // splits + prefix] = 1
    np.testing.assert_array_equal(counts, want)
    assert plan.nbytes == 2 * int(want.sum())


@pytest.mark.parametrize("kwargs, match", [
    (dict(rows=100, cols=512, splits=1, prefix=64), "rows .* multiple of 8"),
    (dict(rows=64, cols=500, splits=1, prefix=64), "cols .* multiple of 64"),
    (dict(rows=64, cols=512, splits=4, prefix=192), "at most a split's 128"),
    (dict(rows=64, cols=512, splits=1, prefix=100), "prefix .* multiple of 64"),
    (dict(rows=64, cols=512, splits=0, prefix=64), "splits must be a positive int"),
])
def test_bad_plans_say_what_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        L2Prefetch(**kwargs)


def test_fraction_zero_is_no_plan_and_out_of_range_is_refused():
    assert prefetch_plan((256, 512), splits=1, fraction=0.0) is None
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\]"):
        prefetch_plan((256, 512), splits=1, fraction=1.5)


def _case(seed, *, splits, rows, hidden, n, k):
    keys = jax.random.split(jax.random.key(seed), 4)
    parts = jax.random.normal(keys[0], (splits, rows, hidden), jnp.float32)
    residual = (4.0 * jax.random.normal(keys[1], (rows, hidden), jnp.float32)).astype(jnp.bfloat16)
    weight = (1.0 + 0.2 * jax.random.normal(keys[2], (hidden,), jnp.float32)).astype(jnp.bfloat16)
    next_weight = jax.random.normal(keys[3], (n, k), jnp.float32).astype(jnp.bfloat16)
    return parts, residual, weight, next_weight


def test_the_kernel_with_a_prefetch_gives_the_same_bits():
    """Interpreter: 8 rows (8 CTAs) prefetching 12 boxes (two rounds, the second predicated) of a [1536, 512] weight."""
    parts, residual, weight, next_weight = _case(0, splits=2, rows=8, hidden=256, n=1536, k=512)
    plan = prefetch_plan(next_weight.shape, splits=2, fraction=1.0)
    assert plan.num_boxes == 12
    plain = residual_rmsnorm(parts, residual, weight, eps=EPS, interpret=True)
    fetched = residual_rmsnorm(parts, residual, weight, eps=EPS, prefetch_weight=next_weight, prefetch=plan,
                               interpret=True)
    for a, b in zip(plain, fetched, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def _lowered(splits, hidden, rows, plan):
    sd = jax.ShapeDtypeStruct
    args = [sd((splits, 64, hidden), jnp.float32), sd((rows, hidden), jnp.bfloat16), sd((hidden,), jnp.bfloat16)]
    if plan is None:
        fn = jax.jit(lambda p, r, w: residual_rmsnorm(p, r, w, eps=EPS))
    else:
        fn = jax.jit(lambda p, r, w, nw: residual_rmsnorm(p, r, w, eps=EPS, prefetch_weight=nw, prefetch=plan))
        args.append(sd((plan.rows, plan.cols), jnp.bfloat16))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("splits, hidden, n, k, qkv_splits, mb", [
    (4, 2048, 3072, 2048, 4, 16),       # llama-1b: input norm -> q/k/v, whole
    (2, 4096, 6144, 4096, 2, 8),        # 8b: input norm -> q/k/v, 8 of 50 MB
    (4, 2048, 16384, 2048, 1, 8),       # 1b: post-attention norm -> gate/up
])
def test_lowers_for_cuda_with_the_prefetch_in_the_kernel(splits, hidden, n, k, qkv_splits, mb):
    """Lowered for CUDA on this CPU at llama shapes: still one Mosaic GPU call, now taking the next weight, and its
    module holds TMA prefetches the plain kernel's does not."""
    plan = prefetch_plan((n, k), splits=qkv_splits, fraction=min(1.0, mb * 2**20 / (n * k * 2)))
    plain, fetched = _lowered(splits, hidden, 64, None), _lowered(splits, hidden, 64, plan)
    assert fetched.count("stablehlo.custom_call @mosaic_gpu") == 1 and "residual_rmsnorm_mosaic_gpu" in fetched
    call = re.search(r"stablehlo.custom_call @mosaic_gpu\w*\(([^)]*)\)", fetched).group(1)
    assert call.count("%") == 4                          # parts, residual, norm weight, the next weight
    assert fetched.count("prefetch") > plain.count("prefetch")


def test_the_gated_gemm_with_a_prefetch_gives_the_same_bits():
    """Interpreter: the gated GEMM (4 CTAs of 64 columns) prefetching a [256, 1024] down weight's first 128 columns
    of each of its 2 splits (2 boxes for 4 CTAs: a predicated round) gives the bits it gives without."""
    from pallas_kernels.decode_matmul import TuningConfig, decode_gated_matmul
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (8, 256), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (512, 256), jnp.float32) / 16).astype(jnp.bfloat16)
    down = jax.random.normal(keys[2], (256, 1024), jnp.float32).astype(jnp.bfloat16)
    plan = prefetch_plan(down.shape, splits=2, fraction=0.25)
    assert plan.prefix == 128 and plan.num_boxes == 2
    config = TuningConfig(tile_n=64, num_stages=2)
    plain = decode_gated_matmul(x, w, config=config, interpret=True)
    fetched = decode_gated_matmul(x, w, config=config, prefetch_weight=down, prefetch=plan, interpret=True)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(fetched, np.float32))


@pytest.mark.parametrize("i, k, down_splits, mb", [(8192, 2048, 4, 8), (14336, 4096, 4, 8)])
def test_the_gated_gemm_lowers_for_cuda_with_the_prefetch(i, k, down_splits, mb):
    """llama-1b / 8b's gate/up at 64 rows with the engine's config, prefetching 8 MB of the down projection."""
    from pallas_kernels.decode_matmul import decode_gated_matmul
    from stratum_jax.model.projection import gated_kernel_config
    sd = jax.ShapeDtypeStruct
    config = gated_kernel_config(i, 64, k)
    plan = prefetch_plan((k, i), splits=down_splits, fraction=mb * 2**20 / (k * i * 2))

    def lowered(plan):
        if plan is None:
            fn = jax.jit(lambda x, w: decode_gated_matmul(x, w, config=config))
            return fn.trace(sd((64, k), jnp.bfloat16), sd((2 * i, k), jnp.bfloat16)).lower(
                lowering_platforms=("cuda",)).as_text()
        fn = jax.jit(lambda x, w, d: decode_gated_matmul(x, w, config=config, prefetch_weight=d, prefetch=plan))
        return fn.trace(sd((64, k), jnp.bfloat16), sd((2 * i, k), jnp.bfloat16), sd((k, i), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
    plain, fetched = lowered(None), lowered(plan)
    assert fetched.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert fetched.count("prefetch") > plain.count("prefetch")


def test_the_attention_kernel_with_a_prefetch_gives_the_same_bits():
    """Interpreter: the swapped decode kernel over a ragged mixed-page batch (4 rows x 2 kv heads, no split and split
    2), prefetching a [256, 512] weight's 2 boxes (fewer than the CTAs: a predicated round), gives its bits
    without."""
    from pallas_kernels.swapped_decode_attention import SwappedConfig, swapped_paged_attention
    from pallas_kernels.testing import random_paged_case
    case = random_paged_case(4, lengths=[1, 65, 0, 200], page_sizes=[8, 64, 16, 32], num_q_heads=8, num_kv_heads=2,
                             head_dim=64)
    o_weight = jax.random.normal(jax.random.key(9), (256, 512), jnp.float32).astype(jnp.bfloat16)
    plan = prefetch_plan(o_weight.shape, splits=1, fraction=1.0)
    assert plan.num_boxes == 2
    for splits in (1, 2):
        config = SwappedConfig(block_kv=64, num_stages=2, num_splits=splits)
        plain = swapped_paged_attention(**case, config=config, interpret=True)
        fetched = swapped_paged_attention(**case, config=config, prefetch_weight=o_weight, prefetch=plan,
                                          interpret=True)
        np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(fetched, np.float32))


@pytest.mark.parametrize("head_dim, hidden", [(64, 2048), (128, 4096)])
def test_the_attention_kernel_lowers_for_cuda_with_the_prefetch(head_dim, hidden):
    """llama-1b / 8b's decode shapes (B=64, Hq=32, Hkv=8, the default config) prefetching the o projection."""
    from pallas_kernels.swapped_decode_attention import swapped_paged_attention
    sd = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    args = (sd(64, 32, head_dim), sd(8, 1 << 16, head_dim), sd(8, 1 << 16, head_dim), sd(64, dt=jnp.int32),
            sd(64, 4096 // 8, dt=jnp.int32), sd(64, dt=jnp.int32))
    q_out = 32 * head_dim
    plan = DecodeKernelMatmul(l2_prefetch_mb=16).prefetch_plan(64, NextWeight(sd(hidden, q_out)))
    plain = jax.jit(lambda *a: swapped_paged_attention(*a)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    fetched = jax.jit(lambda *a: swapped_paged_attention(*a[:-1], prefetch_weight=a[-1], prefetch=plan)).trace(
        *args, sd(hidden, q_out)).lower(lowering_platforms=("cuda",)).as_text()
    assert fetched.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert fetched.count("prefetch") > plain.count("prefetch")


def _rope_case(rows=16, table_rows=8):
    from pallas_kernels.testing import random_paged_case
    hq, hkv, d = 4, 2, 64
    case = random_paged_case(0, lengths=[1, 65, 0, 200, 8, 64, 130, 3][:table_rows],
                             page_sizes=[8, 64, 16, 32, 256, 8, 128, 16][:table_rows], num_q_heads=hq,
                             num_kv_heads=hkv, head_dim=d)
    keys = jax.random.split(jax.random.key(0), 3)
    parts = jax.random.normal(keys[0], (2, rows, (hq + 2 * hkv) * d), jnp.float32)
    cos, sin = (jax.random.uniform(k, (rows, d // 2)) for k in keys[1:])
    slots = (jnp.arange(rows, dtype=jnp.int32) * 8 + 4096) % case["k_pool"].shape[1]
    return case, (parts, cos, sin, slots, case["k_pool"], case["v_pool"]), dict(num_q_heads=hq, num_kv_heads=hkv)


def test_the_kv_write_with_attentions_first_tiles_prefetched_gives_the_same_bits():
    """Interpreter: rope_kv_write over 16 token rows, 8 of them decode rows with tables (every page size, lengths
    0 to 200, NaN outside the sequences, garbage past each row's pages), prefetching their first 64 keys and values:
    q and both pools equal those without, bit for bit (the table reads stay inside each row's pages)."""
    from pallas_kernels.rope_kv_write import FirstTiles, rope_kv_write
    case, args, heads = _rope_case()
    first = FirstTiles(case["page_starts"], case["page_sizes"], case["lengths"])
    plain = rope_kv_write(*args, **heads, interpret=True)
    fetched = rope_kv_write(*args, **heads, first_tiles=first, interpret=True)
    for a, b in zip(plain, fetched, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kv_write_lowers_for_cuda_with_the_first_tiles_prefetch(head_dim):
    """llama-1b / 8b's decode shapes: 64 rows, a table 80 entries wide (max context 640)."""
    from pallas_kernels.rope_kv_write import FirstTiles, rope_kv_write
    sd = jax.ShapeDtypeStruct
    args = [sd((4, 64, 48 * head_dim), jnp.float32), sd((64, head_dim // 2), jnp.float32),
            sd((64, head_dim // 2), jnp.float32), sd((64,), jnp.int32), sd((8, 1 << 16, head_dim), jnp.bfloat16),
            sd((8, 1 << 16, head_dim), jnp.bfloat16)]
    tables = FirstTiles(sd((64, 80), jnp.int32), sd((64,), jnp.int32), sd((64,), jnp.int32))
    plain = jax.jit(lambda *a: rope_kv_write(*a, num_q_heads=32, num_kv_heads=8)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    fetched = jax.jit(lambda t, *a: rope_kv_write(*a, num_q_heads=32, num_kv_heads=8, first_tiles=t)).trace(
        tables, *args).lower(lowering_platforms=("cuda",)).as_text()
    assert fetched.count("stablehlo.custom_call @mosaic_gpu") == 1
    assert fetched.count("prefetch") > plain.count("prefetch")


@pytest.mark.parametrize("change, match", [
    (dict(prefetch_tokens=32), "prefetch_tokens must be one of"),
    (dict(starts=np.zeros((8, 0), np.int32)), r"W >= 1"),
    (dict(starts=np.zeros((24, 16), np.int32)), r"1 <= T <= R = 16"),
    (dict(sizes=np.zeros((8,), np.float32)), r"page_sizes must be \[T\] = \[8\] int32"),
])
def test_bad_first_tiles_are_refused(change, match):
    from pallas_kernels.rope_kv_write import FirstTiles, rope_kv_write
    case, args, heads = _rope_case()
    starts = jnp.asarray(change.get("starts", case["page_starts"]))
    sizes = jnp.asarray(change.get("sizes", case["page_sizes"]))
    lengths = case["lengths"] if starts.shape[0] == 8 else jnp.zeros((starts.shape[0],), jnp.int32)
    sizes = sizes if starts.shape[0] == 8 or "sizes" in change else jnp.full((starts.shape[0],), 8, jnp.int32)
    with pytest.raises(ValueError, match=match):
        rope_kv_write(*args, **heads, first_tiles=FirstTiles(starts, sizes, lengths),
                      prefetch_tokens=change.get("prefetch_tokens", 64), interpret=True)


def test_bad_prefetch_arguments_are_refused():
    parts, residual, weight, next_weight = _case(0, splits=2, rows=8, hidden=256, n=768, k=512)
    plan = prefetch_plan((768, 512), splits=2, fraction=1.0)
    with pytest.raises(ValueError, match="together"):
        residual_rmsnorm(parts, residual, weight, eps=EPS, prefetch=plan, interpret=True)
    with pytest.raises(ValueError, match=r"prefetch_weight must be bfloat16 \(768, 512\)"):
        residual_rmsnorm(parts, residual, weight, eps=EPS, prefetch_weight=next_weight[:512], prefetch=plan,
                         interpret=True)


def test_the_matmul_plans_by_the_next_gemms_split_and_the_budget():
    """DecodeKernelMatmul.prefetch_plan at llama-1b's shapes, 64 rows: q/k/v (12 MB) whole under a 16 MB budget,
    split as its GEMM splits; gate/up (64 MB) its first 8 MB, one split; nothing with the budget at 0 or for a
    projection XLA runs (the LM head's width)."""
    qkv = NextWeight(jax.ShapeDtypeStruct((3072, 2048), jnp.bfloat16))
    gate_up = NextWeight(jax.ShapeDtypeStruct((16384, 2048), jnp.bfloat16), gated=True)
    plan = DecodeKernelMatmul(l2_prefetch_mb=16).prefetch_plan(64, qkv)
    config = kernel_config(64, 3072, 2048)
    assert plan.splits == (config.k_splits or default_k_splits(3072, 2048, config.tile_n))
    assert plan.nbytes == 3072 * 2048 * 2
    plan = DecodeKernelMatmul(l2_prefetch_mb=8).prefetch_plan(64, gate_up)
    assert plan.splits == 1 and plan.nbytes == 8 * 2**20
    assert DecodeKernelMatmul().prefetch_plan(64, qkv) is None
    assert DecodeKernelMatmul(l2_prefetch_mb=8).prefetch_plan(
        64, NextWeight(jax.ShapeDtypeStruct((128256, 2048), jnp.bfloat16))) is None


# As test_residual_rmsnorm.py's: hidden 256, 4 q heads of 64, intermediate 1024.
_CFG = dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=1024, head_dim=64, dtype="bfloat16")


def test_the_models_boundaries_prefetch_the_projection_they_feed(monkeypatch):
    """A forward with the projections on the kernel (interpreter) and a 1 MB budget: every fused boundary but the
    final norm gets a plan for the weight it feeds (post-attention: gate/up; each later layer's input: q/k/v), the
    gate/up GEMM one for the down projection, each attention call the o projection's, and the hidden states and caches
    equal those without the prefetch, bit for bit."""
    import pallas_kernels.residual_rmsnorm as norm_module
    import pallas_kernels.decode_matmul as matmul_module
    plans = []

    def recording(real, kernel):
        def call(*args, prefetch=None, prefetch_weight=None, **kwargs):
            plans.append((kernel, None if prefetch is None else (prefetch.rows, prefetch.cols, prefetch_weight.shape)))
            return real(*args, prefetch=prefetch, prefetch_weight=prefetch_weight, **kwargs)
        return call
    monkeypatch.setattr("stratum_jax.model.projection.residual_rmsnorm",
                        recording(norm_module.residual_rmsnorm, "norm"))
    monkeypatch.setattr("stratum_jax.model.projection.decode_gated_matmul",
                        recording(matmul_module.decode_gated_matmul, "gated"))
    params = llama.init_params(_CFG, seed=5)
    params = {k: fuse_layer(v, 1) if k.startswith("layers_") else v for k, v in params.items()}   # the engine's layout
    attends = []
    _, fetched = forward_with(_CFG, params, DecodeKernelMatmul(interpret=True, l2_prefetch_mb=1), attends)
    qkv_rows = (_CFG.num_heads + 2 * _CFG.num_kv_heads) * _CFG.head_dim
    i = _CFG.intermediate_size
    post = ("norm", (2 * i, 256, (2 * i, 256)))
    gated = ("gated", (256, i, (256, i)))
    later_input = ("norm", (qkv_rows, 256, (qkv_rows, 256)))
    want = [post, gated] + [later_input, post, gated] * (_CFG.num_layers - 1) + [("norm", None)]
    assert plans == want
    # Each layer's attention got the o projection's weight and its plan (whole under the budget, one split).
    o_shape = params["layers_0"]["self_attn"]["o_proj"]["weight"].shape
    assert len(attends) == _CFG.num_layers
    for got in attends:
        assert got.weight.shape == o_shape and (got.plan.rows, got.plan.cols, got.plan.prefix) == (*o_shape, o_shape[1])
    plans.clear()
    attends.clear()
    _, plain = forward_with(_CFG, params, DecodeKernelMatmul(interpret=True), attends)
    assert plans == [(kernel, None) for kernel, _ in want] and attends == [None] * len(attends)
    for a, b in zip(fetched, plain, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("value", [-1.0, 51.0, float("nan"), "8"])
def test_the_flag_is_checked(value):
    with pytest.raises(ValueError, match=r"--l2-prefetch-mb must be a number of MB in \[0, 50"):
        RuntimeConfig(l2_prefetch_mb=value)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
def test_gpu_the_compiled_kernels_with_prefetches_give_the_same_bits(model):
    """On the GPU at llama shapes, 64 rows: the norm kernel prefetching q/k/v (16 MB budget) and gate/up, the gated
    GEMM prefetching down, the decode attention kernel (~1K context) prefetching o and the fused q/k/v write
    prefetching attention's first tiles compile, run, and give the bits they give without (the prefetch only warms
    L2)."""
    from pallas_kernels.decode_matmul import decode_gated_matmul
    from stratum_jax.model.projection import gated_kernel_config
    cfg = PRESETS[model]
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    matmul = DecodeKernelMatmul(l2_prefetch_mb=16)
    keys = jax.random.split(jax.random.key(0), 4)
    parts, residual, weight, qkv = _case(1, splits=2, rows=64, hidden=h, n=qkv_rows, k=h)
    gate_up = (jax.random.normal(keys[0], (2 * i, h), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[1], (h, i), jnp.float32) * i ** -0.5).astype(jnp.bfloat16)
    for next_weight in (qkv, gate_up):
        plan = matmul.prefetch_plan(64, NextWeight(next_weight, next_weight is gate_up))
        assert plan is not None
        plain = residual_rmsnorm(parts, residual, weight, eps=EPS)
        fetched = residual_rmsnorm(parts, residual, weight, eps=EPS, prefetch_weight=next_weight, prefetch=plan)
        for a, b in zip(plain, fetched, strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    plan = matmul.prefetch_plan(64, NextWeight(down))
    x = jax.random.normal(keys[2], (64, h), jnp.float32).astype(jnp.bfloat16)
    config = gated_kernel_config(i, 64, h)
    plain = decode_gated_matmul(x, gate_up, config=config)
    fetched = decode_gated_matmul(x, gate_up, config=config, prefetch_weight=down, prefetch=plan)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(fetched, np.float32))
    from pallas_kernels.swapped_decode_attention import swapped_paged_attention
    from pallas_kernels.testing import ragged_decode_case
    case = ragged_decode_case(64, cfg.head_dim, 1024)
    o_weight = (jax.random.normal(keys[3], (h, cfg.num_heads * cfg.head_dim), jnp.float32) * h ** -0.5
                ).astype(jnp.bfloat16)
    plan = matmul.prefetch_plan(64, NextWeight(o_weight))
    plain = swapped_paged_attention(**case)
    fetched = swapped_paged_attention(**case, prefetch_weight=o_weight, prefetch=plan)
    np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(fetched, np.float32))
    # The fused q/k/v write prefetching the same rows' first tiles (the ragged case's tables: every page size).
    from pallas_kernels.rope_kv_write import FirstTiles, rope_kv_write
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    parts = jax.random.normal(keys[0], (2, 64, (hq + 2 * hkv) * d), jnp.float32)
    cos, sin = (jax.random.uniform(k, (64, d // 2)) for k in keys[1:3])
    slots = jnp.arange(64, dtype=jnp.int32) * 8 + 8      # some slots inside rows' pages: written either way
    args = (parts, cos, sin, slots, case["k_pool"], case["v_pool"])
    plain = rope_kv_write(*args, num_q_heads=hq, num_kv_heads=hkv)
    fetched = rope_kv_write(*args, num_q_heads=hq, num_kv_heads=hkv,
                            first_tiles=FirstTiles(case["page_starts"], case["page_sizes"], case["lengths"]))
    for a, b in zip(plain, fetched, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_the_start_up_note_says_what_the_budget_does():
    from stratum_jax.model.projection import l2_prefetch_note
    assert l2_prefetch_note(0.0, "kernel", "kernel") is None
    assert "has no effect" in l2_prefetch_note(8, "xla", "kernel") and "'xla'" in l2_prefetch_note(8, "xla", "kernel")
    on = l2_prefetch_note(8, "kernel", "kernel")
    assert on.startswith("L2 prefetch: up to 8 MB") and "o (by the decode attention kernel" in on
    assert "not o" in l2_prefetch_note(8, "kernel", "reference")


@pytest.mark.slow
def test_the_engine_with_every_prefetch_generates_what_xla_does(monkeypatch):
    """The engine's real step with --l2-prefetch-mb 1, the Pallas projections and the Pallas attention (interpreter):
    each decode attention call gets the o projection's prefetch, each fused q/k/v write the decode rows' tables (for
    attention's first tiles), and the greedy tokens equal XLA's projections with the reference attention."""
    import stratum_jax.decode as decode_module
    import stratum_jax.model.projection as projection_module
    seen, tiles = [], []
    real_attention, real_write = decode_module.sharded_decode_attention, projection_module.rope_kv_write

    def attention(*args, prefetch=None, **kwargs):
        seen.append(prefetch)
        return real_attention(*args, prefetch=prefetch, **kwargs)

    def write(*args, first_tiles=None, **kwargs):
        tiles.append(first_tiles)
        return real_write(*args, first_tiles=first_tiles, **kwargs)
    monkeypatch.setattr(decode_module, "sharded_decode_attention", attention)
    monkeypatch.setattr(projection_module, "rope_kv_write", write)
    fetched = greedy_tokens(_CFG, "kernel", attention="kernel", l2_prefetch_mb=1.0)
    assert seen and all(p is not None for p in seen[-_CFG.num_layers:])     # the decode step's calls
    assert tiles and all(t is not None for t in tiles[-_CFG.num_layers:])
    assert fetched == greedy_tokens(_CFG, "xla")
