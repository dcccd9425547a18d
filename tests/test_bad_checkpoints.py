"""Bad checkpoints get a clear error naming the file and what to fix, and nothing is lost: HF model
directories (config.json, safetensors, the index, the tokenizer files) and DMLP checkpoints (meta.json and
orbax params). Complements tests/test_model.py's loader tests and tests/test_dmlp_trainer.py's."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dmlp_checkpoint import write_checkpoint
from stratum_jax.dmlp.checkpoint import CheckpointError as DmlpCheckpointError
from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, load_checkpoint, save_checkpoint
from stratum_jax.model.loader import CheckpointError, load_model

GOLDEN_QWEN2 = Path(__file__).parent / "hf_reference" / "golden" / "qwen2"


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the tiny golden Qwen2 checkpoint (float32, single file, vocab 272) to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(GOLDEN_QWEN2, d)
    return d


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**d, **changes}))


def _write_tokenizer(d: Path, **tokenizer_config) -> None:
    """A word-level tokenizer.json of 5 tokens, and a tokenizer_config.json when given fields."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    if tokenizer_config:
        (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


def _shard(ckpt: Path, **weight_map_changes) -> list[str]:
    """Splits model.safetensors into a.safetensors and b.safetensors with an index; returns the names."""
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({k: tensors[k] for k in names[:5]}, ckpt / "a.safetensors")
    save_file({k: tensors[k] for k in names[5:]}, ckpt / "b.safetensors")
    weight_map = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map,
                                                                                  **weight_map_changes}}))
    return names

# ---------------------------------------------------------------------------------------------- config.json


@pytest.mark.parametrize("field, value, match", [
    ("num_hidden_layers", 2.7, "field 'num_hidden_layers' must be a positive integer, got 2.7"),   # was truncated
    ("num_hidden_layers", None, "field 'num_hidden_layers' must be a positive integer, got null"),  # TypeError
    ("num_attention_heads", 0, "field 'num_attention_heads' must be a positive integer, got 0"),  # ZeroDivisionError
    ("num_key_value_heads", 0, "field 'num_key_value_heads' must be a positive integer or null"),  # fell back
    ("num_attention_heads", 5, "hidden_size 48 is not a multiple of num_attention_heads 5"),
    ("tie_word_embeddings", "false", "field 'tie_word_embeddings' must be true or false"),  # bool("false") is True
    ("architectures", {"Qwen2ForCausalLM": 1}, "field 'architectures' must be a list of class names"),  # KeyError
    ("rope_parameters", [1], "field 'rope_parameters' must be an object or null"),  # TypeError
    ("rope_parameters", {"rope_theta": float("inf")}, "'rope_parameters.rope_theta' must be a positive finite"),
    ("rms_norm_eps", "1e-6", "field 'rms_norm_eps' must be a positive finite number"),
    ("eos_token_id", 1.5, "field 'eos_token_id' must be a token id, a list of token ids, or null"),  # was int()ed
    ("layer_types", 5, "field 'layer_types' must be a list"),  # TypeError
])
def test_config_field_of_the_wrong_type_is_named(ckpt, field, value, match):
    _edit_json(ckpt / "config.json", **{field: value})
    with pytest.raises(CheckpointError, match=rf"ckpt/config.json: .*{match}"):
        load_model(str(ckpt))


def test_config_not_utf8_says_so(ckpt):
    (ckpt / "config.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(CheckpointError, match=r"ckpt/config.json: not UTF-8 text"):
        load_model(str(ckpt))


def test_generation_config_that_is_not_an_object(ckpt):
    (ckpt / "generation_config.json").write_text("[2]")  # was silently ignored
    with pytest.raises(CheckpointError, match=r"generation_config.json: must hold a JSON object, got list"):
        load_model(str(ckpt))

# ------------------------------------------------------------------------------------ safetensors and index


def _rewrite_header(file: Path, edit) -> None:
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n:])


def test_safetensors_tensors_sharing_bytes_are_refused(ckpt):
    a, b = "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"

    def alias(header):
        header[b]["data_offsets"] = header[a]["data_offsets"]  # b silently read a's values
    _rewrite_header(ckpt / "model.safetensors", alias)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: not a readable safetensors file .*'{b}'.* "
                                              r"overlaps the tensor before it"):
        load_model(str(ckpt))


def test_safetensors_trailing_bytes_are_refused(ckpt):
    with open(ckpt / "model.safetensors", "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"model.safetensors: .*tensors end at data offset \d+ but the data is"):
        load_model(str(ckpt))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_weights_with_nan_or_inf_are_refused_naming_the_tensors(ckpt, dtype):
    """They loaded silently and every step then produced NaN logits; now the load says which tensors."""
    tensors = load_file(ckpt / "model.safetensors")
    a, b = "model.layers.0.mlp.down_proj.weight", "model.norm.weight"
    tensors[a] = tensors[a].copy()
    tensors[a].flat[[3, 7]] = np.nan
    tensors[b] = tensors[b].copy()
    tensors[b].flat[0] = np.inf
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"2 tensors hold NaN or Inf: .*{a} \(2 values\).*{b} \(1 values\)"
                                              "|" rf"2 tensors hold NaN or Inf: .*{b} \(1 values\).*{a} \(2 values\)"):
        load_model(str(ckpt), dtype=dtype)


