"""The model package: config validation, presets, tokenizers, the incremental detokenizer, checkpoint
loading errors, and the forward pass over paged vs contiguous KV caches."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from stratum_jax.model.config import PRESETS, ModelConfig, freeze_rope_scaling
from stratum_jax.model.llama import (Decoder, attend_dense_causal, compute_logits, forward, init_kv_cache, init_params,
                                     param_shapes)
from stratum_jax.model.loader import CheckpointError, hf_tensor_name, load_model
from stratum_jax.model.safetensors_file import SafetensorsFile
from stratum_jax.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer

GOLDEN_QWEN2 = Path(__file__).parent / "hf_reference" / "golden" / "qwen2"
TINY = PRESETS["tiny"]

# ---------------------------------------------------------------------------------------------- config


def _cfg(**kw):
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
                head_dim=8)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("kw, match", [
    (dict(num_kv_heads=3), "num_heads .4. must be a multiple of num_kv_heads .3."),
    (dict(head_dim=7), "head_dim must be even"),
    (dict(dtype="float16"), "dtype must be one of"),
    (dict(num_layers=0), "num_layers must be a positive int"),
    (dict(eos_token_ids=(64,)), r"eos_token_ids: 64 is not a token id in \[0, vocab_size=64\)"),
    (dict(rope_scaling=(("factor", 2.0), ("rope_type", "yarn"))), "rope_type 'yarn' is not supported"),
    (dict(rope_scaling=(("factor", 2.0), ("rope_type", "llama3"))), "missing"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "tuple of .key, value. pairs"),
])
def test_config_validation_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def _hf_llama(**kw):
    d = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": [2, 3], "torch_dtype": "bfloat16",
         "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 256}}
    d.update(kw)
    return d


def test_from_hf_config_transformers4_and_5_layouts_agree():
    v4 = ModelConfig.from_hf_config(_hf_llama())
    rope = dict(_hf_llama()["rope_scaling"], rope_theta=500000.0)
    v5 = _hf_llama(rope_parameters=rope, dtype="bfloat16")
    for k in ("rope_scaling", "rope_theta", "torch_dtype"):
        del v5[k]
    assert ModelConfig.from_hf_config(v5) == v4
    assert v4.head_dim == 16 and v4.dtype == "bfloat16" and v4.eos_token_ids == (2, 3) and v4.rope_theta == 5e5
    assert v4.rope_scaling_dict() == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    assert ModelConfig.from_hf_config(_hf_llama(), dtype="float32").dtype == "float32"
    hash(v4)  # static argument of jit


def test_from_hf_config_qwen2_has_qkv_bias():
    d = _hf_llama(architectures=["Qwen2ForCausalLM"], rope_scaling=None, use_sliding_window=False,
                  sliding_window=4096, layer_types=["full_attention"] * 2)
    cfg = ModelConfig.from_hf_config(d)
    assert cfg.attention_bias and cfg.rope_scaling is None
    mistral = ModelConfig.from_hf_config(_hf_llama(architectures=["MistralForCausalLM"], sliding_window=None))
    assert not mistral.attention_bias


@pytest.mark.parametrize("kw, field", [
    (dict(architectures=["GPT2LMHeadModel"]), "'architectures'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'rope_scaling'"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), "'sliding_window'"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True), "'use_sliding_window'"),
    (dict(hidden_act="gelu"), "'hidden_act'"),
    (dict(attention_bias=True), "'attention_bias'"),
    (dict(vocab_size=None), "vocab_size"),
])
def test_from_hf_config_rejects_unsupported_naming_the_field(kw, field):
    d = _hf_llama(**kw)
    if d["vocab_size"] is None:
        del d["vocab_size"]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(d)


def test_presets_have_the_published_shapes():
    assert PRESETS["llama-8b"].num_params == 8_030_261_248  # Llama-3.1-8B
    assert PRESETS["llama-1b"].num_params == 1_235_814_400  # Llama-3.2-1B
    assert PRESETS["llama-1b"].rope_scaling_dict()["factor"] == 32.0
    assert PRESETS["llama-8b"].rope_scaling_dict()["factor"] == 8.0
    assert TINY.dtype == "float32" and TINY.vocab_size >= 259
    assert freeze_rope_scaling({"type": "linear", "factor": 2.0}) == (("factor", 2.0), ("rope_type", "linear"))


def test_init_params_is_deterministic_in_seed():
    a, b, c = init_params(TINY, 0), init_params(TINY, 0), init_params(TINY, 1)
    leaves_a, leaves_b, leaves_c = (jax.tree_util.tree_leaves(p) for p in (a, b, c))
    assert all(np.array_equal(x, y) for x, y in zip(leaves_a, leaves_b, strict=True))
    assert not np.array_equal(a["layers_0"]["self_attn"]["q_proj"]["weight"],
                              c["layers_0"]["self_attn"]["q_proj"]["weight"])
    bf16 = init_params(dataclasses.replace(TINY, dtype="bfloat16"))
    assert {x.dtype for x in jax.tree_util.tree_leaves(bf16)} == {jnp.dtype("bfloat16")}


def _flax_param_shapes(cfg):
    """The parameter tree flax's Decoder.init builds (the oracle for param_shapes)."""
    one, cache = jnp.zeros((1,), jnp.int32), init_kv_cache(cfg, 1)
    return jax.eval_shape(lambda k: Decoder(cfg).init(k, one, one, cache, one, lambda layer, q, k_, v: q,
                                                      method=Decoder.init_all)["params"], jax.random.key(0))


