"""DKVC (the delta KV cache): the storage rule, the anchor choice, the precision flag and its fallbacks, and
the engine on every precision through the jnp reference path, host tier included."""
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stratum_jax.config import KV_PRECISION_ENV, RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.kv.anchor import ALIGNED_LEN, choose_anchor
from stratum_jax.kv.delta_cache import FP8_MAX, DeltaKV, init_delta_cache
from stratum_jax.kv.precision import HBM_BANDWIDTH_THRESHOLD_GBPS, resolve_precision
from stratum_jax.kv.prefix_hash import prompt_chain_hashes
from stratum_jax.model.loader import load_model
from stratum_jax.request import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)
# Jitted once each: op by op, the scatters and gathers would compile one small executable apiece.
write = jax.jit(DeltaKV.write)
gather = jax.jit(DeltaKV.gather)


# ---- the storage rule ------------------------------------------------------------------------------

def _cache(precision, anchor, floor, num_slots=64):
    return init_delta_cache([(anchor, anchor)], [(floor, floor)], num_slots, precision)[0]


def test_fp8_granule_scale_is_set_by_its_first_write_and_later_tokens_saturate():
    """A granule written whole in one step gets scale max(floor, amax / 448) and rebuilds within fp8's
    rounding; a later step's token bigger than the scale allows saturates at +-448 * scale, the scale
    unchanged; padding slots (>= num_slots) change nothing."""
    rng = np.random.default_rng(0)
    heads, dim = 2, 16
    anchor = jnp.asarray(rng.normal(size=(heads, 1, dim)), jnp.float32)
    floor = np.array([1e-3, 1e-3], np.float32)
    cache = _cache("fp8-delta", anchor, floor)
    x = rng.normal(size=(8, heads, dim)).astype(np.float32)
    slots = np.arange(16, 24, dtype=np.int32)                          # granule 2, slot 0 first
    cache = write(cache, jnp.asarray(x), jnp.asarray(x), jnp.arange(8, dtype=jnp.int32), jnp.asarray(slots))
    delta = x.transpose(1, 0, 2) - np.asarray(anchor)                   # [H, 8, D]
    expect_scale = np.maximum(floor, np.abs(delta).max(axis=(1, 2)) / FP8_MAX)
    np.testing.assert_allclose(np.asarray(cache.k_scale)[:, 2], expect_scale, rtol=1e-6)
    k, _ = gather(cache, jnp.asarray(slots)[None], jnp.arange(8, dtype=jnp.int32))
    # e4m3: 3 mantissa bits, so |error| <= 2^-4 relative (plus the subnormal step 2^-9 * scale).
    err = np.abs(np.asarray(k)[:, 0] - x.transpose(1, 0, 2))
    assert np.all(err <= np.abs(delta) * 2**-4 + expect_scale[:, None, None] * 2**-9 + 1e-6)
    assert np.max(err) > 0                                              # it really is quantised

    # A decode token into slot 4 of granule 0 (no first-slot write this step): scale from granule 0's own
    # first write (slot 0, one token), saturating the outlier.
    small = np.full((1, heads, dim), 0.01, np.float32) + np.asarray(anchor)[:, 0][None]
    cache = write(cache, jnp.asarray(small), jnp.asarray(small), jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))
    s0 = np.asarray(cache.k_scale)[:, 0].copy()
    np.testing.assert_allclose(s0, np.maximum(floor, 0.01 / FP8_MAX), rtol=1e-5)
    big = np.asarray(anchor)[:, 0][None] + 10.0
    cache = write(cache, jnp.asarray(big), jnp.asarray(big), jnp.ones(1, jnp.int32), jnp.asarray([4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.k_scale)[:, 0], s0)
    k, _ = gather(cache, jnp.asarray([[4]], jnp.int32), jnp.ones(1, jnp.int32))
    np.testing.assert_allclose(np.asarray(k)[:, 0, 0], np.asarray(anchor)[:, 0] + FP8_MAX * s0[:, None], rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(cache.k_delta, np.float32)))

    before = np.asarray(cache.k_delta, np.float32), np.asarray(cache.k_scale)
    pad = jnp.asarray(rng.normal(size=(2, heads, dim)), jnp.float32)
    cache = write(cache, pad, pad, jnp.zeros(2, jnp.int32), jnp.asarray([64, 64 + 8], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.k_delta, np.float32), before[0])
    np.testing.assert_array_equal(np.asarray(cache.k_scale), before[1])


