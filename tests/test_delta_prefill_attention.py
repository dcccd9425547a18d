"""Delta-KV (DKVC) prefill attention: the causal-block kernel over the delta cache (run in the Mosaic GPU
interpreter on CPU) and its jnp reference, against float64 built from the same stored values (anchor,
deltas, granule scales), with NaN deltas in every free slot and NaN scales in every free granule.

Blocks cover: one ending at its sequence's end and starting mid-page, one in the middle of a long context
(several tiles and pages, mid-page start), one whose context ends inside it (its later tokens are padding
and the keys past the context are stale NaN slots), one at position 0, and a padding block (zeros).

The interpreter recompiles per shape and config (~10-20 s each on 2 CPU cores), so the kernel cases are
few and each covers several features.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.delta_attention import (
    default_fold_mean_anchor, delta_prefill_attention, delta_prefill_attention_reference)
from pallas_kernels.paged_attention import TuningConfig, prefill_block_tokens
from pallas_kernels.testing import (
    float64_delta_pools, float64_prefill_attention, float64_prefill_score_variance, packed_delta_kwargs,
    prefill_blocks_case, random_delta_case)

FP8, FP16 = jnp.float8_e4m3fn, jnp.float16
# As in test_delta_attention.py: after the K/V rounding the kernel's MMAs see (none on the folded path,
# bf16 on the rebuild path) only P's and the output's bf16 rounding are left, about 2^-8 of the output's
# magnitude; a key rebuilt with a neighbour granule's scale, a wrong anchor row or a wrong causal bound
# moves a short row's output by O(0.1-1).
RTOL_ROUNDED_KV = 1e-2
VAR_RTOL, VAR_ATOL = 2e-4, 1e-5
DELTA_KEYS = ("k_delta", "v_delta", "k_scale", "v_scale", "anchor_k", "anchor_v")


def prefill_case(seed, *, lengths, page_sizes, blocks, num_q_heads, num_kv_heads, head_dim, delta_dtype, anchor_len,
                 mma_bf16):
    """(kernel arguments, truth case, valid [blocks, tokens]) for causal blocks (sequence, q_start, n_valid)
    over a random delta cache; the truth case holds the rebuilt float64 pools (rounded to bf16 with
    mma_bf16, as the rebuild path's MMAs see them) for the float64 truths."""
    case = random_delta_case(seed, lengths=lengths, page_sizes=page_sizes, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, delta_dtype=delta_dtype,
                             anchor_len=anchor_len)
    k, v = float64_delta_pools(case, mma_bf16=mma_bf16)
    tokens = prefill_block_tokens(num_q_heads, num_kv_heads)
    truth = prefill_blocks_case({**case, "k_pool": k, "v_pool": v}, blocks, tokens, seed=seed)
    valid = truth.pop("valid")
    args = {n: truth[n] for n in ("q", "q_starts", "lengths", "page_starts", "page_sizes")}
    args.update({n: case[n] for n in DELTA_KEYS})
    return args, truth, valid


def check(out, truth, valid):
    """out [blocks, tokens, Hq, D] against the float64 truth on the real tokens; every row (padding tokens
    too) finite, padding blocks (length 0) zeros."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (a stale slot leaked)"
    want = float64_prefill_attention(truth)
    err, tol = np.abs(out - want)[valid].max(), RTOL_ROUNDED_KV * max(1.0, np.abs(want).max())
    assert err <= tol, f"max abs err {err:.3g} > {tol:.3g}"
    pad = np.asarray(truth["lengths"]) == 0
    assert not out[pad].any(), "a padding block must give zeros"


def test_fp8_folded_every_page_class_gqa4_stats():
    """fp8 deltas, a mean anchor (the folded path: f16 tiles converted in SMEM, per-key scale columns, the
    anchor added in the epilogue), GQA 4 (16 tokens per block), block_kv 64 so pages of 8/16/32 tokens are
    several per tile and 256-token pages span tiles; the score variance (free from the shared pipeline)
    and the jnp reference against float64 too. The kernel takes the scales packed (the engine cache's layout)."""
    blocks = [(0, 140 - 16, 16), (1, 150, 16), (2, 70, 5), (3, 0, 9), (-1, 0, 0)]
    args, truth, valid = prefill_case(11, lengths=[140, 230, 75, 9], page_sizes=[8, 32, 256, 16], blocks=blocks,
                                      num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8, anchor_len=1,
                                      mma_bf16=False)
    out, var = delta_prefill_attention(**packed_delta_kwargs(args), interpret=True, return_score_stats=True,
                                       config=TuningConfig(block_kv=64))
    check(out, truth, valid)
    np.testing.assert_allclose(np.asarray(var)[valid], float64_prefill_score_variance(truth)[valid],
                               rtol=VAR_RTOL, atol=VAR_ATOL)
    ref, ref_var = delta_prefill_attention_reference(**{**args, "q": args["q"].astype(jnp.float32)},
                                                     return_score_stats=True)
    np.testing.assert_allclose(np.asarray(ref)[valid], float64_prefill_attention(truth)[valid], atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ref_var)[valid], float64_prefill_score_variance(truth)[valid],
                               rtol=VAR_RTOL, atol=VAR_ATOL)


def test_fp16_position_anchor_rebuild_gqa1():
    """fp16 deltas, a 256-row position-aligned anchor (the rebuild path: an anchor ring, K/V rebuilt to bf16;
    a context past 256 wraps the anchor), GQA 1 (64 tokens per block: the whole q tile is one head), pages of
    64 and 128 tokens (one page per tile, and a page piece), blocks starting mid-page; the default config."""
    blocks = [(0, 300 - 64, 64), (1, 40, 50)]
    args, truth, valid = prefill_case(12, lengths=[300, 90], page_sizes=[128, 64], blocks=blocks, num_q_heads=1,
                                      num_kv_heads=1, head_dim=64, delta_dtype=FP16, anchor_len=256, mma_bf16=True)
    check(delta_prefill_attention(**args, interpret=True), truth, valid)


def test_fp16_folded_d128_gqa8_fp32_q():
    """fp16 deltas with a mean anchor (the folded path: the ring slots are the MMA operands), head_dim 128,
    GQA 8 (8 tokens per block), q in fp32 (rounded to f16 for the MMA, output fp32), mixed
    page sizes in one call, block_kv 128 (the default for the folded path)."""
    blocks = [(0, 100, 8), (1, 250, 3), (2, 0, 8)]
    args, truth, valid = prefill_case(13, lengths=[130, 253, 20], page_sizes=[16, 256, 8], blocks=blocks,
                                      num_q_heads=8, num_kv_heads=1, head_dim=128, delta_dtype=FP16, anchor_len=1,
                                      mma_bf16=False)
    args["q"] = args["q"].astype(jnp.float32)
    out = delta_prefill_attention(**args, interpret=True)
    assert out.dtype == jnp.float32
    check(out, truth, valid)


def test_entry_point_errors():
    """Bad shapes and configs are refused at the entry, naming the kernel and what to fix."""
    blocks = [(0, 0, 16)]
    args, _, _ = prefill_case(14, lengths=[20], page_sizes=[8], blocks=blocks, num_q_heads=4, num_kv_heads=1,
                              head_dim=64, delta_dtype=FP8, anchor_len=1, mma_bf16=False)
    bad = [
        (dict(q=args["q"][0]), "delta_prefill_attention: q must be \\[blocks, tokens"),
        (dict(q=jnp.zeros((1, 32, 4, 64), jnp.bfloat16)), "do not fit the 64-row q tile"),
        (dict(q=jnp.zeros((1, 16, 3, 64), jnp.bfloat16)), "a GQA group of 3 .* must be a power of 2"),
        (dict(q_starts=args["q_starts"].astype(jnp.float32)), "q_starts must be int32"),
        (dict(v_delta=args["v_delta"].astype(jnp.float16)), "delta_prefill_attention: k_delta/v_delta must both"),
        (dict(k_scale=args["k_scale"][:, :8]), "k_scale must be float32"),
        (dict(lengths=jnp.zeros((2,), jnp.int32)), "lengths and page_sizes"),
    ]
    for override, msg in bad:
        with pytest.raises(ValueError, match=msg):
            delta_prefill_attention(**{**args, **override}, interpret=True)
    with pytest.raises(ValueError, match="causal blocks are not split"):
        delta_prefill_attention(**args, config=TuningConfig(num_splits=2))
    with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
        delta_prefill_attention(**args, config=TuningConfig(block_kv=256, num_splits=1))
    with pytest.raises(ValueError, match="KB of shared memory per CTA"):
        delta_prefill_attention(**args, config=TuningConfig(num_stages=32))
    with pytest.raises(ValueError, match="fold_mean_anchor=True needs a mean anchor"):
        delta_prefill_attention(**{**args, "anchor_k": jnp.zeros((1, 256, 64), jnp.bfloat16),
                                   "anchor_v": jnp.zeros((1, 256, 64), jnp.bfloat16)}, fold_mean_anchor=True)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [FP8, FP16])
@pytest.mark.parametrize("anchor_len", [1, 256])
def test_kernel_compiled_on_gpu(dtype, anchor_len):
    """The compiled kernel at the benchmark's head shape (Hq=32, Hkv=8, D=128: 16 tokens per block) in its
    default config ($STRATUM_DKVC_FOLD_MEAN_ANCHOR picks the mean anchor's path), every page class, NaN in
    free slots, blocks past the context and a padding block."""
    blocks = [(0, 0, 16), (1, 1000 - 16, 16), (2, 300, 16), (3, 500, 7), (4, 70, 9), (5, 2000 - 16, 16), (-1, 0, 0)]
    args, truth, valid = prefill_case(15, lengths=[16, 1000, 700, 507, 79, 2000], page_sizes=[8, 16, 32, 64, 128, 256],
                                      blocks=blocks, num_q_heads=32, num_kv_heads=8, head_dim=128, delta_dtype=dtype,
                                      anchor_len=anchor_len,
                                      mma_bf16=not (anchor_len == 1 and default_fold_mean_anchor()))
    check(delta_prefill_attention(**args), truth, valid)
