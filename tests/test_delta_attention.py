"""Delta-KV decode attention: the Mosaic GPU kernel (run in the Mosaic GPU interpreter on CPU) and its jnp
reference, against float64 numpy built from the same rounded inputs (anchor, deltas, scales), on
ragged mixed-page-size batches with NaN deltas in every free slot and NaN scales in every free granule.

The interpreter recompiles per shape and config (~10 s each on 2 CPU cores), so the kernel cases are
few and each covers several features; the file's budget is about 60 s.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.delta_attention import (
    FOLD_MEAN_ANCHOR_ENV, default_fold_mean_anchor, delta_attention, delta_attention_reference,
    delta_prefill_attention, delta_smem_bytes)
from pallas_kernels.paged_attention import TuningConfig, default_num_splits
from pallas_kernels.testing import (float64_delta_attention, float64_delta_score_variance, packed_delta_kwargs,
                                    random_delta_case)

FP8, FP16 = jnp.float8_e4m3fn, jnp.float16
# The rebuild path rounds the rebuilt K/V and the softmax probabilities to bf16 for its MMAs, and its
# output to q's dtype (bf16 here). Against a float64 truth over K/V rounded the same way only P's and the
# output's rounding are left: about 2^-8 of the output's magnitude (up to ~4 here: the anchors carry an
# offset, as real K/V do), so the bound is relative to that magnitude. A key rebuilt with a neighbour
# granule's scale or a wrong anchor row moves a short row's output by O(0.1-1).
RTOL_ROUNDED_KV = 1e-2
# Against the unrounded truth the K/V rounding adds about as much again.
RTOL = 2e-2


def check(out, case, *, folded=False, **kw):
    """out against float64 truths. The folded path (mean anchor) attends over the exact K/V (f16 deltas,
    fp32 scales; only q, P and the output are rounded), so it meets the tight bound against the unrounded
    truth; the rebuild path meets it against the truth over bf16-rounded K/V."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN in the output"
    bounds = ((False, RTOL_ROUNDED_KV),) if folded else ((True, RTOL_ROUNDED_KV), (False, RTOL))
    for mma_bf16, rtol in bounds:
        want = float64_delta_attention(case, mma_bf16=mma_bf16, **kw)
        err, tol = np.abs(out - want).max(), rtol * max(1.0, np.abs(want).max())
        assert err <= tol, f"max abs err {err:.3g} > {tol:.3g} (truth with K/V rounded to bf16: {mma_bf16})"
    return out


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,anchor_len", [(FP16, 1), (FP8, 256)])
def test_reference_matches_float64(dtype, anchor_len):
    """fp32 math on the stored values: every page size, GQA 4, NaN deltas/scales in free slots, a
    length-0 row, lengths past the anchor's 256 rows (its rows wrap); soft cap and sm_scale too."""
    case = random_delta_case(0, lengths=[1, 37, 300, 64, 0, 270], page_sizes=[8, 16, 32, 64, 128, 256],
                             num_q_heads=8, num_kv_heads=2, head_dim=64, delta_dtype=dtype, anchor_len=anchor_len)
    fq = {**case, "q": case["q"].astype(jnp.float32)}
    out = np.asarray(delta_attention_reference(**fq))
    np.testing.assert_allclose(out, float64_delta_attention(case), atol=2e-5, rtol=0)
    assert np.all(out[4] == 0)
    capped, var = delta_attention_reference(**fq, soft_cap=5.0, sm_scale=0.3, return_score_stats=True)
    np.testing.assert_allclose(np.asarray(capped), float64_delta_attention(case, soft_cap=5.0, sm_scale=0.3),
                               atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case, soft_cap=5.0, sm_scale=0.3),
                               rtol=2e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Kernel (interpret mode)
# ---------------------------------------------------------------------------------------------

