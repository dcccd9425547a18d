"""The swapped-operand paged decode kernel (keys on WGMMA's M): in the Mosaic GPU interpreter against float64
numpy on ragged mixed-page batches (outputs, soft cap, score statistics), its lowering to Mosaic GPU (on a CPU) at
the engine's shapes, and, on a GPU, the compiled kernel against the jnp reference and float64.

Interpret mode simulates every thread, barrier and TMA copy, so the shapes here are tiny (the file runs in
about a minute on 2 CPU cores)."""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from cluster_interpreter import CLUSTER_HANGS

import jax
import jax.numpy as jnp

import pallas_kernels.swapped_decode_attention as swapped_module
from pallas_kernels.delta_attention import pack_granule_scales
from pallas_kernels.swapped_decode_attention import (
    SHORT_CONTEXT_KEYS, SwappedConfig, default_swapped_config, query_columns, swapped_paged_attention,
    swapped_paged_attention_reference)
from pallas_kernels.testing import (float64_attention, float64_score_variance, fp8_granule_case, ragged_decode_case,
                                    random_paged_case)

BF16_TOL = 2e-2
# Score variance: fp32 scores of the same bf16 values the float64 truth uses, summed after a shift (as
# tests/test_paged_attention.py); one key too many or too few moves a variance by ~var / n (> 1e-3 here).
VAR_RTOL, VAR_ATOL = 2e-4, 1e-5

# Lengths 0 and 1, one under / over a page (7, 65, 129) and a tile (63, 127, 129), a full 256 page and more,
# every page size in one batch; every slot outside a sequence holds NaN, table entries past it are garbage.
LENGTHS = [1, 7, 0, 65, 129, 300, 63, 127]
SIZES = [8, 8, 16, 64, 128, 256, 32, 16]


def check(out, want, tol=BF16_TOL):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN in the output"
    err = np.abs(out - want).max()
    assert err <= tol, f"max abs err {err:.3g} > {tol}"
    return out


def check_var(var, want, rtol=VAR_RTOL, atol=VAR_ATOL):
    var = np.asarray(var)
    assert var.dtype == np.float32 and var.shape == want.shape, (var.dtype, var.shape)
    assert np.isfinite(var).all() and (var >= 0).all(), var
    np.testing.assert_allclose(var, want, rtol=rtol, atol=atol)


def as_mma_input(case):
    """The case with q rounded to bf16, as the kernel's MMA sees it (the float64 truth of an fp32-q case)."""
    return {**case, "q": case["q"].astype(jnp.bfloat16)}


def offset_case(case, k_shift, q_shift):
    """Every live K row and q get a common offset, so each row's scores share a mean many times their spread
    (the K offset moves the mean only): where fp32 sums of s and s^2 without a shift lose the variance to
    cancellation."""
    k = np.asarray(case["k_pool"].astype(jnp.float32)) + k_shift     # NaN stays NaN
    q = np.asarray(case["q"].astype(jnp.float32)) + q_shift
    return {**case, "k_pool": jnp.asarray(k, jnp.bfloat16), "q": jnp.asarray(q, case["q"].dtype)}


def test_reference_matches_float64():
    case = random_paged_case(0, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    out = swapped_paged_attention_reference(**{**case, "q": case["q"].astype(jnp.float32)})
    check(out, float64_attention(case), tol=2e-5)


STATS = dict(return_score_stats=True)


# One kv head where the case is about something else than several: the interpreter's time grows with the grid.
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads,block_kv,splits,q_dtype,sm_scale,kw", [
    # llama's GQA 4 (N = 8 with the neighbour group), D=64's default tile; score statistics
    (64, 8, 2, 128, 1, jnp.bfloat16, None, STATS),
    # GQA 1, D=128's default tile, a given sm_scale; statistics of soft-capped scores
    (128, 2, 2, 64, 1, jnp.bfloat16, 0.2, dict(soft_cap=5.0, **STATS)),
    # GQA 8, fp32 q and output, split-K 2 (the 1- and 7-token rows' second split is empty); statistics; the
    # loop's and the epilogue's SMEM shared
    (64, 8, 1, 64, 2, jnp.float32, None, dict(shared_smem=True, **STATS)),
    (128, 3, 1, 64, 3, jnp.bfloat16, None, {}),     # GQA 3: groups padded to 8 rows, split-K 3
    (64, 16, 1, 256, 1, jnp.bfloat16, None, {}),    # GQA 16: N = 16, 256-token tiles (four M groups)
])
def test_kernel_matches_float64(head_dim, num_q_heads, num_kv_heads, block_kv, splits, q_dtype, sm_scale, kw):
    """The output against float64 (NaN in every stale slot); with return_score_stats also score_var against
    float64 (one interpreter run checks both: the interpreter's time is the file's time)."""
    case = random_paged_case(1, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, q_dtype=q_dtype)
    kw = dict(kw)
    config = SwappedConfig(block_kv=block_kv, num_splits=splits, shared_smem=kw.pop("shared_smem", False))
    out = swapped_paged_attention(**case, sm_scale=sm_scale, config=config, interpret=True, **kw)
    soft_cap = kw.get("soft_cap")
    if kw.get("return_score_stats"):
        out, var = out
        # fp32 q is rounded to bf16 for the MMA: the truth of the scores the kernel computes
        want = float64_score_variance(as_mma_input(case), sm_scale=sm_scale, soft_cap=soft_cap)
        assert want.max() > 0.5                               # non-trivial values
        check_var(var, want)
        var = np.asarray(var)
        # No key: exactly 0. One key: 0 up to the fp32 rounding of s - c (a fused multiply-add may keep the
        # product's rounding error, ~1e-12 here).
        assert np.all(var[LENGTHS.index(0)] == 0) and np.all(var[LENGTHS.index(1)] < 1e-12)
    assert out.shape == case["q"].shape and out.dtype == q_dtype
    got = check(out, float64_attention(case, sm_scale=sm_scale, soft_cap=soft_cap))
    assert np.all(got[LENGTHS.index(0)] == 0.0), "a length-0 row must give zeros"


def as_f16_pools(case):
    """The case with float16 pools (a DKVC fp16-delta pool's dtype; bf16 values are exact in f16, NaN stays)."""
    return {**case, "k_pool": case["k_pool"].astype(jnp.float16), "v_pool": case["v_pool"].astype(jnp.float16)}


def test_float16_pools_match_float64():
    """float16 pools (the folded fp16-delta path, stratum_jax/attention.py): the MMAs run in f16 (q, the ring, P),
    the output in q's dtype; NaN in every stale slot; split-K 2; score statistics. q beyond f16's range is clipped,
    not turned inf: on q head 0 (|q| up to ~1e6) the scores are huge but finite, so its softmax picks its largest
    key, and the other heads are as float64 says."""
    case = as_f16_pools(random_paged_case(5, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=4, num_kv_heads=1,
                                          head_dim=64))
    case["q"] = case["q"].at[:, 0].multiply(1e6 / 4)
    out, var = swapped_paged_attention(**case, config=SwappedConfig(block_kv=64, num_splits=2), interpret=True,
                                       return_score_stats=True)
    assert out.dtype == jnp.bfloat16
    got = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(got).all()
    want = float64_attention(case)
    check(got[:, 1:], want[:, 1:])
    assert np.all(got[LENGTHS.index(0)] == 0.0)
    check_var(np.asarray(var)[:, 1:], float64_score_variance(case)[:, 1:], rtol=2e-3)


