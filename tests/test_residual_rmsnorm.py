"""pallas_kernels/residual_rmsnorm.py: a projection's split-K sum, the residual add and the RMSNorm in one kernel. The
kernel in the Mosaic GPU interpreter against its reference and the model's own ops, its refusals, its lowering at
llama shapes, the model's layer boundaries on it, and the engine's greedy tokens with it."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusion_cases import forward_with, greedy_tokens
from pallas_kernels.residual_rmsnorm import residual_rmsnorm, residual_rmsnorm_reference, supports
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.projection import DecodeKernelMatmul, Unsummed

EPS = 1e-5


def _case(seed, *, splits, rows, hidden, padded_rows=None, parts_dtype=jnp.float32):
    k = jax.random.split(jax.random.key(seed), 3)
    parts = jax.random.normal(k[0], (splits, padded_rows or rows, hidden), jnp.float32).astype(parts_dtype)
    residual = (4.0 * jax.random.normal(k[1], (rows, hidden), jnp.float32)).astype(jnp.bfloat16)
    weight = (1.0 + 0.2 * jax.random.normal(k[2], (hidden,), jnp.float32)).astype(jnp.bfloat16)
    return parts, residual, weight


def _model_ops(parts, residual, weight):
    """The unfused path's ops: the partials summed (Unsummed.summed, as the kernels sum them), the model's bf16 add,
    llama.rms_norm."""
    x = residual + Unsummed(parts).summed(residual.shape[0], residual.dtype)
    return x, llama.rms_norm(x, weight, EPS)


@pytest.mark.parametrize("splits, rows, hidden, padded_rows, parts_dtype", [
    (4, 8, 512, None, jnp.float32),        # llama-1b's o / down split
    (2, 16, 1024, 64, jnp.float32),        # 8b's split; the GEMM's padding rows past the residual's are not read
    (1, 8, 256, None, jnp.bfloat16),       # no split: the GEMM's bf16 output as it is
])
def test_the_kernel_matches_the_models_add_and_norm(splits, rows, hidden, padded_rows, parts_dtype):
    """The new residual stream bit for bit; the norm within one bf16 step where the row's mean square was summed in
    another order than XLA's (and exactly equal on almost every element)."""
    parts, residual, weight = _case(splits, splits=splits, rows=rows, hidden=hidden, padded_rows=padded_rows,
                                    parts_dtype=parts_dtype)
    x, h = residual_rmsnorm(parts, residual, weight, eps=EPS, interpret=True)
    assert x.shape == h.shape == (rows, hidden) and x.dtype == h.dtype == jnp.bfloat16
    for want_x, want_h in (_model_ops(parts, residual, weight),
                           residual_rmsnorm_reference(parts[:, :rows], residual, weight, eps=EPS)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))
        got, want = np.asarray(h, np.float32), np.asarray(want_h, np.float32)
        np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=0)
        assert np.mean(got != want) < 0.01


def test_each_row_is_normalised_on_its_own():
    """A row of zeros stays zeros (rsqrt(eps) times 0), a row 1000x larger gives the same norm as its small twin:
    the scale is per row, not shared between the CTAs."""
    parts, residual, weight = _case(7, splits=2, rows=8, hidden=256)
    parts = parts.at[:, 3].set(0.0).at[:, 5].set(parts[:, 4] * 1024.0)
    residual = residual.at[3].set(0.0).at[5].set(residual[4] * 1024.0)
    x, h = (np.asarray(a, np.float32) for a in residual_rmsnorm(parts, residual, weight, eps=EPS, interpret=True))
    assert np.all(x[3] == 0) and np.all(h[3] == 0)
    np.testing.assert_allclose(x[5], x[4] * 1024.0, rtol=2.0 ** -7)
    np.testing.assert_allclose(h[5], h[4], rtol=2.0 ** -6, atol=1e-6)


@pytest.mark.parametrize("change, match", [
    (dict(parts=jnp.zeros((2, 8, 256), jnp.float16)), "float32 or bfloat16"),
    (dict(residual=jnp.zeros((8, 256), jnp.float32)), r"residual must be \[R, H\] bfloat16 with H = 256"),
    (dict(residual=jnp.zeros((8, 512), jnp.bfloat16)), r"residual must be \[R, H\]"),
    (dict(residual=jnp.zeros((16, 256), jnp.bfloat16)), r"1 <= R <= 8 \(the partials' rows\)"),
    (dict(weight=jnp.zeros((128,), jnp.bfloat16)), r"weight must be \[H\] = \[256\]"),
    (dict(parts=jnp.zeros((2, 8, 200), jnp.float32), residual=jnp.zeros((8, 200), jnp.bfloat16),
          weight=jnp.zeros((200,), jnp.bfloat16)), "multiple of 256"),
    (dict(parts=jnp.zeros((8, 8, 8192), jnp.float32), residual=jnp.zeros((8, 8192), jnp.bfloat16),
          weight=jnp.zeros((8192,), jnp.bfloat16)), "do not fit a CTA's SMEM"),
])
def test_bad_inputs_are_refused_with_what_to_fix(change, match):
    parts, residual, weight = _case(0, splits=2, rows=8, hidden=256)
    args = {**dict(parts=parts, residual=residual, weight=weight), **change}
    with pytest.raises(ValueError, match=match):
        residual_rmsnorm(**args, eps=EPS, interpret=True)
    if args["parts"].shape[-1] != 256:       # a hidden size the kernel does not take: `supports` says so too
        s, _, h = args["parts"].shape
        assert not supports(s, 8, h, args["parts"].dtype)


