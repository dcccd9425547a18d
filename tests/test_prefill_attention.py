"""The warp-specialised prefill kernel (pallas_kernels/prefill_attention.py) against float64.

Interpret mode runs the real kernel body on CPU: its three warpgroups, the ping-pong schedule barrier,
the consumed barriers and the page-class TMA copies (the interpreter checks that every barrier phase is
observed and that SMEM is never read uninitialised). The GPU test compiles it for the H200.
"""
from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention import TuningConfig
from pallas_kernels.prefill_attention import ws_prefill_attention, ws_prefill_block_tokens
from pallas_kernels.testing import float64_prefill_attention, prefill_blocks_case, random_paged_case

BF16_TOL = 2e-2


def _case(num_q_heads, num_kv_heads, head_dim, seed, lengths=(140, 230, 75, 9)):
    """Sequences on several page-size classes (NaN in free slots). Blocks: one ending at its sequence's
    end (its last tile partial: the V tail is zeroed), one in the middle of a long context (keys over
    several tiles and pages, unmasked tiles first), one truncated (only its first 5 tokens real), one
    starting at position 0, one padding block (zeros)."""
    case = random_paged_case(seed, lengths=list(lengths), page_sizes=[8, 32, 256, 16],
                             num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    n = ws_prefill_block_tokens(num_q_heads, num_kv_heads)
    blocks = [(0, lengths[0] - n, n), (1, lengths[1] - n - 8, n), (2, lengths[2] - 5, 5), (3, 0, min(n, lengths[3])),
              (-1, 0, 0)]
    return prefill_blocks_case(case, blocks, n, seed=seed)


def _check(out, pcase, valid):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    assert not np.isnan(out[valid]).any(), "NaN in a real token's output"
    err = np.abs(out - float64_prefill_attention(pcase))[valid].max()
    assert err <= BF16_TOL, f"max abs err {err:.3g} > {BF16_TOL}"
    assert not out[-1].any(), "a padding block must give zeros"


def test_ws_prefill_matches_float64():
    """GQA group 4 (32 tokens per block, 16 per warpgroup) with 64-token tiles: pages of 8 and 32 are several
    copies per tile, 256 a piece of one page, and the long block streams several tiles through the ring
    (unmasked ones first). Other groups and 128-token tiles run in the GPU test (the interpreter is slow)."""
    pcase = _case(8, 2, 64, seed=31)
    valid = pcase.pop("valid")
    out = ws_prefill_attention(**pcase, interpret=True, config=TuningConfig(block_kv=64, num_splits=1))
    assert out.shape == pcase["q"].shape and out.dtype == pcase["q"].dtype
    _check(out, pcase, valid)


def _f16_pools(pcase):
    """float16 pools: a DKVC fp16-delta pool's dtype (bf16 values are exact in f16; NaN stays NaN)."""
    return {**pcase, "k_pool": pcase["k_pool"].astype(jnp.float16), "v_pool": pcase["v_pool"].astype(jnp.float16)}


def test_ws_prefill_entry_errors():
    pcase = _case(8, 2, 64, seed=32)
    pcase.pop("valid")
    with pytest.raises(ValueError, match="do not fit the 128-row q tile"):
        ws_prefill_attention(**{**pcase, "q": jnp.zeros((5, 64, 8, 64), jnp.bfloat16)})
    with pytest.raises(ValueError, match="q_starts must be int32"):
        ws_prefill_attention(**{**pcase, "q_starts": pcase["q_starts"][:2]})
    wide = {**pcase, "q": jnp.zeros((5, 32, 32, 128), jnp.bfloat16),
            "k_pool": jnp.zeros((8, 4096, 128), jnp.bfloat16), "v_pool": jnp.zeros((8, 4096, 128), jnp.bfloat16)}
    with pytest.raises(ValueError, match="block_kv 256 is for head_dim 64"):
        ws_prefill_attention(**wide, config=TuningConfig(block_kv=256, num_splits=1))
    with pytest.raises(ValueError, match="KB of SMEM"):
        ws_prefill_attention(**wide, config=TuningConfig(block_kv=128, num_stages=4, num_splits=1))
    assert ws_prefill_block_tokens(32, 8) == 32 and ws_prefill_block_tokens(12, 4) is None
    with pytest.raises(ValueError, match="both bfloat16 or both float16"):
        ws_prefill_attention(**{**pcase, "v_pool": pcase["v_pool"].astype(jnp.float16)})


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("config", [TuningConfig(block_kv=64, num_splits=1), TuningConfig(block_kv=128, num_splits=1),
                                    TuningConfig(block_kv=64, num_stages=3, num_splits=1)])
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64), (8, 8, 64)])
def test_ws_prefill_compiled_on_gpu(config, heads):
    pcase = _case(*heads, seed=33, lengths=(1400, 2300, 75, 9))
    valid = pcase.pop("valid")
    _check(ws_prefill_attention(**pcase, config=config), pcase, valid)


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("heads", [(32, 8, 128), (32, 8, 64)])
def test_ws_prefill_on_float16_pools_compiled_on_gpu(heads):
    """float16 pools (the fp16-delta fold), compiled, with the default config and split-K 2."""
    pcase = _f16_pools(_case(*heads, seed=35, lengths=(1400, 2300, 75, 9)))
    valid = pcase.pop("valid")
    for config in (None, TuningConfig(block_kv=64, num_splits=2)):
        _check(ws_prefill_attention(**pcase, config=config), pcase, valid)