@pytest.mark.parametrize("cfg", [TINY, _cfg(num_layers=2, attention_bias=True, tie_word_embeddings=False,
                                            dtype="bfloat16")], ids=["tiny", "bias-untied-bf16"])
def test_param_shapes_match_the_flax_modules(cfg):
    """param_shapes is written out by hand; forward() applies the flax modules to it, so they must agree."""
    assert param_shapes(cfg) == _flax_param_shapes(cfg)
    got = jax.tree_util.tree_map(lambda x: (x.shape, x.dtype), init_params(cfg, 0))
    assert got == jax.tree_util.tree_map(lambda s: (s.shape, s.dtype), param_shapes(cfg))


def test_init_params_distribution():
    """Matrices ~N(0, 0.02), each leaf its own stream; norms are ones and biases zeros."""
    cfg = _cfg(vocab_size=4096, hidden_size=256, intermediate_size=512, num_layers=2, attention_bias=True,
               tie_word_embeddings=False, dtype="bfloat16")
    params = init_params(cfg, 7)
    flat = {"/".join(k.key for k in path): np.asarray(x, np.float32)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    matrices = {n: x for n, x in flat.items() if x.ndim == 2}
    assert len(matrices) == 2 + 7 * cfg.num_layers
    for name, x in matrices.items():
        assert abs(x.std() - 0.02) < 0.001 and abs(x.mean()) < 0.001, name
    big = matrices["embed_tokens/weight"].ravel() / 0.02  # 1M draws: the tails of a normal, not of a uniform
    assert 0.0022 < np.mean(np.abs(big) > 3) < 0.0032 and 4 < np.abs(big).max() < 6  # normal: 0.0027
    a, b = matrices["layers_0/mlp/gate_proj/weight"], matrices["layers_0/mlp/up_proj/weight"]
    assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01  # same shape, different streams
    rows = matrices["embed_tokens/weight"]
    assert abs(np.corrcoef(rows[:-1].ravel(), rows[1:].ravel())[0, 1]) < 0.01  # no structure along the counter
    for name, x in flat.items():
        if name.endswith("norm/weight"):
            assert np.array_equal(x, np.ones_like(x)), name
        if name.endswith("bias"):
            assert np.array_equal(x, np.zeros_like(x)), name

# ------------------------------------------------------------------------------------------ tokenizers


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer(TINY.vocab_size)
    text = "héllo, 日本 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256 and tok.eos_token_ids == (257,) and tok.vocab_size == 512
    assert tok.encode(text, add_bos=False) == ids[1:] and max(ids[1:]) < 256
    assert tok.decode(ids + [257, 258, 400]) == text  # specials and padding ids never decode


def test_byte_tokenizer_fallback_chat_format():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], system="be brief")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids) == "system: be brief\nuser: hi\nassistant:"
    with pytest.raises(ValueError, match="'role'"):
        tok.apply_chat_template([{"content": "hi"}])


