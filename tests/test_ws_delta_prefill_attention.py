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
from pallas_kernels.testing import (float64_delta_pools, float64_prefill_attention, packed_delta_kwargs,
                                    prefill_blocks_case, random_delta_case)

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
    """fp8 deltas (converted to f16 tiles by the compute warpgroups), D=64, GQA 4 (32 tokens per block: 16 per
    compute warpgroup), the default config (64-token tiles): 8/16/32-token pages are several copies per tile
    (each with its own packed scale copy), 256-token pages a piece of one page; the long block streams more tiles
    than the ring holds. The scales come packed (the engine cache's layout); the jnp reference takes them too."""
    blocks = [(0, 140 - 32, 32), (1, 230 - 32 - 8, 32), (2, 70, 5), (3, 0, 9), (-1, 0, 0)]
    args, truth, valid = ws_case(21, lengths=[140, 230, 75, 9], page_sizes=[8, 32, 256, 16], blocks=blocks,
                                 num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8)
    assert default_ws_delta_config(64, FP8, args["page_starts"].shape[1]).block_kv == 64
    packed = packed_delta_kwargs(args)
    out = ws_delta_prefill_attention(**packed, interpret=True)
    assert out.shape == args["q"].shape and out.dtype == args["q"].dtype
    check(out, truth, valid)
    ref = delta_prefill_attention_reference(**{**packed, "q": args["q"].astype(jnp.float32)})
    np.testing.assert_allclose(np.asarray(ref)[valid], float64_prefill_attention(truth)[valid], atol=2e-5, rtol=0)


def test_fp16_d128_gqa8_fp32_q():
    """fp16 deltas (the ring slots are the WGMMA operands), two scale arrays (packed at the entry), D=128, GQA 8
    (16 tokens per block), q in fp32 (output fp32), 64-token tiles with 3 stages, pages of 16, 256, 64 and 128
    tokens."""
    blocks = [(0, 100, 16), (1, 250 - 16, 16), (2, 60, 3), (3, 0, 16), (-1, 0, 0)]
    args, truth, valid = ws_case(22, lengths=[130, 250, 63, 20], page_sizes=[16, 256, 64, 128], blocks=blocks,
                                 num_q_heads=8, num_kv_heads=1, head_dim=128, delta_dtype=FP16)
    args["q"] = args["q"].astype(jnp.float32)
    out = ws_delta_prefill_attention(**args, interpret=True, config=TuningConfig(block_kv=64, num_stages=3,
                                                                                  num_splits=1))
    assert out.dtype == jnp.float32
    check(out, truth, valid)


def test_entry_point_errors():
    """Bad shapes and configs are refused at the entry, naming the kernel and what to fix."""
    args, _, _ = ws_case(23, lengths=[20], page_sizes=[8], blocks=[(0, 0, 32)], num_q_heads=4, num_kv_heads=1,
                         head_dim=64, delta_dtype=FP8)
    name = "ws_delta_prefill_attention"
    bad = [
        (dict(q=args["q"][0]), f"{name}: q must be \\[blocks, tokens"),
        (dict(q=jnp.zeros((1, 64, 4, 64), jnp.bfloat16)), "do not fit the 128-row q tile"),
        (dict(q=jnp.zeros((1, 16, 3, 64), jnp.bfloat16)), "a GQA group of 3 .* must be a power of 2"),
        (dict(q_starts=args["q_starts"].astype(jnp.float32)), "q_starts must be int32"),
        (dict(v_delta=args["v_delta"].astype(jnp.float16)), f"{name}: k_delta/v_delta must both"),
        (dict(k_scale=args["k_scale"][:, :8]), "k_scale must be float32"),
        (dict(anchor_k=jnp.zeros((1, 256, 64), jnp.bfloat16), anchor_v=jnp.zeros((1, 256, 64), jnp.bfloat16)),
         "takes a mean anchor .* go through delta_prefill_attention"),
    ]
    for override, msg in bad:
        with pytest.raises(ValueError, match=msg):
            ws_delta_prefill_attention(**{**args, **override})
    for config, msg in [(TuningConfig(block_kv=256, num_splits=1), "block_kv must be 64 or 128"),
                        (TuningConfig(block_kv=128, num_stages=4, num_splits=1), "KB of SMEM")]:
        with pytest.raises(ValueError, match=msg):
            ws_delta_prefill_attention(**args, config=config)
    with pytest.raises(ValueError, match="sm_scale must be > 0"):
        ws_delta_prefill_attention(**args, sm_scale=0.0)


