"""Writes a trained decoder as an HF checkpoint directory (LlamaForCausalLM) that `load_model` and
transformers both read: config.json, model.safetensors, generation_config.json, and the tokenizer files.

Tensor names come from `loader.hf_tensor_name`, the same mapping the loader reads them back with, and
the layout is already torch's (see llama.py), so export is a renaming with no transposes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp

from stratum_jax.model.config import ModelConfig
from stratum_jax.model.llama import Params
from stratum_jax.model.loader import hf_tensor_name


def hf_config(cfg: ModelConfig, bos_id: int, eos_id: int, pad_id: int) -> dict:
    """The config.json of `cfg` as LlamaForCausalLM (transformers 5 layout; plain RoPE only)."""
    if cfg.rope_scaling is not None or cfg.attention_bias:
        raise ValueError("export writes plain Llama configs: no rope_scaling, no attention bias")
    return {
        **cfg.to_hf_llama_config(),
        "rope_theta": cfg.rope_theta,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "bfloat16",
        "use_cache": True,
    }


def export_hf(params: Params, cfg: ModelConfig, tokenizer_dir: str | Path, out_dir: str | Path, *,
              bos_id: int, eos_ids: list[int], pad_id: int) -> Path:
    """Saves params (any float dtype) as bf16 model.safetensors plus configs and tokenizer files."""
    from safetensors.flax import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    flat = {hf_tensor_name(tuple(k.key for k in path)): jnp.asarray(leaf, jnp.bfloat16)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_file(flat, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, bos_id, eos_ids[0], pad_id), indent=2) + "\n")
    gen = {"bos_token_id": bos_id, "eos_token_id": list(eos_ids), "pad_token_id": pad_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return out
