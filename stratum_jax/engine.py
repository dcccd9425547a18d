"""The engine loop: admit -> one packed step (prefill chunks + decode tokens) -> sample -> stream -> free.

`Engine` is the narrow interface every driver uses (the CLI, the gRPC servicer, the benchmarks):
`add_request`, `cancel`, `step`, `stats`, `warmup`, plus `generate` for offline use. It is not
thread-safe; a server runs it on one thread. A step is three calls: the scheduler picks the work
(scheduler/), the model runner runs it on the device (model_runner.py), and the outputs are
post-processed (outputs.py). Exactly one output per accepted request ever has `finished=True`.
"""
from __future__ import annotations

import collections
import itertools
import statistics
import time

import jax
import numpy as np

from stratum_jax.attention import resolve_backend
from stratum_jax.compile_watch import CompileWatch
from stratum_jax.config import RuntimeConfig
from stratum_jax.dmlp.features import FEATURE_NAMES
from stratum_jax.dmlp.runtime import build_cache_policy, warm_predictor
from stratum_jax.gpu_idle import DeviceTimeline, GpuIdleMeter
from stratum_jax.kv.block_meta import Clock, EngineClock, RequestFeatures, features_of
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.prefix_hash import prompt_chain_hashes
from stratum_jax.kv.recall_choice import RecallChoice
from stratum_jax.kv.transfer import KvTransfers
from stratum_jax.kv.precision import kv_bytes_per_slot, start_kv_cache
from stratum_jax.model.loader import LoadedModel, load_model
from stratum_jax.model.tokenizer import IncrementalDetokenizer
from stratum_jax.model_runner import InFlightStep, ModelRunner, RunResult, kv_layout_of
from stratum_jax.outputs import OutputProcessor, token_logprobs
from stratum_jax.engine_stats import EngineStats, StepTiming
from stratum_jax.request import (FinishReason, GenerationResult, InvalidRequestError, QueueFullError, RequestState,
                                 SamplingParams, StepOutput)
from stratum_jax.scheduler import build_scheduler
from stratum_jax.scheduler.base import ScheduledBatch, StepCosts
from stratum_jax.sequence import Sequence
from stratum_jax.tensor_parallel import make_tensor_parallel