def test_default_configs_fit_smem():
    """fp16: 128-token tiles where they fit (a 16K-token table of 8-token pages at D=128), else 64; fp8: 64-token
    tiles (with its f16 tiles, 128 would not fit at D=128)."""
    assert default_ws_delta_config(128, FP16, 2048).block_kv == 128
    assert default_ws_delta_config(128, FP16, 8192).block_kv == 64      # a 64K-token table of 8-token pages
    assert default_ws_delta_config(128, FP8, 2048).block_kv == 64
    big = TuningConfig(block_kv=128, num_splits=1)
    assert ws_delta_smem_bytes(big, 128, FP8, 2048) > 227 * 1024
    for dtype in (FP16, FP8):
        for head_dim in (64, 128):
            cfg = default_ws_delta_config(head_dim, dtype, 2048)
            assert ws_delta_smem_bytes(cfg, head_dim, dtype, 2048) <= 227 * 1024


@pytest.mark.parametrize("dtype,head_dim", [(FP8, 128), (FP16, 64)])
def test_kernel_lowers_to_mosaic_gpu_on_cpu(dtype, head_dim):
    """The compiled (not interpreted) kernel's lowering to Mosaic GPU runs on a CPU in its default config:
    register-operand P, run_state, set_max_registers, the fp8 rows loaded from swizzled SMEM and stored as f16
    tiles, the f16 ring slots as WGMMA operands, the scale-area TMA copies, the column vectors and the anchor row
    loaded from GMEM are all emitted here (ptxas's register allocation is the one step only a GPU runs)."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    S = 1024
    pools = (shape(2, S, head_dim, dt=dtype), shape(2, S, head_dim, dt=dtype), shape(2, S // 8, dt=jnp.float32),
             shape(2, S // 8, dt=jnp.float32), shape(2, 1, head_dim), shape(2, 1, head_dim))
    args = (shape(2, 32, 8, head_dim), *pools, shape(2, dt=jnp.int32), shape(2, dt=jnp.int32),
            shape(2, 8, dt=jnp.int32), shape(2, dt=jnp.int32))
    text = jax.jit(lambda *a: ws_delta_prefill_attention(*a)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [FP8, FP16])
@pytest.mark.parametrize("config", [None, TuningConfig(block_kv=64, num_splits=1),
                                    TuningConfig(block_kv=64, num_stages=3, num_splits=1)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64), (8, 8, 64)])
def test_compiled_on_gpu(dtype, config, heads):
    """The compiled kernel at realistic head shapes (llama-8b's D=128 and llama-1b's D=64 with GQA 4, and GQA
    1), every page class in one batch, NaN in free slots and scales, blocks past the context, a padding block."""
    tokens = ws_prefill_block_tokens(heads[0], heads[1])
    blocks = [(0, 0, tokens), (1, 1000 - tokens, tokens), (2, 300, tokens), (3, 500, 7), (4, 70, 9),
              (5, 2000 - tokens, tokens), (-1, 0, 0)]
    args, truth, valid = ws_case(24, lengths=[16, 1000, 700, 507, 79, 2000], page_sizes=[8, 16, 32, 64, 128, 256],
                                 blocks=blocks, num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2],
                                 delta_dtype=dtype)
    check(ws_delta_prefill_attention(**args, config=config), truth, valid)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
def test_compiled_on_gpu_matches_single_pipeline_kernel():
    """At the engine's shape the WS kernel and the single-pipeline delta prefill kernel (`delta_prefill_attention`,
    64-row blocks) agree on the same tokens (both folded: the same f16 MMAs, so within P's f16 rounding)."""
    from pallas_kernels.delta_attention import delta_prefill_attention
    blocks = [(0, 2000 - 32, 32), (1, 500, 32), (-1, 0, 0)]
    args, truth, valid = ws_case(25, lengths=[2000, 900], page_sizes=[16, 256], blocks=blocks, num_q_heads=32,
                                 num_kv_heads=8, head_dim=128, delta_dtype=FP8)
    ws = np.asarray(ws_delta_prefill_attention(**args).astype(jnp.float32))
    half = {**args, "q": args["q"].reshape(6, 16, 32, 128), "q_starts": jnp.repeat(args["q_starts"], 2) +
            jnp.tile(jnp.array([0, 16], jnp.int32), 3)}
    half["lengths"] = jnp.where(jnp.repeat(args["lengths"], 2) > 0, jnp.minimum(half["q_starts"] + 16,
                                jnp.repeat(args["lengths"], 2)), 0)
    half["page_starts"], half["page_sizes"] = jnp.repeat(args["page_starts"], 2, 0), jnp.repeat(args["page_sizes"], 2)
    single = np.asarray(delta_prefill_attention(**half, fold_mean_anchor=True).astype(jnp.float32)).reshape(ws.shape)
    np.testing.assert_allclose(ws[valid], single[valid], atol=2e-2 * max(1.0, np.abs(single).max()), rtol=0)


@pytest.mark.parametrize("anchor_len,stats,variant,want", [(1, False, "ws", "ws_delta_prefill_attention"),
                                                           (1, True, "ws", "delta_prefill_attention"),
                                                           (256, False, "ws", "delta_prefill_attention"),
                                                           (1, False, "single", "delta_prefill_attention")])
def test_engine_prefill_routes_dkvc_to_the_ws_kernel(monkeypatch, anchor_len, stats, variant, want):
    """stratum_jax.attention.prefill_attention (the engine step's prefill attention, backend "kernel") sends a
    DeltaKV with a mean anchor to `ws_delta_prefill_attention` in blocks of 128 // group tokens when no score
    statistics are asked for and the variant is "ws"; score statistics, a position-aligned anchor and the
    "single" variant keep the single-pipeline kernel. The kernels are replaced by recorders (the interpreted
    kernels are covered above; the engine's own interpreted runs use the "single" variant)."""
    import pallas_kernels.delta_attention as delta_module
    import pallas_kernels.prefill_attention as prefill_module
    from stratum_jax.attention import RowTables, prefill_attention
    from stratum_jax.kv.delta_cache import DeltaKV
    calls = []

    def recorder(name):
        def fake(q, *a, return_score_stats=False, **kw):
            calls.append((name, q.shape))
            out = jnp.zeros(q.shape, q.dtype)
            return (out, jnp.zeros(q.shape[:3], jnp.float32)) if return_score_stats else out
        return fake
    monkeypatch.setattr(prefill_module, "ws_delta_prefill_attention", recorder("ws_delta_prefill_attention"))
    monkeypatch.setattr(delta_module, "delta_prefill_attention", recorder("delta_prefill_attention"))
    hkv, slots, d = 2, 512, 64
    delta = DeltaKV(anchor_k=jnp.zeros((hkv, anchor_len, d), jnp.bfloat16),
                    anchor_v=jnp.zeros((hkv, anchor_len, d), jnp.bfloat16),
                    k_delta=jnp.zeros((hkv, slots, d), FP8), v_delta=jnp.zeros((hkv, slots, d), FP8),
                    scales=jnp.ones((hkv, slots // 8, 4), jnp.float32),
                    k_floor=jnp.ones((hkv,), jnp.float32), v_floor=jnp.ones((hkv,), jnp.float32))
    tables = RowTables(context_lens=jnp.array([100, 0], jnp.int32), page_starts=jnp.zeros((2, 32), jnp.int32),
                       page_sizes=jnp.array([16, 16], jnp.int32))
    q = jnp.zeros((2, 128, 4, d), jnp.bfloat16)                      # 2 tiles of 128 tokens, GQA 2
    positions = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (2, 128))
    res = prefill_attention(q, positions, jnp.array([0, -1], jnp.int32), tables, delta, None, backend="kernel",
                            interpret=True, return_score_stats=stats, kernel_variant=variant)
    assert [name for name, _ in calls] == [want]
    tokens = 64 if want == "ws_delta_prefill_attention" else 32      # 128 // group or 64 // group
    assert calls[0][1] == (2 * 128 // tokens, tokens, 4, d)
    assert (res[0] if stats else res).shape == q.shape
