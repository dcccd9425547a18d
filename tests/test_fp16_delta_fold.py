"""The fp16-delta fold (stratum_jax/attention.py `_unit_scale_fold`): a DKVC cache of fp16 deltas with a mean anchor
runs on the plain kernels' f16 path (the swapped decode kernel, the warp-specialised prefill kernel) with the deltas
as the pools, and the anchor's V added after. Checked in the Mosaic GPU interpreter against float64 attention over
the K/V rebuilt from the stored values (anchor + delta: fp16 deltas keep unit scales), with NaN in every stale slot;
the same fold for fp8 deltas with fixed per-head scales (`--fp8-scale head`: the scales folded into q and the
output, the swapped kernel on the fp8 pools); and the routing: what does not fold (fp8 deltas with granule
scales, a position-aligned anchor, the "paged" decode variant, folding switched off) still takes the delta
kernels."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.delta_attention import FOLD_MEAN_ANCHOR_ENV, pack_granule_scales
from pallas_kernels.prefill_attention import ws_prefill_block_tokens
from pallas_kernels.testing import float64_attention, float64_delta_pools, float64_score_variance, random_delta_case
from stratum_jax.attention import RowTables, decode_attention, prefill_attention
from stratum_jax.kv.delta_cache import DeltaKV

LENGTHS = [1, 7, 0, 65, 129, 300]
SIZES = [8, 16, 64, 128, 256, 32]
TOL = 2e-2


def fp16_delta(seed, *, anchor_len=1, lengths=LENGTHS, sizes=SIZES, num_q_heads=4, num_kv_heads=1, head_dim=64):
    """(case, DeltaKV): a random delta case with fp16 deltas and the unit scales an fp16-delta cache keeps (NaN
    in stale slots' deltas, as before)."""
    case = random_delta_case(seed, lengths=lengths, page_sizes=sizes, num_q_heads=num_q_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, delta_dtype=jnp.float16,
                             anchor_len=anchor_len)
    for side in ("k", "v"):
        case[f"{side}_scale"] = jnp.ones_like(case[f"{side}_scale"])
    ones = jnp.ones((num_kv_heads,), jnp.float32)
    delta = DeltaKV(anchor_k=case["anchor_k"], anchor_v=case["anchor_v"], k_delta=case["k_delta"],
                    v_delta=case["v_delta"], scales=pack_granule_scales(case["k_scale"], case["v_scale"]), k_floor=ones,
                    v_floor=ones)
    return case, delta


def truth_case(case):
    k, v = float64_delta_pools(case)
    return {**case, "k_pool": k, "v_pool": v}


def check(out, want):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert np.isfinite(out).all(), "NaN/inf in the output (a stale slot leaked)"
    err = np.abs(out - want).max()
    assert err <= TOL * max(1.0, np.abs(want).max()), f"max abs err {err:.3g}"
    return out


def test_decode_fold_matches_float64_with_score_stats(two_splits):
    """The swapped kernel on the f16 deltas + the anchor's V: output against float64 over anchor + delta
    (a length-0 row stays zeros), score variance against the truth's (the per-query shift q . a_k cancels).
    Split-K 2 (`two_splits`: the grid's default of 16 splits is slow in the interpreter)."""
    case, delta = fp16_delta(0)
    tables = RowTables(case["lengths"], case["page_starts"], case["page_sizes"])
    positions = case["lengths"] - 1
    out, var = decode_attention(case["q"], positions, tables, delta, None, backend="kernel", interpret=True,
                                return_score_stats=True)
    assert out.dtype == case["q"].dtype
    truth = truth_case(case)
    got = check(out, float64_attention(truth))
    assert not got[LENGTHS.index(0)].any()
    np.testing.assert_allclose(np.asarray(var), float64_score_variance(truth), rtol=2e-3, atol=1e-4)


def fp8_fixed_delta(seed, **kw):
    """(case, DeltaKV): fp8 deltas with one fixed scale per kv head (`--fp8-scale head`): every granule's scale
    is its head's floor, which the fold takes into q and the output."""
    case, delta = fp16_delta(seed, **kw)
    heads = delta.num_kv_heads
    k_floor = jnp.asarray(np.linspace(0.02, 0.05, heads), jnp.float32)
    v_floor = jnp.asarray(np.linspace(0.03, 0.01, heads), jnp.float32)
    for side, floor in (("k", k_floor), ("v", v_floor)):
        d = case[f"{side}_delta"].astype(jnp.float32) * 16.0          # ~N(0, 16^2): uses fp8's range
        case[f"{side}_delta"] = jnp.clip(d, -448, 448).astype(jnp.float8_e4m3fn)
        case[f"{side}_scale"] = jnp.broadcast_to(floor[:, None], case[f"{side}_scale"].shape)
    delta = DeltaKV(anchor_k=case["anchor_k"], anchor_v=case["anchor_v"], k_delta=case["k_delta"],
                    v_delta=case["v_delta"], scales=pack_granule_scales(case["k_scale"], case["v_scale"]),
                    k_floor=k_floor,
                    v_floor=v_floor, fixed_scales=True)
    return case, delta


def test_decode_fold_of_fixed_fp8_scales_matches_float64(two_splits):
    """fp8 deltas with fixed per-head scales: the swapped kernel on the fp8 pools (fp8 score MMAs, V converted
    to an f16 staging tile in the kernel) with s_k folded into q and s_v onto the output, plus the anchor's V, against float64
    over anchor + scale x delta (NaN in stale slots); score variance too. Two kv heads of different scales."""
    case, delta = fp8_fixed_delta(4, num_q_heads=4, num_kv_heads=2)
    tables = RowTables(case["lengths"], case["page_starts"], case["page_sizes"])
    out, var = decode_attention(case["q"], case["lengths"] - 1, tables, delta, None, backend="kernel",
                                interpret=True, return_score_stats=True)
    truth = truth_case(case)
    got = check(out, float64_attention(truth))
    assert not got[LENGTHS.index(0)].any()
    np.testing.assert_allclose(np.asarray(var), float64_score_variance(truth), rtol=2e-3, atol=1e-4)


def test_prefill_fold_matches_float64():
    """The warp-specialised kernel on the f16 deltas + the anchor's V, through `prefill_attention` (tiles of
    the engine's layout) with split-K 2 (each split's f16 partial and lse merged): a tile ending at its
    sequence's end, one in the middle of a long context, one padding tile (zeros)."""
    case, delta = fp16_delta(1, lengths=[300, 200], sizes=[16, 256])
    per_block = ws_prefill_block_tokens(4, 1)                        # 32 tokens per block at group 4
    tile = per_block
    # tile 0: the last `tile` positions of sequence 0; tile 1: positions 40.. of sequence 1; tile 2: padding
    starts = [300 - tile, 40, 0]
    positions = np.stack([np.arange(s, s + tile) for s in starts]).astype(np.int32)
    positions[2] = -1
    tile_rows = jnp.asarray([0, 1, -1], jnp.int32)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, tile, 4, 64)), jnp.bfloat16)
    tables = RowTables(jnp.asarray([300, 40 + tile], jnp.int32), case["page_starts"], case["page_sizes"])
    out = prefill_attention(q, jnp.asarray(positions), tile_rows, tables, delta, None, backend="kernel",
                            interpret=True, prefill_splits=2)
    # Truth: each real token as a decode row over the keys at positions <= its own.
    k, v = float64_delta_pools(case)
    rows = np.repeat([0, 1], tile)
    per_token = dict(q=q[:2].reshape(2 * tile, 4, 64), k_pool=k, v_pool=v,
                     lengths=jnp.asarray(positions[:2].reshape(-1) + 1), page_starts=case["page_starts"][rows],
                     page_sizes=case["page_sizes"][rows])
    check(out[:2].reshape(2 * tile, 4, 64), float64_attention(per_token))
    assert not np.asarray(out[2].astype(jnp.float32)).any(), "a padding tile must give zeros"


