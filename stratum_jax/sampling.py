"""On-device sampling: greedy, temperature, top-k, top-p, per-request seeds, and logprobs.

Each row draws from its own key, `fold_in(key(seed), token_index)`, so a request's samples depend only on
its seed and how many tokens it has produced, never on what else shares the batch.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling parameters as device arrays ([rows] each). temperature 0 = greedy; top_k 0 = off."""

    temperature: jax.Array    # float32
    top_p: jax.Array          # float32
    top_k: jax.Array          # int32
    seed_hi: jax.Array        # uint32, high word of the 64-bit seed
    seed_lo: jax.Array        # uint32
    token_index: jax.Array    # int32, how many tokens the request has generated before this one


jax.tree_util.register_dataclass(
    SamplingArrays, data_fields=["temperature", "top_p", "top_k", "seed_hi", "seed_lo", "token_index"],
    meta_fields=[])


def _row_keys(s: SamplingArrays) -> jax.Array:
    def one(hi, lo, idx):
        key = jax.random.wrap_key_data(jnp.stack([hi, lo]), impl="threefry2x32")
        return jax.random.fold_in(key, idx)
    return jax.vmap(one)(s.seed_hi, s.seed_lo, s.token_index)


def sample(logits: jax.Array, s: SamplingArrays, *, greedy_only: bool) -> jax.Array:
    """logits [rows, vocab] float32 -> token ids [rows] int32.

    greedy_only is static: a batch with no sampled rows skips the sort over the vocabulary.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if greedy_only:
        return greedy
    vocab = logits.shape[-1]
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    order = jnp.argsort(-logits, axis=-1)                                   # [rows, vocab], best first
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1) / temp
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    k = jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    sorted_logits = jnp.where(rank < k, sorted_logits, -jnp.inf)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = (mass_before < s.top_p[:, None]) | (rank == 0)
    sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(_row_keys(s), sorted_logits)  # index into the sorted order
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(s.temperature > 0, sampled, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array, *, top_k: int):
    """Log-probabilities of the model's distribution (before temperature) for chosen tokens and the top-k.

    logits [rows, vocab] float32, tokens [rows] int32 -> (chosen [rows], top_ids [rows, top_k],
    top_logprobs [rows, top_k]). top_k is static (0 skips the top-k).
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, jnp.maximum(tokens, 0)[:, None], axis=-1)[:, 0]
    if top_k == 0:
        empty = jnp.zeros((logits.shape[0], 0))
        return chosen, empty.astype(jnp.int32), empty
    top_lp, top_ids = jax.lax.top_k(logp, top_k)
    return chosen, top_ids.astype(jnp.int32), top_lp
