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
    tp: the mesh its params live on (None: one device); norms_folded: the layers' RMSNorm weights are folded into
    the projections after them (model/fused.py `fold_norms`)."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    name: str
    tp: TensorParallel | None = None
    norms_folded: bool = False


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
    check_finite(params, path)
    log.info("loaded %s: tokenizer in %.2f s, %s params (%.2f GB in %s) onto %s in %.2f s", path,
             loaded - start, f"{cfg.num_params:,}", params_nbytes(params) / 1e9, cfg.dtype,
             _where(tp), time.perf_counter() - loaded)
    name = name_or_dir if name_or_dir in EMBEDDED else path.resolve().name
    return LoadedModel(cfg if tp is None else tp.tp_model_config(cfg), params, tokenizer, name, tp)


def checkpoint_config(path: Path, dtype: str | None = None) -> ModelConfig:
    """An HF checkpoint directory's model config (config.json, and generation_config.json's end tokens), without
    reading its weights. dtype overrides the checkpoint's."""
    cfg_file = path / "config.json"
    d = _read_json(cfg_file)
    _check_field_types(d, cfg_file)
    try:
        cfg = ModelConfig.from_hf_config(d, dtype=dtype)
    except CheckpointError:
        raise
    except ValueError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e
    except (TypeError, KeyError, AttributeError, ZeroDivisionError) as e:  # a field _check_field_types missed
        raise CheckpointError(f"{cfg_file}: a field has the wrong type or value ({type(e).__name__}: {e}); "
                              "compare it with the model's published config.json") from e
    return _generation_eos(path, cfg)


# config.json fields checked for JSON type before from_hf_config reads them: int() would truncate 2.7 layers
# to 2 and bool() would read "false" as true, loading a model that runs but computes the wrong thing.
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
_NULLABLE = ("num_key_value_heads", "head_dim")  # null: the default (num_attention_heads, hidden / heads)
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")  # null: false