def _write_bpe_tokenizer(d: Path, **tokenizer_config) -> None:
    """A byte-level BPE tokenizer trained on a few words, saved like an HF checkpoint's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<|im_end|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "the quick brown fox", "héllo wörld"] * 10, trainer)
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                         **tokenizer_config}))


def test_hf_tokenizer_round_trip_and_specials(tmp_path):
    _write_bpe_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tok = HFTokenizer(tmp_path)
    text = "hello wörld, 日本 🙂"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 0
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == (1, 2)  # generation_config.json wins over tokenizer_config.json
    assert tok.encode(text, add_bos=False) == ids[1:]

    _write_bpe_tokenizer(tmp_path, add_bos_token=False)
    assert HFTokenizer(tmp_path).encode("hello")[0] != 0


def test_hf_tokenizer_chat_template(tmp_path):
    template = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    _write_bpe_tokenizer(tmp_path, chat_template=template)
    tok = HFTokenizer(tmp_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], system="be brief")
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template writes BOS
    assert 2 in ids  # <|im_end|> is parsed as its special id, not spelled out
    assert tok._tok.decode(ids, skip_special_tokens=False) == \
        "<s><|system|>be brief<|im_end|><|user|>hello<|im_end|><|assistant|>"
    # transformers 5 keeps the template in its own file, which wins
    (tmp_path / "chat_template.jinja").write_text("{{ messages[-1].content }}")
    assert HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hello"}]) == tok.encode(
        "hello", add_bos=False)


def _stream(detok, ids):
    return [detok.push(i) for i in ids]


def test_incremental_detokenizer_holds_back_partial_utf8():
    tok = ByteTokenizer()
    text = "aé日🙂b"
    detok = IncrementalDetokenizer(tok)
    deltas = _stream(detok, tok.encode(text, add_bos=False))
    assert "".join(deltas) == detok.text == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas == ["a", "", "é", "", "", "日", "", "", "", "🙂", "b"]
    assert detok.flush() == ""

    cut = IncrementalDetokenizer(tok)
    assert _stream(cut, "🙂".encode()[:2]) == ["", ""]
    assert cut.flush() == "\ufffd" and cut.text == "\ufffd"


def test_incremental_detokenizer_bpe_matches_full_decode(tmp_path):
    _write_bpe_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    prompt = tok.encode("hello")
    text = " wörld 日本 🙂 the quick fox"
    ids = tok.encode(text, add_bos=False) + [tok.eos_token_ids[0]]
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    deltas = _stream(detok, ids)
    assert "".join(deltas) + detok.flush() == text == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_detokenizer_uses_prompt_context_for_leading_space(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    sp = Tokenizer(models.WordLevel({"▁Hello": 0, "▁world": 1, "<unk>": 2}, unk_token="<unk>"))
    sp.pre_tokenizer, sp.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    sp.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.decode([1]) == "world"  # SentencePiece drops the leading space of the first token...
    detok = IncrementalDetokenizer(tok, prompt_ids=[0])
    assert detok.push(1) == " world"  # ...but after the prompt the space belongs to the stream

# -------------------------------------------------------------------------------------------- loader


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the tiny golden Qwen2 checkpoint (float32, single file) to break in various ways."""
    d = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_QWEN2, d)
    return d


def test_load_preset_and_dtype_override():
    m = load_model("tiny", dtype="bfloat16")
    assert m.name == "tiny" and m.config == dataclasses.replace(TINY, dtype="bfloat16")
    assert isinstance(m.tokenizer, ByteTokenizer) and m.tokenizer.vocab_size == TINY.vocab_size
    assert m.params["embed_tokens"]["weight"].dtype == jnp.bfloat16


def test_load_checkpoint_as_bfloat16(ckpt):
    """Released checkpoints are bfloat16, which numpy cannot hold; the loader reads them anyway."""
    from safetensors.flax import save_file as save_jax

    tensors = {k: jnp.asarray(v, jnp.bfloat16) for k, v in load_file(ckpt / "model.safetensors").items()}
    save_jax(tensors, str(ckpt / "model.safetensors"))
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, dtype="bfloat16")))
    m = load_model(str(ckpt))
    assert m.config.dtype == "bfloat16" and m.name == "ckpt"
    w = m.params["layers_1"]["mlp"]["up_proj"]["weight"]
    assert w.dtype == jnp.bfloat16 and np.array_equal(w, tensors["model.layers.1.mlp.up_proj.weight"])
    assert isinstance(m.tokenizer, ByteTokenizer)  # no tokenizer.json in the directory


