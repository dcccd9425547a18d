"""The engine loop: admit -> prefill/decode step -> sample -> stream -> free.

`Engine` is the narrow interface every driver uses (the CLI, the gRPC servicer, the benchmarks):
`add_request`, `cancel`, `step`, `stats`, plus `generate` for offline use. It is not thread-safe; a server
runs it on one thread. Each `step` returns, per request, what it produced; exactly one output per accepted
request ever has `finished=True`.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import statistics
import time

import jax
import numpy as np

from stratum_jax.attention import AttentionMetadata
from stratum_jax.config import RuntimeConfig
from stratum_jax.decode import StepOptions, decode_steps, model_step
from stratum_jax.dmlp.features import FEATURE_NAMES
from stratum_jax.dmlp.runtime import build_cache_policy, warm_predictor
from stratum_jax.kv.block_meta import Clock, EngineClock, RequestFeatures, features_of
from stratum_jax.gpu_idle import GpuIdleMeter
from stratum_jax.kv.page_pool import PagePool, prompt_chain_hashes
from stratum_jax.kv.transfer import KvTransfers
from stratum_jax.model.llama import init_kv_cache
from stratum_jax.model.loader import LoadedModel, load_model
from stratum_jax.model.tokenizer import IncrementalDetokenizer
from stratum_jax.request import (FinishReason, InvalidRequestError, QueueFullError, RequestState,
                                 SamplingParams, StepOutput, TokenLogprob)
from stratum_jax.sampling import SamplingArrays
from stratum_jax.scheduler.fcfs import FcfsScheduler, ScheduledBatch
from stratum_jax.sequence import Sequence


@dataclasses.dataclass
class EngineStats:
    queued: int
    running: int
    kv_pages_total: int           # in 8-token base pages
    kv_pages_free: int
    kv_tokens_total: int
    kv_tokens_used: int           # slots in pages that running requests own (allocated)
    kv_tokens_written: int        # of those, slots holding a token (allocated - written = fragmentation)
    prefix_cache_hits: int        # full pages served from the prefix cache
    prefix_cache_queries: int
    preemptions: int
    steps: int
    decode_step_ms: float         # median wall time per decode step (per token) over recent calls
    prefill_tokens_per_s: float   # median over recent prefill steps
    gpu_idle_frac: float | None = None   # share of the last second with no step on the device (gpu_idle.py)
    gpu_idle_gap_ms: float | None = None # idle gap between the previous step's results and the latest dispatch
    kv_host_tokens_total: int = 0        # host tier capacity (0: no host tier)
    kv_host_tokens_used: int = 0         # tokens of the pages it holds
    kv_host_hits: int = 0                # prefix pages a request got from the host tier (also in prefix_cache_hits)
    kv_prefetched_pages: int = 0         # host-tier pages recalled ahead of their request's admission
    kv_offloaded_pages: int = 0          # pages copied HBM -> host
    kv_recalled_pages: int = 0           # pages copied host -> HBM (host hits + prefetches)


@dataclasses.dataclass(frozen=True)
class StepTiming:
    kind: str            # "prefill" or "decode"
    seconds: float       # wall time of the step, inputs to sampled tokens on the host
    num_seqs: int
    num_tokens: int      # new tokens processed (prompt tokens for prefill)


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[list[TokenLogprob]] | None
    prompt_logprobs: list[list[TokenLogprob]] | None
    prompt_tokens: int
    cached_prompt_tokens: int


KERNEL_HEAD_DIMS = (64, 128)


def _resolve_attention(config: RuntimeConfig, model_config) -> str:
    """The decode attention backend: --attention, with "auto" = the Pallas kernel where it runs (a Hopper
    GPU, bf16 KV, head_dim 64/128), else the jnp reference. An explicit "kernel" that cannot run is an
    error that says what to change."""
    # jax's CUDA devices report compute_capability ("9.0" on H100/H200); if a build does not, trust
    # the GPU to be one the kernel compiles for (the compile then says so if not).
    cc = getattr(jax.devices()[0], "compute_capability", None)
    on_hopper = jax.default_backend() == "gpu" and (cc is None or str(cc).startswith("9"))
    fits = model_config.dtype == "bfloat16" and model_config.head_dim in KERNEL_HEAD_DIMS
    if config.attention == "auto":
        return "kernel" if on_hopper and fits else "reference"
    if config.attention == "kernel":
        if not config.interpret_kernels and not on_hopper:
            raise ValueError("--attention kernel needs an NVIDIA Hopper GPU (sm_90); on CPU add "
                             "--interpret-kernels (slow, for tests) or use --attention reference")
        if model_config.dtype != "bfloat16":
            raise ValueError("--attention kernel reads bfloat16 KV pages; add --dtype bfloat16 "
                             f"(the model is {model_config.dtype})")
        if model_config.head_dim not in KERNEL_HEAD_DIMS:
            raise ValueError(f"--attention kernel supports head_dim {KERNEL_HEAD_DIMS}, the model has "
                             f"{model_config.head_dim}: use --attention reference")
    return config.attention


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


class Engine:
    """policy: a cache policy to use instead of the one `config.cache_policy` names (tests).
    clock: ms on the engine's clock for KV block metadata (default: since construction)."""

    def __init__(self, config: RuntimeConfig, model: LoadedModel | None = None, *, policy=None,
                 clock: Clock | None = None):
        self.model = model if model is not None else load_model(config.model, dtype=config.dtype,
                                                                seed=config.seed)
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        # max_context is fixed here, where the model's limit is known (None = that limit, capped).
        self.config = config = config.for_model(self.model_config.max_position_embeddings)
        self.attention_backend = _resolve_attention(config, self.model_config)
        self.num_slots = config.kv_pool_slots
        self.kv_cache = init_kv_cache(self.model_config, self.num_slots)
        # The cache policy (eviction, page size); with --dmlp-online also the fine-tuner, which the
        # engine feeds (through the policy) but never starts: the server does, after warm-up.
        if policy is None:
            self.cache_policy, self.dmlp_tuner = build_cache_policy(config)
        else:
            self.cache_policy, self.dmlp_tuner = policy, None
        self.clock: Clock = clock if clock is not None else EngineClock()
        self.pool = PagePool(self.num_slots, enable_prefix_caching=config.enable_prefix_caching,
                             policy=self.cache_policy, clock=self.clock, host_tokens=config.kv_host_tokens)
        # Host-tier copies (kv/transfer.py), into the tier's recycled page buffers.
        self.transfers = KvTransfers(buffers=self.pool.host.buffers if self.pool.host is not None else None)
        self.pool.request_features = self._request_features
        # Attention-score variance (attn_var5) is measured only when something reads it: the DMLP's
        # features or the block event log. It costs ~4-6% of the kernel's time at 1K context on an H200
        # (benchmarks/results/score_stats_cost_h200.json); the page-size rule uses it when it is there.
        self._measure_attention_stats = config.cache_policy == "dmlp" or config.trace_out is not None
        # Device idle time between steps: the DMLP's gpu_idle_frac and the stratum_gpu_idle_* metrics.
        self.gpu_idle = GpuIdleMeter()
        self.scheduler = FcfsScheduler(config, self.pool)     # page size: --page-size, else the policy
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._eos = frozenset(self.tokenizer.eos_token_ids) | frozenset(self.model_config.eos_token_ids)
        self._steps = 0
        self._recent_decode_ms: collections.deque[float] = collections.deque(maxlen=64)   # per token step
        self._recent_prefill_tps: collections.deque[float] = collections.deque(maxlen=64)
        self.last_step: StepTiming | None = None      # what the latest step ran, for benchmarks/metrics
        self._t0 = time.monotonic()
        self._recent_queue_ms: collections.deque[float] = collections.deque(maxlen=64)
        self._mean_queue_ms: float | None = None
        self._trace = None
        if config.trace_out:
            from training.traces import StratumEventLogWriter
            self._trace = StratumEventLogWriter(config.trace_out)
            self.pool.record_events = True

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        params.validate(max_tokens_cap=self.config.max_tokens_cap)
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.config.max_context:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"limit of {self.config.max_context} tokens: shorten the prompt or lower max_tokens")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} waiting requests); retry later")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        seq = Sequence(request_id=request_id, prompt_ids=prompt_ids, params=params, seed=seed,
                       detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids))
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Marks a request cancelled; the next step frees its pages and emits its final output."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        seq.cancel_requested = True
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs: dict[str, StepOutput] = {}
        self.pool.new_step()          # last step's block accesses reach the cache policy in one batch
        with jax.profiler.TraceAnnotation("scheduler"):
            for seq in [s for s in self._requests.values() if s.cancel_requested]:
                self._finish(seq, FinishReason.CANCELLED, outputs)
            batch = self.scheduler.schedule()
        if self.pool.host is not None:
            with jax.profiler.TraceAnnotation("kv_transfers"):
                self._prefetch()
                # Before the step: offloads read pages scheduling just evicted, recalls fill pages it
                # just allocated (kv/transfer.py).
                self.kv_cache = self.transfers.run(self.kv_cache, self.pool.take_transfers())
        if batch is not None:
            with jax.profiler.TraceAnnotation(batch.kind):
                self._run_batch(batch, outputs)
            self._steps += 1
            for seq in batch.seqs:
                if seq.admit_time is not None and not seq.queue_wait_recorded:
                    self._recent_queue_ms.append((seq.admit_time - seq.arrival_time) * 1e3)
                    self._mean_queue_ms = statistics.fmean(self._recent_queue_ms)
                    seq.queue_wait_recorded = True
            if self._trace is not None:
                self._write_block_events(batch)
        return list(outputs.values())

    def _prefetch(self) -> None:
        """Recalls host-tier pages of queued requests into free HBM, in the cache policy's order, so their
        prefix is resident when they are admitted. Looks at as many queued requests as one batch holds."""
        budget = self.config.kv_prefetch_pages
        if budget <= 0 or not self.pool.host_pages or not self.scheduler.waiting:
            return
        candidates, keep = [], []
        for seq in itertools.islice(self.scheduler.waiting, self.config.max_batch_size):
            if seq.wants_prompt_logprobs:
                continue                   # admitted without the prefix cache
            tokens = seq.all_token_ids
            if seq.queued_chain_hashes is None or seq.queued_chain_hashes[0] != len(tokens):
                seq.queued_chain_hashes = (len(tokens), prompt_chain_hashes(tokens))
            host, hbm = self.pool.host_candidates(seq.queued_chain_hashes[1])
            candidates += host
            keep += hbm
        if candidates:
            self.pool.prefetch(candidates, budget, keep=keep)

    @property
    def idle_tick_s(self) -> float | None:
        """How often a driver with no work should call `tick` (seconds), or None when nothing needs it
        (only a DMLP policy feeding online fine-tuning does)."""
        ms = getattr(self.cache_policy, "idle_tick_ms", None)
        return None if ms is None else ms / 1e3

    def tick(self) -> None:
        """Housekeeping while idle: the cache policy closes block accesses whose horizons have passed,
        so online fine-tuning keeps getting labelled examples when traffic stops."""
        self.cache_policy.tick(self.clock())

    def close(self) -> None:
        """Flushes and closes the block event log, if any."""
        if self._trace is not None:
            self._trace.close()

    def _write_block_events(self, batch: ScheduledBatch) -> None:
        """Drains the pool's block events into the --trace-out log, each with its time and the block's
        features at that access (the same `BlockInfo` the cache policy sees; see kv/block_meta.py).

        Features the engine cannot give are logged as null (missing), never as 0: attn_var5 for a block
        created before its request's first step finished (or when nothing measures it), gpu_idle_frac
        before the first step.
        """
        for event, t_ms, content_hash, request_id, info in self.pool.events:
            features = features_of(info, FEATURE_NAMES) if info is not None else {}
            self._trace.write(event, t_ms, content_hash.hex(), request_id, features)
        self.pool.events.clear()

    def _request_features(self, request_id: str) -> RequestFeatures | None:
        """Request-level features of a block access (the pool asks once per access batch)."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        p = seq.params
        return RequestFeatures(
            gen_frac=len(seq.output_ids) / p.max_tokens, input_tokens=len(seq.prompt_ids), max_tokens=p.max_tokens,
            queue_wait_ms=self._mean_queue_ms,
            prompt_pages=len(seq.prompt_ids) // seq.blocks.page_size if seq.blocks is not None else None,
            kv_hbm_frac=self.pool.hbm_fraction,   # cached pages in HBM / in HBM and the host tier
            attn_var5=seq.attn_var5,       # from the steps' score statistics; None before the first step
            gpu_idle_frac=self.gpu_idle.idle_fraction(self.clock()))

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[GenerationResult]:
        """Offline: runs every prompt as one continuous batch; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {i: GenerationResult(i, [], "", FinishReason.LENGTH, None, None, 0, 0) for i in ids}
        while any(r for r in ids if r in self._requests):
            for out in self.step():
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids += out.new_token_ids
                res.text += out.text_delta
                if out.logprobs is not None:
                    res.logprobs = (res.logprobs or []) + out.logprobs
                if out.prompt_logprobs is not None:
                    res.prompt_logprobs = out.prompt_logprobs
                res.prompt_tokens = out.prompt_tokens
                res.cached_prompt_tokens = out.cached_prompt_tokens
                if out.finished:
                    res.finish_reason = out.finish_reason
        return [results[i] for i in ids]

    def warmup(self) -> None:
        """Compiles the smallest prefill and decode buckets."""
        self.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        warm_predictor(self.cache_policy)

    def stats(self) -> EngineStats:
        free = self.pool.free_slots
        written: dict[int, int] = {}            # page start slot -> tokens written in it (shared pages once)
        for seq in self.scheduler.running:
            ps = seq.blocks.page_size
            for i, page in enumerate(seq.blocks.pages):
                n = min(ps, max(0, seq.num_computed - i * ps))
                written[page.start_slot] = max(written.get(page.start_slot, 0), n)
        return EngineStats(
            queued=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_pages_total=self.num_slots // 8, kv_pages_free=free // 8,
            kv_tokens_total=self.num_slots, kv_tokens_used=self.num_slots - free,
            kv_tokens_written=sum(written.values()),
            prefix_cache_hits=self.pool.prefix_hits, prefix_cache_queries=self.pool.prefix_queries,
            preemptions=self.scheduler.preemptions, steps=self._steps,
            decode_step_ms=statistics.median(self._recent_decode_ms) if self._recent_decode_ms else 0.0,
            prefill_tokens_per_s=(statistics.median(self._recent_prefill_tps)
                                  if self._recent_prefill_tps else 0.0),
            gpu_idle_frac=self.gpu_idle.idle_fraction(self.clock()), gpu_idle_gap_ms=self.gpu_idle.last_gap_ms,
            kv_host_tokens_total=self.pool.host.capacity_tokens if self.pool.host is not None else 0,
            kv_host_tokens_used=self.pool.host.tokens if self.pool.host is not None else 0,
            kv_host_hits=self.pool.host_hits, kv_prefetched_pages=self.pool.prefetched,
            kv_offloaded_pages=self.transfers.stats.offloaded_pages,
            kv_recalled_pages=self.transfers.stats.recalled_pages)

    # -- one batch ----------------------------------------------------------------------------------
    def _run_batch(self, batch: ScheduledBatch, outputs: dict[str, StepOutput]) -> None:
        t0 = time.perf_counter()
        if batch.kind == "decode":
            self._run_decode(batch, outputs, t0)
        else:
            self._run_prefill(batch, outputs, t0)

    def _record(self, batch: ScheduledBatch, t0: float, tokens: int) -> None:
        elapsed = time.perf_counter() - t0
        self.last_step = StepTiming(batch.kind, elapsed, len(batch.seqs), tokens)
        # Medians over recent steps: a step that compiled a new shape must not skew the estimate.
        if batch.kind == "decode":
            self._recent_decode_ms.append(elapsed * 1e3 / max(1, max(batch.chunk_lens)))
        else:
            self._recent_prefill_tps.append(tokens / elapsed)

    def _common_inputs(self, batch: ScheduledBatch, rows: int, max_ctx: int):
        """Block tables and sampling arrays for the batch's sequences, padded to `rows`."""
        page_starts = np.zeros((rows, max_ctx // 8), np.int32)
        page_sizes = np.full(rows, 8, np.int32)
        temp = np.zeros(rows, np.float32)
        top_p = np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        seed_hi = np.zeros(rows, np.uint32)
        seed_lo = np.zeros(rows, np.uint32)
        tok_idx = np.zeros(rows, np.int32)
        for r, seq in enumerate(batch.seqs):
            starts = seq.blocks.page_starts()
            page_starts[r, :len(starts)] = starts
            page_sizes[r] = seq.blocks.page_size
            p = seq.params
            temp[r], top_p[r], top_k[r] = p.temperature, p.top_p, p.top_k
            seed_hi[r], seed_lo[r] = seq.seed >> 32, seq.seed & 0xFFFFFFFF
            tok_idx[r] = len(seq.output_ids)
        sampling = SamplingArrays(temp, top_p, top_k, seed_hi, seed_lo, tok_idx)
        return page_starts, page_sizes, sampling

    def _step_options(self, batch: ScheduledBatch, max_ctx: int, decode: bool) -> StepOptions:
        want_prompt_lp = [s.params.prompt_logprobs for s in batch.seqs if s.wants_prompt_logprobs]
        return StepOptions(
            # The kernel serves decode; prefill chunks take the reference path whatever the backend, so
            # the backend only keys decode compilations.
            max_context=max_ctx, backend=self.attention_backend if decode else "reference",
            interpret=self.config.interpret_kernels and decode,
            greedy_only=all(s.params.temperature == 0 for s in batch.seqs),
            top_logprobs=max(s.params.logprobs for s in batch.seqs),
            prompt_logprobs=max(want_prompt_lp) if want_prompt_lp and not decode else -1,
            attn_stats=self._measure_attention_stats)

    def _run_decode(self, batch: ScheduledBatch, outputs: dict[str, StepOutput], t0: float) -> None:
        """Up to config.decode_steps tokens per sequence in one device call (chunk_lens = steps each)."""
        seqs, steps = batch.seqs, batch.chunk_lens
        # At least 8 rows: a decode step is memory-bound, so padding a small batch costs almost nothing,
        # and fewer buckets mean fewer compilations.
        rows = _pow2_at_least(len(seqs), floor=8)
        num_steps = min(self.config.decode_steps, _pow2_at_least(max(steps)))
        # The gather bound and the block-table width follow one bucket, so shapes add no compile axis.
        max_ctx = _pow2_at_least(max(s.num_tokens - 1 + n for s, n in zip(seqs, steps)), floor=64)
        page_starts, page_sizes, sampling = self._common_inputs(batch, rows, max_ctx)
        last = np.zeros(rows, np.int32)
        pos = np.zeros(rows, np.int32)
        allowed = np.zeros(rows, np.int32)
        for r, (seq, n) in enumerate(zip(seqs, steps)):
            last[r] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
            pos[r] = seq.num_tokens - 1
            allowed[r] = n
        opts = self._step_options(batch, max_ctx, decode=True)
        dispatch_ms = self.clock()
        result, self.kv_cache = decode_steps(self.model.params, self.kv_cache, last, pos, allowed, page_starts,
                                             page_sizes, sampling, cfg=self.model_config, opts=opts,
                                             num_steps=num_steps)
        result = jax.device_get(result)
        self.gpu_idle.step(dispatch_ms, self.clock())
        self._record(batch, t0, int(allowed.sum()))
        with jax.profiler.TraceAnnotation("postprocess"):
            for r, (seq, n) in enumerate(zip(seqs, steps)):
                for i in range(n):
                    seq.num_computed += 1
                    lps = self._token_logprobs(seq, result, (i, r))
                    if self._measure_attention_stats:
                        seq.recent_attn_var.append(float(result.attn_score_var[i, r]))
                    self._append_token(seq, int(result.tokens[i, r]), lps, outputs)
                    if seq.finish_reason is not None:
                        break                    # the rest of this row's steps are discarded
                else:
                    if seq.blocks.has_unregistered_full_pages(seq.num_computed):
                        seq.blocks.register_full_pages(seq.all_token_ids, seq.num_computed, seq.request_id)

    def _run_prefill(self, batch: ScheduledBatch, outputs: dict[str, StepOutput], t0: float) -> None:
        seqs = batch.seqs
        rows = _pow2_at_least(len(seqs))
        chunk = _pow2_at_least(max(batch.chunk_lens), floor=8)
        max_ctx = _pow2_at_least(max(s.num_computed + n for s, n in zip(seqs, batch.chunk_lens)), floor=64)
        page_starts, page_sizes, sampling = self._common_inputs(batch, rows, max_ctx)
        tokens = np.zeros((rows, chunk), np.int32)
        slots = np.full((rows, chunk), self.num_slots, np.int32)        # out of range = dropped write
        q_pos = np.full((rows, chunk), -1, np.int32)
        next_tok = np.full((rows, chunk), -1, np.int32)
        ctx = np.zeros(rows, np.int32)
        sample_cols = np.zeros(rows, np.int32)
        for r, (seq, n) in enumerate(zip(seqs, batch.chunk_lens)):
            start = seq.num_computed
            tokens[r, :n] = seq.token_slice(start, start + n)
            slots[r, :n] = seq.blocks.slots(start, n)
            q_pos[r, :n] = np.arange(start, start + n)
            if seq.wants_prompt_logprobs:
                nxt = np.arange(start + 1, start + n + 1)
                ok = nxt < len(seq.prompt_ids)
                next_tok[r, :n][ok] = np.asarray(seq.prompt_ids)[nxt[ok]]
            ctx[r] = start + n
            sample_cols[r] = n - 1
        opts = self._step_options(batch, max_ctx, decode=False)
        # Host numpy arrays go straight into the jitted call, which transfers them in its C++ path.
        meta = AttentionMetadata(q_pos, ctx, page_starts, page_sizes)
        dispatch_ms = self.clock()
        result, self.kv_cache = model_step(self.model.params, self.kv_cache, tokens, slots, meta, sample_cols,
                                           sampling, next_tok, cfg=self.model_config, opts=opts)
        result = jax.device_get(result)
        self.gpu_idle.step(dispatch_ms, self.clock())
        self._record(batch, t0, sum(batch.chunk_lens))
        with jax.profiler.TraceAnnotation("postprocess"):
            for r, (seq, n) in enumerate(zip(seqs, batch.chunk_lens)):
                if seq.wants_prompt_logprobs:
                    self._collect_prompt_logprobs(seq, r, n, result)
                seq.num_computed += n
                if self._measure_attention_stats:
                    # One value for the chunk's last <= 5 prompt tokens replaces what an earlier chunk gave.
                    seq.recent_attn_var.clear()
                    seq.recent_attn_var.append(float(result.attn_score_var[r]))
                if seq.blocks.has_unregistered_full_pages(seq.num_computed):
                    seq.blocks.register_full_pages(seq.all_token_ids, seq.num_computed, seq.request_id)
                if seq.num_computed < seq.num_tokens:
                    seq.state = RequestState.PREFILLING
                    continue                     # a middle prefill chunk: nothing sampled
                seq.state = RequestState.DECODING
                self._append_token(seq, int(result.tokens[r]), self._token_logprobs(seq, result, r), outputs)

    @staticmethod
    def _token_logprobs(seq: Sequence, result, index) -> list[list[TokenLogprob]] | None:
        """The chosen token's logprob, then the top-K, for result row `index` (r, or (step, r))."""
        k = seq.params.logprobs
        if k == 0:
            return None
        token = int(result.tokens[index])
        return [[TokenLogprob(token, float(result.logprob[index]))] + [
            TokenLogprob(int(i), float(v)) for i, v in zip(result.top_ids[index][:k], result.top_logprobs[index][:k])]]

    def _collect_prompt_logprobs(self, seq: Sequence, r: int, n: int, result) -> None:
        """Prompt position p gets the logprob of token p given tokens < p; position 0 gets []."""
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [[]]
        k = seq.params.prompt_logprobs
        for c in range(n):
            nxt = seq.num_computed + c + 1
            if nxt >= len(seq.prompt_ids):
                break
            seq.prompt_logprobs.append(
                [TokenLogprob(seq.prompt_ids[nxt], float(result.prompt_logprob[r, c]))] + [
                    TokenLogprob(int(i), float(v))
                    for i, v in zip(result.prompt_top_ids[r, c, :k], result.prompt_top_logprobs[r, c, :k])])

    def _append_token(self, seq: Sequence, token: int, lps, outputs: dict[str, StepOutput]) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output_ids.append(token)
        out = self._output_for(seq, outputs)
        out.new_token_ids.append(token)
        if lps is not None:
            out.logprobs = (out.logprobs or []) + lps
        p = seq.params
        reason = None
        if token in p.stop_token_ids:
            reason = FinishReason.STOP_TOKEN
        elif token in self._eos and not p.ignore_eos:
            reason = FinishReason.EOS
        else:
            seq.pending_text += seq.detokenizer.push(token)
            reason = self._check_stop_strings(seq)
        if reason is None and (len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.config.max_context):
            reason = FinishReason.LENGTH
        if reason is None:
            # Hold back text that might be the start of a stop string.
            hold = max((len(s) for s in p.stop_strings), default=1) - 1
            cut = len(seq.pending_text) - hold if hold else len(seq.pending_text)
            if cut > 0:
                out.text_delta += seq.pending_text[:cut]
                seq.emitted_text += seq.pending_text[:cut]
                seq.pending_text = seq.pending_text[cut:]
        else:
            self._finish(seq, reason, outputs)

    def _check_stop_strings(self, seq: Sequence) -> FinishReason | None:
        if not seq.params.stop_strings:
            return None
        text = seq.emitted_text + seq.pending_text
        longest = max(len(s) for s in seq.params.stop_strings)
        search_from = max(0, len(seq.emitted_text) - longest + 1)
        hits = [i for i in (text.find(s, search_from) for s in seq.params.stop_strings) if i >= 0]
        if not hits:
            return None
        seq.pending_text = text[len(seq.emitted_text):min(hits)]
        return FinishReason.STOP_STRING

    def _finish(self, seq: Sequence, reason: FinishReason, outputs: dict[str, StepOutput]) -> None:
        out = self._output_for(seq, outputs)
        if reason not in (FinishReason.STOP_STRING, FinishReason.CANCELLED):
            seq.pending_text += seq.detokenizer.flush()
        if reason != FinishReason.CANCELLED:
            out.text_delta += seq.pending_text
            seq.emitted_text += seq.pending_text
        seq.pending_text = ""
        seq.finish_reason = reason
        if seq.attn_var5 is not None:
            self.scheduler.variance_scale.observe(seq.attn_var5)
        seq.state = RequestState.CANCELLED if reason == FinishReason.CANCELLED else RequestState.FINISHED
        out.finished = True
        out.finish_reason = reason
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]

    def _output_for(self, seq: Sequence, outputs: dict[str, StepOutput]) -> StepOutput:
        out = outputs.get(seq.request_id)
        if out is None:
            out = StepOutput(request_id=seq.request_id, new_token_ids=[], text_delta="",
                             prompt_tokens=len(seq.prompt_ids), cached_prompt_tokens=seq.cached_prompt_tokens)
            if seq.wants_prompt_logprobs and not seq.is_prefilling:
                # A one-token prompt skips prefill: its only position has no logprob.
                out.prompt_logprobs = seq.prompt_logprobs or [[]]
                seq.prompt_logprobs_sent = True
            outputs[seq.request_id] = out
        out.output_tokens = len(seq.output_ids)
        return out