def test_index_that_is_not_an_object(ckpt):
    (ckpt / "model.safetensors.index.json").write_text("[]")  # was an AttributeError
    with pytest.raises(CheckpointError, match=r"model.safetensors.index.json: no 'weight_map' object"):
        load_model(str(ckpt))


@pytest.mark.parametrize("shard", [3, "../other/model.safetensors", "/etc/hostname"])
def test_index_shard_names_must_be_files_of_the_directory(ckpt, tmp_path, shard):
    """An int was a TypeError; a path outside the directory read another checkpoint's weights."""
    other = tmp_path / "other"
    shutil.copytree(GOLDEN_QWEN2, other)
    names = _shard(ckpt)
    _edit_json(ckpt / "model.safetensors.index.json",
               weight_map={**json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"],
                           names[0]: shard})
    with pytest.raises(CheckpointError, match=rf"index.json: weight_map gives tensor '{names[0]}' the shard "
                                              r".*; each must be the name of a .safetensors file in"):
        load_model(str(ckpt))


def test_shard_tensor_the_index_does_not_list_is_refused(ckpt):
    _shard(ckpt)
    tensors = load_file(ckpt / "b.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(48, np.float32)  # would be silently ignored
    save_file(tensors, ckpt / "b.safetensors")
    with pytest.raises(CheckpointError, match=r"b.safetensors: has tensor 'model.layers.0.self_attn.o_proj.bias', "
                                              r"but model.safetensors.index.json does not list it"):
        load_model(str(ckpt))


def test_shard_tensor_the_index_places_elsewhere_is_refused(ckpt):
    names = _shard(ckpt)
    tensors = load_file(ckpt / "b.safetensors")
    tensors[names[0]] = np.ones_like(load_file(ckpt / "a.safetensors")[names[0]])  # a second, different copy
    save_file(tensors, ckpt / "b.safetensors")
    with pytest.raises(CheckpointError, match=rf"b.safetensors: has tensor '{names[0]}', but .*index.json lists it "
                                              r"in a.safetensors"):
        load_model(str(ckpt))

# ---------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_json_that_is_a_directory(ckpt):
    (ckpt / "tokenizer.json").mkdir()  # was: the byte tokenizer, silently
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer.json: cannot be loaded"):
        load_model(str(ckpt))


def test_tokenizer_config_that_is_not_an_object_is_named(ckpt):
    _write_tokenizer(ckpt)
    (ckpt / "tokenizer_config.json").write_text("[]")  # the error named tokenizer.json
    with pytest.raises(CheckpointError, match=r"ckpt/tokenizer_config.json: must hold a JSON object, got list"):
        load_model(str(ckpt))


@pytest.mark.parametrize("field", ["bos_token", "eos_token"])
def test_special_token_missing_from_the_vocabulary(ckpt, field):
    """Was dropped silently: no BOS on any prompt, or no EOS to stop at."""
    _edit_json(ckpt / "generation_config.json", eos_token_id=None)
    _write_tokenizer(ckpt, **{field: "<|missing|>"})
    with pytest.raises(CheckpointError, match=rf"tokenizer_config.json: {field} '<\|missing\|>' is not in the "
                                              r"vocabulary of .*tokenizer.json"):
        load_model(str(ckpt))


@pytest.mark.parametrize("template, match", [
    ("{% for %}", "chat template is not valid jinja"),  # failed on every chat request instead
    (5, "chat_template must be a string"),
    ([1], "chat_template list entries must be"),  # the error named tokenizer.json
])
def test_bad_chat_template_fails_at_load(ckpt, template, match):
    _write_tokenizer(ckpt, bos_token="<s>", chat_template=template)
    with pytest.raises(CheckpointError, match=rf"ckpt/tokenizer_config.json: {match}"):
        load_model(str(ckpt))


def test_chat_template_jinja_not_utf8_is_named(ckpt):
    _write_tokenizer(ckpt, bos_token="<s>")
    (ckpt / "chat_template.jinja").write_bytes(b"\xff{{ messages }}")
    with pytest.raises(CheckpointError, match=r"ckpt/chat_template.jinja: not UTF-8 text"):
        load_model(str(ckpt))


def test_tokenizer_bos_id_outside_the_vocabulary(ckpt):
    _write_tokenizer(ckpt)  # no tokenizer_config.json: BOS comes from generation_config.json
    _edit_json(ckpt / "generation_config.json", bos_token_id=100_000)  # was prepended, clamped by the gather
    with pytest.raises(CheckpointError, match=r"ckpt: the tokenizer's BOS id 100000 .*not a token id in "
                                              r"\[0, vocab_size=272\)"):
        load_model(str(ckpt))

# ------------------------------------------------------------------------------------------------- DMLP


@pytest.fixture
def dmlp(tmp_path):
    return write_checkpoint(tmp_path / "dmlp")


def _edit_meta(path: str, **changes) -> None:
    _edit_json(Path(path) / "meta.json", **changes)


def test_dmlp_plain_file(tmp_path):
    (tmp_path / "ck").write_text("not a checkpoint")  # was a NotADirectoryError
    with pytest.raises(DmlpCheckpointError, match=r"ck: is a file; a DMLP checkpoint is a directory"):
        load_checkpoint(str(tmp_path / "ck"))


@pytest.mark.parametrize("content, match", [
    (b"[]", "must hold a JSON object, got list"),  # AttributeError
    (b"\xff\xfe", "cannot be read as JSON text"),  # UnicodeDecodeError
    (None, "cannot be read as JSON text"),  # meta.json is a directory: IsADirectoryError
])
def test_dmlp_unreadable_meta(dmlp, content, match):
    meta = Path(dmlp) / "meta.json"
    meta.unlink()
    meta.mkdir() if content is None else meta.write_bytes(content)
    with pytest.raises(DmlpCheckpointError, match=rf"meta.json: {match}"):
        load_checkpoint(dmlp)


@pytest.mark.parametrize("field, value, match", [
    ("num_inputs", -1, "num_inputs must be a positive integer, got -1"),  # a TypeError from jax
    ("num_inputs", 36.5, "num_inputs must be a positive integer, got 36.5"),  # read as 36
    ("hidden", "32", "hidden must be a list of positive integers, got '32'"),  # read as widths (3, 2)
    ("horizons_ms", "10", "horizons_ms must be a list of numbers"),
    ("extra", [1], "extra must be an object"),
    ("normalizer", {"mean": [0.0] * 18, "std": [0.0] * 18}, "normalizer has .* a std that is not a positive finite"),
])
def test_dmlp_bad_meta_fields(dmlp, field, value, match):
    _edit_meta(dmlp, **{field: value})
    with pytest.raises(DmlpCheckpointError, match=rf"meta.json: {match}"):
        load_checkpoint(dmlp)


@pytest.mark.parametrize("other_hidden", [(16,), (32, 32, 32)])
def test_dmlp_params_of_another_model(dmlp, tmp_path, other_hidden):
    """The error used to be orbax's tree mismatch advising partial_restore=True."""
    other = write_checkpoint(tmp_path / "other", hidden=other_hidden)
    shutil.rmtree(Path(dmlp) / "params")
    shutil.copytree(Path(other) / "params", Path(dmlp) / "params")
    with pytest.raises(DmlpCheckpointError, match=r"dmlp/params: \['Dense_\d'\]\['\w+'\] is .*, but .*meta.json "
                                                  r"\(num_inputs, hidden, horizons_ms\) implies .*from different models"):
        load_checkpoint(dmlp)


def test_dmlp_damaged_params_message_is_short(dmlp):
    manifest = Path(dmlp) / "params" / "manifest.ocdbt"
    manifest.write_bytes(manifest.read_bytes()[:20])
    with pytest.raises(DmlpCheckpointError, match=r"params: cannot restore parameters .*damaged or incomplete") as e:
        load_checkpoint(dmlp)
    assert "tensorstore_spec" not in str(e.value)


def test_dmlp_save_never_replaces_what_is_not_a_checkpoint(dmlp, tmp_path):
    """Saving over a directory of other files deleted them, and over a file renamed it aside; a checkpoint
    or an empty directory is still replaced."""
    ck = load_checkpoint(dmlp)
    (tmp_path / "precious_dir").mkdir()
    (tmp_path / "precious_dir" / "notes.txt").write_text("keep me")
    (tmp_path / "precious_file").write_text("keep me")
    before = sorted(os.listdir(tmp_path))
    for target in ("precious_dir", "precious_file"):
        with pytest.raises(DmlpCheckpointError, match=rf"{target}: exists and is not a DMLP checkpoint"):
            save_checkpoint(str(tmp_path / target), ck)
    assert sorted(os.listdir(tmp_path)) == before
    assert (tmp_path / "precious_dir" / "notes.txt").read_text() == (tmp_path / "precious_file").read_text() == "keep me"

    save_checkpoint(dmlp, DmlpCheckpoint(ck.config, ck.params, ck.normalizer, {"run": 2}))
    assert load_checkpoint(dmlp).extra == {"run": 2}
    (tmp_path / "empty").mkdir()
    save_checkpoint(str(tmp_path / "empty"), ck)
    assert load_checkpoint(str(tmp_path / "empty")).config == ck.config
