"""pallas_kernels/norm_fold.py: the residual add in the GEMM before it (split-K summed inside a cluster) and the
RMSNorm folded into the gated GEMM after it, run in the Mosaic GPU interpreter, and lowered for CUDA at llama
shapes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cluster_interpreter import CLUSTER_HANGS

from pallas_kernels.decode_matmul import TuningConfig, decode_gated_matmul_reference
from pallas_kernels.norm_fold import (cluster_k_splits, cluster_tiling, decode_gated_matmul_normed,
                                      decode_gated_matmul_normed_reference, decode_matmul_partials_sumsq,
                                      decode_matmul_partials_sumsq_reference, decode_matmul_residual,
                                      decode_matmul_residual_reference, fold_norm_weight)
from pallas_kernels.residual_rmsnorm import residual_rmsnorm_reference

EPS = 1e-5


def _operands(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16)
    residual = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    return x, w, residual




@pytest.mark.parametrize("m,n,k,config", [
    pytest.param(64, 128, 512, TuningConfig(tile_n=64, num_stages=2, k_splits=4), marks=CLUSTER_HANGS),
    pytest.param(64, 128, 1024, TuningConfig(tile_n=128, num_stages=3, k_splits=8), marks=CLUSTER_HANGS),
    pytest.param(5, 128, 256, TuningConfig(tile_n=64, num_stages=2, k_splits=2), marks=CLUSTER_HANGS),
    pytest.param(100, 64, 512, TuningConfig(tile_n=64, num_stages=2, k_splits=None), marks=CLUSTER_HANGS),
    (64, 192, 256, TuningConfig(tile_n=96, num_stages=2, k_splits=1)),     # no split: a cluster of one
    (5, 64, 512, TuningConfig(tile_n=64, num_stages=2, k_splits=1)),       # few rows (padded to 64)
])
@pytest.mark.parametrize("exchange", ["dsmem", "l2"])
def test_the_residual_kernel_is_the_unfused_sum_and_add_bit_for_bit(m, n, k, config, exchange):
    """The split-K sum in split order in fp32, rounded, then the bf16 add: exactly `decode_matmul_partials` summed
    by `sum_partials` and added, as the unfused path (residual_rmsnorm's x) computes it. (The interpreter reads no
    peer's shared memory: the multi-block "dsmem" cases run on the GPU only.)"""
    if exchange == "dsmem" and config.k_splits != 1:
        pytest.skip("the interpreter has no peer shared memory (cluster_ref)")
    x, w, residual = _operands(m, n, k)
    got = decode_matmul_residual(x, w, residual, config=config, exchange=exchange, interpret=True)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(decode_matmul_residual_reference(x, w, residual)))
    # Every split and every row share is summed: a changed K range or residual row changes the output.
    tail = decode_matmul_residual(x.at[:, -64:].set(0), w, residual, config=config, exchange=exchange,
                                  interpret=True)
    assert (np.asarray(tail) != np.asarray(got)).mean() > 0.5
    last_row = decode_matmul_residual(x, w, residual.at[m - 1].add(1.0), config=config, exchange=exchange,
                                      interpret=True)
    assert not np.array_equal(np.asarray(last_row[m - 1]), np.asarray(got[m - 1]))
    np.testing.assert_array_equal(np.asarray(last_row[:m - 1]), np.asarray(got[:m - 1]))


def test_the_interpreter_refuses_a_peer_shared_memory_exchange_saying_what_to_use():
    x, w, residual = _operands(64, 128, 512)
    with pytest.raises(NotImplementedError, match="k_splits=1 or exchange='l2'"):
        decode_matmul_residual(x, w, residual, config=TuningConfig(tile_n=64, num_stages=2, k_splits=2),
                               exchange="dsmem", interpret=True)
    with pytest.raises(ValueError, match="exchange must be one of"):
        decode_matmul_residual(x, w, residual, exchange="nvlink", interpret=True)


