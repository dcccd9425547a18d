"""The jit-compiled model step: one forward over a [seqs, chunk] batch on the paged cache, then sampling.

`model_step` serves prefill chunks (and single decode tokens); `decode_steps` runs several decode steps
in one call with `lax.fori_loop`, feeding each sampled token back on device, so the host's per-step work
(building inputs, reading tokens back, detokenizing) is paid once per call instead of once per token.
Shapes are bucketed by the engine (rows, chunk, context bound and step count are powers of two), so each
bucket compiles once. The KV cache is donated: XLA updates the pools in place.

Attention-score variance (`attn_score_var`, for the page-size rule and the DMLP's `attn_var5` feature).
For one query row (one q head of one sequence at one token), s_j = sm_scale * q . k_j is the softmax
input for key j, and the row's score variance is the population variance of s_j over the keys it sees:
mean(s^2) - mean(s)^2 (see stratum_jax/attention.py). Each step averages it over all q heads and all
layers for each query token; then
  - `decode_steps` returns it per step and row: DecodeResult.attn_score_var [num_steps, rows], 0 for
    a row that is not running at that step;
  - `model_step` returns StepResult.attn_score_var [rows]: the mean over the row's last
    min(ATTN_VAR_LAST_TOKENS, valid tokens in the chunk) valid query tokens (valid: q_position >= 0;
    "last" in chunk-column order, which is position order as the engine lays chunks out); 0 for a
    row with no valid token. For a decode token (chunk 1) this is that token's value.
The kernel backend gets it from the kernel (`return_score_stats=True`), the reference backend from
the scores it computes anyway. StepOptions.attn_stats=False turns it off (zeros, the plain kernel).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from stratum_jax.attention import AttentionMetadata, paged_attention_for_step
from stratum_jax.model import llama
from stratum_jax.sampling import SamplingArrays, sample, token_logprobs


@dataclasses.dataclass(frozen=True)
class StepResult:
    """tokens [S]; logprob [S]; top_ids/top_logprobs [S, K]; prompt_* are [S, C] / [S, C, K] or empty;
    attn_score_var [S] float32 (module docstring: last <= 5 valid tokens of the chunk)."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    prompt_logprob: jax.Array
    prompt_top_ids: jax.Array
    prompt_top_logprobs: jax.Array
    attn_score_var: jax.Array


