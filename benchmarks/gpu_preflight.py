"""The engine's step programs lowered for CUDA on a host without a GPU, at a model's real shapes: a pre-flight
for device calls.

    JAX_PLATFORMS=cpu python benchmarks/gpu_preflight.py --model llama-1b --batch 64 --prompt-len 512 \\
        --new-tokens 256 --attention kernel --l2-prefetch-mb 16
    JAX_PLATFORMS=cpu python benchmarks/gpu_preflight.py --model llama-8b --batch 64 --attention kernel \\
        --shapes decode --layers 4                          # the first 4 layers only: the same kernels, faster

It takes benchmarks/e2e_decode.py's flags (so an e2e command line can be checked as it stands) and builds the
engine config that e2e would (`e2e_decode.engine_config`); --model may also be an HF checkpoint directory, of which
only config.json is read (will this model's shapes run on the kernels?). On an H200 the engine traces every step shape
(decode, the packed prefill buckets, sampling) with its Pallas kernels and compiles them at start-up; a mistake
that shows only at a real model's shapes (a kernel's shape check, an SMEM budget, a tile count that does not
divide, an L2 prefetch plan) would first show there, costing lent GPU time. Here each program is built as
`ModelRunner.program` builds it, with the choices the engine makes on a Hopper GPU ("auto" projections and
attention resolved as there; the warp-specialised prefill; no interpreter), from abstract weights and KV pools
(nothing is allocated: llama-8b and 70b shapes work on a laptop), and exported with `jax.export` for the `cuda`
platform. Mosaic GPU lowers each kernel to its module then, so the kernels' own checks run.

With a delta --kv-precision (DKVC) the cache is the engine's delta pools around an anchor of --anchor-lens
positions (the engine picks 1, the mean anchor, or 256, position-aligned blocks, from a warm-up run of the real
weights; both by default), with --fp8-scale's storage rule.

What it cannot see: the PTX compile (ptxas, registers), XLA's GPU compile, and anything at run time. One device.

Prints a line a program: seconds to lower, its distinct Mosaic GPU kernels (a kernel called the same way from every
layer is lowered once, into a function each layer calls), their calls in one pass of the step and the L2 prefetch
sites in their code; writes JSON with --out (also each program's kernel names). Exits 1 if any program failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
import time
import traceback

import jax
import numpy as np

from stratum_jax.attention import resolve_backend
from stratum_jax.config import RuntimeConfig
from stratum_jax.kv.anchor import ALIGNED_LEN
from stratum_jax.kv.delta_cache import init_delta_cache
from stratum_jax.model.config import PRESETS
from stratum_jax.model.fused import fold_norms, fuse_layer
from stratum_jax.model.llama import init_kv_cache, param_shapes
from stratum_jax.model.loader import EMBEDDED, CheckpointError, LoadedModel, checkpoint_config
from stratum_jax.model.projection import resolve_projections
from stratum_jax.model.tokenizer import ByteTokenizer
from stratum_jax.model_runner import ModelRunner, kv_layout_of
from e2e_decode import build_parser as e2e_parser, engine_config, run_combinations  # noqa: E402  (benchmarks/)
from run_record import provenance, save_json  # noqa: E402  (beside this script)

SHAPE_KINDS = ("decode", "packed", "sample", "prompt_logprobs")
MOSAIC_CALL = "stablehlo.custom_call @mosaic_gpu"   # one a distinct kernel lowering
# A Mosaic GPU kernel's module names it "<function>_mosaic_gpu" (Pallas' name for the kernel body, shapes and all).
KERNEL_NAME = re.compile(r"\\00(\w+?)_mosaic_gpu")
# The PTX of a TMA prefetch to L2 (plgpu.async_prefetch; pallas_kernels/l2_prefetch.py): one a prefetch site in a
# kernel's code, not a count of executions.
L2_PREFETCH = "cp.async.bulk.prefetch.tensor"


def kernel_calls(text: str) -> int:
    """Mosaic GPU kernel launches in one pass of a lowered module's body: each kernel's call sites (jax lowers a
    kernel wrapper called alike from every layer once, as a private function each layer calls), or 1 for a
    kernel inlined into its caller. The decode loop's steps are one loop body: counted once."""
    total = 0
    for func in re.split(r"\n\s*func\.func ", text)[1:]:
        name = re.match(r"(?:(?:private|public) )?@([\w.$-]+)", func).group(1)
        kernels = func.count(MOSAIC_CALL)
        if kernels:
            sites = len(re.findall(rf"call @{re.escape(name)}\(", text))
            total += kernels * max(sites, 1)
    return total