def test_the_residual_kernel_equals_the_unfused_boundarys_stream():
    """Against the kernel it replaces: residual_rmsnorm's first output from the same projection's split-K partials."""
    x, w, residual = _operands(64, 256, 1024, seed=3)
    parts = jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32)[None]     # one split's partial
    want, _ = residual_rmsnorm_reference(parts, residual, jnp.ones((256,), jnp.bfloat16), eps=EPS)
    got = decode_matmul_residual(x, w, residual, config=TuningConfig(tile_n=64, num_stages=2, k_splits=1),
                                 interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("m,i,k,config", [
    (64, 128, 512, TuningConfig(tile_n=64, num_stages=2)),
    (5, 64, 256, TuningConfig(tile_n=64, num_stages=3)),       # padded rows: zeros, whose scale is 1 / sqrt(eps)
    (100, 128, 256, TuningConfig(tile_n=64, num_stages=2)),    # two row tiles
    (16, 224, 256, TuningConfig(tile_n=112, num_stages=2)),    # llama-8b's tile width
])
def test_the_normed_gated_kernel_scales_each_row_by_its_rms(m, i, k, config):
    x, w, _ = _operands(m, 2 * i, k, seed=1)
    x = x * jnp.asarray(np.linspace(0.1, 4.0, m)[:, None], jnp.bfloat16)    # rows of different scales
    got = decode_gated_matmul_normed(x, w, eps=EPS, config=config, interpret=True)
    assert got.shape == (m, i) and got.dtype == jnp.bfloat16
    want = np.asarray(decode_gated_matmul_normed_reference(x, w, eps=EPS), np.float32)
    # The same products and scale, the mean's sum in another order: equal up to a bf16 rounding of the products.
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=1e-2, atol=1e-2)
    assert np.abs(want).max() > 0.3
    # The scale is each row's own: doubling row 2 leaves every output as it was (rms_norm is scale-invariant) ...
    doubled = decode_gated_matmul_normed(x.at[2].multiply(2), w, eps=EPS, config=config, interpret=True)
    np.testing.assert_allclose(np.asarray(doubled, np.float32), np.asarray(got, np.float32), rtol=1e-2, atol=1e-3)
    # ... and the statistic sees all of K: a row whose last K tile grows gets a smaller scale for its other terms.
    grown = decode_gated_matmul_normed(x.at[0, -64:].multiply(8), w.at[:, -64:].set(0), eps=EPS, config=config,
                                       interpret=True)
    plain = decode_gated_matmul_normed(x, w.at[:, -64:].set(0), eps=EPS, config=config, interpret=True)
    assert np.abs(np.asarray(grown[0], np.float32)).sum() < 0.9 * np.abs(np.asarray(plain[0], np.float32)).sum()
    np.testing.assert_array_equal(np.asarray(grown[1:]), np.asarray(plain[1:]))


def test_the_fold_computes_the_unfused_norm_then_gated_projection():
    """fold_norm_weight(g, w) with the in-kernel scale against rms_norm(x) * g through the unfused gated kernel's
    numerics: the same function, the bf16 roundings in other places (module docstring); within a few bf16 steps."""
    x, w, residual = _operands(64, 2 * 128, 512, seed=5)
    g = jnp.asarray(np.random.default_rng(6).uniform(0.5, 2.0, 512), jnp.bfloat16)
    _, h = residual_rmsnorm_reference(jnp.zeros((1, 64, 512), jnp.float32), x, g, eps=EPS)   # rms_norm(x) * g
    unfused = np.asarray(decode_gated_matmul_reference(h, w), np.float32)
    folded = np.asarray(decode_gated_matmul_normed(x, fold_norm_weight(g, w), eps=EPS,
                                                   config=TuningConfig(tile_n=64, num_stages=2), interpret=True),
                        np.float32)
    scale = np.abs(unfused).max()
    assert scale > 0.3
    assert np.abs(folded - unfused).max() < 0.03 * scale
    assert np.abs(folded - unfused).mean() < 0.003 * scale
    # Without the fold (g left out) the outputs are far off: the test can tell.
    unfolded = np.asarray(decode_gated_matmul_normed(x, w, eps=EPS, config=TuningConfig(tile_n=64, num_stages=2),
                                                     interpret=True), np.float32)
    assert np.abs(unfolded - unfused).mean() > 0.03 * scale


