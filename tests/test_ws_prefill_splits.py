"""Split-K over the context in the warp-specialised prefill kernels (`TuningConfig.num_splits` >= 2,
pallas_kernels/prefill_attention.py), against float64.

Each block's key range [0, length) is cut into S ranges of whole tiles, one CTA each, merged in XLA. The cases
reuse the unsplit tests' batches (tests/test_prefill_attention.py, tests/test_ws_delta_prefill_attention.py):
pages of several size classes with NaN in every free slot, a padding block (length 0), blocks whose ranges
hold unmasked tiles then masked ones, and with 64-token tiles a last split starting past the causal bound of
a block's first rows (they see no key there: l = 0, weight 0 in the merge) and empty splits (a 9-key block at
S = 2 and 3, the padding block at any S).
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import TuningConfig
from pallas_kernels.prefill_attention import ws_delta_prefill_attention, ws_prefill_attention, ws_prefill_splits
from test_prefill_attention import _case, _check
from test_ws_delta_prefill_attention import FP8, FP16, check as check_delta, ws_case


def _splits_config(splits, block_kv=64):
    return TuningConfig(block_kv=block_kv, num_splits=splits)


@pytest.mark.parametrize("splits", [2, 3])
def test_split_matches_float64(splits):
    """GQA 4, D=64, 64-token tiles (128-token ones unroll twice the copies: slower here; the GPU test runs
    them). Block 0 (keys [0, 140), first token at 108): tiles 0 1 | 2 at S=2, 0 | 1 | 2 at S=3; tile 2 (keys
    128..139) is past the bound of the block's first 20 tokens. Block 1 (222 keys, first token 190): 2
    unmasked tiles, then masked ones in the next range (S=3: 0 1 | 2 3)."""
    pcase = _case(4, 1, 64, seed=31)     # GQA 4 on one kv head: the interpreter time grows with the grid
    valid = pcase.pop("valid")
    out = ws_prefill_attention(**pcase, interpret=True, config=_splits_config(splits))
    assert out.shape == pcase["q"].shape and out.dtype == pcase["q"].dtype
    _check(out, pcase, valid)
    assert np.isfinite(np.asarray(out.astype(jnp.float32))).all()


def test_split_delta_fp8_matches_float64():
    """The delta variant (fp8 deltas: the compute warpgroups convert each tile, zeroing V rows past the length
    by the tile's index in the sequence; the scale granules found through the page table by that index), D=64,
    GQA 4, S=3 with 64-token tiles: each split adds the mean anchor to its own partial, the merge keeps it
    once; block 0 (140 keys, first token 108) has its first rows past the third range's start (key 128)."""
    blocks = [(0, 140 - 32, 32), (1, 230 - 32 - 8, 32), (2, 70, 5), (3, 0, 9), (-1, 0, 0)]
    args, truth, valid = ws_case(21, lengths=[140, 230, 75, 9], page_sizes=[8, 32, 256, 16], blocks=blocks,
                                 num_q_heads=4, num_kv_heads=1, head_dim=64, delta_dtype=FP8)
    out = ws_delta_prefill_attention(**args, interpret=True, config=_splits_config(3))
    check_delta(out, truth, valid)


def test_split_changes_the_kernel_only_when_asked():
    """num_splits 1 and None trace the same program; 2 traces another (grid axis "k", the lse output)."""
    pcase = _case(8, 2, 64, seed=32)
    pcase.pop("valid")
    names = list(pcase)

    def text(config):
        return str(jax.make_jaxpr(lambda *a: ws_prefill_attention(**dict(zip(names, a)), config=config))(
            *pcase.values()))
    one = text(_splits_config(1))
    assert text(_splits_config(None)) == one
    two = text(_splits_config(2))
    assert two != one and "float32[" in two


def test_ws_prefill_splits_helper():
    # llama-8b's 256-token tail after a 32K prefix: 8 blocks x 8 kv heads = 64 CTAs -> 2 splits (128 CTAs).
    assert ws_prefill_splits(8, 8, 32768 + 256) == 2
    assert ws_prefill_splits(2, 8, 32768) == 8                 # 16 CTAs: 8 splits of 32 tiles
    assert ws_prefill_splits(1, 1, 1 << 20) == 16              # capped
    assert ws_prefill_splits(8, 8, 600) == 1                   # 5 tiles: not several per split
    assert ws_prefill_splits(32, 8, 32768) == 1                # 256 CTAs already fill the SMs
    assert ws_prefill_splits(0, 8, 0) == 1


@pytest.mark.parametrize("delta_dtype", [None])      # fp8 deltas: +10 s here; run it with [None, FP8] by hand
def test_split_lowers_to_mosaic_gpu_on_cpu(delta_dtype):
    """The compiled kernel with S=2 at D=128 (llama-8b's heads: GQA 4, 32 tokens a block, the default
    128-token tiles for bf16, 64 for fp8 deltas) lowers to Mosaic GPU on a CPU: the third grid axis, the
    guarded softmax and the lse tile's store and copy are emitted."""
    shape = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt)
    slots, d = 4096, 128
    blocks = (shape(2, dt=jnp.int32), shape(2, dt=jnp.int32), shape(2, 64, dt=jnp.int32), shape(2, dt=jnp.int32))
    q = shape(2, 32, 32, d)
    if delta_dtype is None:
        args = (q, shape(8, slots, d), shape(8, slots, d), *blocks)
        fn = jax.jit(lambda *a: ws_prefill_attention(*a, config=TuningConfig(block_kv=128, num_splits=2)))
    else:
        args = (q, shape(8, slots, d, dt=delta_dtype), shape(8, slots, d, dt=delta_dtype),
                shape(8, slots // 8, dt=jnp.float32), shape(8, slots // 8, dt=jnp.float32), shape(8, 1, d),
                shape(8, 1, d), *blocks)
        fn = jax.jit(lambda *a: ws_delta_prefill_attention(*a, config=TuningConfig(block_kv=64, num_splits=2)))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_engine_prefill_passes_splits(monkeypatch):
    """stratum_jax.attention.prefill_attention leaves the kernel unsplit by default and passes prefill_splits
    (an int, or "auto" from the grid and max_context) into the WS kernel's config."""
    import pallas_kernels.prefill_attention as prefill_module
    from stratum_jax.attention import RowTables, prefill_attention
    seen = []

    def fake(q, *a, config=None, **kw):
        seen.append(config)
        return jnp.zeros(q.shape, q.dtype)
    monkeypatch.setattr(prefill_module, "ws_prefill_attention", fake)
    hkv, d = 2, 64
    pool = jnp.zeros((hkv, 512, d), jnp.bfloat16)
    tables = RowTables(context_lens=jnp.array([100, 0], jnp.int32), page_starts=jnp.zeros((2, 32), jnp.int32),
                       page_sizes=jnp.array([16, 16], jnp.int32))
    q = jnp.zeros((2, 128, 4, d), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(128, dtype=jnp.int32), (2, 128))
    run = lambda **kw: prefill_attention(q, positions, jnp.array([0, -1], jnp.int32), tables, pool, pool,
                                         backend="kernel", interpret=True, **kw)
    run()
    run(prefill_splits=3)
    run(prefill_splits="auto", max_context=32768)       # 4 blocks x 2 heads = 8 CTAs -> 16 splits
    assert seen[0] is None
    assert seen[1].num_splits == 3 and seen[1].block_kv == 128
    assert seen[2].num_splits == 16
    with pytest.raises(ValueError, match="prefill_splits must be"):
        run(prefill_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("block_kv", [64, 128])
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64)])
def test_split_compiled_on_gpu(splits, block_kv, heads):
    pcase = _case(*heads, seed=33, lengths=(1400, 2300, 75, 9))
    valid = pcase.pop("valid")
    _check(ws_prefill_attention(**pcase, config=_splits_config(splits, block_kv)), pcase, valid)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [FP8, FP16])
def test_split_delta_compiled_on_gpu(dtype):
    tokens = 32
    blocks = [(0, 0, tokens), (1, 1000 - tokens, tokens), (2, 300, tokens), (3, 500, 7), (-1, 0, 0)]
    args, truth, valid = ws_case(24, lengths=[16, 1000, 700, 507], page_sizes=[8, 16, 32, 256], blocks=blocks,
                                 num_q_heads=32, num_kv_heads=8, head_dim=128, delta_dtype=dtype)
    check_delta(ws_delta_prefill_attention(**args, config=_splits_config(2)), truth, valid)