def test_kernel_fp8_mean_anchor_every_page_size():
    """The folded path with fp8 deltas (f16 tiles converted in SMEM), block_kv 64, GQA 4, every page size
    in one batch (the tile holds 8/4/2 whole pages, one page, or a piece of one: every place a granule
    scale can sit), lengths 1, P-1, P+1, ragged, a length-0 row (zeros, no anchor added), NaN in every
    free slot and granule; the score variance (the dropped q . anchor_k shift must not change it). The scales
    come packed, as the engine's cache stores them."""
    case = random_delta_case(1, lengths=[1, 15, 33, 65, 0, 300], page_sizes=[8, 16, 32, 64, 128, 256],
                             num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8, anchor_len=1)
    out, var = delta_attention(**packed_delta_kwargs(case), interpret=True, return_score_stats=True,
                               config=TuningConfig(block_kv=64, num_splits=1))
    out = check(out, case, folded=True)
    assert np.all(out[4] == 0)
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case), rtol=2e-4, atol=1e-5)


def test_kernel_fp16_mean_anchor_split_block128():
    """The folded path with fp16 deltas (the ring slots are the MMA operands), block_kv 128 (16 granules
    per tile), GQA 2, split-K over 2 CTAs (the short rows leave one split empty: its partial must carry
    no anchor), q in fp32 (rounded to f16 for the MMA), mixed page sizes, NaN in free slots."""
    case = random_delta_case(6, lengths=[9, 290, 0, 129, 70], page_sizes=[8, 16, 32, 256, 64],
                             num_q_heads=2, num_kv_heads=1, head_dim=64, delta_dtype=FP16, anchor_len=1)
    case["q"] = case["q"].astype(jnp.float32) * 3.0
    out = delta_attention(**case, interpret=True, config=TuningConfig(block_kv=128, num_splits=2))
    assert out.dtype == jnp.float32
    out = check(out, case, folded=True)
    assert np.all(out[2] == 0)


def test_kernel_folded_value_scales_tiny_and_zero():
    """Value scales of ~1e-9 (fp8 deltas: each V term is ~5e-8, below f16's smallest normal, so P * sv
    rounded to f16 without the log2(sv) shift of the softmax max would lose every digit; compare the
    delta part alone: zero anchors), one live granule with value scale 0 and one with key scale 0
    (their keys add nothing / score 0), and in a third row a q far beyond f16's range (clipped to
    65280 for the f16 MMA, so its output is finite, not NaN)."""
    case = random_delta_case(7, lengths=[40, 100, 24], page_sizes=[8, 32, 16], num_q_heads=2, num_kv_heads=1,
                             head_dim=64, delta_dtype=FP8, anchor_len=1)
    starts = np.asarray(case["page_starts"])
    v_scale = np.asarray(case["v_scale"]) * 1e-7
    k_scale = np.asarray(case["k_scale"]).copy()
    v_scale[0, starts[1, 0] // 8] = 0.0          # sequence 1, tokens 0-7
    k_scale[0, starts[1, 1] // 8 + 1] = 0.0      # sequence 1, tokens 40-47
    zero_anchor = jnp.zeros_like(case["anchor_v"])
    case.update(v_scale=jnp.asarray(v_scale), k_scale=jnp.asarray(k_scale), anchor_v=zero_anchor,
                anchor_k=zero_anchor, q=case["q"].at[2, 0].set(1e6))
    out = np.asarray(delta_attention(**case, interpret=True, config=TuningConfig(num_splits=1)).astype(jnp.float32))
    assert np.isfinite(out[2]).all()
    want = float64_delta_attention(case)[:2]
    assert np.abs(want).max() < 1e-4      # the whole output is the tiny delta part
    np.testing.assert_allclose(out[:2], want, rtol=0, atol=RTOL_ROUNDED_KV * np.abs(want).max())


def test_kernel_fp16_position_anchor_block128_split_stats():
    """fp16 deltas, a 256-row position-aligned anchor (a ring of anchor tiles; lengths past 256 wrap),
    block_kv 128 (16 copies per tile for 8-token pages), GQA 1, split-K over 2 CTAs (one empty for the
    short rows), score statistics against float64; the scales packed (the rebuild path reads K's after the K
    wait and V's after the V wait, both from the one copy on K's barrier)."""
    case = random_delta_case(2, lengths=[9, 290, 0, 129, 70], page_sizes=[8, 16, 32, 256, 64],
                             num_q_heads=1, num_kv_heads=1, head_dim=64, delta_dtype=FP16, anchor_len=256)
    out, var = delta_attention(**packed_delta_kwargs(case), interpret=True, return_score_stats=True,
                               config=TuningConfig(block_kv=128, num_splits=2))
    out = check(out, case)
    assert np.all(out[2] == 0)
    # The kernel's scores come from bf16-rounded keys: compare with the truth over the same keys.
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case, mma_bf16=True),
                               rtol=2e-4, atol=1e-5)