def test_float8_pools_match_float64():
    """float8_e4m3fn pools (the fold of an fp8-delta cache with fixed per-head scales): fp8 score MMAs on the K
    rows with q in e4m3 parts, each V tile converted to an f16 staging tile (the last tile's rows past the length
    as zeros: NaN in every stale slot); split-K 2, score statistics, every page size, a partial last tile; the
    float8 default's layout (2 stages, 2 q parts, the loop's and the epilogue's SMEM shared). Tiles of 64 keys over
    lengths up to 300: full tiles take the V conversion without the mask, a last partial one with it."""
    case = random_paged_case(7, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=4, num_kv_heads=1, head_dim=64)
    case = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
            "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    config = SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2, shared_smem=True)
    out, var = swapped_paged_attention(**case, config=config, interpret=True, return_score_stats=True)
    got = check(out, float64_attention(case))      # the fp8 values exactly, in float64
    assert np.all(got[LENGTHS.index(0)] == 0.0)
    check_var(np.asarray(var), float64_score_variance(case), rtol=2e-3)
    with pytest.raises(ValueError, match="both float8_e4m3fn"):
        swapped_paged_attention(**{**case, "v_pool": case["v_pool"].astype(jnp.bfloat16)}, interpret=True)


@pytest.mark.parametrize("config, stats", [
    (SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2, refill_under_pv=True,
                   fp8_q_in_kernel=True, split_first_percent=70), True),
    (SwappedConfig(block_kv=128, num_stages=2, num_splits=1, fp8_q_terms=3, fp8_q_stacked=False,
                   shared_smem=True), False)], ids=["fp8-default-split2-stats", "block128-unstacked"])
