"""Runs the tensor-parallel cases on 4 CPU devices and prints their results as one JSON object.

tests/test_tensor_parallel.py runs this in a subprocess: the device count must be set before jax is
imported, and the rest of the suite runs with one device.

    python tests/tp_cases.py {engines,pieces} GENERATE_FLAGS...     (see tests/test_tensor_parallel.py)
"""
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jax._src.pallas.mosaic_gpu.interpret.shared_memory as shared_memory_module  # noqa: E402
import pallas_kernels.paged_attention as paged_attention_module  # noqa: E402
from stratum_jax import generate  # noqa: E402
from stratum_jax.attention import RowTables  # noqa: E402
from stratum_jax.config import RuntimeConfig  # noqa: E402
from stratum_jax.engine import Engine  # noqa: E402
from stratum_jax.kv.delta_cache import init_delta_cache  # noqa: E402
from stratum_jax.model.loader import load_model  # noqa: E402
from stratum_jax.request import SamplingParams  # noqa: E402
from stratum_jax.tensor_parallel import make_tensor_parallel  # noqa: E402
from stratum_jax.tp_attention import sharded_decode_attention  # noqa: E402

# The generate flags of every engine here: argv (tests/test_tensor_parallel.py gives the same to the CLI).
PART, FLAGS = sys.argv[1], sys.argv[2:]


def run_cli_config(extra: list[str]):
    """The generate CLI's engine and requests for FLAGS + extra (as `python -m stratum_jax.generate` builds
    them), run: ([{"token_ids", "logprobs": per position [chosen, top...]}] per prompt, the engine)."""
    args = generate.build_parser().parse_args(FLAGS + extra)
    engine = Engine(RuntimeConfig.from_cli_args(args))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, logprobs=args.logprobs,
                        ignore_eos=args.ignore_eos)
    results = engine.generate(args.prompt_ids, sp)
    return [{"token_ids": r.token_ids, "logprobs": [[e.logprob for e in pos] for pos in r.logprobs]}
            for r in results], engine

def collectives(engine) -> dict:
    """Collective ops in the engine's compiled decode and packed steps (those its run compiled):
    step kind -> op kind -> list of result element counts."""
    found = {}
    runner = engine.runner
    for shape in [s for s in runner.shapes if s not in runner.missing_shapes() and s.kind in ("decode", "packed")]:
        text = runner._executable(shape, engine.kv_cache).as_text()
        ops = {}
        for m in re.finditer(r"= \w+\[([\d,]*)\]\S* (all-reduce|all-gather|reduce-scatter|all-to-all|"
                             r"collective-permute)(?:-start)?\(", text):
            dims = [int(d) for d in m.group(1).split(",") if d]
            ops.setdefault(m.group(2), []).append(int(np.prod(dims)))
        found[shape.kind] = ops
    return found


def layout(engine) -> dict:
    """Per-device shapes of a few parameters (the engine's fused layout, model/fused.py) and of layer 0's k_pool."""
    p = engine.model.params["layers_0"]
    leaves = {"qkv_proj": p["self_attn"]["qkv_proj"]["weight"], "gate_up_proj": p["mlp"]["gate_up_proj"]["weight"],
              "o_proj": p["self_attn"]["o_proj"]["weight"], "down_proj": p["mlp"]["down_proj"]["weight"],
              "embed_tokens": engine.model.params["embed_tokens"]["weight"], "k_pool": engine.kv_cache[0][0]}
    return {k: {"global": list(v.shape), "per_device": [list(s.data.shape) for s in v.addressable_shards]}
            for k, v in leaves.items()}


def delta_layout(engine) -> dict:
    """The precision an engine runs and the per-device shapes of layer 0's DKVC arrays."""
    layer = engine.kv_cache[0]
    return {"precision": engine.kv_precision,
            **{k: [list(s.data.shape) for s in getattr(layer, k).addressable_shards]
               for k in ("anchor_k", "k_delta", "scales", "k_floor")}}


