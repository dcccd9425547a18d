"""The stratum.v1.Stratum servicer: the six RPCs, on asyncio, over an EngineRunner.

Every Messages call ends in exactly one way: a MessageStop event (status OK), or a gRPC status whose
message says what to fix. The call's life (checks, engine, bookkeeping) is frontend.Generation's, shared
with the HTTP endpoint; this file maps it to stratum.v1 messages and gRPC status codes.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import pathlib

import grpc
import jax

import stratum_jax
from serving import cost, profiling
from serving.frontend import DRAINING, SERVING, Failure, Finished, Frontend, Pool, RequestFailed, Served
from serving.hardware import DeviceInfo
from serving.headers import parse_headers
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from serving.translate import STOP_REASONS, delta_event, from_proto
from stratum_jax.metrics import LatencySummary
from stratum_jax.request import InvalidRequestError

log = logging.getLogger(__name__)

GRPC_CODES = {
    Failure.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.UNKNOWN_MODEL: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Failure.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
}


class StratumServicer(pb_grpc.StratumServicer):
    def __init__(self, frontend: Frontend, device: DeviceInfo, prices: cost.Prices,
                 profile_root: str | pathlib.Path) -> None:
        self.frontend = frontend
        self.device = device
        self.prices = prices
        self.profile_root = pathlib.Path(profile_root)
        self.hbm_bandwidth_gbps = 0.0

    @property
    def state(self) -> str:
        return self.frontend.state

    @property
    def served(self) -> Served | None:
        return self.frontend.served

    def set_served(self, served: Served, hbm_bandwidth_gbps: float) -> None:
        self.hbm_bandwidth_gbps = hbm_bandwidth_gbps
        self.frontend.set_served(served)

    # ---- Messages ----

    async def Messages(self, request: pb.MessagesRequest, context: grpc.aio.ServicerContext):
        generation = self.frontend.generation(context.time_remaining())
        try:
            started = await generation.start(request.ByteSize(), context.invocation_metadata() or (),
                                             lambda: from_proto(request))
            yield pb.MessagesEvent(start=pb.MessageStart(request_id=started.request_id,
                                                         prompt_tokens=started.prompt_tokens, model=started.model))
            async for event in generation.events():
                if isinstance(event, Finished):
                    metered = None
                    if event.metered is not None:
                        metered = _breakdown(event.stack, event.metered, event.measured, event.kv_bytes_per_token,
                                             event.prompt_tokens - event.cached_prompt_tokens, event.output_tokens)
                    yield pb.MessagesEvent(stop=pb.MessageStop(
                        stop_reason=STOP_REASONS[event.finish_reason],
                        usage=pb.Usage(input_tokens=event.prompt_tokens, output_tokens=event.output_tokens,
                                       cached_input_tokens=event.cached_prompt_tokens),
                        timings=pb.Timings(queue_ms=event.queue_ms, ttft_ms=event.ttft_ms,
                                           total_ms=event.total_ms),
                        stack=event.stack, route=event.route, metered=metered))
                else:
                    yield delta_event(event)
        except RequestFailed as e:
            await context.abort(GRPC_CODES[e.failure], e.message)
        finally:
            # Without a recorded status, the client cancelled, disconnected or ran out of time: gRPC cancels
            # the handler task (CancelledError) or closes the generator (GeneratorExit) mid-stream.
            generation.close()

    # ---- the unary RPCs ----

    async def CountTokens(self, request: pb.CountTokensRequest, context) -> pb.CountTokensResponse:
        served = await self._checked(request, context)
        try:
            parse_headers(context.invocation_metadata())
            ids = served.translator.prompt_ids(request)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.CountTokensResponse(input_tokens=len(ids))

    async def CostEstimate(self, request: pb.CostEstimateRequest, context) -> pb.CostEstimateResponse:
        served = await self._checked(request, context)
        try:
            parse_headers(context.invocation_metadata())
            served.translator.check_max_tokens(request.max_tokens)
            ids = served.translator.prompt_ids(request)
            served.translator.check_fits(len(ids), request.max_tokens)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        # One breakdown per pool, each at its own rates: the medians of its recent bills (Pool.measured).
        breakdowns = []
        for pool in served.pools.values():
            measured = pool.measured()
            try:
                c = cost.estimate(len(ids), request.max_tokens, request.ByteSize(), pool.kv_bytes_per_token,
                                  measured, self.prices)
            except ValueError as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{pool.name} stack: {e}")
            breakdowns.append(_breakdown(pool.name, c, measured, pool.kv_bytes_per_token, len(ids),
                                         request.max_tokens))
        stratum = breakdowns[0]
        return pb.CostEstimateResponse(
            estimated_cost_usd=stratum.cost_usd, input_tokens=len(ids), max_output_tokens=request.max_tokens,
            gpu_usd_per_hour=self.prices.gpu_usd_per_hour, transfer_usd_per_gb=self.prices.transfer_usd_per_gb,
            hbm_usd_per_gb_hour=self.prices.hbm_usd_per_gb_hour, breakdown=stratum, stacks=breakdowns)

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        served = self.served
        return pb.HealthResponse(
            ready=self.state == SERVING, state=self.state, device=self.device.device, platform=self.device.platform,
            cuda_version=self.device.cuda_version, hbm_bandwidth_gbps=self.hbm_bandwidth_gbps,
            model=served.model_info if served else None, version=stratum_jax.__version__,
            jax_version=jax.__version__)

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.MetricsSnapshot:
        served = await self._loaded(context)
        frontend = self.frontend
        stacks = [self._stack_snapshot(pool) for pool in served.pools.values()]
        router = frontend.router_metrics.status_counts()
        everyone = collections.Counter(router)
        for snapshot in stacks:
            everyone.update(dict(snapshot.requests_by_status))
        top = pb.MetricsSnapshot()
        top.CopyFrom(stacks[0])          # the Stratum stack's (proto: MetricsSnapshot)
        top.in_flight = len(frontend.active)
        top.requests_by_status.clear()
        top.requests_by_status.update(everyone)
        top.stacks.extend(stacks)
        top.router_requests_by_status.update(router)
        top.prompt_length_entropy_bits = served.router.lengths.bits()
        return top

    def _stack_snapshot(self, pool: Pool) -> pb.MetricsSnapshot:
        """One stack's figures: its engine's stats, its requests' counts and latencies."""
        s, metrics, runner = pool.runner.stats, pool.metrics, pool.runner
        input_tokens, output_tokens = metrics.token_counts()
        return pb.MetricsSnapshot(
            stack=pool.name, queued=s.queued, running=s.running, in_flight=self.frontend.in_flight(pool.name),
            kv_pages_total=s.kv_pages_total, kv_pages_used=s.kv_pages_total - s.kv_pages_free,
            kv_pages_free=s.kv_pages_free, kv_tokens_total=s.kv_tokens_total, kv_tokens_used=s.kv_tokens_used,
            prefix_cache_hits=s.prefix_cache_hits, prefix_cache_queries=s.prefix_cache_queries,
            cache_hit_rate=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            preemptions=s.preemptions, steps=s.steps, decode_step_ms=s.decode_step_ms,
            prefill_tokens_per_s=s.prefill_tokens_per_s, input_tokens=input_tokens, output_tokens=output_tokens,
            requests_by_status=metrics.status_counts(), accepted=runner.accepted, finished=runner.finished,
            ttft=_summary(metrics.recent_ttft.summary()), tpot=_summary(metrics.recent_tpot.summary()),
            e2e=_summary(metrics.recent_e2e.summary()), draining=self.state == DRAINING,
            dmlp=_dmlp_status(runner.engine))

    async def Profile(self, request: pb.ProfileRequest, context) -> pb.ProfileResponse:
        served = await self._loaded(context)
        try:
            num_steps, timeout_s = profiling.check_request(request.num_steps, request.timeout_s)
            trace_dir = profiling.trace_dir_for(self.profile_root, request.name)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        capture = profiling.ProfileCapture(trace_dir, num_steps, timeout_s)
        try:
            result = await asyncio.wrap_future(served.runner.profile(capture))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.ProfileResponse(trace_dir=result.trace_dir, steps_captured=result.steps_captured,
                                  files=result.files)

    # ---- helpers ----

    async def _loaded(self, context) -> Served:
        try:
            return self.frontend.require_loaded()
        except RequestFailed as e:
            await context.abort(GRPC_CODES[e.failure], e.message)

    async def _checked(self, request, context) -> Served:
        """The size and state checks of the unary RPCs (not counted: only Messages calls are)."""
        try:
            self.frontend.check_size(request.ByteSize())   # the serialized size: what came over the wire
            return self.frontend.require_serving()
        except RequestFailed as e:
            await context.abort(GRPC_CODES[e.failure], e.message)


