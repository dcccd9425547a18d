"""Issue #15's wrong-checkpoint case at the KV cache the engine runs, shared by its CI test
(tests/test_dmlp_guard_wrong_checkpoint.py) and its benchmark (benchmarks/dmlp_guard_wrong_checkpoint.py):
a deliberately wrong DMLP checkpoint, a prefix-sharing load, and the prefix-cache hit rate of that load
through the engine's own `PagePool` and `BlockTable`s under the policy a `RuntimeConfig` builds.

The engine's pieces are called as the engine calls them per request (match_prefix, acquire_prefix,
allocate, register_full_pages, release, and new_step, which hands the step's accesses to the policy);
the model's steps are left out: they do not touch the cache, and a guard judges windows of hundreds of
accesses, so thousands of requests at the tiny model's CPU step time would be minutes.
"""
from __future__ import annotations

import random

import jax
import numpy as np

from stratum_jax.config import RuntimeConfig
from stratum_jax.dmlp.checkpoint import DmlpCheckpoint, save_checkpoint
from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, init_params
from stratum_jax.dmlp.runtime import build_cache_policy
from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.page_pool import PagePool

PAGE = 16
HORIZONS_MS = (10.0, 50.0, 100.0, 200.0, 500.0)


def wrong_checkpoint(path) -> str:
    """Writes, at `path`, a one-unit DMLP whose reuse prediction falls with the page's access count: a
    page used once looks hot, a shared prefix used by many requests looks cold, so it evicts the prefixes
    LRU keeps. Returns the path."""
    f = len(FEATURE_NAMES)
    cfg = DmlpConfig(num_inputs=2 * f, horizons_ms=HORIZONS_MS, hidden=(1,))
    params = jax.tree_util.tree_map(np.zeros_like, jax.device_get(init_params(cfg, 0)))
    params["Dense_0"]["kernel"][FEATURE_NAMES.index("access_count"), 0] = 1.0   # log1p(access count)
    params["Dense_1"]["kernel"][0, :] = -8.0
    params["Dense_1"]["bias"][:] = 4.0
    save_checkpoint(str(path), DmlpCheckpoint(cfg, params, Normalizer(np.zeros(f, np.float32), np.ones(f, np.float32)),
                                              {"time_scale": 1.0}))
    return str(path)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts (token lists): one of 6 shared 3-page prefixes (Zipf-like popularity) and a private
    1-2 page body."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(3 * PAGE)] for _ in range(6)]
    weights = [1.0 / (i + 1) for i in range(6)]
    return [rng.choices(prefixes, weights)[0] + [rng.randrange(3, 250) for _ in range(rng.randrange(16, 40))]
            for _ in range(n)]


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def hit_rate(config: RuntimeConfig, load: list[list[int]], slots: int = 512, concurrent: int = 4):
    """Prefix-cache hit rate of `load` through a pool of `slots` token slots under the policy `config`
    builds; each request holds its pages until `concurrent` later ones arrived (1 simulated ms apart).
    Returns (hit rate, policy)."""
    policy, _ = build_cache_policy(config)
    clock = _Clock()
    pool = PagePool(slots, policy=policy, clock=clock)
    live = []
    for i, tokens in enumerate(load):
        clock.t += 1.0
        pool.new_step()
        full = len(tokens) // PAGE
        table = BlockTable(pool, PAGE)
        table.adopt_prefix(pool.acquire_prefix(pool.match_prefix(tokens, PAGE, full), full, f"r{i}"))
        if not table.ensure_capacity(len(tokens)):
            raise RuntimeError(f"a {slots}-slot pool cannot hold {concurrent + 1} requests of {len(tokens)} tokens")
        table.register_full_pages(tokens, len(tokens), f"r{i}")
        live.append(table)
        if len(live) > concurrent:
            live.pop(0).release()
    if pool.evictions == 0:
        raise RuntimeError("the pool was meant to be small enough to force evictions: make `slots` smaller")
    pool.check_invariants()
    return pool.prefix_hits / pool.prefix_queries, policy