def build_parser() -> argparse.ArgumentParser:
    ap = e2e_parser(__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPE_KINDS), choices=SHAPE_KINDS,
                    help="which kinds of step program to lower (default: all the engine compiles)")
    ap.add_argument("--anchor-lens", nargs="+", type=int, default=[1, ALIGNED_LEN], metavar="N",
                    help="with a delta --kv-precision: the anchor lengths to lower (the engine's two candidates)")
    ap.add_argument("--layers", type=int, default=None, metavar="N",
                    help="lower the model with its first N layers only (the same kernels, N/L of the time)")
    return ap


def abstract_model(name: str, dtype: str | None, layers: int | None) -> LoadedModel:
    """A preset's or a checkpoint directory's model (its config.json only: no weights are read) as shapes only: its
    params in the engine's fused layout (model/fused.py) as jax.ShapeDtypeStruct leaves, nothing allocated."""
    if name in PRESETS:
        cfg = PRESETS[name] if dtype is None else dataclasses.replace(PRESETS[name], dtype=dtype)
    else:
        path = EMBEDDED.get(name, pathlib.Path(name))
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {name!r}: give a preset ({', '.join([*PRESETS, *EMBEDDED])}) or a checkpoint "
                             "directory with a config.json (its weights are not read)")
        try:
            cfg = checkpoint_config(path, dtype)
        except CheckpointError as e:
            raise SystemExit(f"--model {name!r}: {e}") from e
    if layers is not None:
        if not 1 <= layers <= cfg.num_layers:
            raise SystemExit(f"--layers must be in [1, {cfg.num_layers}] for {name}, got {layers}")
        cfg = dataclasses.replace(cfg, num_layers=layers)
    params = jax.eval_shape(lambda p: {k: fuse_layer(v, 1) if k.startswith("layers_") else v for k, v in p.items()},
                            param_shapes(cfg))
    return LoadedModel(cfg, params, ByteTokenizer(cfg.vocab_size), name)


def abstract_kv_cache(config: RuntimeConfig, model: LoadedModel, anchor_len: int):
    """The engine's KV cache for config.kv_precision as shapes only: bf16 pools, or DKVC's delta pools, scales and
    floors around a (zero) anchor of anchor_len positions (kv/precision.py `start_kv_cache` without its warm-up)."""
    cfg, slots = model.config, config.kv_pool_slots
    if config.kv_precision == "bf16":
        return jax.eval_shape(lambda: init_kv_cache(cfg, slots))
    anchor = np.zeros((cfg.num_kv_heads, anchor_len, cfg.head_dim), cfg.dtype)
    floors = np.ones(cfg.num_kv_heads, np.float32)
    fixed = config.kv_precision == "fp8-delta" and config.fp8_scale == "head"
    layers = cfg.num_layers
    return jax.eval_shape(lambda: init_delta_cache([(anchor, anchor)] * layers, [(floors, floors)] * layers, slots,
                                                   config.kv_precision, fixed_scales=fixed))


def runner_for(config: RuntimeConfig, model: LoadedModel, kv_cache) -> ModelRunner:
    """The model runner the engine would build for config and its KV cache on a Hopper GPU."""
    config = config.for_model(model.config.max_position_embeddings)
    backend = resolve_backend(config, model.config, on_hopper=True)
    projections = resolve_projections(config, model.config, on_hopper=True, tensor_parallel=1)
    if config.fold_norms and projections == "kernel":
        fold_norms(model)         # abstract params: only marks the model folded, as the engine's fold would
    return ModelRunner(config, model, num_slots=config.kv_pool_slots, backend=backend, projections=projections,
                       attn_stats=config.measures_attention_stats, kv_layout=kv_layout_of(kv_cache))