@pytest.mark.parametrize("packed", [False, True], ids=["two-arrays", "packed"])
def test_float8_granule_scales_match_float64(config, stats, packed):
    """float8 pools with a scale per 8-slot granule per kv head (`F8PackedGranulePages`, the default fp8-delta
    cache's decode kernel): each page piece's scale granules copied beside its rows, the keys' scales on S^T's rows, the
    values' on P; every page size in one batch (a tile holds 8 / 4 / 2 whole pages, one, or a piece of one: every
    place a granule can sit in the scale buffers), scales differing 10x between granules (a neighbour's scale is
    caught), NaN in every stale slot and in every granule with no live key, a length-0 row; GQA 4 over 2 kv heads.
    Against float64 of scale x e4m3 value; the score variance too. packed: the scales as the cache stores them
    (`pack_granule_scales`), else K's and V's as two arrays (packed at the entry)."""
    case = random_paged_case(11, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    f8, truth = fp8_granule_case(case, seed=11)
    kernel_args = dict(f8)
    if packed:
        kernel_args["packed_scales"] = pack_granule_scales(kernel_args.pop("k_scale"), kernel_args.pop("v_scale"))
    res = swapped_paged_attention(**kernel_args, config=config, interpret=True, return_score_stats=stats)
    out, var = res if stats else (res, None)
    got = check(out, float64_attention(truth))
    assert np.all(got[LENGTHS.index(0)] == 0.0)
    if stats:
        check_var(np.asarray(var), float64_score_variance(truth), rtol=2e-3)
    # the reference takes the same scales
    ref = swapped_paged_attention_reference(**{**f8, "q": f8["q"].astype(jnp.float32)})
    check(ref, float64_attention(truth), tol=1e-4)


def test_float8_granule_value_scales_tiny_and_zero():
    """Value scales of ~1e-9 (each V term ~4e-8, under f16's smallest normal: P * v_scale rounded to f16 without
    the softmax max's log2(v_scale) shift would lose every digit), one live granule with value scale 0 and one
    with key scale 0 (their keys add nothing / score 0)."""
    case = random_paged_case(12, lengths=[40, 100, 24], page_sizes=[8, 32, 16], num_q_heads=4, num_kv_heads=1,
                             head_dim=64)
    f8, truth = fp8_granule_case(case, seed=12, scale_range=(1e-9, 1e-8))
    starts = np.asarray(case["page_starts"])
    k_scale, v_scale = np.array(f8["k_scale"]) * 1e6, np.array(f8["v_scale"])
    v_scale[0, starts[1, 0] // 8] = 0.0          # sequence 1, tokens 0-7
    k_scale[0, starts[1, 1] // 8 + 1] = 0.0      # sequence 1, tokens 40-47
    f8.update(k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    for side, scale in (("k", k_scale), ("v", v_scale)):
        truth[f"{side}_pool"] = (np.asarray(f8[f"{side}_pool"].astype(jnp.float32), np.float64)
                                 * np.repeat(scale, 8, axis=1)[..., None])
    out = np.asarray(swapped_paged_attention(**f8, config=SwappedConfig(block_kv=64, num_stages=2, num_splits=1,
                                                                        fp8_q_terms=2),
                                             interpret=True, out_dtype=jnp.float32))
    want = float64_attention(truth)
    assert 0 < np.abs(want).max() < 1e-6      # the whole output is tiny
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-2 * np.abs(want).max())


def test_float8_granule_scales_entry_checks():
    case = random_paged_case(13, lengths=[5], page_sizes=[8], num_q_heads=4, num_kv_heads=1, head_dim=64)
    f8, _ = fp8_granule_case(case)
    with pytest.raises(ValueError, match="k_scale and v_scale together"):
        swapped_paged_attention(**{**f8, "v_scale": None}, interpret=True)
    with pytest.raises(ValueError, match=r"k_scale must be \[num_kv_heads, num_slots // 8\]"):
        swapped_paged_attention(**{**f8, "k_scale": f8["k_scale"][:, :-1]}, interpret=True)
    with pytest.raises(ValueError, match="for float8_e4m3fn pools"):
        swapped_paged_attention(**{**case, "k_scale": f8["k_scale"], "v_scale": f8["v_scale"]}, interpret=True)
    packed = pack_granule_scales(f8["k_scale"], f8["v_scale"])
    for bad in ({**f8, "packed_scales": packed},                                         # and k_scale / v_scale
                {**case, "packed_scales": packed}):                                      # bf16 pools
        with pytest.raises(ValueError, match=r"packed_scales are for float8_e4m3fn pools without k_scale"):
            swapped_paged_attention(**bad, interpret=True)
    with pytest.raises(ValueError, match=r"packed_scales must be float32 \[num_kv_heads, num_slots // 8, 4\]"):
        swapped_paged_attention(**{**f8, "k_scale": None, "v_scale": None, "packed_scales": packed[:, :, :2]},
                                interpret=True)


def test_float8_refill_under_pv_gives_the_same_output():
    """`refill_under_pv` (float8 pools): the ring slot's next copies are issued while the P V MMA runs, not after
    it. Only when the copies start changes: the output is the default order's bit for bit (NaN in every stale
    slot, every page size, so 8-token pages' 8 copies a tile; 2 and 3 stages, split-K 1 and 2, lengths that
    leave slots never refilled) and float64's. For bf16 pools (P V reads the V slot) the flag is ignored: the
    traced kernel is the default's."""
    case = random_paged_case(13, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=4, num_kv_heads=1, head_dim=64)
    f8 = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
          "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    want = float64_attention(f8)
    for stages, splits in ((2, 1), (3, 2)):
        config = SwappedConfig(block_kv=64, num_stages=stages, num_splits=splits, fp8_q_terms=2)
        default = np.asarray(swapped_paged_attention(**f8, config=config, interpret=True), np.float32)
        early = np.asarray(swapped_paged_attention(**f8, config=dataclasses.replace(config, refill_under_pv=True),
                                                   interpret=True), np.float32)
        np.testing.assert_array_equal(early, default)
        check(early, want)
    config = SwappedConfig(block_kv=64, num_stages=2)
    trace = lambda cfg: str(jax.make_jaxpr(lambda c: swapped_paged_attention(**c, config=cfg))(case))
    assert trace(dataclasses.replace(config, refill_under_pv=True)).replace("refill_under_pv=True", "") == \
        trace(config).replace("refill_under_pv=False", "")


def affine_truth(case, out_scale, out_bias):
    """float64 attention over the case's pools, times out_scale, plus out_bias per kv head (rows with keys)."""
    group = case["q"].shape[1] // out_scale.shape[0]
    has_keys = np.asarray(case["lengths"])[:, None, None] > 0
    return (float64_attention(case) * np.repeat(np.asarray(out_scale, np.float64), group)[None, :, None]
            + np.where(has_keys, np.repeat(np.asarray(out_bias, np.float64), group, axis=0)[None], 0.0))


@pytest.mark.parametrize("pool_dtype", [jnp.float8_e4m3fn, jnp.bfloat16], ids=["float8", "bf16"])
def test_out_affine_in_kernel_gives_xlas_output(pool_dtype):
    """The output's affine map per kv head (out_scale, out_bias: the DKVC fold's s_v and a_v) in the kernel's
    epilogue (`out_affine_in_kernel`, no split-K) gives XLA's map after the kernel bit for bit, and float64's;
    a sequence of length 0 keeps zeros (no bias). With split-K the flag changes nothing (XLA maps the merged
    output). Two kv heads, so a CTA's 8-row block holds both groups and the map must be its own head's."""
    case = random_paged_case(21, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    case = {**case, "k_pool": case["k_pool"].astype(pool_dtype), "v_pool": case["v_pool"].astype(pool_dtype),
            "q": case["q"].astype(jnp.float32)}
    rng = np.random.default_rng(5)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 2), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    want = affine_truth(as_mma_input(case) if pool_dtype == jnp.bfloat16 else case, scale, bias)
    for splits in (1, 2):
        config = SwappedConfig(block_kv=64, num_stages=2, num_splits=splits, fp8_q_terms=2,
                               shared_smem=splits == 1)
        run = lambda cfg: swapped_paged_attention(**case, config=cfg, interpret=True, out_scale=scale,
                                                  out_bias=bias, out_dtype=jnp.bfloat16)
        xla = run(config)
        kernel = run(dataclasses.replace(config, out_affine_in_kernel=True))
        assert kernel.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(kernel, np.float32), np.asarray(xla, np.float32))
        got = check(kernel, want, tol=4 * BF16_TOL)     # bf16 output of values up to ~4
        assert np.all(got[LENGTHS.index(0)] == 0.0)


def test_fp8_q_in_kernel_gives_xlas_split():
    """`fp8_q_in_kernel`: each CTA splits its own 8-row q block (head scales applied, power-of-two unscales, e4m3
    parts) after issuing its first copies; the output is XLA's split's bit for bit (fp32 and bf16 q, split-K 1 and
    2, with the output map in the kernel: the whole fold in one launch). Two kv heads, per-head scales."""
    case = random_paged_case(23, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    f8 = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
          "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    rng = np.random.default_rng(8)
    kw = dict(interpret=True, q_scale=jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32),
              out_scale=jnp.asarray(rng.uniform(0.5, 2.0, 2), jnp.float32),
              out_bias=jnp.asarray(rng.standard_normal((2, 64)), jnp.float32), out_dtype=jnp.bfloat16)
    for q_dtype, splits in ((jnp.float32, 1), (jnp.bfloat16, 2)):
        c = {**f8, "q": case["q"].astype(q_dtype)}
        config = SwappedConfig(block_kv=64, num_stages=2, num_splits=splits, fp8_q_terms=2, shared_smem=True,
                               refill_under_pv=True)
        xla = swapped_paged_attention(**c, config=config, **kw)
        one = swapped_paged_attention(**c, config=dataclasses.replace(
            config, fp8_q_in_kernel=True, out_affine_in_kernel=True), **kw)
        np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(xla, np.float32))


@CLUSTER_HANGS     # passed 4 of 4 runs by hand (session 36), then hung in a CI run: see cluster_interpreter.py
def test_split_merge_in_kernel_gives_xlas_merge():
    """`split_merge_in_kernel`: the splits of a (sequence, kv head) run as one cluster, exchange their rows and
    log-sum-exp through global memory, and the first merges them (with the output map, for float8 pools the whole
    fold: q split, scores, merge, s_v and a_v in one launch): bit for bit XLA's `combine_splits` and map, also
    with split-K 3, shared SMEM, the score statistics (merged by XLA as before) and a sequence of length 0."""
    case = random_paged_case(23, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    f8 = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
          "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn), "q": case["q"].astype(jnp.bfloat16)}
    rng = np.random.default_rng(8)
    affine = dict(q_scale=jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32),
                  out_scale=jnp.asarray(rng.uniform(0.5, 2.0, 2), jnp.float32),
                  out_bias=jnp.asarray(rng.standard_normal((2, 64)), jnp.float32), out_dtype=jnp.bfloat16)
    fold = SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2, refill_under_pv=True,
                         fp8_q_in_kernel=True)
    plain = SwappedConfig(block_kv=64, num_stages=2, num_splits=3, shared_smem=True)
    for c, config, kw in ((f8, fold, affine), ({**case, "q": case["q"].astype(jnp.float32)}, plain,
                                               {"return_score_stats": True})):
        xla = swapped_paged_attention(**c, config=config, interpret=True, **kw)
        merged = swapped_paged_attention(**c, config=dataclasses.replace(
            config, split_merge_in_kernel=True, out_affine_in_kernel=True), interpret=True, **kw)
        for got, want in zip(jax.tree.leaves(merged), jax.tree.leaves(xla)):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_longest_first_splits_match_float64():
    """`split_first_percent`: every sequence's first split covers that percent of its tiles, the others share the
    rest, and the grid runs the split axis outermost; the output (float8 pools through the engine's fold: q's
    split in the kernel, refill under P V; bf16 pools with split-K 3 and the score statistics, whose key counts
    follow the same partition) matches float64 and the even splits' output up to the merge's rounding, with
    sequences whose first split takes every tile (the others empty) and a sequence of length 0."""
    case = random_paged_case(29, lengths=LENGTHS, page_sizes=SIZES, num_q_heads=8, num_kv_heads=2, head_dim=64)
    f8 = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
          "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    fold = SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2, refill_under_pv=True,
                         fp8_q_in_kernel=True)
    plain = SwappedConfig(block_kv=64, num_stages=2, num_splits=3)
    for c, config, percent in ((f8, fold, 65), (case, plain, 50)):
        stats = config is plain
        even = swapped_paged_attention(**c, config=config, interpret=True, return_score_stats=stats)
        first = swapped_paged_attention(**c, config=dataclasses.replace(config, split_first_percent=percent),
                                        interpret=True, return_score_stats=stats)
        even, first = (jax.tree.leaves(x) for x in (even, first))
        got = check(first[0], float64_attention(c))
        np.testing.assert_allclose(got, np.asarray(even[0], np.float32), atol=1e-2)
        assert np.all(got[LENGTHS.index(0)] == 0.0)
        if stats:
            check_var(np.asarray(first[1]), float64_score_variance(c))
    trace = str(jax.make_jaxpr(lambda c: swapped_paged_attention(
        **c, config=dataclasses.replace(plain, split_first_percent=50)))(case))
    assert "grid_names=('k', 'b', 'h')" in trace, "the split axis is not the grid's outermost"
    with pytest.raises(ValueError, match="split_first_percent must be"):
        SwappedConfig(split_first_percent=100)
    assert SwappedConfig(split_first_percent=60, split_merge_in_kernel=True).split_first_percent is None


def test_out_affine_entry_checks():
    case = random_paged_case(0, lengths=[5], page_sizes=[8], num_q_heads=4, num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match=r"out_scale must be \[1\] float32"):
        swapped_paged_attention(**case, out_scale=jnp.ones((4,), jnp.float32))
    with pytest.raises(ValueError, match=r"out_bias must be \[1, 64\] float32"):
        swapped_paged_attention(**case, out_bias=jnp.ones((1, 64), jnp.bfloat16))