class Engine:
    """policy: a cache policy to use instead of the one `config.cache_policy` names (tests).
    clock: ms on the engine's clock for KV block metadata (default: since construction)."""

    def __init__(self, config: RuntimeConfig, model: LoadedModel | None = None, *, policy=None,
                 clock: Clock | None = None):
        self.compiles = CompileWatch().install()
        if model is None:
            tp = make_tensor_parallel(config.tensor_parallel, embedding=config.tp_embedding)
            model = load_model(config.model, dtype=config.dtype, seed=config.seed, tp=tp)
        elif config.tensor_parallel != (model.tp.size if model.tp is not None else 1):
            raise ValueError(f"--tensor-parallel {config.tensor_parallel} but the model given was laid out "
                             f"for {model.tp.size if model.tp is not None else 1} devices: load it with "
                             "load_model(..., tp=make_tensor_parallel(config.tensor_parallel))")
        self.model = model
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        # max_context is fixed here, where the model's limit is known (None = that limit, capped).
        self.config = config = config.for_model(self.model_config.max_position_embeddings)
        self.attention_backend = resolve_backend(config, self.model_config)
        self.num_slots = config.kv_pool_slots
        # bf16 pools, or DKVC's anchor + delta pools (--kv-precision; the precision run may be a fallback).
        self.kv_precision, self.kv_cache, self.kv_anchor = start_kv_cache(
            config.kv_precision, model, self.num_slots,
            sharding=model.tp.kv_sharding if model.tp is not None else None)
        # The cache policy (eviction, page size); with --dmlp-online also the fine-tuner, which the
        # engine feeds (through the policy) but never starts: the server does, after warm-up.
        if policy is None:
            self.cache_policy, self.dmlp_tuner = build_cache_policy(config)
        else:
            self.cache_policy, self.dmlp_tuner = policy, None
        self.clock: Clock = clock if clock is not None else EngineClock()
        self.pool = PagePool(self.num_slots, enable_prefix_caching=config.enable_prefix_caching,
                             policy=self.cache_policy, clock=self.clock, host_tokens=config.kv_host_tokens)
        # Host-tier copies (kv/transfer.py, pinned host memory), and the choice between recalling a prefix's
        # host pages and recomputing them, by the measured copy and prefill rates (kv/recall_choice.py).
        self.transfers = KvTransfers()
        self.pool.recall_choice = self.transfers.recall_choice = RecallChoice(self._prefill_tokens_per_s)
        self.pool.request_features = self._request_features
        # Attention-score variance (attn_var5) is measured only when something reads it: the DMLP's
        # features or the block event log (its cost is in BENCHMARKS.md); the page-size rule uses it
        # when it is there.
        self._measure_attention_stats = config.cache_policy == "dmlp" or config.trace_out is not None
        # Device idle time between steps: the DMLP's gpu_idle_frac, the stratum_gpu_idle_* metrics, HAB.
        self.gpu_idle = GpuIdleMeter()
        self.timeline = DeviceTimeline(self.gpu_idle)   # busy intervals of steps dispatched without waiting
        self.scheduler = build_scheduler(config, self.pool)   # page size: --page-size, else the policy
        # Bytes per token slot over all layers: the pools' (deltas and per-granule scales with DKVC), not
        # the resident anchor's.
        self._kv_bytes_per_token = kv_bytes_per_slot(self.kv_cache)
        self.runner = ModelRunner(config, self.model, num_slots=self.num_slots, backend=self.attention_backend,
                                  attn_stats=self._measure_attention_stats, kv_layout=kv_layout_of(self.kv_cache))
        self.outputs = OutputProcessor(frozenset(self.tokenizer.eos_token_ids)
                                       | frozenset(self.model_config.eos_token_ids), config.max_context)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)
        self._steps = 0
        self._recent_decode_ms: collections.deque[float] = collections.deque(maxlen=64)   # per token step
        self._recent_prefill_tps: collections.deque[float] = collections.deque(maxlen=64)
        self.last_step: StepTiming | None = None      # the latest step read back, for benchmarks/metrics
        self._inflight: InFlightStep | None = None     # dispatched, results not read yet (async scheduling)
        self._recent_queue_ms: collections.deque[float] = collections.deque(maxlen=64)
        self._mean_queue_ms: float | None = None
        self._trace = None
        if config.trace_out:
            from stratum_jax.kv.event_log import StratumEventLogWriter
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
        """Requests in flight, or a dispatched step still to be read (its rows may all have finished)."""
        return bool(self._requests) or self._inflight is not None

    # -- the loop -----------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedules and dispatches the next step, then reads and post-processes the step before it.

        With async scheduling (the default) step N+1 is on the device before the host reads step N's
        results, so the host's post-processing and the next scheduling overlap the device's work instead
        of leaving it idle between steps: decode rows whose newest token is still on the device take it
        there (decode.TokenFeed). A sequence that finishes in step N (EOS, a stop string) has one more
        token computed in N+1, which is dropped. Without it (--no-async-scheduling) each step is read
        right after its dispatch. Outputs and tokens are the same either way.
        """
        outputs: dict[str, StepOutput] = {}
        self.pool.new_step()          # last step's block accesses reach the cache policy in one batch
        with jax.profiler.TraceAnnotation("scheduler"):
            for seq in [s for s in self._requests.values() if s.cancel_requested]:
                self._finish(seq, FinishReason.CANCELLED, outputs)
            self.timeline.watch(self._inflight, self.clock())
            batch = self.scheduler.schedule(self._step_costs())
        if self.pool.host is not None:
            with jax.profiler.TraceAnnotation("kv_transfers"):
                self._prefetch()
                # Before the step: offloads read pages scheduling just evicted, recalls fill pages it
                # just allocated (kv/transfer.py).
                self.kv_cache = self.transfers.run(self.kv_cache, self.pool.take_transfers())
        launched = None
        if batch is not None:
            with jax.profiler.TraceAnnotation(f"dispatch {batch.kind}"):
                self.timeline.watch(self._inflight, self.clock())
                launched, self.kv_cache = self.runner.dispatch(batch, self.kv_cache, previous=self._inflight)
                self._account_dispatch(launched)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            self._complete(previous, outputs)
        if launched is not None and not self.config.async_scheduling:
            self._inflight = None
            self._complete(launched, outputs)
        return list(outputs.values())

    def drain(self) -> list[StepOutput]:
        """Reads and post-processes the step in flight, if any, without dispatching another (a profiler
        window that should hold one whole step; a driver that wants every result before it stops)."""
        outputs: dict[str, StepOutput] = {}
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            self._complete(step, outputs)
        return list(outputs.values())

    def _account_dispatch(self, step: InFlightStep) -> None:
        """What a dispatched step will have done once it runs, applied now so the next step can be
        scheduled before its results are read: chunks are computed, decode rows have their tokens
        computed, and every row that samples has one more token pending."""
        batch = step.batch
        for seq, n in zip(batch.decode, batch.decode_steps):
            seq.num_computed += n
            seq.num_pending += n
        for seq, n in zip(batch.prefill, batch.chunk_lens):
            seq.num_computed += n
            if seq.num_computed < seq.num_tokens:
                seq.state = RequestState.PREFILLING
            else:                             # the chunk reaches the end: it samples the first token
                seq.state = RequestState.DECODING
                seq.num_pending += 1
        self.timeline.dispatched(step, self._ms(step.dispatch_s))

    def _complete(self, step: InFlightStep, outputs: dict[str, StepOutput]) -> None:
        """Reads a dispatched step's results and post-processes them."""
        was_done = step.is_ready()
        with jax.profiler.TraceAnnotation("wait"):
            run = self.runner.collect(step, self.kv_cache)
        start_ms, end_ms = self.timeline.read(step, self._ms(run.done_s), was_done)
        self._record(step.batch, (end_ms - start_ms) / 1e3)
        with jax.profiler.TraceAnnotation("postprocess"):
            self._postprocess(step, run, outputs)
        self._steps += 1
        for seq in step.batch.seqs:
            if seq.admit_time is not None and not seq.queue_wait_recorded:
                self._recent_queue_ms.append((seq.admit_time - seq.arrival_time) * 1e3)
                self._mean_queue_ms = statistics.fmean(self._recent_queue_ms)
                seq.queue_wait_recorded = True
        if self._trace is not None:
            self._write_block_events()

    def _ms(self, perf_s: float) -> float:
        """A time.perf_counter() reading on the engine clock (ms)."""
        return self.clock() - (time.perf_counter() - perf_s) * 1e3

    def _step_costs(self) -> StepCosts:
        """What the scheduler may weigh: the device idle gap since the last step's results, and the
        measured per-token costs."""
        now_ms = self.clock()
        idle_since = self.timeline.idle_since_ms(self._inflight)
        idle = 0.0 if idle_since is None else max(0.0, now_ms - idle_since)
        prefill_tps = self._prefill_tokens_per_s()
        return StepCosts(now_s=time.monotonic(), idle_gap_ms=idle,
                         prefill_ms_per_token=1e3 / prefill_tps if prefill_tps else None,
                         decode_ms_per_step=(statistics.median(self._recent_decode_ms)
                                             if self._recent_decode_ms else None))

    def _prefill_tokens_per_s(self) -> float | None:
        """Median prompt tokens per second of recent prefill and mixed steps (None before the first)."""
        return statistics.median(self._recent_prefill_tps) if self._recent_prefill_tps else None

    def _record(self, batch: ScheduledBatch, device_s: float) -> None:
        prefill_tokens = sum(batch.chunk_lens)
        self.last_step = StepTiming(batch.kind, device_s, len(batch.seqs), batch.num_tokens, prefill_tokens)
        if device_s <= 0:
            return
        # Medians over recent steps: an outlier step must not skew the estimate.
        if batch.kind == "decode":
            self._recent_decode_ms.append(device_s * 1e3 / max(1, max(batch.decode_steps)))
        else:
            self._recent_prefill_tps.append(prefill_tokens / device_s)

    def _live(self, seq: Sequence, epoch: int) -> bool:
        """Whether a step's row for seq still counts: not finished, cancelled or preempted since dispatch."""
        return seq.epoch == epoch and seq.request_id in self._requests and self._requests[seq.request_id] is seq

    def _postprocess(self, step: InFlightStep, run: RunResult, outputs: dict[str, StepOutput]) -> None:
        batch, res = step.batch, run.result
        stats = self._measure_attention_stats
        epochs = step.epochs
        if run.shape.kind == "decode":
            for r, (seq, n) in enumerate(zip(batch.decode, batch.decode_steps)):
                if not self._live(seq, epochs[r]):
                    continue
                for i in range(n):
                    seq.num_pending -= 1
                    if stats:
                        seq.recent_attn_var.append(float(res.attn_score_var[i, r]))
                    lps = token_logprobs(seq.params.logprobs, int(res.tokens[i, r]), res.logprob[i, r],
                                         res.top_ids[i, r], res.top_logprobs[i, r])
                    if self._append_token(seq, int(res.tokens[i, r]), lps, outputs):
                        break                    # the rest of this row's steps are discarded
                else:
                    self._register_full_pages(seq)
            return
        for r, seq in enumerate(batch.decode):
            if not self._live(seq, epochs[r]):
                continue
            seq.num_pending -= 1
            if stats:
                seq.recent_attn_var.append(float(res.attn_score_var[r]))
            if not self._append_token(seq, int(res.tokens[r]), self._row_logprobs(seq, res, r), outputs):
                self._register_full_pages(seq)
        for i, (seq, n) in enumerate(zip(batch.prefill, batch.chunk_lens)):
            r = len(batch.decode) + i
            if not self._live(seq, epochs[r]):
                continue
            start = step.chunk_starts[i]
            if res.prompt_logprob is not None and step.device.wants_prompt_logprobs[i]:
                off = run.offsets[r]
                self.outputs.collect_prompt_logprobs(seq, start, n, res.prompt_logprob[off:off + n],
                                                     res.prompt_top_ids[off:off + n],
                                                     res.prompt_top_logprobs[off:off + n])
            if stats:
                # One value for the chunk's last <= 5 prompt tokens replaces what an earlier chunk gave.
                seq.recent_attn_var.clear()
                seq.recent_attn_var.append(float(res.attn_score_var[r]))
            self._register_full_pages(seq)
            if start + n < seq.num_known_tokens:
                continue                     # a middle prefill chunk: nothing sampled
            seq.num_pending -= 1
            self._append_token(seq, int(res.tokens[r]), self._row_logprobs(seq, res, r), outputs)

    @staticmethod
    def _row_logprobs(seq: Sequence, res, r: int):
        return token_logprobs(seq.params.logprobs, int(res.tokens[r]), res.logprob[r], res.top_ids[r],
                              res.top_logprobs[r])

    @staticmethod
    def _register_full_pages(seq: Sequence) -> None:
        """Offers seq's full pages to the prefix cache: pages whose tokens the host knows and whose K/V
        every dispatched step writes (a step still in flight writes them before any later step reads)."""
        computed = min(seq.num_computed, seq.num_known_tokens)
        if seq.blocks is not None and seq.blocks.has_unregistered_full_pages(computed):
            seq.blocks.register_full_pages(seq.all_token_ids, computed, seq.request_id)

    def _append_token(self, seq: Sequence, token: int, lps, outputs: dict[str, StepOutput]) -> bool:
        """Adds a sampled token; returns True if the request finished."""
        reason = self.outputs.append_token(seq, token, lps, outputs)
        if reason is not None:
            self._finish(seq, reason, outputs)
        return reason is not None

    def _finish(self, seq: Sequence, reason: FinishReason, outputs: dict[str, StepOutput]) -> None:
        self.outputs.finish(seq, reason, outputs)
        if seq.attn_var5 is not None:
            self.scheduler.variance_scale.observe(seq.attn_var5)
        seq.state = RequestState.CANCELLED if reason == FinishReason.CANCELLED else RequestState.FINISHED
        self.scheduler.remove(seq)
        del self._requests[seq.request_id]

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
        ms = self.cache_policy.idle_tick_ms
        return None if ms is None else ms / 1e3

    def tick(self) -> None:
        """Housekeeping while idle: the cache policy closes block accesses whose horizons have passed,
        so online fine-tuning keeps getting labelled examples when traffic stops."""
        self.cache_policy.tick(self.clock())

    def close(self) -> None:
        """Flushes and closes the block event log, if any, and stops counting compiles."""
        self.compiles.close()
        if self._trace is not None:
            self._trace.close()

    def _write_block_events(self) -> None:
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
        self.drain()             # a step dispatched after the last request ended: nothing of it is kept
        return [results[i] for i in ids]

    def warmup(self, progress: bool = True) -> float:
        """Compiles every step shape the config can produce (model_runner.py) and the DMLP predictor.
        Returns the seconds compiling took."""
        seconds = self.runner.compile_all(self.kv_cache, progress=progress)
        warm_predictor(self.cache_policy)
        return seconds

    def mark_serving(self) -> None:
        """The driver is taking traffic: from now on a compile is on the request path, counted apart
        (EngineStats.jit_compilations_after_serving) and logged as a WARNING."""
        self.compiles.mark_serving()

    def _kv_tokens_written(self) -> int:
        """Slots of running sequences' pages that hold a token, shared (prefix) pages counted once. Vectorised:
        the server reads stats after every step, and 64 sequences at 32K context own thousands of pages."""
        starts, counts = [], []
        for seq in self.scheduler.running:
            page_starts, ps = seq.blocks.page_starts(), seq.blocks.page_size
            starts.append(page_starts)
            counts.append(np.clip(seq.num_computed - np.arange(len(page_starts)) * ps, 0, ps))
        if not starts:
            return 0
        starts, counts = np.concatenate(starts), np.concatenate(counts)
        order = np.lexsort((-counts, starts))            # by page, the most written copy first
        starts, counts = starts[order], counts[order]
        first = np.ones(len(starts), bool)
        first[1:] = starts[1:] != starts[:-1]
        return int(counts[first].sum())

    def stats(self) -> EngineStats:
        free = self.pool.free_slots
        return EngineStats(
            queued=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_pages_total=self.num_slots // 8, kv_pages_free=free // 8,
            kv_tokens_total=self.num_slots, kv_tokens_used=self.num_slots - free,
            kv_tokens_written=self._kv_tokens_written(),
            prefix_cache_hits=self.pool.prefix_hits, prefix_cache_queries=self.pool.prefix_queries,
            preemptions=self.scheduler.preemptions, steps=self._steps,
            decode_step_ms=statistics.median(self._recent_decode_ms) if self._recent_decode_ms else 0.0,
            prefill_tokens_per_s=self._prefill_tokens_per_s() or 0.0,
            gpu_idle_frac=self.gpu_idle.idle_fraction(self.clock()), gpu_idle_gap_ms=self.gpu_idle.last_gap_ms,
            kv_host_tokens_total=self.pool.host.capacity_tokens if self.pool.host is not None else 0,
            kv_host_tokens_used=self.pool.host.tokens if self.pool.host is not None else 0,
            kv_host_hits=self.pool.host_hits, kv_prefetched_pages=self.pool.prefetched,
            kv_offloaded_pages=self.transfers.stats.offloaded_pages,
            kv_recalled_pages=self.transfers.stats.recalled_pages,
            jit_compilations=self.compiles.total, jit_compilations_after_serving=self.compiles.after_serving,
            hab_triggers=self.scheduler.triggers, kv_precision=self.kv_precision,
            kv_bytes_per_token=self._kv_bytes_per_token, kv_recall_batches=self.transfers.stats.recall_batches,
            kv_recall_seconds=tuple(self.transfers.stats.recall_seconds))
