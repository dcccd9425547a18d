"""The engine loop: admit -> one packed step (prefill chunks + decode tokens) -> sample -> stream -> free.

`Engine` is the narrow interface every driver uses (the CLI, the gRPC servicer, the benchmarks):
`add_request`, `cancel`, `step`, `stats`, `warmup`, plus `generate` for offline use. It is not
thread-safe; a server runs it on one thread. A step is: schedule (scheduler/ picks the work), dispatch
(model_runner.py launches it on the device), collect (a step's results reach the host) and postprocess
(postprocess.py, outputs.py). The rest lives beside it: the requests in flight (request_table.py), the
in-flight step of async scheduling (inflight.py), the stats (engine_stats.py), host-tier prefetch
(prefetch.py) and the block features and event log (block_events.py). Exactly one output per accepted
request ever has `finished=True`.
"""
from __future__ import annotations

import logging
import time

import jax

from stratum_jax.attention import on_hopper_gpu, resolve_backend
from stratum_jax.block_events import BlockEventFeed
from stratum_jax.compile_watch import CompileWatch
from stratum_jax.config import RuntimeConfig
from stratum_jax.dmlp.runtime import build_cache_policy, warm_predictor
from stratum_jax.gpu_idle import DeviceTimeline, GpuIdleMeter
from stratum_jax.kv.block_meta import Clock, EngineClock
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.recall_choice import RecallChoice
from stratum_jax.kv.transfer import KvTransfers, committed
from stratum_jax.kv.precision import kv_bytes_per_slot, start_kv_cache
from stratum_jax.kv.pool_memory import check_pool_fits
from stratum_jax.model.fused import fold_norms, fuse_projections
from stratum_jax.model.loader import LoadedModel, load_model, params_nbytes
from stratum_jax.model.projection import fold_norms_note, l2_prefetch_note, resolve_projections
from stratum_jax.model_runner import InFlightStep, ModelRunner, RunResult, kv_layout_of
from stratum_jax.outputs import OutputProcessor
from stratum_jax.phase_times import PhaseTimes
from stratum_jax.engine_stats import EngineStats, StepRecorder, StepTiming, kv_tokens_written
from stratum_jax.inflight import InFlight
from stratum_jax.postprocess import Postprocessor
from stratum_jax.prefetch import prefetch_queued
from stratum_jax.request import FinishReason, GenerationResult, SamplingParams, StepOutput
from stratum_jax.request_table import RequestTable
from stratum_jax.scheduler import build_scheduler
from stratum_jax.scheduler.base import ScheduledBatch, StepCosts
from stratum_jax.step_work import ModelWork
from stratum_jax.tensor_parallel import make_tensor_parallel

