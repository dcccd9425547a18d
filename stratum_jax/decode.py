"""The jit-compiled step: one forward over a packed token batch on the paged cache, then sampling.

A step's tokens are packed into one flat array of `rows + prefill_tokens` tokens (`PackedBatch`):
  - tokens [0, rows) are the decode tokens: token r is row r's newest token (position -1 if row r
    does not decode this step);
  - tokens [rows, rows + prefill_tokens) are prefill chunks, laid out in query tiles of
    `StepGeometry.prefill_tile` tokens; every tile belongs to one row (`tile_rows`), a chunk starts on
    a tile boundary and the rest of its last tile is padding (position -1).
Every matmul, norm and the KV write run once over the flat array, so prefill chunks ride along with
the decode tokens in one device call. Attention splits: decode tokens go to the Pallas kernel (or the
tiled jnp path), prefill tiles to the kernel's causal-block variant (or the tiled jnp path, whose loop
over key blocks has a data-dependent trip count; stratum_jax/attention.py). So the only compile axis is `prefill_tokens` (a small set of
buckets, stratum_jax/step_shapes.py); the row count and the block-table width are fixed by the config,
and sampling settings (temperature, top-p/k, seeds, logprobs) are arrays.

`decode_steps` runs `StepGeometry.decode_steps` decode-only steps in one call (rows that may take fewer
stop writing), feeding each sampled token back on device, so the host's per-step work is paid once
per call. Sampling work that costs milliseconds at a large vocabulary (the sort of top-p/top-k
sampling, the top-K of logprobs) is a static `SamplerVariant` the host picks per batch: a packed step
samples greedily and hands its logits to the small `sample_step` executable when a row needs more. The KV cache is donated: XLA updates the
pools in place.

Attention-score variance (`attn_score_var`, for the page-size rule and the DMLP's `attn_var5`, the
variance over a request's last 5 *decoded* tokens). For one query row (one q head of one token),
s_j = sm_scale * q . k_j is the softmax input for key j, and its score variance is the population variance
of s_j over the keys it sees. A token's value is the mean over all q heads and layers; a row's value is its
decode token's value times `stats_weight` (the host puts 1 on a row with a decode token, 0 elsewhere).
Computed only with StepGeometry.attn_stats (zeros otherwise), and only for decode tokens: prompt tokens
are not decoded tokens, and measuring them kept prefill off the warp-specialised kernel (which computes no
statistics): the DMLP servers of the H200 replay prefilled 16-17% fewer tokens/s than LRU (BENCHMARKS.md, #13
session 14).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from stratum_jax.attention import RowTables
from stratum_jax.kv.delta_cache import num_slots_of
from stratum_jax.kv.slot_write import padding_slots
from stratum_jax.model import llama
from stratum_jax.model.projection import FirstTiles, step_matmul
from stratum_jax.sampling import MAX_TOP_LOGPROBS, SamplingArrays, sample, token_logprobs
from stratum_jax.tensor_parallel import TensorParallel, replicate, shard_vocab
from stratum_jax.tp_attention import sharded_decode_attention, sharded_prefill_attention


@dataclasses.dataclass(frozen=True)
class StepGeometry:
    """The static part of every step an engine runs, fixed by its config (one value per engine)."""

    rows: int                   # decode rows = --max-batch-size
    table_width: int            # block-table entries per row = --max-context / 8
    prefill_tile: int           # query tokens per prefill tile
    decode_steps: int           # most decode steps per decode_steps call
    backend: str = "reference"  # decode attention: "kernel" (Pallas) or "reference"
    projections: str = "xla"    # the layers' projections: "kernel" (Pallas, for few rows) or "xla" (projection.py)
    interpret: bool = False     # run the Pallas kernels in the interpreter (CPU tests)
    l2_prefetch_mb: float = 0.0  # the kernels' L2 prefetch ahead of the next one (config.py l2_prefetch_mb)
    norms_folded: bool = False  # the model's norms are folded into its weights: the folded decode layer (--fold-norms)
    # Prefill attention kernel: "ws" (warp-specialised, three warpgroups per CTA) or "single" (the decode
    # kernel's pipeline). The interpreter runs a multi-warpgroup CTA as threads that each execute an XLA
    # CPU computation; with the engine's overlapped steps they can starve XLA's CPU execution threads
    # and deadlock (seen on a 2-core machine), so interpreted engines use "single" (the ws kernel has its
    # own interpreter tests, one call at a time).
    prefill_kernel: str = "ws"
    decode_kernel: str = "swapped"      # the bf16 decode kernel (config.py DECODE_KERNELS)
    prefill_splits: int | str | None = "auto"   # split-K over the context in the WS prefill kernel
    attn_stats: bool = False    # compute attn_score_var
    tp: TensorParallel | None = None   # the mesh the params and pools are laid out on (None: one device)

    @property
    def max_context(self) -> int:
        """Positions the block table addresses (8-token pages at full width): the attention loop's bound."""
        return self.table_width * 8


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One step's inputs (module docstring for the layout). T = rows + prefill_tokens.

    token_ids [T] int32; positions [T] int32 (-1: padding); write_slots [T] int32 (>= num_slots:
    dropped); stats_weight [T] float32 (module docstring; only the decode rows' entries are read); prompt_next [T] int32, the prompt token
    after each position, for prompt logprobs (-1: none); tile_rows [prefill_tokens / tile] int32;
    tables: RowTables over [rows]; sample_index [rows] int32, the token whose logits row r samples.
    """

    token_ids: jax.Array
    positions: jax.Array
    write_slots: jax.Array
    stats_weight: jax.Array
    prompt_next: jax.Array
    tile_rows: jax.Array
    tables: RowTables
    sample_index: jax.Array


jax.tree_util.register_dataclass(
    PackedBatch, data_fields=[f.name for f in dataclasses.fields(PackedBatch)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """Decode rows' input tokens that the previous step sampled and the host has not read yet (async
    scheduling: the next step is dispatched before the previous one's results reach the host).

    tokens [rows] int32: the previous step's `next_tokens` (each of its rows' last sampled token), on the
    device; source_rows [rows] int32: for each row of this step, the previous step's row whose token it
    takes, or -1 to keep the token the host packed.
    """

    tokens: jax.Array
    source_rows: jax.Array

    def apply(self, host_tokens):
        """host_tokens [rows] int32 -> [rows] int32 with fed rows replaced on the device."""
        fed = self.tokens[jnp.maximum(self.source_rows, 0)]
        return jnp.where(self.source_rows >= 0, fed, host_tokens)


jax.tree_util.register_dataclass(
    TokenFeed, data_fields=[f.name for f in dataclasses.fields(TokenFeed)], meta_fields=[])


@dataclasses.dataclass(frozen=True)
class StepResult:
    """tokens [rows] (greedy); logits [rows, vocab] float32 of each row's sampled position;
    prefill_hidden [P, hidden_size] (after the final norm); attn_score_var [rows] float32."""

    tokens: jax.Array
    logits: jax.Array
    prefill_hidden: jax.Array
    attn_score_var: jax.Array


jax.tree_util.register_dataclass(
    StepResult, data_fields=[f.name for f in dataclasses.fields(StepResult)], meta_fields=[])


def _forward(params, kv_cache, batch: PackedBatch, *, cfg, geo: StepGeometry):
    """The model over the packed tokens -> (hidden [T, hidden_size], attn_score_var [rows], kv_cache)."""
    rows, tile = geo.rows, geo.prefill_tile
    total = batch.token_ids.shape[0]
    prefill = total - rows
    tiles = prefill // tile
    layer_var = []

    def attend(layer, q, k_pool, v_pool, prefetch=None):
        # prefetch: the o projection's weight and plan for the decode kernel's L2 prefetch (llama.Attend).
        res = sharded_decode_attention(geo.tp, q[:rows], batch.positions[:rows], batch.tables, k_pool, v_pool,
                                       backend=geo.backend, interpret=geo.interpret, max_context=geo.max_context,
                                       return_score_stats=geo.attn_stats, kernel_variant=geo.decode_kernel,
                                       prefetch=prefetch)
        out, var = res if geo.attn_stats else (res, None)
        if geo.attn_stats:
            layer_var.append(jnp.mean(var, axis=-1))                                 # [rows]
        if not tiles:
            return out
        # Prompt tokens: no statistics (module docstring), so the prefill runs its fastest kernel.
        pre = sharded_prefill_attention(geo.tp, q[rows:].reshape(tiles, tile, *q.shape[1:]),
                                        batch.positions[rows:].reshape(tiles, tile), batch.tile_rows,
                                        batch.tables, k_pool, v_pool, backend=geo.backend,
                                        interpret=geo.interpret, max_context=geo.max_context,
                                        kernel_variant=geo.prefill_kernel, prefill_splits=geo.prefill_splits)
        return jnp.concatenate([out, pre.reshape(prefill, *q.shape[1:])])

    with jax.named_scope("forward"):
        # The decode rows' tables for the fused q/k/v write's prefetch of attention's first tiles (one device only).
        first_tiles = (FirstTiles(batch.tables.page_starts, batch.tables.page_sizes, batch.tables.context_lens)
                       if geo.l2_prefetch_mb > 0 and geo.tp is None else None)
        hidden, kv_cache = llama.forward(params, cfg, batch.token_ids, jnp.maximum(batch.positions, 0), kv_cache,
                                         batch.write_slots, attend,
                                         step_matmul(geo.projections, interpret=geo.interpret,
                                                     l2_prefetch_mb=geo.l2_prefetch_mb,
                                                     norms_folded=geo.norms_folded), first_tiles)
    if layer_var:
        attn_var = sum(layer_var[1:], layer_var[0]) / len(layer_var) * batch.stats_weight[:rows]
    else:
        attn_var = jnp.zeros((rows,), jnp.float32)
    return hidden, attn_var, kv_cache


@dataclasses.dataclass(frozen=True)
class SamplerVariant:
    """Which sampling work a step does, chosen per batch by the host (each variant compiles once):
    sampled: some row has temperature > 0 (else argmax only: the sort over the vocabulary costs ~2 ms
    per step at a 128K vocabulary on an H200); logprobs: some row asked for logprobs (the top-K over the
    vocabulary costs ~1 ms per step there). Per-row settings stay arrays (SamplingArrays)."""

    sampled: bool = False
    logprobs: bool = False


def sample_logits(logits, sampling: SamplingArrays, *, variant: SamplerVariant):
    """logits [rows, vocab] float32 -> (tokens [rows], logprob [rows], top_ids / top_logprobs [rows, K]);
    K = MAX_TOP_LOGPROBS with variant.logprobs, else 0 (and logprob is zeros)."""
    tokens = sample(logits, sampling, greedy_only=not variant.sampled)
    if not variant.logprobs:
        rows = logits.shape[0]
        empty = jnp.zeros((rows, 0), jnp.float32)
        return tokens, jnp.zeros((rows,), jnp.float32), empty.astype(jnp.int32), empty
    return (tokens, *token_logprobs(logits, tokens, top_k=MAX_TOP_LOGPROBS))


sample_step = jax.jit(sample_logits, static_argnames=("variant",))

# Prompt logprobs are computed in pieces of this many positions by one small executable, only for steps
# whose prefill chunks asked for them.
PROMPT_LOGPROB_PIECE = 64


@functools.partial(jax.jit, static_argnames=("cfg",))
def prompt_logprobs_piece(params, hidden, next_tokens, *, cfg):
    """hidden [PROMPT_LOGPROB_PIECE, hidden_size], next_tokens [PROMPT_LOGPROB_PIECE] int32 (-1: none) ->
    (logprob [n], top_ids [n, K], top_logprobs [n, K]) of each position's next prompt token."""
    return token_logprobs(llama.compute_logits(params, cfg, hidden), next_tokens, top_k=MAX_TOP_LOGPROBS)


