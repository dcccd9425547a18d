"""Paged decode attention: the Mosaic GPU kernel (run in the Mosaic GPU interpreter on CPU) and its
jnp reference, both against a float64 numpy computation on random ragged, mixed-page-size batches.

Interpret mode simulates every thread, barrier and TMA copy, so shapes here are small; the file's
budget is about 4 minutes on 2 CPU cores.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels._interpret import mosaic_gpu_interpret
from pallas_kernels.paged_attention import (
    PAGE_SIZES, TuningConfig, paged_attention, paged_attention_reference, paged_prefill_attention,
    paged_prefill_attention_reference, prefill_block_tokens)
from pallas_kernels.testing import (
    float64_attention, float64_prefill_attention, float64_prefill_score_variance, float64_score_variance,
    prefill_blocks_case, random_paged_case)

BF16_TOL = 2e-2


# Inputs (random buddy-placed pages, NaN in every free slot, garbage table entries past each sequence)
# and the float64 truths come from pallas_kernels/testing.py, shared with benchmarks/kernels.py.


# Score-variance tolerance. The kernel's scores are fp32 dot products of the same bf16 values the
# float64 truth uses (relative error ~1e-6), summed in fp32 after a shift into the score range, so
# the error is ~1e-6 relative (measured) and 2e-4 leaves a wide margin; yet one key too many or
# too few changes a row's variance by about var / n, i.e. > 1e-3 relative for these lengths, so the
# bound still catches masking bugs. (The compiled GPU test is looser: approximate-math exp/tanh.)
VAR_RTOL, VAR_ATOL = 2e-4, 1e-5


def check_var(var, want, rtol=VAR_RTOL, atol=VAR_ATOL):
    var = np.asarray(var)
    assert var.dtype == np.float32 and var.shape == want.shape, (var.dtype, var.shape)
    assert np.isfinite(var).all() and (var >= 0).all(), var
    np.testing.assert_allclose(var, want, rtol=rtol, atol=atol)


def check(out, want, tol=BF16_TOL):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN in the output"
    err = np.abs(out - want).max()
    assert err <= tol, f"max abs err {err:.3g} > {tol}"
    return err


def run_kernel(case, **kw):
    return paged_attention(**case, interpret=True, **kw)


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

def test_reference_matches_float64():
    case = random_paged_case(0, lengths=[1, 37, 300, 64, 0, 129], page_sizes=[8, 16, 32, 64, 128, 256],
                     num_q_heads=8, num_kv_heads=2, head_dim=64)
    want = float64_attention(case)
    out = paged_attention_reference(**{**case, "q": case["q"].astype(jnp.float32)})
    check(out, want, tol=2e-5)     # fp32 math on bf16 inputs, fp32 output
    capped = paged_attention_reference(**{**case, "q": case["q"].astype(jnp.float32)}, soft_cap=5.0,
                                       sm_scale=0.3)
    check(capped, float64_attention(case, soft_cap=5.0, sm_scale=0.3), tol=2e-5)
    assert np.all(np.asarray(out)[4] == 0)


# ---------------------------------------------------------------------------------------------
# Kernel (interpret mode)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(128, 8, 2), (64, 2, 2), (64, 16, 2)])
def test_kernel_every_page_size_in_one_batch(head_dim, num_q_heads, num_kv_heads):
    """q_per_kv 4, 1, 8; every page size mixed in one batch; lengths 1, P-1, P+1, ragged; the
    block_kv=64 tile then holds 8, 4, 2 whole pages or a piece of one page."""
    case = random_paged_case(1 + head_dim + num_q_heads, lengths=[1, 15, 33, 65, 127, 300],
                     page_sizes=[8, 16, 32, 64, 128, 256], num_q_heads=num_q_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim)
    out = run_kernel(case, config=TuningConfig(block_kv=64, num_stages=2, num_splits=1))
    check(out, float64_attention(case))


def test_kernel_block128_small_pages_and_nan_padding_rows():
    """block_kv=128 (16 copies per tile for 8-token pages); length-0 padding rows give zeros; every
    slot outside a live token is NaN and must not leak."""
    case = random_paged_case(2, lengths=[0, 9, 200, 0, 129], page_sizes=[8, 8, 16, 64, 256],
                     num_q_heads=4, num_kv_heads=1, head_dim=64)
    out = run_kernel(case, config=TuningConfig(block_kv=128, num_stages=3, num_splits=1))
    check(out, float64_attention(case))
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(out[0] == 0) and np.all(out[3] == 0)


def test_kernel_split_k_and_soft_cap():
    """Split-K over 3 CTAs per (sequence, kv head) incl. splits with no tiles, plus the soft cap."""
    case = random_paged_case(3, lengths=[700, 5, 0, 190], page_sizes=[32, 256, 8, 64], num_q_heads=4,
                     num_kv_heads=2, head_dim=64)
    cfg = TuningConfig(block_kv=64, num_stages=3, num_splits=3)
    check(run_kernel(case, config=cfg, soft_cap=8.0, sm_scale=0.2),
          float64_attention(case, soft_cap=8.0, sm_scale=0.2))


def test_kernel_unaligned_group_and_fp32_q():
    """q_per_kv 3 (groups padded to 8 rows in the wrapper) and an fp32 query (fp32 output)."""
    case = random_paged_case(4, lengths=[40, 257], page_sizes=[16, 128], num_q_heads=6, num_kv_heads=2,
                     head_dim=64, q_dtype=jnp.float32)
    out = run_kernel(case, config=TuningConfig(block_kv=64, num_stages=2, num_splits=2))
    assert out.dtype == jnp.float32
    check(out, float64_attention(case))


def test_kernel_random_permutations():
    """Random ragged batch, random page sizes, pages scattered at random over a larger pool."""
    rng = np.random.default_rng(5)
    sizes = [int(s) for s in rng.choice(PAGE_SIZES, size=4)]
    lengths = [int(x) for x in rng.integers(1, 260, size=4)]
    case = random_paged_case(6, lengths=lengths, page_sizes=sizes, num_q_heads=4, num_kv_heads=1,
                     head_dim=64, num_slots=4096)
    check(run_kernel(case, config=TuningConfig(block_kv=64, num_stages=4, num_splits=1, no_auto_barriers=True)),
          float64_attention(case))


def test_kernel_default_config_auto_split():
    """The default config at a tiny grid picks a large split (16 CTAs per sequence here), so most
    splits are empty; the combine must ignore them."""
    case = random_paged_case(10, lengths=[300, 3], page_sizes=[32, 8], num_q_heads=4, num_kv_heads=1, head_dim=64)
    check(run_kernel(case), float64_attention(case))


def test_interpret_context_manager():
    """`with mosaic_gpu_interpret():` runs the kernel without interpret=True (engine use)."""
    case = random_paged_case(7, lengths=[20], page_sizes=[16], num_q_heads=2, num_kv_heads=1, head_dim=64)
    with mosaic_gpu_interpret():
        out = paged_attention(**case, config=TuningConfig(num_splits=1, num_stages=2))
    check(out, float64_attention(case))


# ---------------------------------------------------------------------------------------------
# Score statistics (return_score_stats=True)
# ---------------------------------------------------------------------------------------------

def _offset_case(case, k_shift, q_shift):
    """Adds a common offset to every live K row and every q, so each row's scores share a large
    mean (k_shift * q_shift * head_dim * scale): the case where raw sums of s and s^2 cancel."""
    k = np.asarray(case["k_pool"].astype(jnp.float32)) + k_shift     # NaN stays NaN
    q = np.asarray(case["q"].astype(jnp.float32)) + q_shift
    return {**case, "k_pool": jnp.asarray(k, jnp.bfloat16), "q": jnp.asarray(q, case["q"].dtype)}


def test_reference_score_var_matches_float64():
    case = random_paged_case(11, lengths=[1, 37, 300, 64, 0, 129], page_sizes=[8, 16, 32, 64, 128, 256],
                     num_q_heads=8, num_kv_heads=2, head_dim=64)
    plain = paged_attention_reference(**case)
    out, var = paged_attention_reference(**case, return_score_stats=True)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    check_var(var, float64_score_variance(case))
    _, var = paged_attention_reference(**case, return_score_stats=True, soft_cap=5.0, sm_scale=0.3)
    check_var(var, float64_score_variance(case, soft_cap=5.0, sm_scale=0.3))
    shifted = _offset_case(case, 1.0, 1.5)
    _, var = paged_attention_reference(**shifted, return_score_stats=True)
    check_var(var, float64_score_variance(shifted))


@pytest.mark.parametrize("kind", ["gqa4_d128_offset", "split3_softcap_group3"])
def test_kernel_score_var(kind):
    """The kernel's score variance against float64, on ragged mixed-page batches with NaN in every
    free slot, length-0 and length-1 rows; and its `out` is bit-identical to the stats-off `out`.
    - gqa4_d128_offset: block_kv 64 (per-column sums), no split, q_per_kv 4, D 128, every page size,
      scores sharing a common offset several times their spread (where raw fp32 sums of s and s^2
      start to cancel);
    - split3_softcap_group3: block_kv 128 (per-tile row sums), split-K over 3 CTAs (one empty),
      soft cap, sm_scale, q_per_kv 3 (padded q rows), P >= T and P < T pages.
    One kv head each (GQA's head mapping has its own tests): the interpreter's time grows with the grid."""
    if kind == "gqa4_d128_offset":
        case = random_paged_case(12, lengths=[1, 15, 33, 65, 127, 300, 0], page_sizes=[8, 16, 32, 64, 128, 256, 8],
                         num_q_heads=4, num_kv_heads=1, head_dim=128)
        case = _offset_case(case, 1.0, 1.25)
        cfg, kw = TuningConfig(block_kv=64, num_stages=2, num_splits=1), {}
    else:
        case = random_paged_case(13, lengths=[450, 5, 0, 130, 1], page_sizes=[32, 256, 8, 64, 16], num_q_heads=3,
                         num_kv_heads=1, head_dim=64)
        cfg, kw = TuningConfig(block_kv=128, num_stages=2, num_splits=3), dict(soft_cap=8.0, sm_scale=0.2)
    out, var = run_kernel(case, config=cfg, return_score_stats=True, **kw)
    want = float64_score_variance(case, **kw)
    check_var(var, want)
    check(out, float64_attention(case, **kw))
    plain = run_kernel(case, config=cfg, **kw)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32), equal_nan=True)
    # The reference agrees too (same flag, same return).
    _, ref_var = paged_attention_reference(**case, return_score_stats=True, **kw)
    check_var(ref_var, want)


# ---------------------------------------------------------------------------------------------
# Causal prefill blocks (paged_prefill_attention)
# ---------------------------------------------------------------------------------------------

def _prefill_case(num_q_heads, num_kv_heads, head_dim, seed):
    """Sequences on every page size (NaN in free slots); blocks: one ending at its sequence's end, one
    in the middle of a long context (keys over several tiles and pages), one truncated (only its first
    few tokens real: the chunk ended inside the block), one starting at position 0, one padding block."""
    case = random_paged_case(seed, lengths=[140, 230, 75, 9], page_sizes=[8, 32, 256, 16],
                             num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    n = prefill_block_tokens(num_q_heads, num_kv_heads)
    blocks = [(0, 140 - n, n), (1, 150, n), (2, 75 - 5, 5), (3, 0, min(n, 9)), (-1, 0, 0)]
    return prefill_blocks_case(case, blocks, n, seed=seed)


def _check_valid(out, want, valid, tol=BF16_TOL):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out[valid]).any(), "NaN in a real token's output"
    err = np.abs(out - want)[valid].max()
    assert err <= tol, f"max abs err {err:.3g} > {tol}"


@pytest.mark.parametrize("heads", [(8, 2, 64), (2, 2, 64), (16, 2, 64)])
def test_prefill_kernel_matches_float64(heads):
    """The causal-block kernel (interpret mode) against float64: GQA groups 4 (16 tokens per block),
    1 (64 tokens) and 8 (8 tokens); every page-size class; NaN in free slots; truncated and padding
    blocks (a padding block's output is zeros). The score variance too."""
    pcase = _prefill_case(*heads, seed=21)
    valid = pcase.pop("valid")
    out, var = paged_prefill_attention(**pcase, interpret=True, return_score_stats=True)
    _check_valid(out, float64_prefill_attention(pcase), valid)
    assert not np.asarray(out[-1], np.float32).any(), "a padding block must give zeros"
    v, want = np.asarray(var)[valid], float64_prefill_score_variance(pcase)[valid]
    np.testing.assert_allclose(v, want, rtol=VAR_RTOL, atol=VAR_ATOL)
    ref = paged_prefill_attention_reference(**pcase)
    _check_valid(ref, float64_prefill_attention(pcase), valid)


def test_prefill_kernel_block128_and_errors():
    """block_kv 128 (pages both smaller and larger than a tile); and the entry point's errors."""
    pcase = _prefill_case(8, 2, 64, seed=22)
    valid = pcase.pop("valid")
    out = paged_prefill_attention(**pcase, interpret=True, config=TuningConfig(block_kv=128))
    _check_valid(out, float64_prefill_attention(pcase), valid)
    with pytest.raises(ValueError, match="causal blocks are not split"):
        paged_prefill_attention(**pcase, config=TuningConfig(num_splits=2))
    with pytest.raises(ValueError, match="do not fit the 64-row q tile"):
        paged_prefill_attention(**{**pcase, "q": jnp.zeros((5, 32, 8, 64), jnp.bfloat16)})
    with pytest.raises(ValueError, match="q_starts must be int32"):
        paged_prefill_attention(**{**pcase, "q_starts": pcase["q_starts"][:2]})
    assert prefill_block_tokens(12, 4) is None and prefill_block_tokens(32, 8) == 16


# ---------------------------------------------------------------------------------------------
# Entry point validation
# ---------------------------------------------------------------------------------------------

def test_entry_point_shape_errors():
    case = random_paged_case(8, lengths=[5], page_sizes=[8], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     nan_outside=False)
    bad = [
        (dict(q=case["q"][0]), "q must be"),
        (dict(q=jnp.zeros((1, 3, 64), jnp.bfloat16)), "multiple of num_kv_heads"),
        (dict(q=jnp.zeros((1, 4, 32), jnp.bfloat16)), "head_dim mismatch"),
        (dict(k_pool=case["k_pool"].astype(jnp.float32)), "bfloat16"),
        (dict(v_pool=case["v_pool"][:, :128]), "k_pool and v_pool"),
        (dict(k_pool=case["k_pool"][:, :100], v_pool=case["v_pool"][:, :100]), "multiple of 256"),
        (dict(lengths=jnp.zeros((2,), jnp.int32)), "lengths and page_sizes"),
        (dict(page_starts=case["page_starts"][0]), "page_starts must be"),
        (dict(page_sizes=case["page_sizes"].astype(jnp.float32)), "page_sizes must be int32"),
        (dict(q=case["q"].astype(jnp.float16)), "bfloat16 or float32"),
    ]
    for override, msg in bad:
        with pytest.raises(ValueError, match=msg):
            paged_attention(**{**case, **override}, interpret=True)
        if "q" not in override or override["q"].ndim == 3 and override["q"].shape[-1] == 64:
            with pytest.raises(ValueError, match=msg):
                paged_attention_reference(**{**case, **override})
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        paged_attention(**{**case, "q": jnp.zeros((1, 4, 32), jnp.bfloat16),
                           "k_pool": jnp.zeros((2, 256, 32), jnp.bfloat16),
                           "v_pool": jnp.zeros((2, 256, 32), jnp.bfloat16)})
    with pytest.raises(ValueError, match="soft_cap"):
        paged_attention(**case, soft_cap=0.0)


def test_tuning_config_validation():
    for kw in (dict(block_kv=32), dict(num_stages=1), dict(num_splits=0), dict(block_kv=100)):
        with pytest.raises(ValueError):
            TuningConfig(**kw)


# ---------------------------------------------------------------------------------------------
# GPU (compiled) - skipped on CPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("config", [TuningConfig(), TuningConfig(block_kv=128, num_stages=2, num_splits=2),
                                    TuningConfig(p_via_smem=True, num_splits=1)])