def test_out_affine_in_kernel_leaves_no_xla_op_after_the_kernel():
    """With the map in the kernel (no split-K, one q row block per group) the jitted call ends at the kernel:
    nothing computes on its output (reshapes only); with XLA's map the multiply and add follow it."""
    args = (jax.ShapeDtypeStruct((64, 32, 128), jnp.float32),
            *(jax.ShapeDtypeStruct((8, 1 << 16, 128), jnp.float8_e4m3fn),) * 2,
            jax.ShapeDtypeStruct((64,), jnp.int32), jax.ShapeDtypeStruct((64, 512), jnp.int32),
            jax.ShapeDtypeStruct((64,), jnp.int32))
    affine = (jnp.ones((8,), jnp.float32), jnp.zeros((8, 128), jnp.float32))

    def after_kernel(in_kernel):
        config = SwappedConfig(block_kv=64, num_stages=2, num_splits=1, fp8_q_terms=2, shared_smem=True,
                               out_affine_in_kernel=in_kernel)
        jaxpr = jax.make_jaxpr(lambda *a: swapped_paged_attention(
            *a, config=config, out_scale=affine[0], out_bias=affine[1], out_dtype=jnp.bfloat16))(*args)
        eqns = jaxpr.eqns[-1].params["jaxpr"].jaxpr.eqns         # the entry's jit
        # the kernel: plgpu.kernel's call (a custom_vmap_call around the pallas_call in jax 0.11)
        kernel = max(i for i, e in enumerate(eqns) if e.primitive.name in ("pallas_call", "custom_vmap_call"))
        return {e.primitive.name for e in eqns[kernel + 1:]}
    assert after_kernel(True) <= {"reshape", "slice", "convert_element_type"}, after_kernel(True)
    assert {"mul", "add"} <= after_kernel(False)


@pytest.mark.parametrize("config", ["one-launch", "merged"])
@pytest.mark.parametrize("q_dtype", [jnp.bfloat16, jnp.float32])
def test_one_launch_fold_lowers_to_mosaic_gpu(q_dtype, config):
    """llama-8b's decode shape, fp8 pools, the whole fold in one launch (`ONE_LAUNCH_FP8`: no split-K with shared
    SMEM, q's split in the kernel's prologue, the output map in its epilogue; `MERGED_FP8`: split-K 2 as clusters,
    merged and mapped by the first split): lowers for CUDA, and the program is that one custom call with no XLA
    reduction or arithmetic around it."""
    config = {"one-launch": ONE_LAUNCH_FP8, "merged": MERGED_FP8}[config]
    text = _lowered_text(64, 128, config=config, pool_dtype=jnp.float8_e4m3fn, q_dtype=q_dtype,
                         q_scale=jnp.ones((32,), jnp.float32), out_scale=jnp.ones((8,), jnp.float32),
                         out_bias=jnp.zeros((8, 128), jnp.float32), out_dtype=jnp.bfloat16)
    assert text.count("stablehlo.custom_call") == 1 and "mosaic_gpu" in text
    ops = set(re.findall(r"stablehlo\.([a-z_]+)", text))
    assert not ops & {"reduce", "multiply", "add", "divide", "reduce_precision", "concatenate", "transpose"}, ops


def test_float8_refill_under_pv_lowers_to_mosaic_gpu():
    """llama-8b's decode shape with the copies issued under the P V MMA: the ring refill inside the MMA's scope
    lowers (TMA issue between the WGMMA and its wait)."""
    config = SwappedConfig(block_kv=64, num_stages=2, num_splits=2, fp8_q_terms=2, refill_under_pv=True)
    assert "mosaic_gpu" in _lowered_text(64, 128, config=config, pool_dtype=jnp.float8_e4m3fn)


def test_float8_longest_first_splits_lower_to_mosaic_gpu():
    """The fp8 default at llama-8b's decode shape with longest-first splits (`split_first_percent`): the split
    axis outermost and the uneven tile range lower for CUDA."""
    config = dataclasses.replace(default_swapped_config(128, 4096, jnp.float8_e4m3fn), num_splits=2,
                                 split_first_percent=65)
    assert "mosaic_gpu" in _lowered_text(64, 128, config=config, pool_dtype=jnp.float8_e4m3fn)


