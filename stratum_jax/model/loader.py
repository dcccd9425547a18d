"""Loads a model by preset name (random init) or from an HF checkpoint directory.

A checkpoint directory holds config.json and either model.safetensors or shards listed by
model.safetensors.index.json; tokenizer.json is optional (the byte tokenizer stands in). Every
problem raises CheckpointError naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.model.config import PRESETS, ModelConfig, hf_eos_ids
from stratum_jax.model.llama import Params, init_params, param_shapes
from stratum_jax.model.safetensors_file import DTYPES, SafetensorsFile
from stratum_jax.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from stratum_jax.tensor_parallel import TensorParallel, init_params_on_mesh, place_on_mesh

log = logging.getLogger(__name__)

# Trained checkpoints shipped inside the package (package data), loaded like any HF directory.
# pydoc-2m: 2.45M params trained on the Python 3.11 docs (training/train_lm.py; BENCHMARKS.md).
EMBEDDED = {"pydoc-2m": Path(__file__).parent / "weights" / "pydoc-2m"}

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# Checkpoint tensors with no parameter behind them: old Llama exports saved RoPE buffers.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint or preset that cannot be loaded; the message names the file and the problem."""


@dataclasses.dataclass
class LoadedModel:
    """config: the model as laid out (with tensor parallelism: tp.tp_model_config of the checkpoint's);
    tp: the mesh its params live on (None: one device)."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    name: str
    tp: TensorParallel | None = None


def load_model(name_or_dir: str, *, dtype: str | None = None, seed: int = 0,
               tp: TensorParallel | None = None) -> LoadedModel:
    """A preset name ("tiny", "llama-1b", "llama-8b", "llama-70b") -> random parameters from `seed` and the
    byte tokenizer; an embedded name ("pydoc-2m") -> that trained checkpoint; a directory -> its HF
    checkpoint. `dtype` ("float32"/"bfloat16") overrides the preset's or the checkpoint's dtype; weights
    are converted once, on the device. tp: lay the weights out on its mesh (stratum_jax/tensor_parallel.py),
    each device creating or reading only its own shard.
    """
    if name_or_dir in PRESETS:
        cfg = PRESETS[name_or_dir]
        if dtype is not None:
            cfg = _replace(cfg, f"preset {name_or_dir!r}", dtype=dtype)
        tp = tp if tp is None else tp.for_model(cfg)      # --tp-embedding auto decided for this model
        start = time.perf_counter()
        if tp is None:
            params = init_params(cfg, seed)
        else:
            cfg, params = init_params_on_mesh(cfg, seed, tp)
        jax.block_until_ready(params)  # blocks only so that the time logged is true
        log.info("initialised preset %s: %s params in %s (seed %d) on %s in %.2f s", name_or_dir,
                 f"{cfg.num_params:,}", cfg.dtype, seed, _where(tp), time.perf_counter() - start)
        return LoadedModel(cfg, params, ByteTokenizer(cfg.vocab_size), name_or_dir, tp)

    path = EMBEDDED.get(name_or_dir, Path(name_or_dir))
    if not path.is_dir():
        what = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
        raise CheckpointError(f"{name_or_dir}: {what}; give a checkpoint directory (config.json + "
                              f"*.safetensors) or a preset: {', '.join([*PRESETS, *EMBEDDED])}")
    cfg_file = path / "config.json"
    cfg = checkpoint_config(path, dtype)
    tp = tp if tp is None else tp.for_model(cfg)          # --tp-embedding auto decided for this model
    start = time.perf_counter()
    tokenizer = _load_tokenizer(path, cfg)
    loaded = time.perf_counter()
    if tp is not None:
        try:
            tp.check_model(cfg)
        except ValueError as e:
            raise CheckpointError(f"{cfg_file}: {e}") from e
    params = jax.block_until_ready(load_params(path, cfg, tp))  # blocks only so that the time logged is true
    log.info("loaded %s: tokenizer in %.2f s, %s params (%.2f GB in %s) onto %s in %.2f s", path,
             loaded - start, f"{cfg.num_params:,}", params_nbytes(params) / 1e9, cfg.dtype,
             _where(tp), time.perf_counter() - loaded)
    name = name_or_dir if name_or_dir in EMBEDDED else path.resolve().name
    return LoadedModel(cfg if tp is None else tp.tp_model_config(cfg), params, tokenizer, name, tp)


def checkpoint_config(path: Path, dtype: str | None = None) -> ModelConfig:
    """An HF checkpoint directory's model config (config.json, and generation_config.json's end tokens), without
    reading its weights. dtype overrides the checkpoint's."""
    cfg_file = path / "config.json"
    try:
        cfg = ModelConfig.from_hf_config(_read_json(cfg_file), dtype=dtype)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e
    return _generation_eos(path, cfg)