def test_fixed_head_scales_never_move_and_saturate_past_the_floor():
    """--fp8-scale head: every granule keeps its head's floor (no amax, no scale scatter); a prefill of whole
    granules and a decode token are both quantised with it, within fp8's rounding, and a delta beyond
    448 x floor saturates."""
    rng = np.random.default_rng(1)
    heads, dim = 2, 16
    anchor = jnp.asarray(rng.normal(size=(heads, 1, dim)), jnp.float32)
    floor = np.array([4.0 / FP8_MAX, 8.0 / FP8_MAX], np.float32)        # head 0 holds |delta| <= 4, head 1 <= 8
    cache = init_delta_cache([(anchor, anchor)], [(floor, floor)], 64, "fp8-delta", fixed_scales=True)[0]
    assert cache.fixed_scales
    scales = np.asarray(cache.k_scale).copy()
    np.testing.assert_array_equal(scales, np.broadcast_to(floor[:, None], scales.shape))
    x = np.asarray(anchor)[:, 0][None] + rng.uniform(-3.5, 3.5, size=(8, heads, dim)).astype(np.float32)
    x[3, 1, 0] = np.asarray(anchor)[1, 0, 0] + 20.0                      # beyond head 1's 8: saturates
    slots = np.arange(16, 24, dtype=np.int32)
    cache = write(cache, jnp.asarray(x), jnp.asarray(x), jnp.arange(8, dtype=jnp.int32), jnp.asarray(slots))
    cache = write(cache, jnp.asarray(x[:1]), jnp.asarray(x[:1]), jnp.zeros(1, jnp.int32), jnp.asarray([5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(cache.k_scale), scales)     # no write moved a scale
    np.testing.assert_array_equal(np.asarray(cache.v_scale), scales)
    k, _ = gather(cache, jnp.asarray(np.concatenate([slots, [5]]))[None], jnp.arange(9, dtype=jnp.int32) % 8)
    k = np.asarray(k)[:, 0]                                               # [H, 9, D]
    want = np.concatenate([x, x[:1]]).transpose(1, 0, 2)
    delta = want - np.asarray(anchor)
    expect = np.clip(delta, -FP8_MAX * floor[:, None, None], FP8_MAX * floor[:, None, None]) + np.asarray(anchor)
    assert np.all(np.abs(k - expect) <= np.abs(delta) * 2**-4 + floor[:, None, None] * 2**-9 + 1e-6)
    assert k[1, 3, 0] == pytest.approx(np.asarray(anchor)[1, 0, 0] + 8.0, rel=1e-6)   # saturated at 448 x floor
    with pytest.raises(ValueError, match="fp8-delta storage rule"):
        init_delta_cache([(anchor, anchor)], [(floor, floor)], 64, "fp16-delta", fixed_scales=True)


def test_fp16_delta_rebuilds_bf16_kv_around_a_position_aligned_anchor():
    """anchor + fp16(x - anchor), rounded to bf16, is x within fp16's rounding of the delta (2^-11
    relative) plus bf16's of the result (2^-8 relative), and mostly exactly; the anchor is read at
    position % anchor_len."""
    rng = np.random.default_rng(1)
    heads, dim, alen = 2, 8, 256
    anchor = jnp.asarray(rng.normal(size=(heads, alen, dim)), jnp.bfloat16)
    cache = _cache("fp16-delta", anchor, np.ones(heads, np.float32), num_slots=32)
    positions = np.array([3, 255, 256, 700], np.int32)
    x = jnp.asarray(np.asarray(anchor, np.float32)[:, positions % alen].transpose(1, 0, 2)
                    + rng.normal(size=(4, heads, dim)) * 0.1, jnp.bfloat16)
    cache = write(cache, x, x, jnp.asarray(positions), jnp.arange(4, dtype=jnp.int32))
    k, v = gather(cache, jnp.arange(4, dtype=jnp.int32)[None], jnp.asarray(positions))
    want = np.asarray(x, np.float32).transpose(1, 0, 2)
    got = np.asarray(k[:, 0], np.float32)
    delta = want - np.asarray(anchor, np.float32)[:, positions % alen]
    assert np.all(np.abs(got - want) <= np.abs(delta) * 2**-11 + np.abs(want) * 2**-8)
    assert np.mean(got == want) > 0.9
    np.testing.assert_array_equal(np.asarray(v), np.asarray(k))


# ---- the anchor choice -----------------------------------------------------------------------------

def _kv(position_term: float, seed=0, windows=4, heads=2, dim=4):
    """[1 layer, 2, windows, heads, 2 * ALIGNED_LEN, dim]: an offset of 3, noise 0.1, and position_term x a
    fixed pattern of the position mod ALIGNED_LEN (what a position-aligned anchor can learn)."""
    rng = np.random.default_rng(seed)
    w = 2 * ALIGNED_LEN
    pattern = rng.normal(size=(heads, ALIGNED_LEN, dim))[:, np.arange(w) % ALIGNED_LEN]
    noise = rng.normal(size=(1, 2, windows, heads, w, dim)) * 0.1
    return (3.0 + position_term * pattern[None, None, None] + noise).astype(np.float32)


def test_anchor_choice_follows_the_held_out_delta_magnitude():
    aligned = choose_anchor(_kv(position_term=1.0), jnp.float32)
    assert aligned.kind == "aligned" and aligned.anchors[0][0].shape == (2, ALIGNED_LEN, 4)
    assert aligned.rms["aligned"] < 0.2 < aligned.rms["mean"]
    mean = choose_anchor(_kv(position_term=0.0), jnp.float32)
    assert mean.kind == "mean" and mean.anchors[0][0].shape == (2, 1, 4)
    np.testing.assert_allclose(np.asarray(mean.anchors[0][0]), 3.0, atol=0.02)
    assert mean.rms["mean"] < 0.11 < 3.0 < mean.rms["kv"]
    # Floors: the 99% quantile of the per-token max |delta| / 448 (noise 0.1 over 4 dims: ~0.2-0.35).
    assert np.all((mean.floors[0][0] > 0.15 / FP8_MAX) & (mean.floors[0][0] < 0.5 / FP8_MAX))
    assert np.all(mean.zero_floors[0][0] > 3.0 / FP8_MAX)
    # max_floors: the largest per-token max |delta| of the held-out windows / 448, above the 99% floor.
    kv = _kv(position_term=0.0)
    held = kv[:, :, kv.shape[2] // 2:] - np.asarray(mean.anchors[0][0], np.float32)[None, None, None]
    want = np.abs(held[0, 0]).max(axis=(0, 2, 3)) / FP8_MAX                      # [Hkv]
    np.testing.assert_allclose(mean.max_floors[0][0], want, rtol=1e-3)
    assert np.all(mean.max_floors[0][0] > mean.floors[0][0])


# ---- the flag and the fallbacks --------------------------------------------------------------------

def test_kv_precision_flag_env_and_errors(monkeypatch):
    monkeypatch.delenv(KV_PRECISION_ENV, raising=False)
    assert RuntimeConfig().kv_precision == "bf16"
    monkeypatch.setenv(KV_PRECISION_ENV, "fp8-delta")
    assert RuntimeConfig().kv_precision == "fp8-delta"
    assert RuntimeConfig(kv_precision="fp16-delta").kv_precision == "fp16-delta"   # the flag wins
    monkeypatch.setenv(KV_PRECISION_ENV, "int4")
    with pytest.raises(ValueError, match=r"--kv-precision \(or \$STRATUM_DKVC_PRECISION\) must be one of"):
        RuntimeConfig()
    monkeypatch.delenv(KV_PRECISION_ENV)
    with pytest.raises(ValueError, match="--kv-precision must|--kv-precision \\(or"):
        RuntimeConfig(kv_precision="fp8")
    assert RuntimeConfig(kv_precision="fp8-delta", tensor_parallel=2).kv_precision == "fp8-delta"   # DKVC under TP
    assert RuntimeConfig().fp8_scale == "granule"
    assert RuntimeConfig(kv_precision="fp8-delta", fp8_scale="head").fp8_scale == "head"
    with pytest.raises(ValueError, match="--fp8-scale must be one of"):
        RuntimeConfig(kv_precision="fp8-delta", fp8_scale="page")
    with pytest.raises(ValueError, match="--fp8-scale head is a rule for fp8 deltas; it needs --kv-precision fp8-delta"):
        RuntimeConfig(kv_precision="fp16-delta", fp8_scale="head")
    from stratum_jax.serve import build_parser
    args = build_parser().parse_args(["--kv-precision", "fp8-delta", "--fp8-scale", "head"])
    assert RuntimeConfig.from_cli_args(args).fp8_scale == "head"


def test_precision_fallbacks_say_why():
    fast = HBM_BANDWIDTH_THRESHOLD_GBPS * 2
    assert resolve_precision("fp8-delta", platform="gpu", capability=(9, 0), bandwidth_gbps=fast)[0] == "fp8-delta"
    got, why = resolve_precision("fp8-delta", platform="gpu", capability=(8, 0), bandwidth_gbps=fast)
    assert got == "fp16-delta" and "compute capability 8.0" in why and "8.9" in why
    got, why = resolve_precision("fp8-delta", platform="gpu", capability=(9, 0),
                                 bandwidth_gbps=HBM_BANDWIDTH_THRESHOLD_GBPS / 2)
    assert got == "bf16" and "bandwidth" in why and "bf16" in why
    assert resolve_precision("fp16-delta", platform="gpu", capability=(8, 0), bandwidth_gbps=fast)[0] == "fp16-delta"
    assert resolve_precision("fp8-delta", platform="cpu", capability=None, bandwidth_gbps=None)[0] == "fp8-delta"
    assert resolve_precision("bf16", platform="gpu", capability=(7, 0), bandwidth_gbps=1.0)[0] == "bf16"


# ---- the engine ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


PS = 16


def make_engine(tiny, precision, **kw):
    defaults = dict(model="tiny", max_context=256, kv_pool_tokens=512, max_batch_size=4, prefill_chunk=64,
                    max_tokens_cap=256, page_size=PS, kv_precision=precision)
    defaults.update(kw)
    return Engine(RuntimeConfig(**defaults), model=tiny)


def _prompts(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def bf16_tokens(tiny):
    engine = make_engine(tiny, "bf16")
    return [r.token_ids for r in engine.generate(_prompts(4, 40, seed=3), SamplingParams(max_tokens=16, **GREEDY))]


@pytest.mark.parametrize("precision", ["fp16-delta", "fp8-delta"])
def test_engine_greedy_tokens_on_delta_precisions(tiny, bf16_tokens, precision):
    """fp16-delta gives bf16's greedy tokens (its rebuild error is below the float32 model's logit gaps
    here); fp8-delta mostly does (measured: 63 of 64 tokens) and is deterministic."""
    engine = make_engine(tiny, precision)
    assert engine.kv_precision == precision and engine.kv_anchor is not None
    sp = SamplingParams(max_tokens=16, **GREEDY)
    got = [r.token_ids for r in engine.generate(_prompts(4, 40, seed=3), sp)]
    same = sum(a == b for x, y in zip(got, bf16_tokens) for a, b in zip(x, y))
    if precision == "fp16-delta":
        assert got == bf16_tokens
    else:
        assert [x[0] for x in got] == [x[0] for x in bf16_tokens]    # the prefill-written prompt
        assert same >= 0.75 * 64
        assert [r.token_ids for r in engine.generate(_prompts(4, 40, seed=3), sp)] == got


def test_engine_with_fixed_head_scales(tiny, bf16_tokens):
    """--fp8-scale head: the cache's scales are the warm-up's max floors and stay so through prefill and
    decode; greedy tokens mostly match bf16's (as the granule rule's do) and repeat exactly."""
    engine = make_engine(tiny, "fp8-delta", fp8_scale="head")
    layer = engine.kv_cache[0]
    assert layer.fixed_scales and engine.kv_anchor is not None
    k_floor = np.asarray(engine.kv_anchor.max_floors[0][0])
    scales = np.asarray(layer.k_scale).copy()        # a copy: the step donates the cache's buffers
    np.testing.assert_allclose(scales, np.broadcast_to(k_floor[:, None], scales.shape))
    sp = SamplingParams(max_tokens=16, **GREEDY)
    got = [r.token_ids for r in engine.generate(_prompts(4, 40, seed=3), sp)]
    after = engine.kv_cache[0]
    assert after.fixed_scales
    np.testing.assert_array_equal(np.asarray(after.k_scale), scales)
    assert np.any(np.asarray(after.k_delta, np.float32) != 0)           # it did write deltas
    same = sum(a == b for x, y in zip(got, bf16_tokens) for a, b in zip(x, y))
    assert [x[0] for x in got] == [x[0] for x in bf16_tokens] and same >= 0.75 * 64
    assert [r.token_ids for r in engine.generate(_prompts(4, 40, seed=3), sp)] == got


def test_fp8_delta_pages_evicted_to_the_host_and_recalled_give_identical_tokens(tiny):
    """A prompt's fp8 delta pages (deltas and scales) go to the host tier and come back byte for byte, and
    the greedy request then gives the tokens it gave first."""
    prompt, *others = _prompts(5, 150, seed=1)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    engine = make_engine(tiny, "fp8-delta", kv_host_tokens=4096)

    def pages_of():
        pages = engine.pool.match_prefix(prompt, PS, (len(prompt) - 1) // PS)
        slots = np.concatenate([np.arange(p.start_slot, p.start_slot + PS) for p in pages])
        data = [np.stack([np.asarray(c.k_delta, np.float32)[:, slots], np.asarray(c.v_delta, np.float32)[:, slots]])
                for c in engine.kv_cache]
        scales = [np.stack([np.asarray(c.k_scale)[:, slots // 8], np.asarray(c.v_scale)[:, slots // 8]])
                  for c in engine.kv_cache]
        return pages, np.stack(data), np.stack(scales)

    first = engine.generate([prompt], sp)[0]
    pages, deltas, scales = pages_of()
    for other in others:                        # 4 x 150 tokens through a 512-token pool evict the prompt
        engine.generate([other], sp)
    assert all(h in engine.pool.host for h in prompt_chain_hashes(prompt)[PS])
    again = engine.generate([prompt], sp)[0]
    assert again.cached_prompt_tokens == 9 * PS and engine.stats().kv_host_hits == 9
    assert again.token_ids == first.token_ids
    pages_after, deltas_after, scales_after = pages_of()
    assert [p.start_slot for p in pages_after] != [p.start_slot for p in pages]   # really moved
    np.testing.assert_array_equal(deltas_after, deltas)
    np.testing.assert_array_equal(scales_after, scales)
    # The host copy holds fp8 deltas (1 byte per element) plus the scales: about half a bf16 page's bytes.
    cfg = tiny.config
    per_token_bf16 = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    per_token = engine.transfers.stats.offloaded_bytes / (engine.transfers.stats.offloaded_pages * PS)
    assert per_token == per_token_bf16 / 2 + cfg.num_layers * cfg.num_kv_heads
    st = engine.stats()
    # On the device each granule's scales are packed into 16 bytes per kv head (K, V and 8 unused bytes, so the
    # decode kernel copies them at once); only K and V go to the host: 1 byte a token a layer a kv head more.
    assert st.kv_precision == "fp8-delta" and st.kv_bytes_per_token == per_token + cfg.num_layers * cfg.num_kv_heads
    assert st.kv_recall_batches >= 1 and len(st.kv_recall_seconds) == min(64, st.kv_recall_batches)


def test_dkvc_metrics_from_engine_stats():
    """stratum_kv_precision, stratum_kv_bytes per tier, recalled pages and the recall-time histogram, each
    recall observed once however often a snapshot is read."""
    from stratum_jax.engine_stats import EngineStats
    from stratum_jax.metrics import ServingMetrics
    m = ServingMetrics()
    base = dict(queued=0, running=1, kv_pages_total=64, kv_pages_free=60, kv_tokens_total=512, kv_tokens_used=32,
                kv_tokens_written=30, prefix_cache_hits=3, prefix_cache_queries=4, preemptions=0, steps=5,
                decode_step_ms=1.0, prefill_tokens_per_s=1.0, kv_host_tokens_total=1024, kv_host_tokens_used=48,
                kv_recalled_pages=2, kv_precision="fp8-delta", kv_bytes_per_token=100)
    m.observe_engine(EngineStats(**base, kv_recall_batches=2, kv_recall_seconds=(0.002, 0.004)))
    m.observe_engine(EngineStats(**base, kv_recall_batches=2, kv_recall_seconds=(0.002, 0.004)))
    m.observe_engine(EngineStats(**{**base, "kv_recalled_pages": 3}, kv_recall_batches=3,
                                 kv_recall_seconds=(0.002, 0.004, 0.5), kv_recall_choices=3, kv_recompute_choices=1))
    value = m.value
    assert value("stratum_kv_precision", {"precision": "fp8-delta"}) == 1
    assert value("stratum_kv_bytes", {"tier": "device"}) == 32 * 100
    assert value("stratum_kv_bytes", {"tier": "host"}) == 48 * 100
    assert value("stratum_kv_recalled_pages_total") == 3
    assert value("stratum_kv_recall_seconds_count") == 3
    assert value("stratum_kv_recall_seconds_sum") == pytest.approx(0.506)
    assert value("stratum_kv_recall_choices_total", {"choice": "recall"}) == 3
    assert value("stratum_kv_recall_choices_total", {"choice": "recompute"}) == 1