# XLA's dot merger turns the gate and up projections (and q/k/v) into one GEMM by concatenating their
# weights on the device. In `decode_steps` the concatenation is loop-invariant (paid once per call of
# several steps); in the packed step it is paid every step, for every layer: 64 MB of gate+up weights per
# layer at llama-1b, a seventh of a batch-64 step with one 256-token chunk (H200 profile, BENCHMARKS.md).
PACKED_STEP_GPU_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


def packed_step_compiler_options(platform: str) -> dict:
    """XLA options `packed_step` is compiled with on `platform` ("gpu", "cpu", ...)."""
    return dict(PACKED_STEP_GPU_COMPILER_OPTIONS) if platform == "gpu" else {}


@functools.partial(jax.jit, static_argnames=("cfg", "geo"), donate_argnames=("kv_cache",))
def packed_step(params, kv_cache, batch: PackedBatch, feed: TokenFeed | None = None, *, cfg, geo: StepGeometry):
    """One engine step over a packed batch (decode tokens and prefill chunks together). feed: decode
    tokens still on the device (TokenFeed), or None.

    Returns (StepResult, new kv_cache). The step samples greedily; a batch with sampled rows or
    logprobs re-samples `StepResult.logits` with `sample_step` (a second, small executable), and prompt
    logprobs come from `StepResult.prefill_hidden` through `prompt_logprobs_piece`.
    """
    if feed is not None:
        batch = dataclasses.replace(
            batch, token_ids=batch.token_ids.at[:geo.rows].set(feed.apply(batch.token_ids[:geo.rows])))
    hidden, attn_var, kv_cache = _forward(params, kv_cache, batch, cfg=cfg, geo=geo)
    logits = shard_vocab(llama.compute_logits(params, cfg, hidden[batch.sample_index]), geo.tp)
    with jax.named_scope("sampling"):
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return replicate(StepResult(tokens, logits, hidden[geo.rows:], attn_var), geo.tp), kv_cache


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """tokens, logprob: [steps, rows]; top_ids, top_logprobs: [steps, rows, MAX_TOP_LOGPROBS];
    attn_score_var: [steps, rows] float32 (0 where the row did not run that step); next_tokens [rows]:
    each row's last sampled token (at step steps_allowed - 1), what the next step feeds back."""

    tokens: jax.Array
    logprob: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array
    attn_score_var: jax.Array
    next_tokens: jax.Array