@pytest.mark.parametrize("name,kw,want", [
    ("fp16 mean anchor, swapped", dict(), "swapped_paged_attention"),
    ("fp16 mean anchor, paged variant", dict(kernel_variant="paged"), "delta_attention"),
    ("fp8 deltas, granule scales", dict(fp8=True), "swapped_paged_attention"),
    ("fp8 deltas, granule scales, paged variant", dict(fp8=True, kernel_variant="paged"), "delta_attention"),
    ("fp8 deltas, granule scales, position-aligned anchor", dict(fp8=True, anchor_len=256), "delta_attention"),
    ("fp8 deltas, fixed per-head scales", dict(fp8=True, fixed=True), "swapped_paged_attention"),
    ("fp8 deltas, fixed scales, paged variant", dict(fp8=True, fixed=True, kernel_variant="paged"), "delta_attention"),
    ("position-aligned anchor", dict(anchor_len=256), "delta_attention"),
    ("folding switched off", dict(no_fold=True), "delta_attention"),
])
def test_decode_routing(monkeypatch, name, kw, want):
    """Which kernel `decode_attention` (backend "kernel") sends a DeltaKV to; the kernels are recorders."""
    import pallas_kernels.delta_attention as delta_module
    import pallas_kernels.swapped_decode_attention as swapped_module
    calls = []

    def recorder(fn_name):
        def fake(q, *a, return_score_stats=False, **k):
            calls.append(fn_name)
            if fn_name == "swapped_paged_attention":     # per-granule scales go to the kernel, fixed ones do not
                granules = kw.get("fp8") and not kw.get("fixed")
                assert (k.get("packed_scales") is not None) == bool(granules), k.keys()
            return jnp.zeros(q.shape, q.dtype)
        return fake
    monkeypatch.setattr(delta_module, "delta_attention", recorder("delta_attention"))
    monkeypatch.setattr(swapped_module, "swapped_paged_attention", recorder("swapped_paged_attention"))
    if kw.get("no_fold"):
        monkeypatch.setenv(FOLD_MEAN_ANCHOR_ENV, "0")
    case, delta = fp16_delta(3, anchor_len=kw.get("anchor_len", 1), lengths=[5, 9], sizes=[8, 8])
    if kw.get("fp8"):
        delta = DeltaKV(**{**delta.__dict__, "k_delta": delta.k_delta.astype(jnp.float8_e4m3fn),
                           "v_delta": delta.v_delta.astype(jnp.float8_e4m3fn), "fixed_scales": kw.get("fixed", False)})
    tables = RowTables(case["lengths"], case["page_starts"], case["page_sizes"])
    decode_attention(case["q"], case["lengths"] - 1, tables, delta, None, backend="kernel",
                     kernel_variant=kw.get("kernel_variant", "swapped"))
    assert calls == [want], name