jax.tree_util.register_dataclass(
    StepResult, data_fields=[f.name for f in dataclasses.fields(StepResult)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The static part of a step: each distinct value compiles its own program."""

    max_context: int            # gather bound of the reference attention (a power of two)
    backend: str = "reference"
    interpret: bool = False
    greedy_only: bool = True
    top_logprobs: int = 0       # K of the top-K logprobs for sampled tokens
    prompt_logprobs: int = -1   # -1: no prompt logprobs; else K for every position of the chunk
    attn_stats: bool = True     # compute attn_score_var (False: zeros, and the plain kernel)


# StepResult.attn_score_var averages over the last this-many valid query tokens of a row's chunk (the
# DMLP's "variance of attention scores over the last 5 tokens").
ATTN_VAR_LAST_TOKENS = 5


def last_valid_columns(q_positions, last: int = ATTN_VAR_LAST_TOKENS):
    """Each row's last min(last, #valid) valid chunk columns (valid: q_positions >= 0; last in column
    order): (cols [S, K] int32, ok [S, K] bool) with K = min(last, chunk); unused entries have ok
    False (and col 0)."""
    chunk = q_positions.shape[1]
    k = min(last, chunk)
    if chunk == 1:
        return jnp.zeros_like(q_positions), q_positions >= 0
    keyed = jnp.where(q_positions >= 0, jnp.arange(chunk, dtype=jnp.int32)[None, :], -1)
    top, _ = lax.top_k(keyed, k)                                  # the k largest valid column indices
    return jnp.maximum(top, 0), top >= 0


def _model_step(params, kv_cache, token_ids, write_slots, meta: AttentionMetadata, sample_cols,
               sampling: SamplingArrays, next_token_ids, *, cfg, opts: StepOptions):
    """One engine step.

    token_ids, write_slots, next_token_ids: [S, C] int32 (write slot >= num_slots = padding, dropped;
    next_token_ids is the prompt token after each position, for prompt logprobs, -1 where none).
    sample_cols: [S] int32, the chunk column whose logits are sampled (the sequence's last new token).
    Returns (StepResult, new kv_cache).
    """
    seqs, chunk = token_ids.shape
    # Per-layer head-mean score variance [S, K] of each row's last K <= 5 valid tokens, collected by
    # the attend closure. llama.forward runs its layers as a plain Python loop inside this trace (no
    # lifted transforms), so the collected values are ordinary values of this trace.
    layer_var = []
    stats_cols, stats_ok = last_valid_columns(meta.q_positions)

    def attend(layer, q, k_pool, v_pool):
        q = q.reshape(seqs, chunk, *q.shape[1:])
        out = paged_attention_for_step(q, k_pool, v_pool, meta, max_context=opts.max_context,
                                       backend=opts.backend, interpret=opts.interpret,
                                       return_score_stats=opts.attn_stats, stats_columns=stats_cols)
        if opts.attn_stats:
            out, var = out
            layer_var.append(jnp.mean(var, axis=-1))
        return out.reshape(seqs * chunk, *out.shape[2:])

    positions = jnp.maximum(meta.q_positions, 0).reshape(-1)
    with jax.named_scope("forward"):
        hidden, kv_cache = llama.forward(params, cfg, token_ids.reshape(-1), positions, kv_cache,
                                         write_slots.reshape(-1), attend)
    hidden = hidden.reshape(seqs, chunk, -1)
    if layer_var:
        token_var = sum(layer_var[1:], layer_var[0]) / len(layer_var)                # [S, K]
        n = jnp.sum(stats_ok, axis=1, dtype=jnp.float32)
        attn_score_var = jnp.sum(jnp.where(stats_ok, token_var, 0.0), axis=1) / jnp.maximum(n, 1.0)
    else:
        attn_score_var = jnp.zeros((seqs,), jnp.float32)
    with jax.named_scope("sampling"):
        last = jnp.take_along_axis(hidden, sample_cols[:, None, None], axis=1)[:, 0]
        logits = llama.compute_logits(params, cfg, last)
        tokens = sample(logits, sampling, greedy_only=opts.greedy_only)
        logprob, top_ids, top_lp = token_logprobs(logits, tokens, top_k=opts.top_logprobs)
    if opts.prompt_logprobs >= 0:
        all_logits = llama.compute_logits(params, cfg, hidden.reshape(seqs * chunk, -1))
        p_lp, p_ids, p_top = token_logprobs(all_logits, next_token_ids.reshape(-1), top_k=opts.prompt_logprobs)
        p_lp = p_lp.reshape(seqs, chunk)
        p_ids = p_ids.reshape(seqs, chunk, -1)
        p_top = p_top.reshape(seqs, chunk, -1)
    else:
        p_lp = jnp.zeros((0, 0))
        p_ids = jnp.zeros((0, 0, 0), jnp.int32)
        p_top = jnp.zeros((0, 0, 0))
    return StepResult(tokens, logprob, top_ids, top_lp, p_lp, p_ids, p_top, attn_score_var), kv_cache


model_step = jax.jit(_model_step, static_argnames=("cfg", "opts"), donate_argnames=("kv_cache",))


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """tokens, logprob: [steps, rows]; top_ids, top_logprobs: [steps, rows, K];
    attn_score_var: [steps, rows] float32 (module docstring; 0 where the row is not running)."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    attn_score_var: jax.Array


jax.tree_util.register_dataclass(
    DecodeResult, data_fields=[f.name for f in dataclasses.fields(DecodeResult)], meta_fields=[])


@functools.partial(jax.jit, static_argnames=("cfg", "opts", "num_steps"), donate_argnames=("kv_cache",))
def decode_steps(params, kv_cache, last_tokens, positions, steps_allowed, page_starts, page_sizes,
                 sampling: SamplingArrays, *, cfg, opts: StepOptions, num_steps: int):
    """Up to `num_steps` decode steps for every row, in one device call.

    last_tokens, positions: [rows] int32, each row's newest token and its position (its K/V is not yet
    in the cache). steps_allowed: [rows] int32, how many steps each row may take (0 for padding rows);
    once a row has used them its writes are dropped and its attention sees an empty context, so a row
    that must stop early never writes past its pages. page_starts [rows, max_pages], page_sizes [rows]:
    the block tables (pages for positions + steps_allowed - 1 must already exist).
    Returns (DecodeResult, new kv_cache); entries past a row's steps_allowed are meaningless, except
    attn_score_var, which is 0 there.
    """
    rows = last_tokens.shape[0]
    num_slots = kv_cache[0][0].shape[1]
    k = opts.top_logprobs
    batch_rows = jnp.arange(rows)

    def body(i, carry):
        kv, tokens, pos, out = carry
        active = i < steps_allowed
        page = jnp.minimum(pos // page_sizes, page_starts.shape[1] - 1)
        slot = jnp.where(active, page_starts[batch_rows, page] + pos % page_sizes, num_slots)
        meta = AttentionMetadata(q_positions=jnp.where(active, pos, -1)[:, None],
                                 context_lens=jnp.where(active, pos + 1, 0),
                                 page_starts=page_starts, page_sizes=page_sizes)
        step_sampling = dataclasses.replace(sampling, token_index=sampling.token_index + i)
        result, kv = _model_step(
            params, kv, tokens[:, None], slot[:, None], meta, jnp.zeros(rows, jnp.int32), step_sampling,
            jnp.full((rows, 1), -1, jnp.int32), cfg=cfg, opts=opts)
        out = DecodeResult(out.tokens.at[i].set(result.tokens), out.logprob.at[i].set(result.logprob),
                           out.top_ids.at[i].set(result.top_ids), out.top_logprobs.at[i].set(result.top_logprobs),
                           out.attn_score_var.at[i].set(jnp.where(active, result.attn_score_var, 0.0)))
        return kv, result.tokens, pos + 1, out

    out = DecodeResult(jnp.zeros((num_steps, rows), jnp.int32), jnp.zeros((num_steps, rows), jnp.float32),
                       jnp.zeros((num_steps, rows, k), jnp.int32), jnp.zeros((num_steps, rows, k), jnp.float32),
                       jnp.zeros((num_steps, rows), jnp.float32))
    kv_cache, _, _, out = lax.fori_loop(0, num_steps, body, (kv_cache, last_tokens, positions, out))
    return out, kv_cache
