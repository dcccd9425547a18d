"""pallas_kernels/rope_kv_write.py: the kernel (Mosaic GPU interpreter on CPU) against its reference and against
the model's own RoPE and slot write; the model's decode layer with q/k/v, RoPE and the KV write fused against the
same layer unfused; bad input refused; CUDA lowering at llama shapes (in place: the pools alias the outputs)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusion_cases import forward_with
from pallas_kernels.rope_kv_write import rope_kv_write, rope_kv_write_reference
from stratum_jax.kv.slot_write import write_slot_rows
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fuse_layer
from stratum_jax.model.projection import DecodeKernelMatmul, rope_kv_write_takes


def _case(seed, *, splits, rows, num_q_heads, num_kv_heads, head_dim, num_slots=96, dtype=jnp.float32, padding=2):
    rng = np.random.default_rng(seed)
    parts = jnp.asarray(rng.standard_normal((splits, rows, (num_q_heads + 2 * num_kv_heads) * head_dim)), dtype)
    positions = jnp.asarray(rng.integers(0, 4000, rows), jnp.int32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    cos, sin = llama.rope_cos_sin(positions, inv_freq)
    # Distinct slots, the last rows padding (>= num_slots: not written).
    slots = np.concatenate([rng.permutation(num_slots)[:rows - padding], num_slots + np.arange(padding)])
    pools = [jnp.asarray(rng.standard_normal((num_kv_heads, num_slots, head_dim)), jnp.bfloat16) for _ in range(2)]
    return dict(parts=parts, cos=cos, sin=sin, slots=jnp.asarray(slots, jnp.int32), k_pool=pools[0], v_pool=pools[1],
                positions=positions, inv_freq=inv_freq)


@pytest.mark.parametrize("splits, rows, head_dim, dtype", [
    (4, 16, 64, jnp.float32),      # llama-1b's head_dim, the q/k/v GEMM's split 4
    (2, 8, 128, jnp.float32),      # llama-8b's
    (1, 24, 32, jnp.bfloat16),     # no split: the GEMM's bf16 output
])
def test_the_kernel_matches_the_models_rope_and_slot_write(splits, rows, head_dim, dtype):
    """Against the model's own ops: the split-K sum rounded to bf16 (decode_matmul), llama.apply_rope, and
    write_slot_rows (padding rows dropped, every other slot untouched). Bit for bit."""
    c = _case(0, splits=splits, rows=rows, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    q, k_pool, v_pool = rope_kv_write(c["parts"], c["cos"], c["sin"], c["slots"], c["k_pool"], c["v_pool"],
                                      num_q_heads=4, num_kv_heads=2, interpret=True)
    y = jnp.sum(c["parts"].astype(jnp.float32), axis=0).astype(jnp.bfloat16).reshape(rows, 8, head_dim)
    want_q = llama.apply_rope(y[:, :4], c["positions"], c["inv_freq"])
    want_k = write_slot_rows(c["k_pool"], c["slots"],
                             llama.apply_rope(y[:, 4:6], c["positions"], c["inv_freq"]).transpose(1, 0, 2))
    want_v = write_slot_rows(c["v_pool"], c["slots"], y[:, 6:].transpose(1, 0, 2))
    for got, want in ((q, want_q), (k_pool, want_k), (v_pool, want_v)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    ref = rope_kv_write_reference(c["parts"], c["cos"], c["sin"], c["slots"], c["k_pool"], c["v_pool"],
                                  num_q_heads=4, num_kv_heads=2)
    for got, want in zip((q, k_pool, v_pool), ref):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_each_row_lands_in_its_own_slot_and_head():
    """A head or row off by one would still pass a test whose rows were alike: every row and head differs here, and
    the written slots are checked one by one. A negative slot counts from the pool's end, as in the scatter
    (`.at[].set(mode="drop")`) this kernel replaces; one below -num_slots is dropped."""
    c = _case(1, splits=2, rows=16, num_q_heads=2, num_kv_heads=2, head_dim=64, padding=3)
    slots = np.asarray(c["slots"]).copy()
    slots[0] = np.setdiff1d(np.arange(96), slots)[-1] - 96    # row 0 -> a free slot, counted from the end
    slots[12] = -200                                          # dropped
    c["slots"] = jnp.asarray(slots, jnp.int32)
    _, k_pool, v_pool = rope_kv_write(c["parts"], c["cos"], c["sin"], c["slots"], c["k_pool"], c["v_pool"],
                                      num_q_heads=2, num_kv_heads=2, interpret=True)
    y = np.asarray(jnp.sum(c["parts"], axis=0).astype(jnp.bfloat16), np.float32).reshape(16, 6, 64)
    written = {int(s) % 96: r for r, s in enumerate(slots[:13]) if -96 <= s < 96}
    assert len(written) == 12
    for slot, r in written.items():
        for h in range(2):
            np.testing.assert_array_equal(np.asarray(v_pool[h, slot], np.float32), y[r, 4 + h])
    untouched = np.setdiff1d(np.arange(96), list(written))
    np.testing.assert_array_equal(np.asarray(k_pool[:, untouched]), np.asarray(c["k_pool"][:, untouched]))
    ref = rope_kv_write_reference(c["parts"], c["cos"], c["sin"], c["slots"], c["k_pool"], c["v_pool"],
                                  num_q_heads=2, num_kv_heads=2)
    np.testing.assert_array_equal(np.asarray(k_pool, np.float32), np.asarray(ref[1], np.float32))


@pytest.mark.parametrize("change, match", [
    (dict(parts=jnp.zeros((2, 16, 7 * 64), jnp.float32)), "num_q_heads"),
    (dict(cos=jnp.zeros((16, 31), jnp.float32)), "cos and sin"),
    (dict(slots=jnp.zeros((16,), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32)), "slots"),
    (dict(k_pool=jnp.zeros((2, 96, 64), jnp.float32)), "bfloat16"),
    (dict(parts=jnp.zeros((2, 12, 8 * 64), jnp.float32)), "multiple of 8"),
])
def test_bad_inputs_are_refused_with_what_to_fix(change, match):
    c = _case(2, splits=2, rows=16, num_q_heads=4, num_kv_heads=2, head_dim=64)
    args = {k: c[k] for k in ("parts", "cos", "sin", "slots", "k_pool", "v_pool")} | change
    with pytest.raises(ValueError, match=match):
        rope_kv_write(**args, num_q_heads=4, num_kv_heads=2, interpret=True)


@pytest.mark.parametrize("head_dim, splits", [(64, 4), (128, 2)])
def test_lowers_to_mosaic_gpu_in_place_at_llama_shapes(head_dim, splits):
    """llama-1b / 8b at batch 64 (32 q heads, 8 kv heads, a 51,200-slot pool), lowered for CUDA on this CPU: one
    Mosaic GPU call, named for the profile, whose outputs alias the donated pools (no copy of the pool)."""
    sd = jax.ShapeDtypeStruct
    args = (sd((splits, 64, 48 * head_dim), jnp.float32), sd((64, head_dim // 2), jnp.float32),
            sd((64, head_dim // 2), jnp.float32), sd((64,), jnp.int32), sd((8, 51200, head_dim), jnp.bfloat16),
            sd((8, 51200, head_dim), jnp.bfloat16))
    fn = jax.jit(lambda *a: rope_kv_write(*a, num_q_heads=32, num_kv_heads=8), donate_argnums=(4, 5))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 and "rope_kv_write_mosaic_gpu" in text
    assert text.count("output_operand_alias<") == 2


class _Unfused(DecodeKernelMatmul):
    """The kernel's projections without the fused q/k/v write (the path before it)."""

    def rope_kv_write(self, x, w, write, num_q_heads):
        return None