jax.tree_util.register_dataclass(
    DecodeResult, data_fields=[f.name for f in dataclasses.fields(DecodeResult)], meta_fields=[])


@functools.partial(jax.jit, static_argnames=("cfg", "geo", "variant"), donate_argnames=("kv_cache",))
def decode_steps(params, kv_cache, last_tokens, positions, steps_allowed, tables: RowTables,
                 sampling: SamplingArrays, feed: TokenFeed | None = None, *, cfg, geo: StepGeometry,
                 variant: SamplerVariant):
    """Up to geo.decode_steps decode steps for every row, in one device call.

    last_tokens, positions: [rows] int32, each row's newest token and its position (its K/V is not yet in
    the cache); feed: rows whose newest token is still on the device (TokenFeed), or None.
    steps_allowed: [rows] int32, how many steps each row may take (0: padding row); once a row
    has used them its writes are dropped and it sees no context, so it never writes past its pages.
    tables.page_starts / page_sizes: the rows' block tables (pages for positions + steps_allowed - 1 must
    exist; context_lens is ignored). The loop always runs geo.decode_steps times: a static trip count
    keeps the loop on the device (a data-dependent one makes XLA read its predicate on the host every
    iteration, +1.1 ms per step for llama-1b on an H200), and rows past their steps do no harm.
    Returns (DecodeResult [geo.decode_steps, rows] (entries past a row's steps_allowed are
    meaningless, except attn_score_var, 0 there), new kv_cache).
    """
    rows, k = geo.rows, MAX_TOP_LOGPROBS if variant.logprobs else 0
    num_slots = num_slots_of(kv_cache[0])
    batch_rows = jnp.arange(rows)

    def body(i, carry):
        kv, tokens, last, out = carry
        active = i < steps_allowed
        pos = positions + i
        page = jnp.minimum(pos // tables.page_sizes, tables.page_starts.shape[1] - 1)
        slot = jnp.where(active, tables.page_starts[batch_rows, page] + pos % tables.page_sizes,
                         padding_slots(num_slots, batch_rows))
        batch = PackedBatch(
            token_ids=tokens, positions=jnp.where(active, pos, -1), write_slots=slot,
            stats_weight=active.astype(jnp.float32), prompt_next=jnp.full((rows,), -1, jnp.int32),
            tile_rows=jnp.zeros((0,), jnp.int32),
            tables=RowTables(jnp.where(active, pos + 1, 0), tables.page_starts, tables.page_sizes),
            sample_index=batch_rows)
        hidden, attn_var, kv = _forward(params, kv, batch, cfg=cfg, geo=geo)
        step_sampling = dataclasses.replace(sampling, token_index=sampling.token_index + i)
        logits = shard_vocab(llama.compute_logits(params, cfg, hidden), geo.tp)
        with jax.named_scope("sampling"):
            new, logprob, top_ids, top_lp = sample_logits(logits, step_sampling, variant=variant)
        out = DecodeResult(out.tokens.at[i].set(new), out.logprob.at[i].set(logprob),
                           out.top_ids.at[i].set(top_ids), out.top_logprobs.at[i].set(top_lp),
                           out.attn_score_var.at[i].set(jnp.where(active, attn_var, 0.0)), out.next_tokens)
        return kv, new, jnp.where(active, new, last), out

    steps = geo.decode_steps
    if feed is not None:
        last_tokens = feed.apply(last_tokens)
    out = DecodeResult(jnp.zeros((steps, rows), jnp.int32), jnp.zeros((steps, rows), jnp.float32),
                       jnp.zeros((steps, rows, k), jnp.int32), jnp.zeros((steps, rows, k), jnp.float32),
                       jnp.zeros((steps, rows), jnp.float32), jnp.zeros((rows,), jnp.int32))
    kv_cache, _, last, out = lax.fori_loop(0, steps, body, (kv_cache, last_tokens, last_tokens, out))
    return replicate(dataclasses.replace(out, next_tokens=last), geo.tp), kv_cache
