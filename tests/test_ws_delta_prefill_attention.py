"""The warp-specialised prefill kernel over the delta-KV (DKVC) cache, folded mean-anchor path
(`ws_delta_prefill_attention`, pallas_kernels/prefill_attention.py), against float64.

The Mosaic GPU interpreter runs the real kernel body on CPU: its three warpgroups, the ping-pong schedule
barrier, the consumed barriers, the page-class TMA copies of delta rows and scale granules, and with fp8
deltas the memory warpgroup's conversion to f16 tiles and its ready barriers (the interpreter checks that
every barrier phase is observed and that SMEM is never read uninitialised). Every free slot holds a NaN
delta and every granule with no live token a NaN scale, so a kernel that reads past a length is caught.
The truth is float64 attention over the K/V rebuilt from the stored values (anchor + scale * delta); the
jnp reference (`delta_prefill_attention_reference`) is checked against the same truth once.

Blocks hold 128 // group tokens. Each case covers: a block ending at its sequence's end (a partial last
tile: V rows past the end zeroed), one in the middle of a long context (unmasked tiles first, several
pages), one whose context ends inside it (its later tokens are padding; the keys past the context are
stale NaN slots), one at position 0, and a padding block (length 0: zeros). The interpreter recompiles per
shape and config, so the cases are few and each covers several features.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.delta_attention import delta_prefill_attention_reference
from pallas_kernels.paged_attention import TuningConfig
from pallas_kernels.prefill_attention import (
    default_ws_delta_config, ws_delta_prefill_attention, ws_delta_smem_bytes, ws_prefill_block_tokens)
from pallas_kernels.testing import float64_delta_pools, float64_prefill_attention, prefill_blocks_case, random_delta_case

FP8, FP16 = jnp.float8_e4m3fn, jnp.float16
# The folded path's MMAs see the stored values exactly (f16 deltas, f16 q rounded from bf16 losslessly), so
# only P's f16 rounding, the fp32 accumulation and the bf16 output are left: about 2^-8 of the output's
# magnitude. A key scaled by a neighbour granule's scale, a wrong causal bound or a stale slot moves a short
# row's output by O(0.1-1).
RTOL = 1e-2
DELTA_KEYS = ("k_delta", "v_delta", "k_scale", "v_scale", "anchor_k", "anchor_v")


def ws_case(seed, *, lengths, page_sizes, blocks, num_q_heads, num_kv_heads, head_dim, delta_dtype):
    """(kernel arguments, truth case, valid [blocks, tokens]) for causal blocks (sequence, q_start, n_valid) of
    ws_prefill_block_tokens(Hq, Hkv) tokens over a random delta cache with a mean anchor."""
    case = random_delta_case(seed, lengths=lengths, page_sizes=page_sizes, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, delta_dtype=delta_dtype, anchor_len=1)
    k, v = float64_delta_pools(case)
    tokens = ws_prefill_block_tokens(num_q_heads, num_kv_heads)
    truth = prefill_blocks_case({**case, "k_pool": k, "v_pool": v}, blocks, tokens, seed=seed)
    valid = truth.pop("valid")
    args = {n: truth[n] for n in ("q", "q_starts", "lengths", "page_starts", "page_sizes")}
    args.update({n: case[n] for n in DELTA_KEYS})
    return args, truth, valid


def check(out, truth, valid):
    """out [blocks, tokens, Hq, D] against the float64 truth on the real tokens; every row finite (padding
    tokens too), padding blocks (length 0) zeros."""
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (a stale slot or scale leaked)"
    want = float64_prefill_attention(truth)
    err, tol = np.abs(out - want)[valid].max(), RTOL * max(1.0, np.abs(want).max())
    assert err <= tol, f"max abs err {err:.3g} > {tol:.3g}"
    pad = np.asarray(truth["lengths"]) == 0
    assert pad.any() and not out[pad].any(), "a padding block must give zeros"


def test_fp8_d64_gqa4_every_small_page_class():
    """fp8 deltas (converted to f16 tiles by the memory warpgroup, scales put in granule order), D=64, GQA 4
    (32 tokens per block: 16 per compute warpgroup), the default config (64-token tiles): 8/16/32-token pages are
    several copies per tile (8/16: scale granules at runtime offsets in their aligned groups of 4), 256-token
    pages a piece of one page; the long block streams more tiles than the ring holds."""
    blocks = [(0, 140 - 32, 32), (1, 230 - 32 - 8, 32), (2, 70, 5), (3, 0, 9), (-1, 0, 0)]
    args, truth, valid = ws_case(21, lengths=[140, 230, 75, 9], page_sizes=[8, 32, 256, 16], blocks=blocks,
                                 num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8)
    assert default_ws_delta_config(64, FP8, args["page_starts"].shape[1]).block_kv == 64
    out = ws_delta_prefill_attention(**args, interpret=True)
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    check(out, truth, valid)
    ref = delta_prefill_attention_reference(**{**args, "q": args["q"].astype(jnp.float32)})
    np.testing.assert_allclose(np.asarray(ref)[valid], float64_prefill_attention(truth)[valid], atol=2e-5, rtol=0)


def test_fp16_d128_gqa8_fp32_q():
    """fp16 deltas (the ring slots are the WGMMA operands; the compute warpgroups read the scale areas through
    the page table), D=128, GQA 8 (16 tokens per block), q in fp32 (output fp32), 64-token tiles with 3 stages,
    pages of 16, 256, 64 and 128 tokens."""
    blocks = [(0, 100, 16), (1, 250 - 16, 16), (2, 60, 3), (3, 0, 16), (-1, 0, 0)]
    args, truth, valid = ws_case(22, lengths=[130, 250, 63, 20], page_sizes=[16, 256, 64, 128], blocks=blocks,
                                 num_q_heads=8, num_kv_heads=1, head_dim=128, delta_dtype=FP16)
    args["q"] = args["q"].astype(jnp.float32)
    out = ws_delta_prefill_attention(**args, interpret=True, config=TuningConfig(block_kv=64, num_stages=3,
                                                                                  num_splits=1))
    assert out.dtype == jnp.float32
    check(out, truth, valid)
