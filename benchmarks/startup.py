"""Start-up time by phase, in a fresh process: imports, backend, model load, KV cache, engine set-up.

    python benchmarks/startup.py --model llama-1b --dtype bfloat16 --label after --out benchmarks/results/startup_cpu.json
    python benchmarks/startup.py --model llama-1b --dtype bfloat16 --write-checkpoint /tmp/ckpt   # then --model /tmp/ckpt

Each run appends one record to --out (a JSON list). Warm-up compiles are not measured here (engine.py
owns them). --write-checkpoint saves the preset's random weights as an HF-style directory (config.json +
model.safetensors) to time the checkpoint path on the same shapes.
"""
from __future__ import annotations

import time

_STARTED = time.perf_counter()

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402


def _hf_config(cfg) -> dict:
    """An HF LlamaForCausalLM config.json for a preset (the fields ModelConfig.from_hf_config reads)."""
    rope = cfg.rope_scaling_dict()
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
            "rope_theta": cfg.rope_theta, "rope_scaling": rope, "tie_word_embeddings": cfg.tie_word_embeddings,
            "torch_dtype": cfg.dtype, "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}


def write_checkpoint(preset: str, dtype: str | None, directory: str) -> None:
    import dataclasses

    import jax
    from safetensors.flax import save_file

    from stratum_jax.model.config import PRESETS
    from stratum_jax.model.llama import init_params
    from stratum_jax.model.loader import hf_tensor_name

    cfg = PRESETS[preset] if dtype is None else dataclasses.replace(PRESETS[preset], dtype=dtype)
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    params = init_params(cfg, 0)
    tensors = {hf_tensor_name(tuple(k.key for k in p)): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(_hf_config(cfg), indent=1))


def rng_compare(shape=(8192, 2048), dtype="bfloat16") -> dict:
    """Compile and run time of one matrix's init: jax.random (threefry) normal vs llama._normal_leaf."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stratum_jax.model.llama import _normal_leaf

    def threefry(key):
        return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

    def counter_hash(words):
        return _normal_leaf(words, shape=shape, dtype=dtype)

    out = {"shape": list(shape), "dtype": dtype}
    for name, fn, arg in (("threefry", threefry, jax.random.key(0)),
                          ("counter_hash", counter_hash, np.array([1, 2], np.uint32))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(arg).compile()
        out[f"{name}_compile_s"] = round(time.perf_counter() - start, 3)
        compiled(arg).block_until_ready()
        start = time.perf_counter()
        for _ in range(3):
            compiled(arg).block_until_ready()
        out[f"{name}_run_s"] = round((time.perf_counter() - start) / 3, 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None)
    p.add_argument("--write-checkpoint", metavar="DIR")
    p.add_argument("--rng-compare", action="store_true", help="time one matrix's init: threefry vs ours")
    args = p.parse_args()
    if args.write_checkpoint:
        write_checkpoint(args.model, args.dtype, args.write_checkpoint)
        return
    if args.rng_compare:
        import jax
        _save(args.out, {"label": "rng_compare", **rng_compare(), **_context(jax.devices()[0])})
        return

    phases: dict[str, float] = {}   # wall seconds
    cpu: dict[str, float] = {}      # this process's CPU seconds (all threads): less sensitive to a shared machine
    last_cpu = [0.0]

    def mark(name: str, since: float) -> float:
        now, now_cpu = time.perf_counter(), time.process_time()
        phases[name], cpu[name] = round(now - since, 3), round(now_cpu - last_cpu[0], 3)
        last_cpu[0] = now_cpu
        print(f"{name:>16s} {phases[name]:8.2f} s wall {cpu[name]:8.2f} s cpu", flush=True)
        return now

    t = _STARTED
    import jax
    t = mark("import_jax", t)
    device = jax.devices()[0]
    t = mark("backend_init", t)
    import serving.server  # noqa: F401  (what `serve` imports)
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.model.llama import init_kv_cache
    from stratum_jax.model.loader import load_model
    t = mark("import_stratum", t)
    config = RuntimeConfig(model=args.model, dtype=args.dtype)
    model = jax.block_until_ready(load_model(config.model, dtype=config.dtype, seed=config.seed))
    t = mark("load_model", t)
    cache = jax.block_until_ready(init_kv_cache(model.config, config.kv_pool_slots))
    t = mark("kv_alloc", t)
    del cache
    engine = Engine(config, model=model)
    jax.block_until_ready(engine.kv_cache)
    t = mark("engine_init", t)   # includes its own KV allocation again
    phases["total_to_warmup"] = round(t - _STARTED, 3)
    cpu["total_to_warmup"] = round(time.process_time(), 3)
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB
    record = {"label": args.label, "model": args.model, "dtype": model.config.dtype,
              "num_params": model.config.num_params, "kv_pool_slots": config.kv_pool_slots,
              "peak_rss_gib": round(peak_rss_gb, 2),
              "phases_s": phases, "phases_cpu_s": cpu, **_context(device)}
    _save(args.out, record)


def _context(device) -> dict:
    import jax
    return {"device": f"{device.platform}:{device.device_kind}", "cpu_count": os.cpu_count(),
            "loadavg_1m": round(os.getloadavg()[0], 2), "jax": jax.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _save(out: str | None, record: dict) -> None:
    """Prints the record and appends it to the "runs" list of the JSON file `out` (created if missing)."""
    print(json.dumps(record))
    if out:
        path = pathlib.Path(out)
        doc = json.loads(path.read_text()) if path.exists() else {"runs": []}
        doc["runs"].append(record)
        path.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