log = logging.getLogger(__name__)


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
        # The step runs on fused q/k/v and gate/up weights (model/fused.py: no per-call weight copies).
        fuse_projections(model)
        self.model = model
        self.model_config = self.model.config
        self.tokenizer = self.model.tokenizer
        # max_context is fixed here, where the model's limit is known (None = that limit, capped).
        self.config = config = config.for_model(self.model_config.max_position_embeddings)
        self.attention_backend = resolve_backend(config, self.model_config)
        # The decode step's projections: the Pallas weight-streaming GEMM or XLA's dot (model/projection.py).
        self.projections = resolve_projections(config, self.model_config, on_hopper=on_hopper_gpu(),
                                               tensor_parallel=config.tensor_parallel)
        if note := l2_prefetch_note(config.l2_prefetch_mb, self.projections, self.attention_backend):
            log.info(note)
        # --fold-norms: the norm weights go into q/k/v's and gate/up's weights (model/fused.py), once per model.
        if config.fold_norms and self.projections == "kernel":
            fold_norms(model)
        if note := fold_norms_note(config.fold_norms, model.norms_folded, self.projections):
            log.info(note)
        self.num_slots = config.kv_pool_slots
        # A pool the device cannot hold is refused here, naming the flag, not deep in XLA's allocator.
        check_pool_fits(config.kv_pool_tokens, self.num_slots, self.model_config, config.kv_precision,
                        devices=model.tp.size if model.tp is not None else 1)
        # bf16 pools, or DKVC's anchor + delta pools (--kv-precision; the precision run may be a fallback).
        self.kv_precision, self.kv_cache, self.kv_anchor = start_kv_cache(
            config.kv_precision, model, self.num_slots,
            sharding=model.tp.kv_sharding if model.tp is not None else None, fp8_scale=config.fp8_scale)
        # Committed from the start, as a recall leaves it: else the copies compile again after the first
        # recall (kv/transfer.py `committed`).
        self.kv_cache = committed(self.kv_cache)
        # The cache policy (eviction, page size); with --dmlp-online also the fine-tuner, which the
        # engine feeds (through the policy) but never starts: the server does, after warm-up.
        if policy is None:
            self.cache_policy, self.dmlp_tuner = build_cache_policy(config)
        else:
            self.cache_policy, self.dmlp_tuner = policy, None
        self.clock: Clock = clock if clock is not None else EngineClock()
        # Host wall time by phase (phase_times.py): the step's parts, admission's prefix lookups and the KV
        # copies; benchmarks read it to split a request's time (benchmarks/host_tier.py).
        self.phases = PhaseTimes()
        self.pool = PagePool(self.num_slots, enable_prefix_caching=config.enable_prefix_caching,
                             policy=self.cache_policy, clock=self.clock, host_tokens=config.kv_host_tokens)
        # Host-tier copies (kv/transfer.py, pinned host memory), and the choice between recalling a prefix's
        # host pages and recomputing them, by the measured copy and prefill rates (kv/recall_choice.py).
        self.transfers = KvTransfers(phases=self.phases, compile_count=lambda: self.compiles.total)
        self.recorder = StepRecorder()        # step count, recent step costs and queue waits (engine_stats.py)
        self.pool.recall_choice = self.transfers.recall_choice = RecallChoice(self.recorder.prefill_tokens_per_s)
        self._measure_attention_stats = config.measures_attention_stats
        # Device idle time between steps: the DMLP's gpu_idle_frac, the stratum_gpu_idle_* metrics, HAB.
        self.gpu_idle = GpuIdleMeter()
        self.timeline = DeviceTimeline(self.gpu_idle)   # busy intervals of steps dispatched without waiting
        # Page size: --page-size, else the policy.
        self.scheduler = build_scheduler(config, self.pool, phases=self.phases)
        # Bytes per token slot over all layers: the pools' (deltas and per-granule scales with DKVC), not
        # the resident anchor's.
        self._kv_bytes_per_token = kv_bytes_per_slot(self.kv_cache)
        # What each step must move and compute, counted (step_work.py): the utilization metrics' numerators.
        self.work = ModelWork.of(self.model_config, params_nbytes(self.model.params), self._kv_bytes_per_token,
                                 jax.numpy.dtype(self.model_config.dtype).itemsize)
        if self.pool.host is not None and config.kv_host_pin_at_start:
            self.transfers.pin(self.kv_cache, config.kv_host_tokens * self._kv_bytes_per_token)
        self.runner = ModelRunner(config, self.model, num_slots=self.num_slots, backend=self.attention_backend,
                                  projections=self.projections, attn_stats=self._measure_attention_stats,
                                  kv_layout=kv_layout_of(self.kv_cache))
        self.outputs = OutputProcessor(frozenset(self.tokenizer.eos_token_ids)
                                       | frozenset(self.model_config.eos_token_ids), config.max_context)
        self.requests = RequestTable(config, self.model_config.vocab_size, self.tokenizer, self.scheduler,
                                     self.outputs)
        self.postprocessor = Postprocessor(self.outputs, self.requests, self._measure_attention_stats)
        self.inflight = InFlight(config.async_scheduling)   # the step dispatched and not read yet
        # Request features for the pool's block accesses, and the --trace-out block event log.
        self.block_events = BlockEventFeed(self.pool, self.requests, self.recorder, self.gpu_idle, self.clock,
                                           config.trace_out)

    # -- requests -----------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queues a request; returns its id. Raises InvalidRequestError (saying what to fix) or QueueFullError."""
        return self.requests.add(prompt_ids, params, request_id)

    def cancel(self, request_id: str) -> bool:
        """Marks a request cancelled; the next step frees its pages and emits its final output."""
        return self.requests.cancel(request_id)

    @property
    def last_step(self) -> StepTiming | None:
        """The latest step read back (benchmarks, metrics, the cost model's prefill rate)."""
        return self.recorder.last_step

    def running_contexts(self) -> list[int]:
        """Tokens each running request has in the KV cache or on the device (benchmarks: the context the
        next decode step reads)."""
        return [seq.num_tokens for seq in self.scheduler.running]

    def has_unfinished(self) -> bool:
        """Requests in flight, or a dispatched step still to be read (its rows may all have finished)."""
        return bool(self.requests) or self.inflight.step is not None

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
        batch = self._schedule(outputs)
        launched = self._dispatch(batch) if batch is not None else None
        for step in self.inflight.advance(launched):     # the step before it; without async, this one too
            self._postprocess(step, self._collect(step), outputs)
        return list(outputs.values())

    def drain(self) -> list[StepOutput]:
        """Reads and post-processes the step in flight, if any, without dispatching another (a profiler
        window that should hold one whole step; a driver that wants every result before it stops)."""
        outputs: dict[str, StepOutput] = {}
        step = self.inflight.drain()
        if step is not None:
            self._postprocess(step, self._collect(step), outputs)
        return list(outputs.values())

    def _schedule(self, outputs: dict[str, StepOutput]) -> ScheduledBatch | None:
        """Ends cancelled requests (their final outputs into `outputs`), picks the next step's work, and
        with a host tier runs the KV copies it needs."""
        self.pool.new_step()          # last step's block accesses reach the cache policy in one batch
        with jax.profiler.TraceAnnotation("scheduler"), self.phases.span("schedule"):
            for seq in self.requests.cancelled():
                self.requests.finish(seq, FinishReason.CANCELLED, outputs)
            self.timeline.watch(self.inflight.step, self.clock())
            batch = self.scheduler.schedule(self._step_costs())
        if self.pool.host is not None:
            with jax.profiler.TraceAnnotation("kv_transfers"):
                with self.phases.span("prefetch"):
                    # Looks at as many queued requests as one batch holds.
                    prefetch_queued(self.pool, self.scheduler.waiting, self.config.max_batch_size,
                                    self.config.kv_prefetch_pages)
                with self.phases.span("transfers"):
                    # Before the step: offloads read pages scheduling just evicted, recalls fill pages it
                    # just allocated (kv/transfer.py).
                    self.kv_cache = self.transfers.run(self.kv_cache, self.pool.take_transfers())
        return batch

    def _dispatch(self, batch: ScheduledBatch) -> InFlightStep:
        """Launches the batch's step on the device without waiting for it."""
        with jax.profiler.TraceAnnotation(f"dispatch {batch.kind}"), self.phases.span("dispatch"):
            self.timeline.watch(self.inflight.step, self.clock())
            launched, self.kv_cache = self.runner.dispatch(batch, self.kv_cache, previous=self.inflight.step)
            # Counted once the device has the step (not delaying it), and before the dispatch is accounted
            # (inflight.account_dispatch moves num_computed on).
            launched.work = self.work.scheduled(
                [s.num_computed + 1 for s in batch.decode], batch.decode_steps,
                [(s.num_computed, n) for s, n in zip(batch.prefill, batch.chunk_lens)])
            self.timeline.dispatched(launched, self._ms(launched.dispatch_s))
        return launched

    def _collect(self, step: InFlightStep) -> RunResult:
        """Waits for a dispatched step's results and records when the device ran it."""
        was_done = step.is_ready()
        with jax.profiler.TraceAnnotation("wait"), self.phases.span("collect"):
            run = self.runner.collect(step, self.kv_cache)
        start_ms, end_ms = self.timeline.read(step, self._ms(run.done_s), was_done)
        self.recorder.record_timing(step.batch, (end_ms - start_ms) / 1e3, step.work)
        return run

    def _postprocess(self, step: InFlightStep, run: RunResult, outputs: dict[str, StepOutput]) -> None:
        """A step's results into `outputs` (postprocess.py), then the stats and the block event log."""
        with jax.profiler.TraceAnnotation("postprocess"), self.phases.span("postprocess"):
            self.postprocessor(step, run, outputs)
        self.recorder.record_postprocessed(step.batch)
        self.block_events.write()

    def _ms(self, perf_s: float) -> float:
        """A time.perf_counter() reading on the engine clock (ms)."""
        return self.clock() - (time.perf_counter() - perf_s) * 1e3

    def _step_costs(self) -> StepCosts:
        """What the scheduler may weigh: the device idle gap since the last step's results, and the
        measured per-token costs."""
        now_ms = self.clock()
        idle_since = self.timeline.idle_since_ms(self.inflight.step)
        idle = 0.0 if idle_since is None else max(0.0, now_ms - idle_since)
        prefill_tps = self.recorder.prefill_tokens_per_s()
        return StepCosts(now_s=time.monotonic(), idle_gap_ms=idle,
                         prefill_ms_per_token=1e3 / prefill_tps if prefill_tps else None,
                         decode_ms_per_step=self.recorder.decode_ms_per_step())

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
        self.block_events.close()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[GenerationResult]:
        """Offline: runs every prompt as one continuous batch; results in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        with self.phases.span("add_requests"):
            ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {i: GenerationResult(i, [], "", FinishReason.LENGTH, None, None, 0, 0) for i in ids}
        while any(r for r in ids if r in self.requests):
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
        """Compiles every step shape the config can produce (model_runner.py), the host tier's copies and
        the DMLP predictor. Returns the seconds it took."""
        t0 = time.perf_counter()
        self.runner.compile_all(self.kv_cache, progress=progress)
        if self.pool.host is not None:     # the host tier's copies, every batch size x page size
            self.kv_cache = self.transfers.compile_copies(self.kv_cache, self.config.page_sizes)
        warm_predictor(self.cache_policy)
        return time.perf_counter() - t0

    def mark_serving(self) -> None:
        """The driver is taking traffic: from now on a compile is on the request path, counted apart
        (EngineStats.jit_compilations_after_serving) and logged as a WARNING."""
        self.compiles.mark_serving()

    def stats(self) -> EngineStats:
        free = self.pool.free_slots
        bytes_per_s, flops_per_s = self.recorder.work_rates()
        return EngineStats(
            queued=len(self.scheduler.waiting), running=len(self.scheduler.running),
            kv_pages_total=self.num_slots // 8, kv_pages_free=free // 8,
            kv_tokens_total=self.num_slots, kv_tokens_used=self.num_slots - free,
            kv_tokens_written=kv_tokens_written(self.scheduler.running),
            prefix_cache_hits=self.pool.prefix_hits, prefix_cache_queries=self.pool.prefix_queries,
            preemptions=self.scheduler.preemptions, steps=self.recorder.steps,
            prefill_tokens=self.recorder.prefill_tokens,
            decode_step_ms=self.recorder.decode_ms_per_step() or 0.0,
            prefill_tokens_per_s=self.recorder.prefill_tokens_per_s() or 0.0,
            gpu_idle_frac=self.gpu_idle.idle_fraction(self.clock()), gpu_idle_gap_ms=self.gpu_idle.last_gap_ms,
            kv_host_tokens_total=self.pool.host.capacity_tokens if self.pool.host is not None else 0,
            kv_host_tokens_used=self.pool.host.tokens + self.pool.host.kept_tokens if self.pool.host is not None else 0,
            kv_host_reused_pages=self.pool.host.reused if self.pool.host is not None else 0,
            kv_host_hits=self.pool.host_hits, kv_prefetched_pages=self.pool.prefetched,
            kv_offloaded_pages=self.transfers.stats.offloaded_pages,
            kv_recalled_pages=self.transfers.stats.recalled_pages,
            jit_compilations=self.compiles.total, jit_compilations_after_serving=self.compiles.after_serving,
            hab_triggers=self.scheduler.triggers, kv_precision=self.kv_precision,
            kv_bytes_per_token=self._kv_bytes_per_token, kv_recall_batches=self.transfers.stats.recall_batches,
            kv_recall_seconds=tuple(self.transfers.stats.recall_seconds),
            kv_recall_choices=self.pool.recall_choice.recalled, kv_recompute_choices=self.pool.recall_choice.recomputed,
            step_bytes_per_s=bytes_per_s, step_flops_per_s=flops_per_s,
            untimed_steps=self.recorder.untimed_steps, estimated_steps=self.recorder.estimated_steps)