def test_float8_q_parts_carry_the_precision(monkeypatch):
    """The fp8 score MMAs see q as e4m3 parts times a per-row unscale: one part (3 mantissa bits) is far from
    the float64 truth, each further part cuts the error; the default (2 at head_dim 128, 3 elsewhere) is
    within BF16_TOL. q here is fp32 with a spread of row norms (a row of zeros included), so the row scale
    must be per row."""
    case = random_paged_case(11, lengths=[65, 129, 300, 7], page_sizes=[16, 64, 256, 8], num_q_heads=8,
                             num_kv_heads=2, head_dim=64)
    q = np.asarray(case["q"], np.float32) * np.array([3.0, 0.01, 40.0, 1.0])[:, None, None]
    q[3, 0] = 0.0
    case = {**case, "q": jnp.asarray(q), "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
            "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    want = float64_attention(case)
    errs = {}
    for terms in (1, 2, 3):
        config = SwappedConfig(block_kv=64, num_stages=2, fp8_q_terms=terms)
        out = np.asarray(swapped_paged_attention(**case, config=config, interpret=True), np.float32)
        errs[terms] = float(np.abs(out - want).max())
        if terms == 2:      # (the interpreter's seconds: one term count; the stacking itself is tested below)
            # the parts as one MMA (the default at N = 8) or one MMA each: the same scores up to fp32 summation order
            apart = swapped_paged_attention(**case, config=dataclasses.replace(config, fp8_q_stacked=False),
                                            interpret=True)
            np.testing.assert_allclose(out, np.asarray(apart, np.float32), rtol=1e-4,
                                       atol=1e-4 * np.abs(want).max())
    assert errs[1] > 4 * errs[2] > 4 * 4 * errs[3], errs
    assert errs[1] > BF16_TOL and errs[2] <= BF16_TOL, errs
    with pytest.raises(ValueError, match="fp8_q_terms"):
        SwappedConfig(fp8_q_terms=0)


def test_float8_stacked_q_parts_take_one_score_mma():
    """`fp8_q_stacked` (N = 8): `stack_q_parts` puts each 8-row block's parts one after the other, and the kernel
    then runs one score MMA a tile (its K tile read from SMEM once) instead of one per part: 2 WGMMAs in the
    traced kernel (S^T, P V) against terms + 1."""
    parts = jnp.arange(3 * 16 * 4, dtype=jnp.float32).reshape(3, 16, 4)
    stacked = np.asarray(swapped_module.stack_q_parts(parts))
    for block in range(2):
        for t in range(3):
            np.testing.assert_array_equal(stacked[(block * 3 + t) * 8:(block * 3 + t + 1) * 8],
                                          np.asarray(parts[t, block * 8:(block + 1) * 8]))
    case = random_paged_case(2, lengths=[65, 129], page_sizes=[16, 64], num_q_heads=8, num_kv_heads=2, head_dim=64)
    case = {**case, "k_pool": case["k_pool"].astype(jnp.float8_e4m3fn),
            "v_pool": case["v_pool"].astype(jnp.float8_e4m3fn)}
    for stacked_parts, mmas in ((True, 2), (False, 4)):
        config = SwappedConfig(block_kv=64, num_stages=2, fp8_q_terms=3, fp8_q_stacked=stacked_parts)
        text = str(jax.make_jaxpr(lambda c: swapped_paged_attention(**c, config=config))(case))
        assert text.count("wgmma_ref") == mmas, (stacked_parts, text.count("wgmma_ref"))


def test_split_rows_fp8_scales_each_row_by_a_power_of_two():
    """Each row's largest |x| lands in [64, 128) (exact power-of-two scales), parts are rounding residuals (each
    smaller than the last, none zero where x has bits left: the round trip through e4m3 that XLA's GPU pipeline
    folded away is not used), a zero row stays zero with a finite unscale, and the error relative to the row's
    largest |x| is below 2^-(4 * terms)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 64)).astype(np.float32) * np.array([1e-6, 1e-2, 1.0, 3.0, 1e3, 0.0])[:, None]
    for terms in (1, 2, 3):
        parts, unscale = swapped_module.split_rows_fp8(jnp.asarray(x), terms)
        assert parts.dtype == jnp.float8_e4m3fn and parts.shape == (terms, 6, 64)
        p = np.asarray(parts.astype(jnp.float32))
        unscale = np.asarray(unscale)
        assert np.all(np.isfinite(unscale)) and np.all(np.log2(unscale) == np.round(np.log2(unscale)))
        top = np.abs(p[0]).max(axis=1)
        assert np.all((top[:5] >= 64) & (top[:5] <= 128)) and top[5] == 0, top
        if terms > 1:
            assert np.all(np.abs(p[1]).max(axis=1) <= np.abs(p[0]).max(axis=1) / 8)
            assert np.all(np.abs(p[1][:5]).max(axis=1) > 0)
        rebuilt = p.sum(axis=0) * unscale[:, None]
        amax = np.abs(x).max(axis=1, keepdims=True)
        rel = np.abs(rebuilt - x) / np.where(amax > 0, amax, 1.0)
        assert rel.max() < 2.0 ** (-4 * terms), (terms, rel.max())


def test_split_rows_fp8_rounds_with_reduce_precision():
    """The parts' rounding must survive XLA's optimisation: with excess precision allowed (XLA's default), the GPU
    pipeline folds convert(convert(x, f8), f32) into x, which zeroed every part after the first on the H200
    (found by test_gpu_reduced_pools_match_float64; the CPU pipeline keeps the round trip, so no CPU run can
    show it). The lowered program rounds every part but the last with a reduce-precision op to e4m3's 4 exponent
    and 3 mantissa bits and converts nothing from float8 back to float32 (the last part is a plain cast)."""
    text = jax.jit(lambda x: swapped_module.split_rows_fp8(x, 3)).lower(jnp.zeros((8, 64), jnp.float32)).as_text()
    assert text.count("stablehlo.reduce_precision") == 2 and text.count("format = e4m3") == 2
    assert "f8E4M3FN) -> tensor<8x64xf32>" not in text         # no convert back from float8


def test_split_rows_fp8_unscale_is_the_row_reduction():
    """The per-row unscale is the row max's own output, with no elementwise op after it: XLA's GPU pipeline ran a
    clip that followed the max as a kernel of its own (a launch a layer). Also pins that clipping before the max
    changes nothing: zero, tiny, huge and non-finite rows keep their unscale in [2^-100, 2^100]."""
    jaxpr = jax.make_jaxpr(lambda x: swapped_module.split_rows_fp8(x, 2))(jnp.zeros((8, 64), jnp.float32)).jaxpr
    reduce_eqn = next(e for e in jaxpr.eqns if e.primitive.name == "reduce_max")
    assert jaxpr.outvars[1] is reduce_eqn.outvars[0]
    x = np.zeros((5, 64), np.float32)
    x[1, 3] = 1e-38                                 # subnormal: no exponent bits
    x[2, 7] = 3e38                                  # 2^127 * 2^-6 clipped to 2^100
    x[3, 0] = np.inf
    x[4, :] = np.linspace(-200.0, 100.0, 64)        # largest |x| 200 in [2^7, 2^8): 2^(8 - 7)
    _, unscale = swapped_module.split_rows_fp8(jnp.asarray(x), 2)
    assert list(np.asarray(unscale)) == [2.0 ** -100, 2.0 ** -100, 2.0 ** 100, 2.0 ** 100, 2.0]


def test_float8_pools_default_config_and_min_splits(monkeypatch):
    """float8 pools at head_dim 128 default to 64-token tiles, 2 stages, 2 q parts split in the attention kernel
    (the fastest timed, BENCHMARKS.md) and split-K of at least FP8_MIN_SPLITS even where the grid rule says 1,
    longest-first where that grid is more than one wave; with shared_smem (not a default yet) deeper where the page
    table's window would leave fewer than FP8_CTAS_PER_SM CTAs an SM (16K context: 4); bf16 pools keep their
    default. head_dim 64 fp8 keeps the bf16 default tiles (not timed)."""
    fp8 = jnp.float8_e4m3fn
    cfg = swapped_module.default_swapped_config(128, pool_dtype=fp8)
    assert (cfg.block_kv, cfg.num_stages, cfg.fp8_q_terms, cfg.num_splits, cfg.shared_smem, cfg.refill_under_pv,
            cfg.fp8_q_in_kernel, cfg.out_affine_in_kernel) == (64, 2, 2, None, False, True, True, False)
    assert swapped_module.default_swapped_config(128) == SwappedConfig(block_kv=64, num_stages=3)
    assert swapped_module.default_swapped_config(64, pool_dtype=fp8) == swapped_module.default_swapped_config(64)
    assert cfg.ctas_per_sm(128, max_pages=16384 // 8) >= 2
    seen = []
    real = swapped_module._build_swapped_kernel
    monkeypatch.setattr(swapped_module, "_build_swapped_kernel",
                        lambda **kw: seen.append(kw["config"]) or real(**kw))
    monkeypatch.setattr(swapped_module, "default_num_splits", lambda batch, kv: 1)
    case = random_paged_case(2, lengths=[40, 300], page_sizes=[16, 128], num_q_heads=4, num_kv_heads=1,
                             head_dim=128)
    as_fp8 = {**case, "k_pool": case["k_pool"].astype(fp8), "v_pool": case["v_pool"].astype(fp8)}
    jax.make_jaxpr(lambda c: swapped_paged_attention(**c))(as_fp8)
    jax.make_jaxpr(lambda c: swapped_paged_attention(**c))(case)
    assert seen[0] == SwappedConfig(block_kv=64, num_stages=2, num_splits=swapped_module.FP8_MIN_SPLITS,
                                    fp8_q_terms=2, refill_under_pv=True, fp8_q_in_kernel=True)
    assert seen[1] == SwappedConfig(block_kv=64, num_stages=3, num_splits=1)
    # Without shared_smem, FP8_MIN_SPLITS (or the grid's); with it, deep enough for FP8_CTAS_PER_SM CTAs an SM.
    splits = lambda c, pages, grid=1: swapped_module.fp8_default_splits(c, 128, pages, 4, grid)
    shared = dataclasses.replace(cfg, shared_smem=True, split_first_percent=None)    # (timed with even splits)
    assert (splits(cfg, 4096 // 8), splits(cfg, 16384 // 8), splits(cfg, 4096 // 8, grid=8)) == (2, 2, 8)
    assert (splits(shared, 4096 // 8), splits(shared, 16384 // 8), splits(shared, 4096 // 8, grid=8)) == (2, 4, 8)
    for pages in (4096 // 8, 16384 // 8):
        fits = dataclasses.replace(shared, num_splits=splits(shared, pages))
        assert fits.ctas_per_sm(128, pages, out_itemsize=4, pool_dtype=fp8) >= swapped_module.FP8_CTAS_PER_SM
    assert dataclasses.replace(cfg, num_splits=2).ctas_per_sm(128, 4096 // 8, out_itemsize=4, pool_dtype=fp8) == 3
    # Longest-first splits only where the split-K grid is more than one wave (3 CTAs an SM x 132 SMs): llama-8b's
    # B=64 (1,024 CTAs) keeps FP8_FIRST_SPLIT_PERCENT, B=24 (384) and the small case above (4 CTAs) run even splits.
    assert cfg.split_first_percent == swapped_module.FP8_FIRST_SPLIT_PERCENT and seen[0].split_first_percent is None
    shape = lambda *s, dt=jnp.int32: jax.ShapeDtypeStruct(s, dt)
    for batch, want in ((64, swapped_module.FP8_FIRST_SPLIT_PERCENT), (24, None)):
        jax.jit(lambda *a: swapped_paged_attention(*a)).trace(
            shape(batch, 32, 128, dt=jnp.bfloat16), shape(8, 1 << 16, 128, dt=fp8), shape(8, 1 << 16, 128, dt=fp8),
            shape(batch), shape(batch, 4096 // 8), shape(batch))
        assert (seen[-1].num_splits, seen[-1].split_first_percent) == (2, want), batch


SHARED_FP8 = SwappedConfig(block_kv=64, num_stages=2, fp8_q_terms=2, shared_smem=True)   # splits: the fp8 rule
# The whole fp8 fold in one launch: no split-K (4 CTAs an SM: B=64 x Hkv=8 in one wave), q split in the kernel
ONE_LAUNCH_FP8 = dataclasses.replace(SHARED_FP8, num_splits=1, refill_under_pv=True, fp8_q_in_kernel=True,
                                     out_affine_in_kernel=True)
# The fp8 default (split-K 2, q split in the kernel) with the split merge and the output map in the kernel
MERGED_FP8 = dataclasses.replace(default_swapped_config(128, 4096, jnp.float8_e4m3fn), num_splits=2,
                                 split_merge_in_kernel=True, out_affine_in_kernel=True)
# Per-granule scales beside fp8 pools of 1 << 16 slots, 8 kv heads, as two arrays (packed at the entry)
GRANULE_SCALES = {"k_scale": jnp.ones((8, (1 << 16) // 8), jnp.float32),
                  "v_scale": jnp.ones((8, (1 << 16) // 8), jnp.float32)}
# Both sides' granule scales packed (`F8PackedGranulePages`)
PACKED_SCALES = {"packed_scales": jnp.ones((8, (1 << 16) // 8, 4), jnp.float32)}
# The fp8 default with longest-first splits (the first split's table window is the larger)
FIRST_FP8 = dataclasses.replace(default_swapped_config(128, 4096, jnp.float8_e4m3fn), num_splits=2,
                                split_first_percent=65)


@pytest.mark.parametrize("head_dim, context, pool_dtype, batch, kw", [
    (128, 4096, jnp.float8_e4m3fn, 64, {}), (128, 4096, jnp.float8_e4m3fn, 64, {"config": SHARED_FP8}),
    (128, 16384, jnp.float8_e4m3fn, 64, {"config": SHARED_FP8, "return_score_stats": True}),
    (64, 4096, jnp.float8_e4m3fn, 64, {}), (128, 4096, jnp.bfloat16, 64, {}), (64, 1024, jnp.float16, 64, {}),
    (128, 16384, jnp.bfloat16, 4, {}),
    (128, 4096, jnp.bfloat16, 64, {"config": SwappedConfig(block_kv=64, num_stages=3, shared_smem=True)}),
    (128, 4096, jnp.float8_e4m3fn, 64, {"config": ONE_LAUNCH_FP8}),
    (128, 16384, jnp.float8_e4m3fn, 64, {"config": ONE_LAUNCH_FP8}),
    (128, 4096, jnp.float8_e4m3fn, 64, {"config": MERGED_FP8}),
    (128, 16384, jnp.float8_e4m3fn, 64, {"config": FIRST_FP8}),
    (128, 16384, jnp.float8_e4m3fn, 64, GRANULE_SCALES), (128, 4096, jnp.float8_e4m3fn, 64, PACKED_SCALES)],
    ids=["fp8-128-4k", "fp8-128-4k-shared", "fp8-128-16k-shared-stats", "fp8-64-4k", "bf16-128-4k", "f16-64-1k",
         "bf16-128-16k-b4", "bf16-128-4k-shared", "fp8-128-4k-one-launch", "fp8-128-16k-one-launch",
         "fp8-128-4k-merged", "fp8-128-16k-longest-first", "fp8-128-16k-two-arrays", "fp8-128-4k-packed"])
def test_smem_bytes_is_what_the_lowering_allocates(head_dim, context, pool_dtype, batch, kw):
    """`SwappedConfig.smem_bytes` (what the default configs and fp8's split rule are chosen by) against the SMEM
    scratch Pallas' lowering sizes for the kernel (its resource estimate, read by wrapping the private
    estimator) plus the mbarriers, at the engine's shapes: the loop's and the epilogue's buffers share one
    region. fp32 q, so the output tile is fp32."""
    lowering = pytest.importorskip("jax._src.pallas.mosaic_gpu.lowering")
    seen = []
    real = lowering._estimate_resources

    def spy(ctx, jaxpr):
        rs = real(ctx, jaxpr)
        seen.append(rs.smem_scratch_bytes)
        return rs
    shape = lambda *s, dt=jnp.int32: jax.ShapeDtypeStruct(s, dt)
    args = (shape(batch, 32, head_dim, dt=jnp.float32), shape(8, 1 << 16, head_dim, dt=pool_dtype),
            shape(8, 1 << 16, head_dim, dt=pool_dtype), shape(batch), shape(batch, context // 8), shape(batch))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lowering, "_estimate_resources", spy)
        captured = {}
        real_build = swapped_module._build_swapped_kernel
        mp.setattr(swapped_module, "_build_swapped_kernel", lambda **k: captured.update(k) or real_build(**k))
        jax.jit(lambda *a: swapped_paged_attention(*a, **kw)).trace(*args).lower(lowering_platforms=("cuda",))
    cfg = captured["config"]
    granules = int("k_scale" in kw or "packed_scales" in kw)      # scale buffers: one, packed
    want = cfg.smem_bytes(head_dim, context // 8, out_itemsize=4, pool_dtype=pool_dtype,
                          score_stats=bool(kw.get("return_score_stats")), merged_itemsize=4, scale_buffers=granules)
    barriers = 8 * (2 + 2 * cfg.num_stages * (len(swapped_module.page_classes(cfg.block_kv)) + 1))
    barriers += 16 if cfg.split_merge_in_kernel else 0      # the cluster's and the merge loads'
    assert seen[-1] + barriers == want, (seen[-1], barriers, want, cfg)
    if cfg.fp8_q_in_kernel and cfg.num_splits == 1:
        # The one-launch fold's point at 4K: B * Hkv = 512 CTAs in one wave of 4 an SM. At 16K a whole row's table
        # window (2,048 entries for 8-token pages) leaves room for 3.
        want_ctas = 4 if context == 4096 else 3
        assert cfg.ctas_per_sm(head_dim, context // 8, out_itemsize=4, pool_dtype=pool_dtype) == want_ctas
    if cfg.split_first_percent is not None:     # the larger first window leaves the fp8 default's 3 CTAs an SM
        assert cfg.ctas_per_sm(head_dim, context // 8, out_itemsize=4, pool_dtype=pool_dtype,
                               scale_buffers=granules) == 3
    if cfg.split_merge_in_kernel:     # the merge's tiles leave the fp8 default's 3 CTAs an SM at 4K
        assert cfg.ctas_per_sm(head_dim, context // 8, out_itemsize=4, pool_dtype=pool_dtype,
                               merged_itemsize=2) == 3


def test_score_stats_shift_and_plain_output():
    """Scores sharing a mean ~100x their spread (`offset_case`: K + 16, q + 2): without the shift (raw fp32
    sums of s and s^2, c = 0) this case's worst variance error is 11x the tolerance, with it 0.003x
    (measured). And the output with statistics is bit-identical to the output without (they must not touch
    the softmax). One CTA (one sequence, one kv head): the interpreter's time grows with the grid."""
    case = random_paged_case(6, lengths=[300], page_sizes=[256], num_q_heads=4, num_kv_heads=1, head_dim=64)
    case = offset_case(case, 16.0, 2.0)
    config = SwappedConfig(block_kv=128, num_splits=1)
    out, var = swapped_paged_attention(**case, config=config, interpret=True, return_score_stats=True)
    check_var(var, float64_score_variance(case))
    plain = swapped_paged_attention(**case, config=config, interpret=True)
    assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))