def lower_all(runner: ModelRunner, kv_cache, kinds, *, progress=print) -> list[dict]:
    """Each of runner's step programs of the given kinds exported for CUDA: one dict a program."""
    rows = []
    for shape in runner.shapes:
        if shape.kind not in kinds:
            continue
        row = dict(shape=str(shape), kind=shape.kind)
        t0 = time.perf_counter()
        try:
            prog = runner.program(shape, kv_cache)
            text = jax.export.export(prog.jitted, platforms=("cuda",))(*prog.args, **prog.static).mlir_module()
            names = sorted(set(KERNEL_NAME.findall(text)) - {"stable"})
            row.update(ok=True, distinct_kernels=text.count(MOSAIC_CALL), kernel_calls=kernel_calls(text),
                       l2_prefetch_sites=text.count(L2_PREFETCH),
                       kernels=names, module_chars=len(text))
        except Exception as e:  # noqa: BLE001 - a failing program is this tool's finding: record it, lower the rest
            row.update(ok=False, error=f"{type(e).__name__}: {e}"[:4000], traceback=traceback.format_exc()[-4000:])
        row["seconds"] = round(time.perf_counter() - t0, 2)
        found = (f"{row['distinct_kernels']:3d} distinct kernels, {row['kernel_calls']:4d} calls, "
                 f"{row['l2_prefetch_sites']:3d} L2 prefetch sites") if row["ok"] else row["error"][:300]
        progress(f"  {row['shape'][:60]:60} {'ok' if row['ok'] else 'FAILED':6} {row['seconds']:6.1f} s {found}")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.interpret_kernels:
        raise SystemExit("--interpret-kernels: the pre-flight lowers the kernels for the GPU, not the interpreter")
    if args.tensor_parallel != 1:
        raise SystemExit("the pre-flight lowers for one device: drop --tensor-parallel")
    if any(n < 1 for n in args.anchor_lens):
        raise SystemExit(f"--anchor-lens must be positive, got {args.anchor_lens}")
    model = abstract_model(args.model, args.dtype, args.layers)
    runs = []
    for attention, precision, kernel in run_combinations(args):
        for anchor_len in (args.anchor_lens if precision != "bf16" else [None]):
            config = engine_config(args, attention, precision, kernel)
            kv_cache = abstract_kv_cache(config, model, anchor_len)
            runner = runner_for(config, model, kv_cache)
            kv = precision + (f" (anchor {anchor_len}, {config.fp8_scale} scales)" if anchor_len else "")
            print(f"{args.model} ({model.config.num_layers} layers) batch {args.batch}: attention "
                  f"{runner.geo.backend}, decode kernel {kernel}, KV {kv}, projections {runner.geo.projections}, L2 prefetch "
                  f"{config.l2_prefetch_mb:g} MB, norms folded {runner.geo.norms_folded}, {runner.geo.decode_steps} "
                  "decode steps a call", flush=True)
            rows = lower_all(runner, kv_cache, args.shapes, progress=lambda line: print(line, flush=True))
            runs.append(dict(attention=runner.geo.backend, decode_kernel=kernel, kv_precision=precision,
                             anchor_len=anchor_len, fp8_scale=config.fp8_scale, projections=runner.geo.projections,
                             l2_prefetch_mb=config.l2_prefetch_mb, norms_folded=runner.geo.norms_folded,
                             programs=rows))
    failed = sum(not r["ok"] for run in runs for r in run["programs"])
    total = sum(len(run["programs"]) for run in runs)
    print(f"{total - failed} of {total} step programs lowered for CUDA" + (f"; {failed} FAILED" if failed else ""))
    if args.out:
        save_json(args.out, dict(provenance("gpu_preflight"), model=args.model, layers=model.config.num_layers,
                                 batch=args.batch, runs=runs))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
