"""--fold-norms: the norm weights folded into q/k/v's and gate/up's weights at load (model/fused.py `fold_norms`), and
the decode layer on the fold kernels (llama.DecoderLayer's folded path, pallas_kernels/norm_fold.py), in the model and
in the engine. The kernels themselves are tested in test_norm_fold.py."""
from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fusion_cases import forward_with
from stratum_jax.config import RuntimeConfig
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fold_norms, fuse_projections
from stratum_jax.model.loader import LoadedModel
from stratum_jax.model.projection import DecodeKernelMatmul, fold_norms_note, residual_kernel_config
from stratum_jax.model.tokenizer import ByteTokenizer

# hidden 256, 4 q heads of 64, intermediate 1024 (down's K splits in a cluster of 4 on the GPU; one block
# interpreted: projection.DecodeKernelMatmul.residual_matmul).
_CFG = dataclasses.replace(PRESETS["tiny"], hidden_size=256, intermediate_size=1024, head_dim=64, dtype="bfloat16")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _model(cfg=_CFG, seed: int = 5) -> LoadedModel:
    """A random bf16 model whose norm weights are not ones (else folding them changes nothing), fused."""
    params = llama.init_params(cfg, seed=seed)
    rng = np.random.default_rng(seed)
    for key in [k for k in params if k.startswith("layers_")]:
        for norm in _NORMS:
            params[key][norm]["weight"] = jnp.asarray(1 + 0.3 * rng.standard_normal(cfg.hidden_size), cfg.dtype)
    model = LoadedModel(cfg, params, ByteTokenizer(cfg.vocab_size), "tiny-fold")
    fuse_projections(model)
    return model


def _copy(model: LoadedModel) -> LoadedModel:
    return dataclasses.replace(model, params=jax.tree.map(jnp.copy, model.params))


def _kernel_names(program: str) -> set[str]:
    return set(re.findall(r"name=(decode_\w+|residual_rmsnorm|rope_kv_write)\b", program))


def test_fold_scales_the_projections_columns_and_leaves_unit_norms_once():
    model = _model()
    before = jax.tree.map(lambda a: np.asarray(a, np.float32), model.params)
    fold_norms(model)
    assert model.norms_folded
    for key in [k for k in model.params if k.startswith("layers_")]:
        layer, old = model.params[key], before[key]
        for norm, (module, proj) in zip(_NORMS, (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj"))):
            np.testing.assert_array_equal(np.asarray(layer[norm]["weight"], np.float32), 1.0)
            want = (old[module][proj]["weight"] * old[norm]["weight"][None, None, :]).astype(jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(layer[module][proj]["weight"]), want)
    # The final norm is not folded (the LM head may be the tied embedding).
    np.testing.assert_array_equal(np.asarray(model.params["norm"]["weight"], np.float32), before["norm"]["weight"])
    once = jax.tree.map(np.asarray, model.params)
    fold_norms(model)                                            # a second engine on the same model: no second fold
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, model.params), once)


def test_fold_refuses_a_layout_it_cannot_fold():
    params = llama.init_params(_CFG, seed=0)                   # HF's layout: no fused q/k/v to fold into
    with pytest.raises(ValueError, match="fuse_projections"):
        fold_norms(LoadedModel(_CFG, params, ByteTokenizer(_CFG.vocab_size), "tiny"))


def test_the_folded_weights_compute_the_same_function_on_xlas_path():
    """The prefill's path (XLA's dot, unit norms) on the folded weights equals the unfolded model to bf16 rounding of
    the folded weights."""
    model = _model()
    folded = _copy(model)
    fold_norms(folded)
    _, want = forward_with(_CFG, model.params, None)
    _, got = forward_with(_CFG, folded.params, None)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=0.03, atol=0.03)


def test_the_folded_layer_runs_the_fold_kernels_and_matches_the_unfused_kernels():
    """A decode forward over 8 rows on the kernels (interpreter): with the norms folded each layer runs the q/k/v GEMM
    with its sums of squares, the KV write with the row norm, o's and down's GEMMs with the residual add, the normed
    gate/up GEMM, and no residual_rmsnorm; the hidden states and caches match the unfused kernels' within bf16
    roundings in other places (norm_fold's docstring)."""
    model = _model()
    folded = _copy(model)
    fold_norms(folded)
    unfused_program, want = forward_with(_CFG, model.params, DecodeKernelMatmul(interpret=True))
    fold_program, got = forward_with(_CFG, folded.params, DecodeKernelMatmul(interpret=True, norms_folded=True))
    assert "residual_rmsnorm" in _kernel_names(unfused_program)
    names = _kernel_names(fold_program)
    assert "residual_rmsnorm" not in names
    assert {"decode_matmul_normed_512x256", "decode_gated_matmul_normed_1024x256", "decode_matmul_residual_256x256",
            "decode_matmul_residual_256x1024", "rope_kv_write"} <= names, names
    for a, b in zip(want, got, strict=True):
        scale = np.abs(a).max()
        assert np.abs(a - b).max() < 0.03 * scale and np.abs(a - b).mean() < 0.003 * scale


def test_a_step_the_kernels_do_not_take_falls_back_to_the_same_function():
    """With the norms folded but no Matmul fusing anything (XLA's products through the folded path's fallbacks: what a
    prefill chunk of more rows than the kernels take runs), the layer computes the unfused model's function."""

    class _NoKernels(DecodeKernelMatmul):
        def rope_kv_write(self, *a, **kw):
            return None

        def gated_normed(self, *a, **kw):
            return None

        def residual_matmul(self, *a, **kw):
            return None

    model = _model()
    folded = _copy(model)
    fold_norms(folded)
    _, want = forward_with(_CFG, model.params, None)
    program, got = forward_with(_CFG, folded.params, _NoKernels(interpret=True, norms_folded=True))
    assert not {n for n in _kernel_names(program) if "normed" in n or "residual" in n}
    for a, b in zip(want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=0.03, atol=0.03)