def test_kernel_compiled_on_gpu(config):
    case = random_paged_case(9, lengths=[1, 15, 33, 65, 127, 300, 0, 1000], page_sizes=[8, 16, 32, 64, 128, 256, 8, 32],
                     num_q_heads=32, num_kv_heads=8, head_dim=128)
    check(paged_attention(**case, config=config), float64_attention(case))


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("config,soft_cap", [(TuningConfig(), None), (TuningConfig(num_splits=1), None),
                                             (TuningConfig(block_kv=128, num_splits=3), 30.0)])
def test_kernel_score_stats_compiled_on_gpu(config, soft_cap):
    """return_score_stats=True, compiled: B=8, Hq=32, Hkv=8, D=128, contexts up to ~1K, mixed pages,
    NaN in free slots. The variance is checked against float64 and the jnp reference; `out` must be
    bit-identical to the stats-off kernel's. Looser than interpret mode: approx-math tanh (soft cap)."""
    case = random_paged_case(14, lengths=[1, 15, 33, 65, 127, 300, 0, 1024], page_sizes=[8, 16, 32, 64, 128, 256, 8, 32],
                     num_q_heads=32, num_kv_heads=8, head_dim=128)
    case = _offset_case(case, 0.5, 0.5)
    out, var = paged_attention(**case, config=config, soft_cap=soft_cap, return_score_stats=True)
    want = float64_score_variance(case, soft_cap=soft_cap)
    check_var(var, want, rtol=2e-3, atol=1e-4)
    _, ref_var = paged_attention_reference(**case, soft_cap=soft_cap, return_score_stats=True)
    check_var(ref_var, want)
    plain = paged_attention(**case, config=config, soft_cap=soft_cap)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32), equal_nan=True)
    check(out, float64_attention(case, soft_cap=soft_cap))


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("config", [TuningConfig(), TuningConfig(block_kv=128)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64), (8, 8, 64)])
def test_prefill_kernel_compiled_on_gpu(config, heads):
    pcase = _prefill_case(*heads, seed=23)
    valid = pcase.pop("valid")
    out, var = paged_prefill_attention(**pcase, config=config, return_score_stats=True)
    _check_valid(out, float64_prefill_attention(pcase), valid)
    np.testing.assert_allclose(np.asarray(var)[valid], float64_prefill_score_variance(pcase)[valid],
                               rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("splits", [1, 2, 5, 17])
def test_combine_splits_against_float64(splits):
    """The split-K merge, unrolled (<= UNROLLED_COMBINE_SPLITS) or by reductions (above it), against the merge
    in float64: partials normalised per split with base-2 lse; an empty split (lse -inf) holds NaN garbage and
    must be ignored, and a row whose splits are all empty gives zeros."""
    from pallas_kernels.split_k import UNROLLED_COMBINE_SPLITS, combine_splits
    assert (splits > UNROLLED_COMBINE_SPLITS) == (splits == 17)
    rng = np.random.default_rng(splits)
    b, hkv, g, d = 3, 2, 4, 8
    o_part = rng.normal(size=(b, splits, hkv, g, d)).astype(np.float32)
    lse = (rng.normal(size=(b, splits, hkv, g)) * 4).astype(np.float32)
    empty = rng.random(size=lse.shape) < 0.3
    empty[0, :, 0, 0] = True                                   # every split of one row empty
    lse[empty] = -np.inf
    o_part[empty] = np.nan
    got = np.asarray(jax.jit(combine_splits)(jnp.asarray(o_part), jnp.asarray(lse)))
    w = np.where(empty, 0.0, np.exp2(lse.astype(np.float64) - np.max(np.where(empty, -1e30, lse), axis=1,
                                                                       keepdims=True)))
    num = np.sum(w[..., None] * np.where(empty[..., None], 0.0, o_part.astype(np.float64)), axis=1)
    den = np.sum(w, axis=1)[..., None]
    want = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.all(got[0, 0, 0] == 0.0)