def _check_field_types(d: Any, cfg_file: Path) -> None:
    """Raises CheckpointError naming the config.json field whose JSON type or value cannot be right."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{cfg_file}: must hold a JSON object, got {type(d).__name__}")

    def bad(key: str, want: str, value: Any) -> CheckpointError:
        return CheckpointError(f"{cfg_file}: field {key!r} must be {want}, got {json.dumps(value)}")

    archs = d.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise bad("architectures", "a list of class names such as [\"LlamaForCausalLM\"]", archs)
    for key in _POSITIVE_INTS:
        v = d.get(key)
        if key in d and not (v is None and key in _NULLABLE) and not (_is_int(v) and v > 0):
            raise bad(key, "a positive integer" + (" or null" if key in _NULLABLE else ""), v)
    heads = d.get("num_attention_heads")
    if d.get("head_dim") is None and _is_int(d.get("hidden_size")) and _is_int(heads) and d["hidden_size"] % heads:
        raise CheckpointError(f"{cfg_file}: hidden_size {d['hidden_size']} is not a multiple of num_attention_heads "
                              f"{heads}, and no head_dim is given")
    rope = [(f"{k}.rope_theta", d[k].get("rope_theta")) for k in ("rope_parameters", "rope_scaling")
            if isinstance(d.get(k), dict) and "rope_theta" in d[k]]
    for key, v in [(k, d[k]) for k in _POSITIVE_NUMBERS if k in d] + rope:
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise bad(key, "a positive finite number", v)
    for key in _BOOLS:
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise bad(key, "true or false", d[key])
    for key in ("rope_parameters", "rope_scaling"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise bad(key, "an object or null", d[key])
    if d.get("layer_types") is not None and not isinstance(d["layer_types"], list):
        raise bad("layer_types", "a list", d["layer_types"])
    for key in ("dtype", "torch_dtype"):
        if d.get(key) is not None and not isinstance(d[key], str):
            raise bad(key, "a dtype name such as \"bfloat16\"", d[key])
    if d.get("bos_token_id") is not None and not _is_int(d["bos_token_id"]):
        raise bad("bos_token_id", "a token id (an integer) or null", d["bos_token_id"])
    if not _is_token_ids(d.get("eos_token_id")):
        raise bad("eos_token_id", "a token id, a list of token ids, or null", d["eos_token_id"])


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token_ids(v: Any) -> bool:
    """An HF eos_token_id: null, an integer, or a list of integers (as hf_eos_ids reads it)."""
    return all(e is None or _is_int(e) for e in (v if isinstance(v, list) else [v]))


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
    extra = sorted(n for n in set(where) - set(expected) if not _ignored(n, cfg))
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
        # A shard's tensor that the index puts elsewhere, or nowhere, would be silently left out.
        unlisted = [n for n in st.names if where.get(n) != file and not _ignored(n, cfg)]
        if unlisted:
            listed = f"lists it in {where[unlisted[0]].name}" if unlisted[0] in where else "does not list it"
            raise CheckpointError(f"{file}: has tensor {unlisted[0]!r}, but {_INDEX} {listed}"
                                  + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else "")
                                  + f"; regenerate {_INDEX} from the shards")
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


def _ignored(name: str, cfg: ModelConfig) -> bool:
    """A checkpoint tensor with no parameter behind it that loading may skip."""
    return name.endswith(_IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == "lm_head.weight")


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


@jax.jit
def _nonfinite_counts(leaves: list[jax.Array]) -> jax.Array:
    """[len(leaves)] int32: how many NaN or Inf values each leaf holds (one fused read of each, on its device)."""
    return jnp.stack([jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in leaves])


def check_finite(params: Params, where: Path) -> None:
    """Raises CheckpointError naming every tensor with NaN or Inf values. The scan runs on the device after loading
    (the host side stays zero-copy): ~4 ms for 16 GB on an H200."""
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    counts = np.asarray(_nonfinite_counts([x for _, x in flat]))
    bad = [(_name(path), int(n)) for (path, _), n in zip(flat, counts, strict=True) if n]
    if bad:
        listed = ", ".join(f"{name} ({n:,} values)" for name, n in bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise CheckpointError(f"{where}: {len(bad)} tensor{'s' if len(bad) > 1 else ''} hold NaN or Inf: {listed}; "
                              "the checkpoint is corrupt or was saved from a diverged run: re-export it")


def _name(key_path) -> str:
    return hf_tensor_name(tuple(k.key for k in key_path))


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Maps each tensor name of the checkpoint to the safetensors file holding it."""
    index = directory / _INDEX
    if index.is_file():
        content = _read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object")
        for name, file in weight_map.items():
            # Shards are files of this directory: a path elsewhere would load another checkpoint's weights.
            if not (isinstance(file, str) and file == Path(file).name and file not in ("", ".", "..")):
                raise CheckpointError(f"{index}: weight_map gives tensor {name!r} the shard {json.dumps(file)}; "
                                      f"each must be the name of a .safetensors file in {directory}")
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
    if tok_file.exists():  # a directory or unreadable file of that name is an error, not "no tokenizer"
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
    # Ids from generation_config.json or tokenizer_config.json outside the embedding would be clamped silently.
    for what, ids in (("BOS", () if tokenizer.bos_token_id is None else (tokenizer.bos_token_id,)),
                      ("EOS", tokenizer.eos_token_ids)):
        for i in ids:
            if not (_is_int(i) and 0 <= i < cfg.vocab_size):
                raise CheckpointError(f"{directory}: the tokenizer's {what} id {i!r} (from generation_config.json, "
                                      f"config.json or tokenizer_config.json) is not a token id in "
                                      f"[0, vocab_size={cfg.vocab_size})")
    return tokenizer


def _generation_eos(directory: Path, cfg: ModelConfig) -> ModelConfig:
    """generation_config.json's eos_token_id, when it has one, replaces config.json's (as transformers'
    generate() does): it is where checkpoints list every stop id (Llama 3.1: three of them)."""
    gen_file = directory / "generation_config.json"
    if not gen_file.is_file():
        return cfg
    gen = _read_json(gen_file)
    if not isinstance(gen, dict):
        raise CheckpointError(f"{gen_file}: must hold a JSON object, got {type(gen).__name__}")
    if gen.get("eos_token_id") is None:
        return cfg
    if not _is_token_ids(gen["eos_token_id"]):
        raise CheckpointError(f"{gen_file}: eos_token_id must be an int or a list of ints, "
                              f"got {gen['eos_token_id']!r}")
    return _replace(cfg, str(gen_file), eos_token_ids=hf_eos_ids(gen["eos_token_id"]))


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"{path}: " + ("is not a regular file" if path.exists() else "file not found"))
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}); it must be a JSON file") from e


def _replace(cfg: ModelConfig, what: str, **changes) -> ModelConfig:
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as e:
        raise CheckpointError(f"{what}: {e}") from e
