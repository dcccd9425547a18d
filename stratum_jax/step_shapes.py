"""The bounded set of step shapes an engine can run, derived from its config alone.

A step is either a packed step (decode tokens of every row plus `prefill_tokens` prompt tokens) or a
multi-step decode call. The row count (--max-batch-size), the block-table width (--max-context / 8)
and the number of decode steps per call are fixed by the config, so the only compile axis is the
packed step's prefill token count, padded to one of a few buckets up to the per-step token budget
(--max-num-batched-tokens). Every shape here is compiled before the server reports SERVING.
"""
from __future__ import annotations

import dataclasses
import itertools

from stratum_jax.config import RuntimeConfig
from stratum_jax.decode import SamplerVariant

# Query tokens per prefill tile (the tiled attention's unit). A chunk starts on a tile boundary, so a
# prefill row wastes at most tile - 1 padding tokens; larger tiles re-read the context fewer times.
MAX_PREFILL_TILE = 128


SAMPLER_VARIANTS = tuple(SamplerVariant(sampled, logprobs)
                         for sampled, logprobs in itertools.product((False, True), repeat=2))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """An executable the engine runs: kind "decode" (multi-step, no prefill; one per sampler variant),
    "packed" (decode tokens plus `prefill_tokens` prompt tokens; samples greedily), "sample" (re-samples
    a packed step's logits; one per non-greedy variant) or "prompt_logprobs" (one piece)."""

    kind: str
    prefill_tokens: int = 0
    variant: SamplerVariant = SamplerVariant()

    def file_label(self) -> str:
        """A file-name-safe label, e.g. packed_p256 or decode_sampled_logprobs."""
        if self.kind == "packed":
            return f"packed_p{self.prefill_tokens}"
        flags = ["sampled"] * self.variant.sampled + ["logprobs"] * self.variant.logprobs
        return "_".join([self.kind, *flags])

    def __str__(self) -> str:
        v = f"sampled={self.variant.sampled}, logprobs={self.variant.logprobs}"
        if self.kind == "packed":
            return f"packed(prefill_tokens={self.prefill_tokens})"
        return f"{self.kind}({v})" if self.kind in ("decode", "sample") else self.kind


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
    """Every executable the engine can run with this config: a decode call per sampler variant, a packed
    step per prefill bucket, the re-samplers and the prompt-logprob piece."""
    return ([StepShape("decode", variant=v) for v in SAMPLER_VARIANTS]
            + [StepShape("packed", p) for p in prefill_buckets(config)]
            + [StepShape("sample", variant=v) for v in SAMPLER_VARIANTS if v.sampled or v.logprobs]
            + [StepShape("prompt_logprobs")])