def test_load_checkpoint_straight_to_device(ckpt):
    """Every tensor lands on the default device with the file's values, cast once; the params are copies,
    not views of the file (rewriting it in place afterwards changes nothing)."""
    tensors = load_file(ckpt / "model.safetensors")  # float32
    # Page-align the data: jax's CPU client would alias (not copy) a 64-byte-aligned read-only buffer.
    raw = (ckpt / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    padded = raw[8:8 + n] + b" " * (-(8 + n) % 4096)  # the format allows trailing spaces in the header
    (ckpt / "model.safetensors").write_bytes(len(padded).to_bytes(8, "little") + padded + raw[8 + n:])
    loaded = {}
    for dtype in ("float32", "bfloat16"):  # as stored (no cast: where a view could slip through), and cast
        params = load_model(str(ckpt), dtype=dtype).params
        flat = loaded[dtype] = {hf_tensor_name(tuple(k.key for k in path)): x
                                for path, x in jax.tree_util.tree_flatten_with_path(params)[0]}
        assert set(flat) == set(tensors)  # qwen2: tied embeddings, no lm_head.weight in the file either
        for name, x in flat.items():
            assert isinstance(x, jax.Array) and x.devices() == {jax.devices()[0]} and x.dtype == dtype, name
            assert np.array_equal(x, tensors[name].astype(dtype)), name
    st = SafetensorsFile(ckpt / "model.safetensors")
    view = st.array("model.norm.weight")
    assert not view.flags.owndata and not view.flags.writeable  # a view of the mapped file, not a copy
    np.testing.assert_array_equal(view, tensors["model.norm.weight"])
    size = (ckpt / "model.safetensors").stat().st_size
    header = 8 + int.from_bytes((ckpt / "model.safetensors").read_bytes()[:8], "little")
    with open(ckpt / "model.safetensors", "r+b") as f:
        f.seek(header)
        f.write(b"\x00" * (size - header))
    assert not view.any()  # the view follows the file...
    for dtype, flat in loaded.items():  # ...the loaded parameters do not
        for name, x in flat.items():
            assert np.array_equal(x, tensors[name].astype(dtype)), (dtype, name)


def test_load_checkpoint_offsets_out_of_range(ckpt):
    raw = (ckpt / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    begin, end = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [begin, len(raw)]
    text = json.dumps(header).encode()
    (ckpt / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"model.safetensors: not a readable safetensors file .*"
                                              r"'model.norm.weight'.* out of range"):
        load_model(str(ckpt))


@pytest.mark.parametrize("target", ["does-not-exist", "llama-405b"])
def test_load_unknown_name_lists_presets(target):
    with pytest.raises(CheckpointError, match=f"{target}: does not exist.*tiny, llama-1b, llama-8b, llama-70b"):
        load_model(target)


def test_load_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: file not found"):
        load_model(str(ckpt))


def test_load_malformed_config_names_file_and_line(ckpt):
    (ckpt / "config.json").write_text('{\n  "vocab_size": 272,\n  "hidden_size": ,\n}')
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: malformed JSON at line 3"):
        load_model(str(ckpt))


def test_load_unsupported_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, architectures=["FalconForCausalLM"])))
    with pytest.raises(CheckpointError, match=r"config.json: config.json field 'architectures'.*Falcon"):
        load_model(str(ckpt))


def test_load_missing_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.bias"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"'model.layers.1.self_attn.q_proj.bias' not found in model.safetensors"):
        load_model(str(ckpt))