def test_the_engine_folds_at_start_and_generates_what_the_unfolded_engine_does(caplog):
    """The engine's real steps (packed prefill on XLA's path, decode calls on the fold kernels, interpreter) with
    --fold-norms: the weights folded once at start, the step marked folded, the log says so, and the greedy tokens
    equal the unfolded engine's."""
    from stratum_jax.engine import Engine
    from stratum_jax.request import SamplingParams

    def tokens(**config):
        model = _model(seed=7)
        engine = Engine(RuntimeConfig(model="tiny", max_context=256, kv_pool_tokens=4096, max_batch_size=2,
                                      prefill_chunk=64, page_size=8, decode_steps=2, projections="kernel",
                                      interpret_kernels=True, **config), model=model)
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        return engine, [r.token_ids for r in engine.generate([[5, 6, 7], list(range(20, 45))], sp)]

    with caplog.at_level(logging.INFO, logger="stratum_jax"):
        engine, folded = tokens(fold_norms=True)
    assert engine.model.norms_folded and engine.runner.geo.norms_folded
    assert any("a decode layer runs 6 kernels" in r.getMessage() for r in caplog.records)
    plain_engine, plain = tokens()
    assert not plain_engine.model.norms_folded and not plain_engine.runner.geo.norms_folded
    assert folded == plain


def test_fold_norms_without_the_kernel_projections_is_a_logged_no_op(caplog):
    from stratum_jax.engine import Engine

    model = _model()
    with caplog.at_level(logging.INFO, logger="stratum_jax"):
        engine = Engine(RuntimeConfig(model="tiny", max_context=256, kv_pool_tokens=1024, max_batch_size=2,
                                      projections="xla", fold_norms=True), model=model)
    assert not engine.model.norms_folded and not engine.runner.geo.norms_folded
    assert any("--fold-norms has no effect" in r.getMessage() for r in caplog.records)


def test_fold_norms_notes():
    assert fold_norms_note(False, False, "kernel") is None
    assert "no effect" in fold_norms_note(True, False, "xla")
    assert "6 kernels" in fold_norms_note(True, True, "kernel")
    assert "another engine" in fold_norms_note(False, True, "xla")


def test_the_flag_parses_and_is_validated():
    import argparse

    parser = argparse.ArgumentParser()
    RuntimeConfig.add_cli_args(parser)
    assert RuntimeConfig.from_cli_args(parser.parse_args(["--fold-norms"])).fold_norms is True
    assert RuntimeConfig.from_cli_args(parser.parse_args([])).fold_norms is False
    with pytest.raises(ValueError, match="--fold-norms"):
        RuntimeConfig(fold_norms="yes")


@pytest.mark.parametrize("model, rows, want", [("llama-1b", 64, (32, 2)), ("llama-8b", 64, (64, 2)),
                                               ("llama-8b", 8, (64, 2))])
def test_the_residual_kernels_cluster_config_at_llama_shapes(model, rows, want):
    """down's K split as clusters of 2 on narrowed tiles at llama shapes (128 CTAs at 1b and 8b), and the plain
    tile in one block when interpreted."""
    cfg = PRESETS[model]
    config = residual_kernel_config(rows, cfg.hidden_size, cfg.intermediate_size, jnp.bfloat16)
    assert config is not None and (config.tile_n, config.k_splits) == want
    assert cfg.hidden_size // config.tile_n * config.k_splits == 128
    one_block = residual_kernel_config(rows, cfg.hidden_size, cfg.intermediate_size, jnp.bfloat16, one_block=True)
    assert one_block.k_splits == 1 and one_block.tile_n >= config.tile_n


@pytest.mark.parametrize("model", ["llama-1b", "llama-8b"])
def test_the_folded_layers_lower_to_mosaic_gpu_at_llama_shapes(model):
    """Two llama-shaped layers' decode forward (64 rows, the kernels compiled, not interpreted, so with multi-block
    clusters) lowered for CUDA on this CPU from abstract weights: the 5 fold kernels (attention here is XLA's
    reference), no residual_rmsnorm."""
    cfg = dataclasses.replace(PRESETS[model], num_layers=2)
    from stratum_jax.model.fused import fuse_layer

    params = jax.eval_shape(lambda p: {k: fuse_layer(v, 1) if k.startswith("layers_") else v for k, v in p.items()},
                            llama.param_shapes(cfg))
    rows, slots = 64, 256
    sd = jax.ShapeDtypeStruct
    pools = [(sd((cfg.num_kv_heads, slots, cfg.head_dim), jnp.bfloat16),) * 2 for _ in range(cfg.num_layers)]

    def attend(layer, q, k, v):
        return llama.attend_dense_causal(q, k, v, jnp.zeros(rows, jnp.int32))

    def forward(p, c, ids):
        return llama.forward(p, cfg, ids, jnp.arange(rows, dtype=jnp.int32), c, jnp.arange(rows, dtype=jnp.int32),
                             attend, DecodeKernelMatmul(norms_folded=True))

    text = jax.jit(forward).trace(params, pools, sd((rows,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    # Each kernel is lowered once and called by every layer (XLA outlines repeated custom calls).
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 5
    for name in (f"decode_matmul_normed_{qkv}x{h}", "rope_kv_write", f"decode_matmul_residual_{h}x{h}",
                 f"decode_gated_matmul_normed_{i}x{h}", f"decode_matmul_residual_{h}x{i}"):
        assert name in text, name
    assert "residual_rmsnorm" not in text