def test_stats_off_traces_the_plain_kernel():
    """Explicitly off options trace the same program as none given, and each option changes it (so the
    equality can fail). The same jaxpr as before the options existed was checked by hashing it (branch
    swapped-stats, 2026-12-02)."""
    case = random_paged_case(2, lengths=[40, 300], page_sizes=[16, 128], num_q_heads=8, num_kv_heads=2, head_dim=64)
    trace = lambda **kw: str(jax.make_jaxpr(lambda c: swapped_paged_attention(**c, **kw))(case))
    plain = trace()
    assert plain == trace(soft_cap=None, return_score_stats=False)
    assert plain != trace(return_score_stats=True)
    assert plain != trace(soft_cap=30.0)


def test_no_config_picks_the_default_tile_and_the_grid_split(monkeypatch):
    """config=None runs default_swapped_config(head_dim) with default_num_splits(batch, num_kv_heads)."""
    seen = []
    monkeypatch.setattr(swapped_module, "default_num_splits", lambda batch, kv: seen.append((batch, kv)) or 2)
    case = random_paged_case(2, lengths=[40, 300], page_sizes=[16, 128], num_q_heads=4, num_kv_heads=1, head_dim=64)
    check(swapped_paged_attention(**case, interpret=True), float64_attention(case))
    assert seen == [(2, 1)]
    jaxpr = str(jax.make_jaxpr(lambda c: swapped_paged_attention(**c))(case))
    assert jaxpr == str(jax.make_jaxpr(lambda c: swapped_paged_attention(
        **c, config=SwappedConfig(block_kv=128, num_splits=2)))(case))