def _where(tp: TensorParallel | None) -> str:
    kind = jax.devices()[0].device_kind
    return kind if tp is None else f"{tp.size} x {kind} (tensor parallel)"


def hf_tensor_name(path: tuple[str, ...]) -> str:
    """Parameter path ("layers_3", "self_attn", "q_proj", "weight") -> HF name
    "model.layers.3.self_attn.q_proj.weight"; ("lm_head", "weight") -> "lm_head.weight"."""
    head, *rest = path
    if head == "lm_head":
        return ".".join(path)
    if head.startswith("layers_"):
        head = "layers." + head.removeprefix("layers_")
    return ".".join(["model", head, *rest])


def load_params(directory: str | Path, cfg: ModelConfig, tp: TensorParallel | None = None) -> Params:
    """Reads the safetensors weights of `directory` into the parameter tree of `cfg`, in cfg.dtype, each
    tensor straight from the memory-mapped file to the default device (no whole-model host copy).
    tp: instead, into the tree of tp.tp_model_config(cfg), each device reading only its shard of each
    tensor from the file (tensor_parallel.place_on_mesh)."""
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
    device = jax.devices()[0]
    placements: dict[str, tuple] = {}          # HF name -> (sharding, kv source rows) with tp
    if tp is not None:
        tp_cfg, rows = tp.tp_model_config(cfg), tp.kv_source_rows(cfg)
        shapes = param_shapes(tp_cfg)
        placements = {_name(p): (s, rows if p[-2].key in ("k_proj", "v_proj") else None)
                      for p, s in jax.tree_util.tree_flatten_with_path(tp.param_shardings(tp_cfg, shapes))[0]}
    flat: dict[str, jax.Array] = {}
    for file, names in by_file.items():
        st = _open_safetensors(file)
        for name in names:
            if name not in st:  # only possible when an index names the wrong shard
                raise CheckpointError(f"{file}: has no tensor {name!r}, though {_INDEX} says it does")
            got, kind = st.shape(name), st.dtype(name)
            if got != expected[name]:
                raise CheckpointError(f"{file}: tensor {name!r} has shape {list(got)}, expected "
                                      f"{list(expected[name])}")
            if kind not in DTYPES:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {kind}, expected a float type")
            if tp is None:
                flat[name] = _to_device(st.array(name), cfg.dtype, device)
            else:
                x = place_on_mesh(st.array(name), *placements[name])
                flat[name] = x if x.dtype == jnp.dtype(cfg.dtype) else x.astype(cfg.dtype)
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[_name(p)], shapes)


def _to_device(view: np.ndarray, dtype: str, device) -> jax.Array:
    """A tensor's file view [shape] -> a device array in `dtype`: one copy from the file's pages into
    device memory, then (when the checkpoint's dtype differs) one cast on the device."""
    if device.platform == "cpu":
        # jax's CPU client aliases an aligned read-only buffer instead of copying it: the parameters
        # would then live in the file's pages, and a checkpoint rewritten while serving would crash the
        # process (SIGBUS). On CPU the device *is* host memory, so this copy is the one copy.
        view = np.array(view)
    x = jax.device_put(view, device)  # float64 becomes float32 here unless jax_enable_x64
    return x if x.dtype == jnp.dtype(dtype) else x.astype(dtype)


def _open_safetensors(file: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile(file)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


def params_nbytes(params: Params) -> int:
    """Bytes of all parameters (global arrays: a sharded one counts once, whole)."""
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def _name(key_path) -> str:
    return hf_tensor_name(tuple(k.key for k in key_path))


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Maps each tensor name of the checkpoint to the safetensors file holding it."""
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
    return {name: single for name in _open_safetensors(single).names}


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
