"""The bounded set of step shapes an engine can run, derived from its config alone.

A step is either a packed step (decode tokens of every row plus `prefill_tokens` prompt tokens) or a
multi-step decode call. The row count (--max-batch-size), the block-table width (--max-context / 8)
and the number of decode steps per call are fixed by the config, so the only compile axis is the
packed step's prefill token count, padded to one of a few buckets up to the per-step token budget
(--max-num-batched-tokens). Every shape here is compiled before the server reports SERVING.
"""
from __future__ import annotations

import dataclasses

from stratum_jax.config import RuntimeConfig

# Query tokens per prefill tile (the tiled attention's unit). A chunk starts on a tile boundary, so a
# prefill row wastes at most tile - 1 padding tokens; larger tiles re-read the context fewer times.
MAX_PREFILL_TILE = 64


@dataclasses.dataclass(frozen=True)
class StepShape:
    """kind "packed" (prefill_tokens > 0) or "decode" (multi-step, no prefill)."""

    kind: str
    prefill_tokens: int = 0

    def __str__(self) -> str:
        return "decode" if self.kind == "decode" else f"packed(prefill_tokens={self.prefill_tokens})"


def prefill_tile(config: RuntimeConfig) -> int:
    return min(MAX_PREFILL_TILE, config.prefill_chunk)


def prefill_budget(config: RuntimeConfig) -> int:
    """Prompt-token slots per step: the token budget less one decode token per row, in whole tiles."""
    tile = prefill_tile(config)
    return (config.max_num_batched_tokens - config.max_batch_size) // tile * tile


def prefill_buckets(config: RuntimeConfig) -> tuple[int, ...]:
    """Prefill token counts a packed step is padded to: tile * 2^k below the budget, and the budget."""
    tile, cap = prefill_tile(config), prefill_budget(config)
    sizes, n = [], tile
    while n < cap:
        sizes.append(n)
        n *= 2
    sizes.append(cap)
    return tuple(sizes)


def bucket_for(prefill_tokens: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `prefill_tokens` (the scheduler never schedules more than the last)."""
    for b in buckets:
        if prefill_tokens <= b:
            return b
    raise ValueError(f"{prefill_tokens} prefill tokens exceed the step budget {buckets[-1]}")


def all_step_shapes(config: RuntimeConfig) -> list[StepShape]:
    """Every shape the engine can run with this config: one decode call and one packed step per bucket."""
    return [StepShape("decode")] + [StepShape("packed", p) for p in prefill_buckets(config)]