def _breakdown(stack: str, c: cost.Cost, measured: cost.Measured, kv_bytes_per_token: int, input_tokens: int,
               output_tokens: int) -> pb.CostBreakdown:
    return pb.CostBreakdown(
        stack=stack, cost_usd=c.estimated_cost_usd, compute_usd=c.compute_usd, hbm_usd=c.hbm_usd,
        transfer_usd=c.transfer_usd, compute_seconds=c.compute_seconds, kv_gb_hours=c.kv_gb_hours,
        transfer_gb=c.transfer_gb, decode_step_ms=measured.decode_step_ms,
        prefill_tokens_per_s=measured.prefill_tokens_per_s, decode_batch=max(1.0, measured.decode_batch),
        prefill_batch=max(1.0, measured.prefill_batch), kv_bytes_per_token=kv_bytes_per_token,
        billed_input_tokens=input_tokens, billed_output_tokens=output_tokens,
        estimated_compute_seconds=c.estimated_compute_seconds)


def _dmlp_status(engine) -> pb.DmlpStatus | None:
    from stratum_jax.dmlp.runtime import dmlp_status
    status = dmlp_status(engine.cache_policy, engine.dmlp_tuner)
    return None if status is None else pb.DmlpStatus(**status)


def _summary(s: LatencySummary) -> pb.LatencySummary:
    return pb.LatencySummary(count=s.count, mean_ms=1e3 * s.mean_s, p50_ms=1e3 * s.p50_s, p95_ms=1e3 * s.p95_s,
                             p99_ms=1e3 * s.p99_s)