def test_entry_checks():
    case = random_paged_case(4, lengths=[5], page_sizes=[8], num_q_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError, match="head_dim"):
        bad = {**case, "q": jnp.zeros((1, 4, 96), jnp.bfloat16), "k_pool": jnp.zeros((2, 256, 96), jnp.bfloat16),
               "v_pool": jnp.zeros((2, 256, 96), jnp.bfloat16)}
        swapped_paged_attention(**bad)
    with pytest.raises(ValueError, match="bfloat16"):
        swapped_paged_attention(**{**case, "k_pool": case["k_pool"].astype(jnp.float32)})
    with pytest.raises(ValueError, match="both float16"):
        swapped_paged_attention(**{**case, "k_pool": case["k_pool"].astype(jnp.float16)})
    with pytest.raises(ValueError, match="lengths"):
        swapped_paged_attention(**{**case, "lengths": jnp.zeros((2,), jnp.int32)})
    with pytest.raises(TypeError, match="SwappedConfig"):
        from pallas_kernels.paged_attention import TuningConfig
        swapped_paged_attention(**case, config=TuningConfig())
    with pytest.raises(ValueError, match="block_kv"):
        SwappedConfig(block_kv=32)
    with pytest.raises(ValueError, match="soft_cap"):
        swapped_paged_attention(**case, soft_cap=0.0)