def test_load_wrong_shape(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    tensors["model.norm.weight"] = np.ones(hidden - 1, np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor 'model.norm.weight' has shape "
                                              rf"\[{hidden - 1}\], expected \[{hidden}\]"):
        load_model(str(ckpt))


def test_load_unexpected_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros_like(tensors["model.norm.weight"])
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: unexpected tensor 'model.layers.0.self_attn.o_proj"):
        load_model(str(ckpt))


def test_load_sharded_missing_shard_and_corrupt_file(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, ckpt / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in names[5:]}, ckpt / "model-00002-of-00002.safetensors")
    weight_map = {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert load_model(str(ckpt)).config.num_layers == 2

    moved = dict(weight_map, **{names[0]: "model-00002-of-00002.safetensors"})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(CheckpointError, match=rf"00002.safetensors: has no tensor '{names[0]}', though model"):
        load_model(str(ckpt))

    (ckpt / "model-00002-of-00002.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002.safetensors: not a readable safetensors file"):
        load_model(str(ckpt))
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: lists shard model-00002-of-00002"):
        load_model(str(ckpt))


def test_load_bad_tokenizer_json(ckpt):
    (ckpt / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer.json: cannot be loaded"):
        load_model(str(ckpt))

# ------------------------------------------------------------------------------------------- forward


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(4,))
def _run(params, cfg, ids, positions, cache, write_slots, kv_slots):
    """Forward + logits for one sequence whose position s lives in pool slot kv_slots[s]."""
    def attend(layer, q, k_pool, v_pool):
        return attend_dense_causal(q, k_pool, v_pool, positions, kv_slots)

    hidden, cache = forward(params, cfg, ids, positions, cache, write_slots, attend)
    return compute_logits(params, cfg, hidden), cache


def _decode_sequence(params, cfg, ids, chunks, slot_of_pos, num_slots):
    """Feeds ids in chunks (prefill, then decode steps), tokens at position p written to slot_of_pos[p]."""
    cache, logits, start = init_kv_cache(cfg, num_slots), [], 0
    slot_of_pos = jnp.asarray(slot_of_pos, jnp.int32)
    for n in chunks:
        pos = jnp.arange(start, start + n, dtype=jnp.int32)
        out, cache = _run(params, cfg, jnp.asarray(ids[start:start + n], jnp.int32), pos, cache, slot_of_pos[pos],
                          slot_of_pos)
        logits.append(out)
        start += n
    return jnp.concatenate(logits), cache


# Shared shapes, so the tests below reuse each other's compilations.
N, NUM_SLOTS = 12, 40


@pytest.fixture(scope="module")
def tiny_params():
    return init_params(TINY, seed=3)


def test_paged_cache_matches_contiguous(tiny_params):
    """Scattered slots filled over several chunks == one contiguous prefill."""
    ids = list(np.random.default_rng(0).integers(0, TINY.vocab_size, N))
    contiguous, c_cache = _decode_sequence(tiny_params, TINY, ids, [N], np.arange(N), NUM_SLOTS)
    slots = np.random.default_rng(1).permutation(NUM_SLOTS)[:N]
    paged, p_cache = _decode_sequence(tiny_params, TINY, ids, [4, 4, 4], slots, NUM_SLOTS)
    np.testing.assert_allclose(paged, contiguous, atol=2e-5, rtol=0)
    for (ck, cv), (pk, pv) in zip(c_cache, p_cache, strict=True):
        np.testing.assert_allclose(pk[:, slots], ck[:, :N], atol=1e-6)
        np.testing.assert_allclose(pv[:, slots], cv[:, :N], atol=1e-6)
        assert not np.any(np.delete(np.asarray(pk), slots, axis=1))  # nothing written elsewhere


def test_padding_slots_are_dropped(tiny_params):
    pad = 4
    rng = np.random.default_rng(2)
    ids = rng.integers(0, TINY.vocab_size, N + pad).astype(np.int32)
    positions = np.concatenate([np.arange(N), rng.integers(0, 5, pad)]).astype(np.int32)
    # Padding points at or past the end of the pool, where nothing may be written.
    write = np.concatenate([np.arange(N), NUM_SLOTS + np.arange(pad) * 3]).astype(np.int32)
    kv_slots = jnp.arange(N, dtype=jnp.int32)
    padded, p_cache = _run(tiny_params, TINY, ids, positions, init_kv_cache(TINY, NUM_SLOTS), write, kv_slots)
    plain, c_cache = _run(tiny_params, TINY, ids[:N], positions[:N], init_kv_cache(TINY, NUM_SLOTS), write[:N],
                          kv_slots)
    np.testing.assert_allclose(padded[:N], plain, atol=1e-5, rtol=0)
    for a, b in zip(jax.tree_util.tree_leaves(p_cache), jax.tree_util.tree_leaves(c_cache), strict=True):
        np.testing.assert_array_equal(a, b)
        assert not np.any(np.asarray(a)[:, N:])


def test_bfloat16_forward_tracks_float32(tiny_params):
    cfg16 = dataclasses.replace(TINY, dtype="bfloat16")
    params16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), tiny_params)
    ids = list(range(40, 40 + N))
    ref, _ = _decode_sequence(tiny_params, TINY, ids, [N], np.arange(N), NUM_SLOTS)
    got, cache = _decode_sequence(params16, cfg16, ids, [N], np.arange(N), NUM_SLOTS)
    assert got.dtype == jnp.float32 and cache[0][0].dtype == jnp.bfloat16
    np.testing.assert_allclose(got, ref, atol=0.05, rtol=0)


