"""The model and the engine run two ways, shared by the tests of the kernels fused into the decode step
(test_rope_kv_write.py, test_residual_rmsnorm.py): a forward over 8 token rows whose program and outputs two
`Matmul`s can be compared on, and an engine's greedy tokens under --projections kernel or xla."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.model import llama

TOKENS = jnp.asarray([5, 17, 99, 3, 250, 7, 1, 42], jnp.int32)
POSITIONS = jnp.asarray([0, 1, 2, 3, 40, 41, 42, 43], jnp.int32)
SLOTS = jnp.asarray([3, 9, 10, 11, 33, 20, 64, 65], jnp.int32)          # the last two: padding (64 slots)


def forward_with(cfg, params, matmul, prefetches: list | None = None) -> tuple[str, list[np.ndarray]]:
    """One jitted forward over TOKENS on random bf16 pools of 64 slots with `matmul`'s projections: (its jaxpr, as
    text: which path it took; [hidden, every pool] as float32 arrays). prefetches: where given, collects the
    `prefetch` each attend call got (llama.Attend: the o projection's WeightPrefetch, or None)."""
    rng = np.random.default_rng(0)
    cache = [tuple(jnp.asarray(rng.standard_normal((cfg.num_kv_heads, 64, cfg.head_dim)), jnp.bfloat16)
                   for _ in range(2)) for _ in range(cfg.num_layers)]
    # One jitted program, awaited (the interpreter's callbacks and an eager forward once deadlocked on 2 cores).
    def attend(layer, q, k, v, prefetch=None):
        if prefetches is not None:
            prefetches.append(prefetch)
        return llama.attend_dense_causal(q, k, v, POSITIONS)
    forward = jax.jit(lambda p, c: llama.forward(p, cfg, TOKENS, POSITIONS, c, SLOTS, attend, matmul))
    program = str(jax.make_jaxpr(forward)(params, cache))
    hidden, cache = forward(params, cache)
    return program, [np.asarray(a, np.float32) for a in (hidden, *jax.tree.leaves(cache))]


def greedy_tokens(cfg, projections: str, **config) -> list[list[int]]:
    """The engine's real step (packed prefill, then decode calls of 2 steps) on a random-init model of `cfg`, with
    --projections `projections` (and any other RuntimeConfig fields in `config`) and the kernels in the interpreter:
    two prompts' 4 greedy tokens each."""
    from stratum_jax.config import RuntimeConfig
    from stratum_jax.engine import Engine
    from stratum_jax.model.loader import LoadedModel
    from stratum_jax.model.tokenizer import ByteTokenizer
    from stratum_jax.request import SamplingParams

    model = LoadedModel(config=cfg, params=llama.init_params(cfg, seed=0), tokenizer=ByteTokenizer(cfg.vocab_size),
                        name="tiny-variant")
    engine = Engine(RuntimeConfig(model="tiny", max_context=256, kv_pool_tokens=4096, max_batch_size=2,
                                  prefill_chunk=64, page_size=8, decode_steps=2, projections=projections,
                                  interpret_kernels=True, **config), model=model)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return [r.token_ids for r in engine.generate([[5, 6, 7], list(range(20, 45))], sp)]
