"""stratum_jax/model/fused.py: q/k/v and gate/up fused into one GEMM each, in shard blocks. The fused model
computes what HF's layout computes (with and without biases, one or several shard blocks), the rewrite is in
place, idempotent and frees what it replaced, and the engine runs on it."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model import llama
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fuse_layer, fuse_projections
from stratum_jax.model.loader import LoadedModel, load_model
from stratum_jax.request import SamplingParams


def _forward(params, cfg, tokens):
    t = len(tokens)
    cache = [(jnp.zeros((cfg.num_kv_heads, 64, cfg.head_dim), jnp.float32),) * 2 for _ in range(cfg.num_layers)]
    pos = jnp.arange(t, dtype=jnp.int32)

    def attend(layer, q, k_pool, v_pool):
        return llama.attend_dense_causal(q, k_pool, v_pool, pos)

    hidden, _ = llama.forward(params, cfg, jnp.asarray(tokens, jnp.int32), pos, cache, pos, attend)
    return hidden


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shards", [1, 2])
def test_the_fused_layout_computes_what_hfs_does(bias, shards):
    cfg = dataclasses.replace(PRESETS["tiny"], attention_bias=bias)
    params = llama.init_params(cfg, seed=3)
    if bias:   # init's biases are zero: give them values, so a misplaced one shows
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 * jnp.arange(x.size, dtype=x.dtype).reshape(x.shape) / x.size
            if p[-1].key == "bias" else x, params)
    fused = {k: fuse_layer(v, shards) if k.startswith("layers_") else v for k, v in params.items()}
    assert llama.fused_shards_of(fused) == shards and llama.fused_shards_of(params) == 0
    qkv = fused["layers_0"]["self_attn"]["qkv_proj"]
    assert qkv["weight"].shape == (shards, (128 + 2 * 64) // shards, 128)
    assert ("bias" in qkv) == bias
    assert fused["layers_1"]["mlp"]["gate_up_proj"]["weight"].shape == (shards, 2 * 384 // shards, 128)
    tokens = [5, 17, 99, 3, 250, 7, 1, 42]
    np.testing.assert_allclose(_forward(fused, cfg, tokens), _forward(params, cfg, tokens), rtol=1e-5, atol=1e-5)


def test_shard_blocks_hold_each_shards_own_rows():
    """Shard s's block of a fused weight is its slice of q, then of k, then of v: what a device holding
    q/k/v split P("tp", None) holds."""
    q, k, v = (np.arange(n * 2, dtype=np.float32).reshape(n, 2) + off for n, off in ((4, 0), (2, 100), (2, 200)))
    layer = {"self_attn": {"q_proj": {"weight": jnp.asarray(q)}, "k_proj": {"weight": jnp.asarray(k)},
                           "v_proj": {"weight": jnp.asarray(v)}},
             "mlp": {"gate_proj": {"weight": jnp.asarray(q)}, "up_proj": {"weight": jnp.asarray(q + 1)}}}
    w = np.asarray(fuse_layer(layer, 2)["self_attn"]["qkv_proj"]["weight"])
    np.testing.assert_array_equal(w[0], np.concatenate([q[:2], k[:1], v[:1]]))
    np.testing.assert_array_equal(w[1], np.concatenate([q[2:], k[1:], v[1:]]))


def test_fusing_a_model_is_in_place_idempotent_and_frees_the_old_arrays():
    model = load_model("tiny", seed=0)
    old = model.params["layers_0"]["mlp"]["gate_proj"]["weight"]
    fuse_projections(model)
    assert old.is_deleted()
    layer = model.params["layers_0"]
    assert set(layer["self_attn"]) == {"qkv_proj", "o_proj"} and set(layer["mlp"]) == {"gate_up_proj", "down_proj"}
    weight = layer["self_attn"]["qkv_proj"]["weight"]
    fuse_projections(model)                      # a second engine on the same model: nothing changes
    assert model.params["layers_0"]["self_attn"]["qkv_proj"]["weight"] is weight


def test_the_engine_runs_on_fused_weights_and_matches_hfs_layout():
    """Greedy tokens of an engine (fused) equal a dense forward over HF's layout of the same weights."""
    cfg = PRESETS["tiny"]
    params = llama.init_params(cfg, seed=0)
    reference = jax.tree_util.tree_map(jnp.array, params)          # a copy the engine's fusion cannot delete
    model = LoadedModel(cfg, params, load_model("tiny").tokenizer, "tiny")
    engine = Engine(RuntimeConfig(model="tiny", max_batch_size=2, max_context=256, kv_pool_tokens=4096), model=model)
    assert llama.fused_shards_of(engine.model.params) == 1
    prompt = [5, 17, 99, 3, 250, 7]
    got = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0].token_ids
    # Greedy decoding by dense forwards over the sequence padded to one length (one compile): causal attention
    # keeps the padding after position n out of position n's hidden state.
    tokens = list(prompt)
    for _ in range(6):
        hidden = _forward(reference, cfg, tokens + [0] * (12 - len(tokens)))
        tokens.append(int(jnp.argmax(llama.compute_logits(reference, cfg, hidden[len(tokens) - 1:len(tokens)]))))
    assert got == tokens[len(prompt):]