def test_default_configs_fit_the_ctas_per_sm_they_were_timed_with():
    """More CTAs per SM than `paged_attention`'s 2 at head_dim 64 (SMEM is the limit, not registers); at 128 the
    3-stage default (the fastest timed, KERNEL_NOTES.md) fits 2. The page table of a 1K-context benchmark (128
    entries; the whole row is the CTA's window without split-K), and a 16K context's still fits in SMEM."""
    for head_dim, ctas in ((64, 3), (128, 2)):
        cfg = default_swapped_config(head_dim)
        assert cfg.ctas_per_sm(head_dim, max_pages=1024 // 8) >= ctas, (head_dim, cfg)
        assert cfg.smem_bytes(head_dim, max_pages=16384 // 8) <= 227 * 1024
    assert [query_columns(g) for g in (1, 2, 4, 8, 12, 16)] == [8, 8, 8, 8, 16, 16]


def test_a_short_max_context_picks_the_short_tile_at_head_dim_64():
    """head_dim 64 with every context bounded by SHORT_CONTEXT_KEYS: 64-token tiles, 3 stages (4 CTAs an SM);
    unbounded or longer: 128-token tiles. head_dim 128 has one default. The bound reaches the kernel's trace."""
    short, long_ = default_swapped_config(64, SHORT_CONTEXT_KEYS), default_swapped_config(64, SHORT_CONTEXT_KEYS + 8)
    assert (short.block_kv, short.num_stages) == (64, 3) and short.ctas_per_sm(64, max_pages=256) == 4
    assert (long_.block_kv, long_.num_stages) == (128, 2) == (default_swapped_config(64).block_kv, 2)
    assert default_swapped_config(128, 256) == default_swapped_config(128)
    case = random_paged_case(2, lengths=[40, 300], page_sizes=[16, 128], num_q_heads=4, num_kv_heads=1, head_dim=64)
    trace = lambda **kw: str(jax.make_jaxpr(lambda c: swapped_paged_attention(**c, **kw))(case))
    assert trace(max_context=512) == trace(config=short)
    assert trace(max_context=512) != trace()


def _lowered_text(batch, head_dim, config=None, pool_dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, **kw):
    """The jitted kernel lowered for CUDA on this CPU: Mosaic GPU's Python passes (layout inference, the
    dialect lowering: WGMMA operand checks, transposed SMEM stores, cross-warp reductions, TMA) all run; only
    ptxas and the hardware don't."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    args = (shape(batch, 32, head_dim, dt=q_dtype), shape(8, 1 << 16, head_dim, dt=pool_dtype),
            shape(8, 1 << 16, head_dim, dt=pool_dtype),
            shape(batch, dt=jnp.int32), shape(batch, 4096 // 8, dt=jnp.int32), shape(batch, dt=jnp.int32))
    fn = jax.jit(lambda *a: swapped_paged_attention(*a, config=config, **kw))
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_config_lowers_to_mosaic_gpu(head_dim):
    """llama-1b (D 64) and llama-8b (D 128) decode shapes, B=64, Hq=32, Hkv=8: the default config, no split."""
    assert "mosaic_gpu" in _lowered_text(64, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float8_granule_scales_lower_to_mosaic_gpu(head_dim):
    """The default fp8-delta cache's decode kernel (per-granule scales beside the fp8 pools,
    `F8PackedGranulePages`) at llama-1b's and llama-8b's decode shapes, default config, with score statistics: the
    scale copy beside each page piece's (on the V barrier), the [T] row vectors of S^T and the scaled P lower for
    CUDA, with the scales packed and as two arrays (packed at the entry)."""
    for scales in (GRANULE_SCALES, PACKED_SCALES):
        assert "mosaic_gpu" in _lowered_text(64, head_dim, pool_dtype=jnp.float8_e4m3fn, return_score_stats=True,
                                             out_bias=jnp.zeros((8, head_dim), jnp.float32), **scales)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float16_pools_lower_to_mosaic_gpu(head_dim):
    """The fp16-delta fold's kernel at the engine's decode shapes: f16 WGMMA operands (A = the K slot, the V slot
    transposed; B = q^T, P^T) and score statistics (the DMLP asks for them)."""
    assert "mosaic_gpu" in _lowered_text(64, head_dim, pool_dtype=jnp.float16, return_score_stats=True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_float8_pools_lower_to_mosaic_gpu(head_dim):
    """The fixed-scale fp8 fold's kernel at the engine's decode shapes: fp8 TMA rings, the in-kernel conversion
    to an f16 V staging tile, fp8 and f16 WGMMA, score statistics."""
    assert "mosaic_gpu" in _lowered_text(64, head_dim, pool_dtype=jnp.float8_e4m3fn, return_score_stats=True)


def test_float8_v_conversion_uses_wide_loads():
    """The fp8 kernel's V conversion reads the e4m3 rows with 4-byte SMEM loads (the WGMMA_UPCAST_2X layout, then a
    shuffle into the WGMMA layout for stmatrix), not a 2-byte load per pair (the WGMMA layout's, 32 a thread a
    64 x 128 tile): read from the Mosaic GPU module the lowering builds (its LLVM-dialect loads)."""
    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    modules = []
    real = core.lower_mgpu_module

    def spy(module, *a, **k):
        out = real(module, *a, **k)
        modules.append(str(module))
        return out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(core, "lower_mgpu_module", spy)
        _lowered_text(64, 128, pool_dtype=jnp.float8_e4m3fn)
    text = modules[-1]
    wide = len(re.findall(r"llvm\.load .*: !llvm\.ptr<3> -> vector<4xi8>", text))
    narrow = len(re.findall(r"llvm\.load .*-> vector<2xi8>", text))
    assert wide >= 16 and narrow == 0, (wide, narrow)


def test_split_k_lowers_to_mosaic_gpu():
    """A batch of 2: the grid picks split-K (the lse output path)."""
    assert "mosaic_gpu" in _lowered_text(2, 64)


def test_score_stats_and_soft_cap_lower_to_mosaic_gpu():
    """The variant only a GPU run would otherwise build: D=64's default tile (T=128: the most stats registers)
    with score statistics (three [T, N] tiles' column sums after the loop, three more column outputs), the soft
    cap (tanh on the WGMMA layout) and split-K (a batch of 2)."""
    assert "mosaic_gpu" in _lowered_text(2, 64, return_score_stats=True, soft_cap=30.0)


# ---------------------------------------------------------------------------------------------
# GPU: the compiled kernel (approximate exp2) against the fp32 reference at the engine's shapes
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_compiled_matches_reference_1k(head_dim):
    """B=64, Hq=32, Hkv=8, ~1K context, every page size mixed, NaN in free slots: the default config (no split)
    and the other tile size, against the fp32 reference and against float64 numpy."""
    case = ragged_decode_case(64, head_dim, 1024)
    want = np.asarray(swapped_paged_attention_reference(**{**case, "q": case["q"].astype(jnp.float32)}))
    for config in (None, SwappedConfig(block_kv=64 if head_dim == 64 else 128, num_splits=1),
                   SwappedConfig(block_kv=64, num_stages=3, num_splits=1)):
        check(jax.jit(lambda c: swapped_paged_attention(**c, config=config))(case), want)
    check(swapped_paged_attention(**case), float64_attention(case))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_split_k_and_fp32_q(head_dim):
    """A small batch (the grid picks split-K) with fp32 q and output."""
    case = ragged_decode_case(4, head_dim, 1024, seed=1)
    case["q"] = case["q"].astype(jnp.float32)
    out = swapped_paged_attention(**case)
    assert out.dtype == jnp.float32
    check(out, np.asarray(swapped_paged_attention_reference(**case)))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_score_stats_match_reference(head_dim):
    """return_score_stats=True, compiled: B=64 at ~1K context with the default config (no split), and B=4 (the
    grid picks split-K) with a soft cap that bends the largest scores; score_var against float64 and the fp32
    reference, the output against float64 and bit-identical to the stats-off output. The kernel's variance is
    checked 10x looser than in the interpreter (as `paged_attention`'s GPU test): the approximate tanh."""
    for batch, kw in ((64, {}), (4, dict(soft_cap=8.0))):
        case = ragged_decode_case(batch, head_dim, 1024, seed=2)
        out, var = swapped_paged_attention(**case, return_score_stats=True, **kw)
        want = float64_score_variance(case, **kw)
        assert want.max() > 0.5
        check_var(var, want, rtol=10 * VAR_RTOL, atol=10 * VAR_ATOL)
        _, ref_var = swapped_paged_attention_reference(**case, return_score_stats=True, **kw)
        check_var(ref_var, want)
        check(out, float64_attention(case, **kw))
        plain = swapped_paged_attention(**case, **kw)
        assert np.array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("pool_dtype", [jnp.float16, jnp.float8_e4m3fn], ids=["float16", "float8"])
def test_gpu_reduced_pools_match_float64(pool_dtype, head_dim):
    """float16 pools (the fp16-delta fold) and float8_e4m3fn pools (the fixed-scale fp8 fold), compiled: B=64 at
    ~1K with every page size (the default config), and B=4 (split-K) with score statistics, against float64 of
    the pools' values."""
    as_pools = lambda c: {**c, "k_pool": c["k_pool"].astype(pool_dtype), "v_pool": c["v_pool"].astype(pool_dtype)}
    case = as_pools(ragged_decode_case(64, head_dim, 1024, seed=3))
    check(swapped_paged_attention(**case), float64_attention(case))
    small = as_pools(ragged_decode_case(4, head_dim, 1024, seed=4))
    out, var = swapped_paged_attention(**small, return_score_stats=True)
    check(out, float64_attention(small))
    check_var(var, float64_score_variance(small), rtol=10 * VAR_RTOL, atol=10 * VAR_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["two-arrays", "packed"])
def test_gpu_float8_granule_scales_match_float64(head_dim, packed):
    """float8 pools with per-granule scales (the default fp8-delta cache's decode kernel: packed, as the cache
    stores them; and as two arrays), compiled: B=64 at ~1K with every page size (the default config), and B=4
    (split-K) with score statistics, against float64 of scale x e4m3 value; NaN in every stale slot and dead
    granule."""
    def kernel_args(f8):
        if not packed:
            return f8
        rest = {k: v for k, v in f8.items() if k not in ("k_scale", "v_scale")}
        return {**rest, "packed_scales": pack_granule_scales(f8["k_scale"], f8["v_scale"])}
    f8, truth = fp8_granule_case(ragged_decode_case(64, head_dim, 1024, seed=8), seed=8)
    check(swapped_paged_attention(**kernel_args(f8)), float64_attention(truth))
    f8, truth = fp8_granule_case(ragged_decode_case(4, head_dim, 1024, seed=9), seed=9)
    out, var = swapped_paged_attention(**kernel_args(f8), return_score_stats=True)
    check(out, float64_attention(truth))
    check_var(var, float64_score_variance(truth), rtol=10 * VAR_RTOL, atol=10 * VAR_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("pool_dtype", [jnp.float16, jnp.float8_e4m3fn], ids=["float16", "float8"])
def test_gpu_out_affine_in_kernel(pool_dtype):
    """Compiled, B=64 at ~1K over every page size, no split-K with shared SMEM: the output map in the epilogue
    (`out_affine_in_kernel`; float8: with q's split in the kernel too, the one-launch fold) equals XLA's ops
    around the kernel (to a bf16 unit in the last place) and float64's; so does split-K 2 merged in the kernel."""
    case = ragged_decode_case(64, 128, 1024, seed=6)
    case = {**case, "k_pool": case["k_pool"].astype(pool_dtype), "v_pool": case["v_pool"].astype(pool_dtype),
            "q": case["q"].astype(jnp.float32)}
    rng = np.random.default_rng(6)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, 8), jnp.float32)
    bias = jnp.asarray(rng.standard_normal((8, 128)), jnp.float32)
    config = dataclasses.replace(default_swapped_config(128, 1024, pool_dtype), num_splits=1, shared_smem=True,
                                 fp8_q_in_kernel=False)
    run = lambda cfg: swapped_paged_attention(**case, config=cfg, out_scale=scale, out_bias=bias,
                                              out_dtype=jnp.bfloat16)
    kernel = run(dataclasses.replace(config, out_affine_in_kernel=True,
                                     fp8_q_in_kernel=pool_dtype == jnp.float8_e4m3fn))
    # The same fp32 operations; XLA may contract o * s + b into an FMA where the kernel does not (or the other
    # way), which can move a bf16 result by one unit in the last place.
    np.testing.assert_allclose(np.asarray(kernel, np.float32), np.asarray(run(config), np.float32),
                               rtol=2.0 ** -7, atol=2.0 ** -7)
    check(kernel, affine_truth(case, scale, bias), tol=4 * BF16_TOL)
    # Split-K 2 as clusters, merged and mapped in the kernel (`split_merge_in_kernel`) against XLA's merge and map
    # (the kernel's exp2 of the merge weights is the approximate one).
    split = dataclasses.replace(config, num_splits=2, shared_smem=False)
    merged = run(dataclasses.replace(split, split_merge_in_kernel=True, out_affine_in_kernel=True,
                                     fp8_q_in_kernel=pool_dtype == jnp.float8_e4m3fn))
    np.testing.assert_allclose(np.asarray(merged, np.float32), np.asarray(run(split), np.float32),
                               rtol=2.0 ** -7, atol=2.0 ** -7)
    check(merged, affine_truth(case, scale, bias), tol=4 * BF16_TOL)
