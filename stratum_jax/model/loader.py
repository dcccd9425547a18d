"""Loads a model by preset name (random init) or from an HF checkpoint directory.

A checkpoint directory holds config.json and either model.safetensors or shards listed by
model.safetensors.index.json; tokenizer.json is optional (the byte tokenizer stands in). Every
problem raises CheckpointError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from stratum_jax.model.config import PRESETS, ModelConfig, hf_eos_ids
from stratum_jax.model.llama import Params, init_params, param_shapes
from stratum_jax.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Checkpoint tensors with no parameter behind them: old Llama exports saved RoPE buffers.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint or preset that cannot be loaded; the message names the file and the problem."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    name: str


def load_model(name_or_dir: str, *, dtype: str | None = None, seed: int = 0) -> LoadedModel:
    """A preset name ("tiny", "llama-1b", "llama-8b") -> random parameters from `seed` and the byte
    tokenizer; a directory -> its HF checkpoint. `dtype` ("float32"/"bfloat16") overrides the preset's
    or the checkpoint's dtype; weights are converted once, on the device.
    """
    if name_or_dir in PRESETS:
        cfg = PRESETS[name_or_dir]
        if dtype is not None:
            cfg = _replace(cfg, f"preset {name_or_dir!r}", dtype=dtype)
        return LoadedModel(cfg, init_params(cfg, seed), ByteTokenizer(cfg.vocab_size), name_or_dir)

    path = Path(name_or_dir)
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise CheckpointError(f"{name_or_dir}: {what}; give a checkpoint directory (config.json + "
                              f"*.safetensors) or a preset: {', '.join(PRESETS)}")
    cfg_file = path / "config.json"
    try:
        cfg = ModelConfig.from_hf_config(_read_json(cfg_file), dtype=dtype)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e
    cfg = _generation_eos(path, cfg)
    tokenizer = _load_tokenizer(path, cfg)
    return LoadedModel(cfg, load_params(path, cfg), tokenizer, path.resolve().name)


def hf_tensor_name(path: tuple[str, ...]) -> str:
    """Parameter path ("layers_3", "self_attn", "q_proj", "weight") -> HF name
    "model.layers.3.self_attn.q_proj.weight"; ("lm_head", "weight") -> "lm_head.weight"."""
    head, *rest = path
    if head == "lm_head":
        return ".".join(path)
    if head.startswith("layers_"):
        head = "layers." + head.removeprefix("layers_")
    return ".".join(["model", head, *rest])


def load_params(directory: str | Path, cfg: ModelConfig) -> Params:
    """Reads the safetensors weights of `directory` into the parameter tree of `cfg`, in cfg.dtype."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    where = _tensor_files(directory)  # HF name -> file
    shapes = param_shapes(cfg)
    expected = {_name(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(shapes)[0]}

    missing = sorted(set(expected) - set(where))
    if missing:
        files = sorted({f.name for f in where.values()})
        raise CheckpointError(f"{directory}: tensor {missing[0]!r} not found in {', '.join(files) or 'any file'}"
                              + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else ""))
    extra = sorted(n for n in set(where) - set(expected) if not n.endswith(_IGNORED_SUFFIXES)
                   and not (cfg.tie_word_embeddings and n == "lm_head.weight"))
    if extra:
        # A tensor this decoder would ignore (an o_proj bias, say) means the output would be wrong.
        raise CheckpointError(f"{where[extra[0]]}: unexpected tensor {extra[0]!r} for this architecture"
                              + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))

    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(where[name], []).append(name)
    flat: dict[str, jax.Array] = {}
    for file, names in by_file.items():
        try:
            # framework="flax": numpy cannot represent bfloat16, the dtype of most released checkpoints.
            with safe_open(str(file), framework="flax") as f:
                present = set(f.keys())
                for name in names:
                    if name not in present:  # only possible when an index names the wrong shard
                        raise CheckpointError(f"{file}: has no tensor {name!r}, though {_INDEX} says it does")
                    sl = f.get_slice(name)
                    got, kind = tuple(sl.get_shape()), sl.get_dtype()
                    if got != expected[name]:
                        raise CheckpointError(f"{file}: tensor {name!r} has shape {list(got)}, expected "
                                              f"{list(expected[name])}")
                    if kind not in ("F32", "F16", "BF16", "F64"):
                        raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}, expected a float type")
                    flat[name] = jnp.asarray(f.get_tensor(name), dtype=cfg.dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[_name(p)], shapes)


def _name(key_path) -> str:
    return hf_tensor_name(tuple(k.key for k in key_path))


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Maps each tensor name of the checkpoint to the safetensors file holding it."""
    from safetensors import SafetensorError, safe_open

    index = directory / _INDEX
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object")
        where = {name: directory / file for name, file in weight_map.items()}
        for file in sorted(set(where.values())):
            if not file.is_file():
                raise CheckpointError(f"{index}: lists shard {file.name}, which does not exist in {directory}")
        return where
    single = directory / _SINGLE
    if not single.is_file():
        raise CheckpointError(f"{directory}: no {_SINGLE} and no {_INDEX}")
    try:
        with safe_open(str(single), framework="flax") as f:
            return {name: single for name in f.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{single}: not a readable safetensors file ({e})") from e


def _load_tokenizer(directory: Path, cfg: ModelConfig) -> Tokenizer:
    tok_file = directory / "tokenizer.json"
    if tok_file.is_file():
        try:
            tokenizer: Tokenizer = HFTokenizer(directory)
        except ValueError as e:  # malformed JSON in a side file names that file itself
            raise CheckpointError(str(e)) from e
        except Exception as e:  # the tokenizers library raises a bare Exception on a bad tokenizer.json
            raise CheckpointError(f"{tok_file}: cannot be loaded ({e})") from e
        source = str(tok_file)
    else:
        # The checkpoint's own EOS ids end generation; the byte tokenizer's 257 only when it names none.
        tokenizer = ByteTokenizer(cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)
        source = f"the byte tokenizer (no {tok_file})"
    if tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(f"{source} has {tokenizer.vocab_size} tokens but {directory / 'config.json'} "
                              f"has vocab_size {cfg.vocab_size}")
    return tokenizer


def _generation_eos(directory: Path, cfg: ModelConfig) -> ModelConfig:
    """generation_config.json's eos_token_id, when it has one, replaces config.json's (as transformers'
    generate() does): it is where checkpoints list every stop id (Llama 3.1: three of them)."""
    gen_file = directory / "generation_config.json"
    if not gen_file.is_file():
        return cfg
    gen = _read_json(gen_file)
    if not isinstance(gen, dict) or gen.get("eos_token_id") is None:
        return cfg
    try:
        eos = hf_eos_ids(gen["eos_token_id"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{gen_file}: eos_token_id must be an int or a list of ints, "
                              f"got {gen['eos_token_id']!r}") from e
    return _replace(cfg, str(gen_file), eos_token_ids=eos)


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e


def _replace(cfg: ModelConfig, what: str, **changes) -> ModelConfig:
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from e