def test_mean_anchor_rebuild_switch(monkeypatch):
    """The fallback for the folded path (module docstring): $STRATUM_DKVC_FOLD_MEAN_ANCHOR=0 for every call,
    or fold_mean_anchor=False, sends a mean anchor through the rebuild path (its numerics are run by the
    soft-cap case below, which takes that path by itself). Which path runs shows in shared memory: at
    D=128, T=128, 3 stages, fp8 the folded path fits (~200 KB) and the anchor ring (~330 KB) does not."""
    big = random_delta_case(5, lengths=[3], page_sizes=[8], num_q_heads=1, num_kv_heads=1, head_dim=128,
                            delta_dtype=FP8, anchor_len=1)
    cfg = TuningConfig(block_kv=128, num_stages=3, num_splits=1)
    jax.eval_shape(lambda c: delta_attention(**c, config=cfg), big)
    with pytest.raises(ValueError, match="KB of shared memory per CTA"):
        delta_attention(**big, config=cfg, fold_mean_anchor=False)
    monkeypatch.setenv(FOLD_MEAN_ANCHOR_ENV, "0")
    assert not default_fold_mean_anchor()
    with pytest.raises(ValueError, match="KB of shared memory per CTA"):
        delta_attention(**big, config=cfg)
    jax.eval_shape(lambda c: delta_attention(**c, config=cfg, fold_mean_anchor=True), big)
    monkeypatch.setenv(FOLD_MEAN_ANCHOR_ENV, "yes")
    with pytest.raises(ValueError, match="STRATUM_DKVC_FOLD_MEAN_ANCHOR must be 0"):
        delta_attention(**big, config=cfg)
    monkeypatch.delenv(FOLD_MEAN_ANCHOR_ENV)
    with pytest.raises(ValueError, match="fold_mean_anchor=True needs a mean anchor"):
        delta_attention(**{**big, "anchor_k": jnp.zeros((1, 256, 128), jnp.bfloat16),
                           "anchor_v": jnp.zeros((1, 256, 128), jnp.bfloat16)}, fold_mean_anchor=True)
    with pytest.raises(ValueError, match="fold_mean_anchor=True cannot take a soft_cap"):
        delta_attention(**big, soft_cap=5.0, fold_mean_anchor=True)
    # At D=128, T=64, fp8 the anchor ring costs 32 KB of SMEM more than the folded path's f16 tiles.
    kw = dict(max_pages=64, out_itemsize=2)
    assert (delta_smem_bytes(TuningConfig(), 128, FP8, fold=False, **kw)
            - delta_smem_bytes(TuningConfig(), 128, FP8, fold=True, **kw)) == 32 * 1024


