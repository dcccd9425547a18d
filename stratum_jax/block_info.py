"""What is known about a cached KV block: the feature names and the `BlockInfo` snapshot.

Neutral ground between the page pool (kv/, which records blocks and their features), the cache
policies (dmlp/, which score them) and the block event log: each imports this module, none of them
the others. The DMLP's input encoding of these features is in `stratum_jax/dmlp/features.py`.
"""
from __future__ import annotations

import dataclasses

# The five seed features of the design, then the block features. Order is the model's input order;
# checkpoints store this list and refuse to load under a different one.
SEED_FEATURES = (
    "gen_frac",          # generated tokens / max tokens of the request using the block, 0..1
    "attn_var5",         # variance of attention scores over the last 5 decoded tokens
    "kv_hbm_frac",       # KV occupancy: HBM blocks / (HBM + host blocks), 0..1
    "queue_wait_ms",     # mean upstream queue wait of recent requests
    "gpu_idle_frac",     # fraction of recent wall time the GPU sat idle, 0..1
)
BLOCK_FEATURES = (
    "recency_ms",        # time since the block's previous access (missing on its first)
    "access_count",      # accesses so far, this one included
    "age_ms",            # time since the block was created (0 on creation)
    "depth",             # position in the prefix chain (0 = first block of the prompt)
    "blocks_after",      # blocks after this one in the request's chain
    "fill",              # tokens in the block / block size; < 1 only for a prompt's tail block
    "sharers",           # distinct requests that have used the block, this one included
    "fan_out",           # distinct next blocks seen after this one (prefix-tree branching)
    "prefix_hit_frac",   # share of the request's chain that had been computed before it arrived
    "prefix_uses",       # uses of the deepest block of that reused prefix (~ turns of a conversation)
    "prefix_gap_ms",     # how long that block had been idle when the request came (think time)
    "input_tokens",      # prompt tokens of the request
    "max_tokens",        # output budget of the request (Mooncake: its output_length)
)
FEATURE_NAMES = SEED_FEATURES + BLOCK_FEATURES


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    """A cached block as the engine sees it. Feature fields hold their values at the block's last access
    (`last_access_ms`); `None` means "not known here". Times are ms on one clock.

    `needed_by_running` marks blocks a running request still reads; no policy evicts those.
    """

    block_id: object
    last_access_ms: float
    access_count: int
    depth: int
    recency_ms: float | None = None
    age_ms: float | None = None
    blocks_after: int | None = None
    fill: float | None = None
    sharers: int | None = None
    fan_out: int | None = None
    prefix_hit_frac: float | None = None
    prefix_uses: int | None = None
    prefix_gap_ms: float | None = None
    input_tokens: int | None = None
    max_tokens: int | None = None
    gen_frac: float | None = None
    attn_var5: float | None = None
    kv_hbm_frac: float | None = None
    queue_wait_ms: float | None = None
    gpu_idle_frac: float | None = None
    needed_by_running: bool = False