@pytest.mark.parametrize("splits, hidden, rows", [(4, 2048, 64), (2, 4096, 64), (4, 2048, 48)])
def test_lowers_to_mosaic_gpu_at_llama_shapes(splits, hidden, rows):
    """llama-1b / 8b at batch 64, and 48 rows whose GEMM partials are padded to 64, lowered for CUDA on this CPU:
    one Mosaic GPU call, named for the profile, and no slice (a copy) of the padded partials before it."""
    sd = jax.ShapeDtypeStruct
    fn = jax.jit(lambda p, r, w: residual_rmsnorm(p, r, w, eps=EPS))
    text = fn.trace(sd((splits, 64, hidden), jnp.float32), sd((rows, hidden), jnp.bfloat16),
                    sd((hidden,), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1 and "residual_rmsnorm_mosaic_gpu" in text
    assert "stablehlo.slice" not in text


class _SummedMatmul(DecodeKernelMatmul):
    """The kernel's projections with every product summed (the path before the fused boundary)."""

    def unsummed(self, x, w):
        return None


# hidden 256 (the kernel's row box), 4 q heads of 64; intermediate 1024 so down splits K in 4 (fp32 partials) while o
# does not split (its bf16 output is the partial).
_CFG = dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=1024, head_dim=64, dtype="bfloat16")


def test_the_models_layer_boundaries_on_the_kernel_match_them_unfused():
    """A bf16 model's forward over 8 token rows with the projections on the kernel (interpreter): every boundary
    after a projection (post-attention, each next layer's input, the final norm) runs the kernel, and the hidden
    states and caches match the summed path's to bf16 rounding."""
    params = llama.init_params(_CFG, seed=5)
    (fused_program, fused), (summed_program, summed) = (
        forward_with(_CFG, params, m) for m in (DecodeKernelMatmul(interpret=True), _SummedMatmul(interpret=True)))
    calls = [re.findall(r"name=_residual_rmsnorm\b", p) for p in (fused_program, summed_program)]  # its jit, once a call
    assert len(calls[0]) == 2 * _CFG.num_layers and not calls[1]
    # Not bit for bit: inside the jitted forward XLA fuses the summed path's product into its residual add and
    # skips the product's bf16 rounding (excess precision, XLA's default), which the kernel keeps (what
    # decode_matmul returns); the one-step differences then carry through the layers.
    for a, b in zip(fused, summed, strict=True):
        np.testing.assert_allclose(a, b, rtol=2.0 ** -6, atol=2.0 ** -6)


def test_the_engine_with_the_fused_kernels_generates_what_xlas_projections_do(monkeypatch, fresh_engine_steps):
    """The engine's real step (packed prefill, then decode calls of 2 steps inside the step's loop) with
    --projections kernel in the interpreter: both fused kernels (q/k/v's RoPE and KV write, the residual add and
    norm) run in the step, and the greedy tokens equal --projections xla's."""
    import pallas_kernels.residual_rmsnorm as norm_module
    import pallas_kernels.rope_kv_write as write_module

    traced = {"write": 0, "norm": 0}
    for module, name, key in ((write_module, "_rope_kv_write", "write"), (norm_module, "_residual_rmsnorm", "norm")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _real=real, _key=key, **kw: traced.update(
            {_key: traced[_key] + 1}) or _real(*a, **kw))
    fused = greedy_tokens(_CFG, "kernel")
    assert traced["write"] >= _CFG.num_layers and traced["norm"] >= 2 * _CFG.num_layers    # traced in each step kind
    assert fused == greedy_tokens(_CFG, "xla")


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("splits, hidden", [(4, 2048), (2, 4096)])
def test_gpu_compiled_matches_the_models_ops_at_llama_shapes(splits, hidden):
    """The compiled kernel at llama-1b / 8b's decode shapes (64 rows, partials padded to 64) against the model's
    own ops run op by op (not jitted: a jitted sum-then-add may skip the product's bf16 rounding): the residual
    stream bit for bit, the norm within one bf16 step on < 1% of elements."""
    parts, residual, weight = _case(3, splits=splits, rows=64, hidden=hidden)
    x, h = jax.jit(lambda *a: residual_rmsnorm(*a, eps=EPS))(parts, residual, weight)
    want_x, want_h = _model_ops(parts, residual, weight)
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(want_x, np.float32))
    got, want = np.asarray(h, np.float32), np.asarray(want_h, np.float32)
    np.testing.assert_allclose(got, want, rtol=2.0 ** -7, atol=0)
    print(f"residual_rmsnorm S={splits} H={hidden}: {int(np.sum(got != want))} of {got.size} norm outputs differ")
    assert np.mean(got != want) < 0.01