def test_fold_norm_weight_scales_the_columns_once():
    w = jnp.asarray([[1.0, 2.0, 3.0], [-1.0, 0.5, 4.0]], jnp.bfloat16)
    g = jnp.asarray([2.0, 0.5, 1.0], jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(fold_norm_weight(g, w), np.float32),
                                  [[2.0, 1.0, 3.0], [-2.0, 0.25, 4.0]])
    with pytest.raises(ValueError, match=r"\[K\] and w \[N, K\]"):
        fold_norm_weight(g[:2], w)


def test_the_cluster_split_is_a_power_of_two_that_fills_the_gpu():
    # llama-1b o / down (32 tiles of 64 columns): 4 splits, 128 CTAs; 8b o (64 tiles): 2; 8b down on 128-column tiles
    # (32 tiles): 4. A short K keeps 4 tiles a split; gate/up-sized N needs none.
    assert cluster_k_splits(2048, 2048, 64) == 4
    assert cluster_k_splits(2048, 8192, 64) == 4
    assert cluster_k_splits(4096, 4096, 64) == 2
    assert cluster_k_splits(4096, 14336, 128) == 4
    assert cluster_k_splits(128, 256, 64) == 1
    assert cluster_k_splits(16384, 2048, 64) == 1
    assert cluster_k_splits(64, 4096, 64, rows=64) == 8       # the portable cluster limit
    # The engine's: clusters of 2 on narrower tiles, about one CTA an SM (the fastest fold measured on the H200).
    assert cluster_tiling(2048, 2048, 64) == (32, 2)          # llama-1b o
    assert cluster_tiling(2048, 8192, 64) == (32, 2)          # llama-1b down
    assert cluster_tiling(4096, 4096, 64) == (64, 2)          # llama-8b o
    assert cluster_tiling(4096, 14336, 128) == (64, 2)        # llama-8b down
    assert cluster_tiling(256, 512, 64) == (32, 2)            # small: narrowed at most to half
    assert cluster_tiling(4096, 384, 64) == (64, 1)           # 6 K tiles: no split of at least 4 each


@pytest.mark.parametrize("call,match", [
    (lambda x, w, r: decode_matmul_residual(x, w, r[:, :64], interpret=True), r"residual must be \[64, 128\]"),
    (lambda x, w, r: decode_matmul_residual(x, w, r, config=TuningConfig(tile_n=64, k_splits=3), interpret=True),
     "multiple of k_splits|1, 2, 4 or 8"),
    (lambda x, w, r: decode_matmul_residual(x, w, r, config=TuningConfig(tile_n=64, k_splits=16), interpret=True),
     "1, 2, 4 or 8"),
    (lambda x, w, r: decode_matmul_residual(x, w, r.astype(jnp.float32), interpret=True), "bfloat16"),
    (lambda x, w, r: decode_gated_matmul_normed(x, w, eps=0.0, interpret=True), "eps must be a positive float"),
    (lambda x, w, r: decode_gated_matmul_normed(x, w[:127], eps=EPS, interpret=True), r"\[2I, K\]"),
    (lambda x, w, r: decode_gated_matmul_normed(x, w, eps=EPS, config=TuningConfig(tile_n=64, k_splits=2),
                                                interpret=True), "k_splits must be None or 1"),
])
def test_bad_inputs_are_refused_with_what_to_fix(call, match):
    x, w, residual = _operands(64, 128, 768)
    with pytest.raises(ValueError, match=match):
        call(x, w, residual)


