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
    RESIDENT_ANCHOR_ENV, default_resident_anchor, delta_attention, delta_attention_reference, delta_smem_bytes)
from pallas_kernels.paged_attention import TuningConfig, default_num_splits
from pallas_kernels.testing import float64_delta_attention, float64_delta_score_variance, random_delta_case

FP8, FP16 = jnp.float8_e4m3fn, jnp.float16
# The kernel rounds the rebuilt K/V and the softmax probabilities to bf16 for its MMAs, and its output to
# q's dtype (bf16 here). Against a float64 truth over K/V rounded the same way only P's and the output's
# rounding are left: about 2^-8 of the output's magnitude (up to ~4 here: the anchors carry an offset,
# as real K/V do), so the bound is relative to that magnitude. A key rebuilt with a neighbour
# granule's scale or a wrong anchor row moves a short row's output by O(0.1-1).
RTOL_ROUNDED_KV = 1e-2
# Against the unrounded truth the K/V rounding adds about as much again.
RTOL = 2e-2


def check(out, case, **kw):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out).any(), "NaN in the output"
    for mma_bf16, rtol in ((True, RTOL_ROUNDED_KV), (False, RTOL)):
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
    """fp8 deltas, a mean anchor (resident tile), block_kv 64, GQA 4, every page size in one batch
    (the tile holds 8/4/2 whole pages, one page, or a piece of one), lengths 1, P-1, P+1, ragged,
    a length-0 row (zeros), NaN in every free slot and granule."""
    case = random_delta_case(1, lengths=[1, 15, 33, 65, 0, 300], page_sizes=[8, 16, 32, 64, 128, 256],
                             num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8, anchor_len=1)
    out = check(delta_attention(**case, interpret=True, config=TuningConfig(block_kv=64, num_splits=1)), case)
    assert np.all(out[4] == 0)


def test_kernel_fp16_position_anchor_block128_split_stats():
    """fp16 deltas, a 256-row position-aligned anchor (a ring of anchor tiles; lengths past 256 wrap),
    block_kv 128 (16 copies per tile for 8-token pages), GQA 1, split-K over 2 CTAs (one empty for the
    short rows), score statistics against float64."""
    case = random_delta_case(2, lengths=[9, 290, 0, 129, 70], page_sizes=[8, 16, 32, 256, 64],
                             num_q_heads=1, num_kv_heads=1, head_dim=64, delta_dtype=FP16, anchor_len=256)
    out, var = delta_attention(**case, interpret=True, return_score_stats=True,
                               config=TuningConfig(block_kv=128, num_splits=2))
    out = check(out, case)
    assert np.all(out[2] == 0)
    # The kernel's scores come from bf16-rounded keys: compare with the truth over the same keys.
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case, mma_bf16=True),
                               rtol=2e-4, atol=1e-5)


def test_kernel_mean_anchor_through_the_anchor_ring(monkeypatch):
    """The fallback for the register-resident mean anchor (module docstring): resident_anchor=False, or
    $STRATUM_DKVC_RESIDENT_ANCHOR=0 for every call, runs the mean through the anchor ring as a 256-row
    block; same truth. Lengths past 256 wrap the block (a wrong broadcast would show there)."""
    case = random_delta_case(4, lengths=[300, 17, 64], page_sizes=[32, 8, 64], num_q_heads=2, num_kv_heads=1,
                             head_dim=64, delta_dtype=FP8, anchor_len=1)
    cfg = TuningConfig(block_kv=64, num_splits=1)
    monkeypatch.setenv(RESIDENT_ANCHOR_ENV, "0")
    assert not default_resident_anchor()
    check(delta_attention(**case, interpret=True, config=cfg), case)
    # It is the ring that ran: at D=128, T=128, 3 stages, fp8 the resident tiles fit SMEM (~194 KB) and the
    # ring (~322 KB) does not.
    big = random_delta_case(5, lengths=[3], page_sizes=[8], num_q_heads=1, num_kv_heads=1, head_dim=128,
                            delta_dtype=FP8, anchor_len=1)
    with pytest.raises(ValueError, match="KB of shared memory per CTA"):
        delta_attention(**big, config=TuningConfig(block_kv=128, num_stages=3, num_splits=1))
    jax.eval_shape(lambda c: delta_attention(**c, config=TuningConfig(block_kv=128, num_stages=3, num_splits=1),
                                             resident_anchor=True), big)
    monkeypatch.setenv(RESIDENT_ANCHOR_ENV, "yes")
    with pytest.raises(ValueError, match="STRATUM_DKVC_RESIDENT_ANCHOR must be 0"):
        delta_attention(**case, interpret=True, config=cfg)
    with pytest.raises(ValueError, match="resident_anchor=True needs a mean anchor"):
        delta_attention(**{**case, "anchor_k": jnp.zeros((1, 256, 64), jnp.bfloat16),
                           "anchor_v": jnp.zeros((1, 256, 64), jnp.bfloat16)}, resident_anchor=True)
    # At D=128, T=64, fp8 the ring costs 32 KB of SMEM more than the resident tile pair (module docstring).
    kw = dict(max_pages=64, out_itemsize=2)
    assert (delta_smem_bytes(TuningConfig(), 128, FP8, resident_anchor=False, **kw)
            - delta_smem_bytes(TuningConfig(), 128, FP8, resident_anchor=True, **kw)) == 32 * 1024