def test_the_models_decode_layers_fused_match_them_unfused():
    """A tiny bf16 model's forward over 8 token rows with the projections on the kernel (interpreter): with q/k/v,
    RoPE and the KV write fused the hidden states and the written caches equal the unfused path's, bit for bit."""
    cfg = dataclasses.replace(PRESETS["tiny"], dtype="bfloat16")
    assert rope_kv_write_takes(8, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size,
                               jnp.bfloat16, jnp.bfloat16, cfg.head_dim)
    params = llama.init_params(cfg, seed=5)
    params = {k: fuse_layer(v, 1) if k.startswith("layers_") else v for k, v in params.items()}
    (fused_program, fused), (unfused_program, unfused) = (
        forward_with(cfg, params, m) for m in (DecodeKernelMatmul(interpret=True), _Unfused(interpret=True)))
    assert fused_program.count("rope_kv_write") >= cfg.num_layers and "rope_kv_write" not in unfused_program
    for a, b in zip(fused, unfused, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("head_dim, splits", [(64, 4), (128, 2)])
def test_gpu_compiled_matches_the_reference_at_llama_shapes(head_dim, splits):
    """The compiled kernel at llama-1b / 8b's decode shapes (64 rows, 32 q heads, 8 kv heads) against its reference,
    pools updated in place inside one jitted program as the step does. V bit for bit; the rotated q and k within one
    bf16 step where the two compilers contract x1 * cos - x2 * sin differently (an FMA or not), which shows where
    the two products nearly cancel: 5 of 131,072 q values on the H200."""
    c = _case(3, splits=splits, rows=64, num_q_heads=32, num_kv_heads=8, head_dim=head_dim, num_slots=4096,
              padding=5)
    args = [c[k] for k in ("parts", "cos", "sin", "slots", "k_pool", "v_pool")]
    want = rope_kv_write_reference(*args, num_q_heads=32, num_kv_heads=8)
    got = jax.jit(lambda *a: rope_kv_write(*a, num_q_heads=32, num_kv_heads=8), donate_argnums=(4, 5))(*args)
    (q, k_pool, v_pool), (want_q, want_k, want_v) = ([np.asarray(a, np.float32) for a in t] for t in (got, want))
    np.testing.assert_array_equal(v_pool, want_v)
    for g, w in ((q, want_q), (k_pool, want_k)):
        np.testing.assert_allclose(g, w, rtol=2.0 ** -7, atol=0)       # one bf16 step at most
        assert np.mean(g != w) < 1e-3


# The engine with this kernel in its step: tests/test_residual_rmsnorm.py, whose engine test runs both fused kernels.