def test_kernel_fp8_mean_anchor_d128_block128():
    """fp8 deltas with head_dim 128 (128-byte rows: the other swizzle), a mean anchor with the soft cap:
    the rebuild path (the cap does not ignore q . anchor_k), the mean broadcast to a 256-row anchor block
    (lengths past 256 wrap it), GQA 4. (block_kv 128 with an anchor ring does not fit SMEM at D=128.)"""
    case = random_delta_case(3, lengths=[40, 260, 3], page_sizes=[16, 128, 8], num_q_heads=4, num_kv_heads=1,
                             head_dim=128, delta_dtype=FP8, anchor_len=1)
    out = delta_attention(**case, interpret=True, soft_cap=8.0, config=TuningConfig(block_kv=64, num_splits=1))
    check(out, case, soft_cap=8.0)


# ---------------------------------------------------------------------------------------------
# Entry point validation
# ---------------------------------------------------------------------------------------------

def test_entry_point_errors():
    case = random_delta_case(4, lengths=[5], page_sizes=[8], num_q_heads=4, num_kv_heads=2, head_dim=64,
                             delta_dtype=FP8, nan_outside=False)
    S = case["k_delta"].shape[1]
    bad = [
        (dict(q=case["q"][0]), "q must be"),
        (dict(k_delta=case["k_delta"].astype(jnp.bfloat16), v_delta=case["v_delta"].astype(jnp.bfloat16)),
         "float16 \\(fp16-delta\\) or float8_e4m3fn"),
        (dict(v_delta=case["v_delta"].astype(jnp.float16)), "float16 \\(fp16-delta\\) or float8_e4m3fn"),
        (dict(v_delta=case["v_delta"][:, :128]), "k_delta and v_delta"),
        (dict(q=jnp.zeros((1, 3, 64), jnp.bfloat16)), "multiple of num_kv_heads"),
        (dict(k_scale=jnp.ones((2, S), jnp.float32)), "k_scale must be float32 \\[num_kv_heads, num_slots // 8\\]"),
        (dict(v_scale=case["v_scale"].astype(jnp.bfloat16)), "v_scale must be float32"),
        (dict(anchor_k=case["anchor_k"].astype(jnp.float32)), "anchor_k must be bfloat16"),
        (dict(anchor_v=jnp.zeros((2, 100, 64), jnp.bfloat16)), "anchor_len must be 1 .* or a multiple of 256"),
        (dict(anchor_v=jnp.zeros((2, 256, 64), jnp.bfloat16)), "anchor_k and anchor_v must have the same shape"),
        (dict(lengths=jnp.zeros((2,), jnp.int32)), "lengths and page_sizes"),
        (dict(page_sizes=case["page_sizes"].astype(jnp.float32)), "page_sizes must be int32"),
    ]
    packed = packed_delta_kwargs(case)
    bad_packed = [
        (dict(k_scale=case["k_scale"]), "either as k_scale and v_scale or as packed_scales, not both"),
        (dict(packed_scales=packed["packed_scales"][..., :2]), "packed_scales must be float32 \\[num_kv_heads, "
         f"num_slots // 8, 4\\] = \\[2, {S // 8}, 4\\]"),
        (dict(packed_scales=packed["packed_scales"].astype(jnp.bfloat16)), "packed_scales must be float32"),
        (dict(packed_scales=None), "k_scale must be float32 .* got None \\(or pass packed_scales\\)"),
    ]
    for base, cases in ((case, bad), (packed, bad_packed)):
        for override, msg in cases:
            with pytest.raises(ValueError, match=msg):
                delta_attention(**{**base, **override}, interpret=True)
            with pytest.raises(ValueError, match=msg):
                delta_attention_reference(**{**base, **override})
    with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
        delta_attention(**case, config=TuningConfig(block_kv=256))
    with pytest.raises(ValueError, match="KB of shared memory per CTA"):
        delta_attention(**case, config=TuningConfig(num_stages=32))
    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        delta_attention(**{**case, "q": jnp.zeros((1, 4, 32), jnp.bfloat16),
                           "k_delta": case["k_delta"][..., :32], "v_delta": case["v_delta"][..., :32],
                           "anchor_k": case["anchor_k"][..., :32], "anchor_v": case["anchor_v"][..., :32]})


