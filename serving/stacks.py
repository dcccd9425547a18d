"""The stacks one server runs (--stacks) and the engine configuration of each, derived from the server's.

    stratum       the server's RuntimeConfig as given by its flags: HAB (--scheduler hab), adaptive pages,
                  and DMLP / DKVC / the host tier when their flags are on.
    baseline      what a well-run conventional server does, vLLM's defaults: continuous FCFS batching with
                  chunked prefill, fixed 16-token pages, an LRU prefix cache, bf16 KV, recompute after
                  eviction (no host tier). No HAB, DMLP, DKVC or adaptive pages. Everything else (model,
                  dtype, batch size, step token budget, prefill chunk, async scheduling, context cap) is the
                  Stratum stack's, so the comparison changes only those pillars.
    long-context  the pool that x-stratum-route: long-context (or the classifier, serving/routing.py) sends
                  requests to: the Stratum stack's config with larger pages (--long-context-page-size) and a
                  higher context cap (--long-context-max-context), in its own KV pool.

Each config is derived with `dataclasses.replace`, so RuntimeConfig validates it once like any other. All
engines are built over ONE loaded model (weights and tokenizer shared in the process, no second copy); each
has its own KV pool and runs on its own EngineRunner thread. They share the device: two engines on one GPU
compete for its compute and memory bandwidth, so a stack's latency depends on the other's load too (a w=0.5
split measures both stacks under their combined traffic).
"""
from __future__ import annotations

import dataclasses

from stratum_jax.config import PAGE_SIZE_CLASSES, RuntimeConfig

STRATUM, BASELINE, LONG_CONTEXT = "stratum", "baseline", "long-context"
POOLS = (STRATUM, BASELINE, LONG_CONTEXT)   # what --stacks may name, in this order
BASELINE_PAGE_SIZE = 16                     # vLLM's default block size


def parse_stacks(text: str) -> tuple[str, ...]:
    """--stacks "stratum,baseline" -> ("stratum", "baseline"); ValueError says what to send."""
    names = tuple(dict.fromkeys(n.strip() for n in str(text).split(",") if n.strip()))
    unknown = [n for n in names if n not in POOLS]
    if unknown or STRATUM not in names:
        raise ValueError(f"--stacks must list stratum and optionally baseline and long-context, comma-separated "
                         f"(e.g. stratum,baseline), got {text!r}")
    return tuple(n for n in POOLS if n in names)


def baseline_config(config: RuntimeConfig, kv_pool_tokens: int | None = None) -> RuntimeConfig:
    """The baseline stack's config: `config` with the four pillars off (module docstring).
    kv_pool_tokens: its KV pool (token slots); None = the same size as the Stratum stack's."""
    return dataclasses.replace(
        config, scheduler="fcfs", page_size=BASELINE_PAGE_SIZE, cache_policy="lru", kv_precision="bf16",
        kv_host_tokens=0, dmlp_checkpoint=None, dmlp_online=False, dmlp_online_dir=None, dmlp_online_cores=None,
        enable_prefix_caching=True, trace_out=None,
        kv_pool_tokens=config.kv_pool_tokens if kv_pool_tokens is None else kv_pool_tokens)


def long_context_config(config: RuntimeConfig, *, page_size: int, max_context: int | None,
                        kv_pool_tokens: int | None) -> RuntimeConfig:
    """The long-context pool's config: the Stratum stack's with `page_size`-token pages, context cap
    `max_context` (None = the model's max_position_embeddings, resolved by the server) and its own pool."""
    if page_size not in PAGE_SIZE_CLASSES:
        raise ValueError(f"--long-context-page-size must be one of {PAGE_SIZE_CLASSES}, got {page_size}")
    return dataclasses.replace(
        config, page_size=page_size, max_context=max_context, trace_out=None,
        dmlp_online=False, dmlp_online_dir=None, dmlp_online_cores=None,   # one online fine-tuner: the main pool's
        kv_pool_tokens=config.kv_pool_tokens if kv_pool_tokens is None else kv_pool_tokens)


def kv_pool_tokens_for_share(share: float, device_bytes: int, kv_bytes_per_token: int) -> int:
    """The token slots a KV pool of `share` of the device's memory holds (bf16 pages: kv_bytes_per_token
    bytes per token over all layers)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"--baseline-kv-memory-share must lie in (0, 1), got {share}")
    return max(256, int(share * device_bytes) // kv_bytes_per_token)