def test_configs_that_would_not_fit_a_cta_are_refused():
    x, w, residual = _operands(64, 256, 4096)
    with pytest.raises(ValueError, match="KB of SMEM.*lower num_stages or tile_n"):
        decode_matmul_residual(x, w, residual, config=TuningConfig(tile_n=256, num_stages=6, k_splits=2),
                               interpret=True)


_LLAMA_SHAPES = [("1b o", 2048, 2048), ("1b down", 2048, 8192), ("8b o", 4096, 4096), ("8b down", 4096, 14336)]


@pytest.mark.parametrize("name,n,k", _LLAMA_SHAPES)
@pytest.mark.parametrize("exchange", ["dsmem", "l2"])
def test_the_residual_kernel_lowers_to_mosaic_gpu_at_llama_shapes(name, n, k, exchange):
    """The engine's tile for each projection (projection.kernel_config) with the cluster split, lowered for CUDA on
    this CPU: Mosaic GPU's passes run, and the module holds the peer fences (the async proxy's only with "l2")."""
    from stratum_jax.model.projection import kernel_config
    tile_n = kernel_config(64, n, k).tile_n
    fn = jax.jit(lambda x, w, r: decode_matmul_residual(x, w, r, config=TuningConfig(tile_n=tile_n),
                                                        exchange=exchange))
    text = fn.trace(jax.ShapeDtypeStruct((64, k), jnp.bfloat16), jax.ShapeDtypeStruct((n, k), jnp.bfloat16),
                    jax.ShapeDtypeStruct((64, n), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert f"decode_matmul_residual_{n}x{k}_mosaic_gpu" in text
    assert "fence.acq_rel.cluster" in text
    assert ("fence.proxy.async.global" in text) == (exchange == "l2")


@pytest.mark.parametrize("i,k", [(8192, 2048), (14336, 4096)])
def test_the_normed_gated_kernel_lowers_to_mosaic_gpu_at_llama_shapes(i, k):
    from stratum_jax.model.projection import gated_kernel_config
    fn = jax.jit(lambda x, w: decode_gated_matmul_normed(x, w, eps=EPS, config=gated_kernel_config(i, 64, k)))
    text = fn.trace(jax.ShapeDtypeStruct((64, k), jnp.bfloat16), jax.ShapeDtypeStruct((2 * i, k), jnp.bfloat16)
                    ).lower(lowering_platforms=("cuda",)).as_text()
    assert f"decode_gated_matmul_normed_{i}x{k}_mosaic_gpu" in text


@pytest.mark.parametrize("m,n,k,config", [
    (64, 192, 512, TuningConfig(tile_n=64, num_stages=2, k_splits=4)),
    (5, 128, 256, TuningConfig(tile_n=64, num_stages=2, k_splits=1)),
])
def test_the_qkv_kernel_leaves_partials_and_each_splits_sums_of_squares(m, n, k, config):
    x, w, _ = _operands(m, n, k, seed=7)
    parts, sumsq = decode_matmul_partials_sumsq(x, w, config=config, interpret=True)
    s = config.k_splits
    want_parts, want_sumsq = decode_matmul_partials_sumsq_reference(x, w, s)
    assert parts.shape == (s, 64, n) and sumsq.shape == (s, 64) and sumsq.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts, np.float32), np.asarray(want_parts), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(sumsq), np.asarray(want_sumsq), rtol=1e-5)
    assert np.all(np.asarray(sumsq)[:, m:] == 0)          # padded rows