def test_kernel_fp8_mean_anchor_d128_block128():
    """fp8 deltas with head_dim 128 (128-byte rows: the other swizzle), a mean anchor with block_kv 128
    (the anchor chunk in registers serves both 64-row halves of a tile), GQA 4, the soft cap."""
    case = random_delta_case(3, lengths=[40, 260, 3], page_sizes=[16, 128, 8], num_q_heads=4, num_kv_heads=1,
                             head_dim=128, delta_dtype=FP8, anchor_len=1)
    out = delta_attention(**case, interpret=True, soft_cap=8.0, config=TuningConfig(block_kv=128, num_splits=1))
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
    for override, msg in bad:
        with pytest.raises(ValueError, match=msg):
            delta_attention(**{**case, **override}, interpret=True)
        with pytest.raises(ValueError, match=msg):
            delta_attention_reference(**{**case, **override})
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
    resident = anchor_len == 1 and default_resident_anchor()     # $STRATUM_DKVC_RESIDENT_ANCHOR=0: the ring
    if delta_smem_bytes(dataclasses.replace(config, num_splits=splits), 128, dtype, resident_anchor=resident,
                        max_pages=case["page_starts"].shape[1], out_itemsize=2 if splits == 1 else 4) > 227 * 1024:
        with pytest.raises(ValueError, match="KB of shared memory per CTA"):
            delta_attention(**case, config=config)
        return
    out, var = delta_attention(**case, config=config, return_score_stats=True)
    check(out, case)
    np.testing.assert_allclose(np.asarray(var), float64_delta_score_variance(case, mma_bf16=True), rtol=2e-3, atol=1e-4)


@pytest.mark.parametrize("dtype,anchor_len,head_dim", [(FP8, 1, 128)])
def test_kernel_lowers_to_mosaic_gpu_on_cpu(dtype, anchor_len, head_dim):
    """The compiled (not interpreted) kernel's lowering to Mosaic GPU runs on a CPU: layouts (fp8 rows
    loaded from swizzled SMEM in the WGMMA layout, the resident anchor's registers), the TMA copies of
    scale pieces and the barriers are all emitted here, so a kernel change that breaks them fails in CI
    rather than at the first GPU compile (ptxas's register allocation is the one step only a GPU runs).
    fp8 with the register-resident mean anchor at D=128 is the combination nothing else compiles."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    S = 1024
    args = (shape(2, 8, head_dim), shape(2, S, head_dim, dt=dtype), shape(2, S, head_dim, dt=dtype),
            shape(2, S // 8, dt=jnp.float32), shape(2, S // 8, dt=jnp.float32),
            shape(2, anchor_len, head_dim), shape(2, anchor_len, head_dim),
            shape(2, dt=jnp.int32), shape(2, 8, dt=jnp.int32), shape(2, dt=jnp.int32))
    fn = jax.jit(lambda *a: delta_attention(*a, config=TuningConfig(), resident_anchor=anchor_len == 1))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