def _set_eos(ckpt, config_eos, generation_eos):
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=config_eos)))
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen.pop("eos_token_id", None)
    if generation_eos is not None:
        gen["eos_token_id"] = generation_eos
    (ckpt / "generation_config.json").write_text(json.dumps(gen))


def test_checkpoint_eos_ends_generation_without_a_tokenizer_json(ckpt):
    """No tokenizer.json: the checkpoint's EOS ids (config.json, replaced by generation_config.json's when
    it names them, lists included) end greedy generation; the byte tokenizer's 257 is just a token then."""
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.request import FinishReason, SamplingParams

    config = RuntimeConfig(model=str(ckpt), max_context=128, kv_pool_tokens=1024, max_batch_size=4,
                           prefill_chunk=32)
    prompt = [5, 6, 7, 8]
    free = Engine(config).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    # Stop on a token greedy decoding reaches a few steps in (not the first), so stopping there is observable.
    stop = next(t for t in free.token_ids[2:] if t != ByteTokenizer.EOS)
    where = free.token_ids.index(stop)
    never = next(t for t in range(1, 272) if t not in free.token_ids)   # an EOS id greedy never produces

    for config_eos, generation_eos in [(stop, None), (never, [never, stop]), ([never], stop)]:
        _set_eos(ckpt, config_eos, generation_eos)
        model = load_model(str(ckpt))
        assert isinstance(model.tokenizer, ByteTokenizer)
        assert stop in model.tokenizer.eos_token_ids and ByteTokenizer.EOS not in model.tokenizer.eos_token_ids
        out = Engine(config, model=model).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0]
        assert out.finish_reason == FinishReason.EOS, (config_eos, generation_eos, out)
        assert out.token_ids == free.token_ids[:where + 1]

    # generation_config.json's list replaces config.json's id, as in transformers' generate().
    _set_eos(ckpt, stop, [never])
    model = load_model(str(ckpt))
    assert model.config.eos_token_ids == model.tokenizer.eos_token_ids == (never,)


def test_bad_generation_config_eos_names_the_file(ckpt):
    _set_eos(ckpt, None, ["two"])
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_model(str(ckpt))
    _set_eos(ckpt, None, 100_000)
    with pytest.raises(CheckpointError, match="generation_config.json.*eos_token_ids"):
        load_model(str(ckpt))


def test_to_hf_llama_config_reads_back_as_the_same_config():
    """`to_hf_llama_config` is `from_hf_config`'s inverse for every Llama-shaped preset (RoPE scaling included);
    a Qwen2-shaped config (q/k/v biases) is refused."""
    scaled = dataclasses.replace(PRESETS["llama-1b"], rope_scaling=freeze_rope_scaling(
        {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
         "original_max_position_embeddings": 8192}))
    for cfg in [c for c in PRESETS.values() if not c.attention_bias] + [scaled]:
        d = {**cfg.to_hf_llama_config(), "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
        assert ModelConfig.from_hf_config(d, dtype=cfg.dtype) == cfg
    with pytest.raises(ValueError, match="q/k/v biases"):
        dataclasses.replace(PRESETS["tiny"], attention_bias=True).to_hf_llama_config()