def test_the_input_norm_folded_into_qkv_computes_the_unfused_qkv_rope_and_kv_write():
    """qkv partials of the folded weight + rope_kv_write's row scale against rms_norm(x) * g through the unfused
    qkv partials + rope_kv_write: the same q and pool rows within bf16 roundings; the kernel against its reference."""
    from pallas_kernels.rope_kv_write import RowNorm, rope_kv_write, rope_kv_write_reference
    heads, kv_heads, d, k, rows = 4, 2, 64, 512, 16
    n = (heads + 2 * kv_heads) * d
    x, w, _ = _operands(rows, n, k, seed=8)
    x = x * 3           # rows with an RMS near 3: the fold's row scale (about 1/3) matters
    g = jnp.asarray(np.random.default_rng(9).uniform(0.5, 2.0, k), jnp.bfloat16)
    rng = np.random.default_rng(10)
    angles = rng.uniform(0, 6.3, (64, d // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    slots = jnp.asarray(np.r_[rng.permutation(200)[:rows], np.full(64 - rows, 10**6)], jnp.int32)
    pool = jnp.zeros((kv_heads, 200, d), jnp.bfloat16)
    config = TuningConfig(tile_n=64, num_stages=2, k_splits=2)
    kw = dict(num_q_heads=heads, num_kv_heads=kv_heads)
    # Unfused: the norm, then the projection's partials (the reference of both kernels; their own tests hold them).
    _, h = residual_rmsnorm_reference(jnp.zeros((1, rows, k), jnp.float32), x, g, eps=EPS)
    unfused_parts, _ = decode_matmul_partials_sumsq_reference(h, w, 2)
    q_u, kp_u, vp_u = rope_kv_write_reference(unfused_parts, cos, sin, slots, pool, pool, **kw)
    # Folded, on the kernels.
    parts, sumsq = decode_matmul_partials_sumsq(x, fold_norm_weight(g, w), config=config, interpret=True)
    row_norm = RowNorm(sumsq, k, EPS)
    q_f, kp_f, vp_f = rope_kv_write(parts, cos, sin, slots, pool, pool, row_norm=row_norm, interpret=True, **kw)
    q_r, kp_r, vp_r = rope_kv_write_reference(parts, cos, sin, slots, pool, pool, row_norm=row_norm, **kw)
    for got, ref in ((q_f, q_r), (kp_f, kp_r), (vp_f, vp_r)):      # kernel vs its reference: a bf16 step at most
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-2, atol=1e-2)
    for got, ref in ((q_f[:rows], q_u[:rows]), (kp_f, kp_u), (vp_f, vp_u)):   # fold vs unfused: a few bf16 steps
        got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
        scale = np.abs(ref).max()
        assert scale > 0.3 and np.abs(got - ref).max() < 0.03 * scale and np.abs(got - ref).mean() < 3e-3 * scale
    # Without the row scale the values are far off: the test can tell.
    q_n, _, _ = rope_kv_write(parts, cos, sin, slots, pool, pool, interpret=True, **kw)
    assert np.abs(np.asarray(q_n[:rows], np.float32) - np.asarray(q_u[:rows], np.float32)).mean() > 0.5


@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
def test_the_folded_qkv_and_its_rope_kv_write_lower_to_mosaic_gpu(model):
    """The q/k/v GEMM with the sums of squares and rope_kv_write with the row scale, at batch 64 on the engine's
    q/k/v config, lowered for CUDA on this CPU."""
    from pallas_kernels.rope_kv_write import RowNorm, rope_kv_write
    from stratum_jax.model.config import PRESETS
    from stratum_jax.model.projection import kernel_config
    cfg = PRESETS[model]
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = (hq + 2 * hkv) * d
    config = kernel_config(64, n, h)
    sd = jax.ShapeDtypeStruct

    def step(x, w, cos, sin, slots, k_pool, v_pool):
        parts, sumsq = decode_matmul_partials_sumsq(x, w, config=config)
        return rope_kv_write(parts, cos, sin, slots, k_pool, v_pool, num_q_heads=hq, num_kv_heads=hkv,
                             row_norm=RowNorm(sumsq, h, EPS))
    pool = sd((hkv, 4096, d), jnp.bfloat16)
    half = sd((64, d // 2), jnp.float32)
    text = jax.jit(step).trace(sd((64, h), jnp.bfloat16), sd((n, h), jnp.bfloat16), half, half,
                               sd((64,), jnp.int32), pool, pool).lower(lowering_platforms=("cuda",)).as_text()
    assert f"decode_matmul_normed_{n}x{h}_mosaic_gpu" in text and "rope_kv_write_mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("name,n,k", _LLAMA_SHAPES)
def test_gpu_residual_kernel_is_the_unfused_sum_every_time(name, n, k):
    """The compiled cluster kernel at llama shapes, both exchanges, 20 calls each: within a bf16 rounding of XLA's
    GEMM, and the two exchanges bit for bit equal to each other and to their first call every time (a missing
    fence or barrier between a block's partial and its peers' reads shows as a stale or NaN row now and then)."""
    from stratum_jax.model.projection import kernel_config
    x, w, residual = _operands(64, n, k, seed=11)
    want = np.asarray(jax.jit(decode_matmul_residual_reference)(x, w, residual), np.float32)
    config = TuningConfig(tile_n=kernel_config(64, n, k).tile_n)
    first = None
    for exchange in ("dsmem", "l2"):
        fn = jax.jit(lambda x, w, r, e=exchange: decode_matmul_residual(x, w, r, config=config, exchange=e))
        for call in range(20):
            got = np.asarray(fn(x, w, residual), np.float32)
            diff = np.abs(got - want)
            # The reference is XLA's GEMM (another summation order): equal up to one bf16 rounding of the product.
            assert np.isfinite(got).all() and diff.max() <= 2.0 ** -6 * max(1.0, np.abs(want).max()), (
                exchange, call, diff.max())
            first = got if first is None else first
            np.testing.assert_array_equal(got, first, err_msg=f"{exchange} call {call}")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("i,k", [(8192, 2048), (14336, 4096)])
def test_gpu_normed_gated_kernel_matches_its_reference(i, k):
    from stratum_jax.model.projection import gated_kernel_config
    x, w, _ = _operands(64, 2 * i, k, seed=12)
    got = jax.jit(lambda x, w: decode_gated_matmul_normed(x, w, eps=EPS, config=gated_kernel_config(i, 64, k)))(x, w)
    want = jax.jit(lambda x, w: decode_gated_matmul_normed_reference(x, w, eps=EPS))(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
def test_gpu_folded_qkv_and_rope_kv_write_match_their_references(model):
    from pallas_kernels.rope_kv_write import RowNorm, rope_kv_write, rope_kv_write_reference
    from stratum_jax.model.config import PRESETS
    from stratum_jax.model.projection import kernel_config
    cfg = PRESETS[model]
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    n = (hq + 2 * hkv) * d
    config = kernel_config(64, n, h)
    x, w, _ = _operands(64, n, h, seed=13)
    parts, sumsq = jax.jit(lambda x, w: decode_matmul_partials_sumsq(x, w, config=config))(x, w)
    want_parts, want_sumsq = decode_matmul_partials_sumsq_reference(x, w, parts.shape[0])
    np.testing.assert_allclose(np.asarray(sumsq), np.asarray(want_sumsq), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(parts, np.float32), np.asarray(want_parts), rtol=2e-2, atol=2e-2)
    rng = np.random.default_rng(14)
    angles = rng.uniform(0, 6.3, (64, d // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    slots = jnp.asarray(rng.permutation(4096)[:64], jnp.int32)
    pool = jnp.zeros((hkv, 4096, d), jnp.bfloat16)
    kw = dict(num_q_heads=hq, num_kv_heads=hkv)
    row_norm = RowNorm(sumsq, h, EPS)
    got = jax.jit(lambda p, c, s, sl, kp, vp: rope_kv_write(p, c, s, sl, kp, vp, row_norm=row_norm, **kw))(
        parts, cos, sin, slots, pool, pool)
    want = rope_kv_write_reference(parts, cos, sin, slots, pool, pool, row_norm=row_norm, **kw)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=1e-2, atol=1e-2)