# ---------------------------------------------------------------------------------------------
# GPU (compiled) - skipped on CPU
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [FP8, FP16])
@pytest.mark.parametrize("anchor_len", [1, 256])
@pytest.mark.parametrize("config", [TuningConfig(), TuningConfig(block_kv=128, num_splits=2),
                                    TuningConfig(p_via_smem=True, num_splits=1)])
def test_kernel_compiled_on_gpu(dtype, anchor_len, config):
    """The compiled kernel at the benchmark's head shape (Hq=32, Hkv=8, D=128), every page size, NaN in
    free slots, a length-0 row, contexts to 1000; the score variance too. A config that does not fit
    SMEM (block_kv 128 with fp16 deltas or an anchor ring) must be refused at the entry instead."""
    case = random_delta_case(9, lengths=[1, 15, 33, 65, 127, 300, 0, 1000], page_sizes=[8, 16, 32, 64, 128, 256, 8, 32],
                             num_q_heads=32, num_kv_heads=8, head_dim=128, delta_dtype=dtype, anchor_len=anchor_len)
    splits = config.num_splits or default_num_splits(8, 8)
    folded = anchor_len == 1 and default_fold_mean_anchor()     # $STRATUM_DKVC_FOLD_MEAN_ANCHOR=0: rebuild
    if delta_smem_bytes(dataclasses.replace(config, num_splits=splits), 128, dtype, fold=folded,
                        max_pages=case["page_starts"].shape[1], out_itemsize=2 if splits == 1 else 4) > 227 * 1024:
        with pytest.raises(ValueError, match="KB of shared memory per CTA"):
            delta_attention(**case, config=config)
        return
    out, var = delta_attention(**case, config=config, return_score_stats=True)
    check(out, case, folded=folded)
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case, mma_bf16=not folded),
                               rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("dtype,anchor_len,head_dim,prefill", [(FP8, 1, 128, False), (FP16, 1, 64, False),
                                                                (FP8, 1, 128, True)])
def test_kernel_lowers_to_mosaic_gpu_on_cpu(dtype, anchor_len, head_dim, prefill):
    """The compiled (not interpreted) kernel's lowering to Mosaic GPU runs on a CPU: layouts (fp8 rows
    loaded from swizzled SMEM and stored as f16 tiles, fp16 ring slots and f16 q/P as WGMMA operands, the
    per-key column vectors, the anchor_v row loaded from GMEM in the epilogue), the TMA copies of scale
    pieces and the barriers are all emitted here, so a kernel change that breaks them fails in CI rather
    than at the first GPU compile (ptxas's register allocation is the one step only a GPU runs). The
    folded path with fp8 at D=128 and with fp16 at D=64: nothing else here compiles it. prefill: the
    causal-block kernel (`delta_prefill_attention`) in its default config (128-token tiles) on the folded
    fp8 path at D=128, the engine's fp8-delta prefill on the H200 (~30 s here, so the one prefill case)."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    S = 1024
    pools = (shape(2, S, head_dim, dt=dtype), shape(2, S, head_dim, dt=dtype),
             shape(2, S // 8, dt=jnp.float32), shape(2, S // 8, dt=jnp.float32),
             shape(2, anchor_len, head_dim), shape(2, anchor_len, head_dim))
    tables = (shape(2, 8, dt=jnp.int32), shape(2, dt=jnp.int32))
    if prefill:     # GQA 4: blocks of 16 tokens
        args = (shape(2, 16, 8, head_dim), *pools, shape(2, dt=jnp.int32), shape(2, dt=jnp.int32), *tables)
        fn = jax.jit(lambda *a: delta_prefill_attention(*a))
    else:
        args = (shape(2, 8, head_dim), *pools, shape(2, dt=jnp.int32), *tables)
        fn = jax.jit(lambda *a: delta_attention(*a, config=TuningConfig(), fold_mean_anchor=anchor_len == 1))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