def kernel_under_shard_map() -> dict:
    """The Pallas decode kernel (interpreted) per shard at tp=2 against the jnp reference on one device."""
    # The interpreter runs every CTA in Python: one split per (row, kv head) keeps it quick.
    paged_attention_module.default_num_splits = lambda batch, num_kv_heads: 1
    # jax 0.11.2's Mosaic GPU interpreter keeps one shared memory for all devices and, at the end of each
    # device's kernel, asserts that no barrier of *any* device is still allocated, with no wait for the
    # other devices first: under shard_map the CPU devices run concurrently, so device 0's check sees
    # device 1's live barriers. The check is the interpreter's own bookkeeping, not the kernel's result
    # (which is compared below), so it is skipped; the clean-up after it does wait for every device.
    shared_memory_module.GPUSharedMemory.assert_no_barriers_allocated = lambda self: None
    rng = np.random.default_rng(0)
    rows, heads, kv_heads, d, slots = 2, 4, 2, 64, 256
    q = jnp.asarray(rng.standard_normal((rows, heads, d)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((kv_heads, slots, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((kv_heads, slots, d)), jnp.bfloat16)
    positions = jnp.array([37, 60], jnp.int32)
    starts = np.zeros((rows, 32), np.int32)
    starts[0, :3] = [0, 16, 48]                 # 16-token pages, not contiguous
    starts[1, :4] = np.arange(4) * 16 + 128
    tables = RowTables(jnp.zeros(rows, jnp.int32), jnp.asarray(starts), jnp.full(rows, 16, jnp.int32))
    tp = make_tensor_parallel(2)
    on_mesh = [jax.device_put(x, tp.sharding("tp", *[None] * (x.ndim - 1))) for x in (k, v)]
    qs = jax.device_put(q, tp.sharding(None, "tp", None))
    sharded = jax.jit(lambda q, k, v: sharded_decode_attention(tp, q, positions, tables, k, v, backend="kernel",
                                                               interpret=True))(qs, *on_mesh)
    ref = sharded_decode_attention(None, q, positions, tables, k, v, backend="reference")
    return {"max_abs_diff": float(jnp.max(jnp.abs(sharded.astype(jnp.float32) - ref.astype(jnp.float32)))),
            "ref_max_abs": float(jnp.max(jnp.abs(ref.astype(jnp.float32)))),
            "out_sharding": str(sharded.sharding.spec)}


def delta_kernel_under_shard_map() -> dict:
    """The DKVC delta decode kernel (interpreted, fp8 deltas, mean anchor) per shard at tp=2 against the
    jnp rebuild on one device, on the same tables as `kernel_under_shard_map` (which sets up the
    interpreter's multi-device allowances first)."""
    rng = np.random.default_rng(1)
    rows, heads, kv_heads, d, slots = 2, 4, 2, 64, 256
    anchors = [(jnp.asarray(rng.standard_normal((kv_heads, 1, d)), jnp.bfloat16),) * 2]
    floors = [(np.full(kv_heads, 0.01, np.float32),) * 2]
    one = init_delta_cache(anchors, floors, slots, "fp8-delta")[0]
    positions = np.arange(slots, dtype=np.int32) % 128
    k, v = (jnp.asarray(rng.standard_normal((slots, kv_heads, d)), jnp.bfloat16) for _ in range(2))
    one = jax.jit(lambda c: c.write(k, v, jnp.asarray(positions), jnp.arange(slots, dtype=jnp.int32)))(one)
    q = jnp.asarray(rng.standard_normal((rows, heads, d)), jnp.bfloat16)
    starts = np.zeros((rows, 32), np.int32)
    starts[0, :4] = np.arange(4) * 16               # positions 0..63 at slots 0..63
    starts[1, :4] = np.arange(4) * 16 + 128         # positions 0..63 at slots 128..191
    tables = RowTables(jnp.zeros(rows, jnp.int32), jnp.asarray(starts), jnp.full(rows, 16, jnp.int32))
    qpos = jnp.array([37, 60], jnp.int32)
    tp = make_tensor_parallel(2)
    sharded_cache = jax.tree.map(lambda x: jax.device_put(x, tp.sharding("tp", *[None] * (x.ndim - 1))), one)
    qs = jax.device_put(q, tp.sharding(None, "tp", None))
    sharded = jax.jit(lambda q, c: sharded_decode_attention(tp, q, qpos, tables, c, None, backend="kernel",
                                                            interpret=True))(qs, sharded_cache)
    ref = sharded_decode_attention(None, q, qpos, tables, one, None, backend="reference")
    return {"max_abs_diff": float(jnp.max(jnp.abs(sharded.astype(jnp.float32) - ref.astype(jnp.float32)))),
            "ref_max_abs": float(jnp.max(jnp.abs(ref.astype(jnp.float32)))),
            "delta_sharding": str(sharded_cache.k_delta.sharding.spec), "out_sharding": str(sharded.sharding.spec)}


def host_tier_at_tp2() -> dict:
    """A DKVC (fp8-delta) engine at tp=2 whose 512-token pool forces a 150-token prompt's pages out to a host
    tier while 4 others run: the prompt again, its prefix recalled. -> tokens of both runs, cached prompt
    tokens and host hits of the second."""
    rng = np.random.default_rng(2)
    prompts = [[int(t) for t in rng.integers(3, 500, 150)] for _ in range(5)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = Engine(RuntimeConfig(model="tiny", dtype="float32", max_context=256, kv_pool_tokens=512,
                                  max_batch_size=4, prefill_chunk=64, max_tokens_cap=64, page_size=16,
                                  kv_host_tokens=4096, kv_precision="fp8-delta", tensor_parallel=2,
                                  compilation_cache_dir=None))
    first = engine.generate([prompts[0]], sp)[0]
    for other in prompts[1:]:
        engine.generate([other], sp)
    again = engine.generate([prompts[0]], sp)[0]
    stats = engine.stats()
    engine.close()
    return {"first": first.token_ids, "again": again.token_ids, "cached": again.cached_prompt_tokens,
            "host_hits": stats.kv_host_hits, "recalled_pages": stats.kv_recalled_pages}


def hf_load() -> dict:
    """The embedded HF checkpoint (pydoc-2m: tied embedding, 4 heads, 2 KV heads) loaded at tp=4, against
    tp=1: whether every tp=4 parameter equals the tp=1 one (k/v projections: with each KV head repeated
    as kv_source_rows says), and the per-device shapes of a few."""
    one = load_model("pydoc-2m", dtype="float32")
    tp = make_tensor_parallel(4)
    four = load_model("pydoc-2m", dtype="float32", tp=tp)
    rows = tp.kv_source_rows(one.config)
    same = {}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(one.params)[0], jax.tree.leaves(four.params)):
        a = np.asarray(a)
        if path[-2].key in ("k_proj", "v_proj"):
            a = a[rows]
        same["/".join(k.key for k in path)] = bool(np.array_equal(a, np.asarray(b)))
    layer = four.params["layers_0"]
    return {"equal": same, "num_kv_heads": four.config.num_kv_heads,
            "per_device": {k: [list(s.data.shape) for s in v.addressable_shards]
                           for k, v in (("embed_tokens", four.params["embed_tokens"]["weight"]),
                                        ("k_proj", layer["self_attn"]["k_proj"]["weight"]),
                                        ("gate_proj", layer["mlp"]["gate_proj"]["weight"]))}}


def errors() -> dict:
    """The messages of bad --tensor-parallel values (None when no error)."""
    out = {}
    for name, extra in (("tp3_heads", ["--model", "tiny", "--tensor-parallel", "3"]),
                        ("tp8_devices", ["--model", "tiny", "--tensor-parallel", "8"])):
        try:
            Engine(RuntimeConfig.from_cli_args(generate.build_parser().parse_args(FLAGS + extra)))
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def main() -> None:
    """argv: PART then the generate flags. PART "engines": the engine runs (layouts, collectives, errors);
    "pieces": the HF load and the kernel under shard_map (the test runs both parts side by side)."""
    result = {"devices": jax.device_count()}
    if PART == "engines":
        result.update(runs={}, layout={}, collectives={})
        tiny = ["--model", "tiny"]
        # tp=4 with --tp-embedding auto: tiny's 128 KB LM head is replicated (tensor_parallel.choose_embedding).
        fp8 = ["--kv-precision", "fp8-delta"]
        cases = {"tiny_tp1": tiny,
                 "tiny_tp2": tiny + ["--tensor-parallel", "2", "--tp-embedding", "vocab-parallel"],
                 "tiny_tp4_auto": tiny + ["--tensor-parallel", "4", "--tp-embedding", "auto"],
                 # DKVC: anchors, deltas and scales split over kv heads like the bf16 pools.
                 "tiny_fp8_tp1": tiny + fp8,
                 "tiny_fp8_tp2": tiny + fp8 + ["--tensor-parallel", "2"]}
        for name, extra in cases.items():
            outputs, engine = run_cli_config(extra)
            result["runs"][name] = outputs
            if engine.model.tp is not None and "fp8" in name:
                result["layout"][name] = delta_layout(engine)
            elif engine.model.tp is not None:
                result["layout"][name] = layout(engine)
                result["collectives"][name] = collectives(engine)
        result["errors"] = errors()
    else:
        result["hf_load"] = hf_load()
        result["kernel"] = kernel_under_shard_map()
        result["delta_kernel"] = delta_kernel_under_shard_map()
        result["host_tier"] = host_tier_at_tp2()
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
