"""The stratum.v1.Stratum servicer: the six RPCs, on asyncio, over an EngineRunner.

Every Messages call ends in exactly one way: a MessageStop event (status OK), or a gRPC status whose
message says what to fix. Its terminal status is counted once in `stratum_requests_total`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import pathlib
import time
import uuid

import grpc
import jax

import stratum_jax
from serving import cost, profiling
from serving.hardware import DeviceInfo
from serving.headers import RequestHeaders, parse_headers
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from serving.runner import EngineRunner, RequestStream, RunnerClosedError
from serving.translate import STOP_REASON_NAMES, STOP_REASONS, Translator, delta_event
from stratum_jax.metrics import LatencySummary, ServingMetrics
from stratum_jax.request import FinishReason, InvalidRequestError, QueueFullError

log = logging.getLogger(__name__)

STARTING, SERVING, DRAINING = "starting", "serving", "draining"


@dataclasses.dataclass
class Served:
    """Everything that exists once the model is loaded and warmed."""

    runner: EngineRunner
    translator: Translator
    model_info: pb.ModelInfo
    kv_bytes_per_token: int


class _Call:
    """Per-Messages-call bookkeeping: the terminal status is recorded exactly once."""

    def __init__(self, metrics: ServingMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.status: str | None = None

    def end(self, status: str) -> None:
        """Records the terminal status; later calls are no-ops."""
        if self.status is None:
            self.status = status
            self.metrics.request_ended(status)


class StratumServicer(pb_grpc.StratumServicer):
    def __init__(self, metrics: ServingMetrics, device: DeviceInfo, prices: cost.Prices,
                 profile_root: str | pathlib.Path, max_message_bytes: int | None = None) -> None:
        self.metrics = metrics
        # Enforced here rather than by gRPC's transport (which is set to accept more, see server.py), so
        # that an oversized Messages call is counted and its status says which flag raises the limit.
        self.max_message_bytes = max_message_bytes
        self.device = device
        self.prices = prices
        self.profile_root = pathlib.Path(profile_root)
        self.hbm_bandwidth_gbps = 0.0
        self.state = STARTING
        self.served: Served | None = None
        self.active: set[RequestStream] = set()   # accepted Messages streams not yet ended
        self.idle = asyncio.Event()                # set whenever `active` is empty
        self.idle.set()

    def set_served(self, served: Served, hbm_bandwidth_gbps: float) -> None:
        self.served = served
        self.hbm_bandwidth_gbps = hbm_bandwidth_gbps
        self.state = SERVING

    # ---- Messages ----

    async def Messages(self, request: pb.MessagesRequest, context: grpc.aio.ServicerContext):
        call = _Call(self.metrics)
        await self._check_size(request, context, call)
        served = await self._require_serving(context, call)
        try:
            headers = parse_headers(context.invocation_metadata())
            prompt_ids, params = served.translator.messages_request(request)
        except InvalidRequestError as e:
            await self._abort(context, call, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:   # a bug (say, in a tokenizer), not the client's fault: still one clean status
            log.exception("could not read a Messages request")
            await self._abort(context, call, grpc.StatusCode.INTERNAL, f"the server could not read the request: {e}")
        self._record_headers(headers)
        deadline = _deadline(context, call.arrival)
        if deadline is not None and deadline <= time.monotonic():
            await self._abort(context, call, grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the deadline passed before the request was queued: give it a longer deadline")
        request_id = request.request_id or uuid.uuid4().hex
        try:
            stream = await served.runner.submit(prompt_ids, params, request_id)
        except InvalidRequestError as e:
            await self._abort(context, call, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            await self._abort(context, call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{e}: the server is at capacity, retry with backoff")
        except RunnerClosedError as e:
            await self._abort(context, call, grpc.StatusCode.UNAVAILABLE, f"{e}: retry on another server")
        except asyncio.CancelledError:
            call.end(_cancel_status(deadline))
            raise
        except RuntimeError as e:
            await self._abort(context, call, grpc.StatusCode.INTERNAL, str(e))

        self._track(stream)
        log.debug("%s accepted: %d prompt tokens, max_tokens %d, route %s, weight %s", request_id,
                  len(prompt_ids), params.max_tokens, headers.route, headers.weight)
        try:
            yield pb.MessagesEvent(start=pb.MessageStart(request_id=request_id, prompt_tokens=len(prompt_ids),
                                                         model=served.translator.limits.model_name))
            async for event in self._stream_events(stream, call, context, deadline):
                yield event
        finally:
            # Without a recorded status, the client cancelled, disconnected or ran out of time: gRPC cancels
            # the handler task (CancelledError) or closes the generator (GeneratorExit) mid-stream.
            call.end(_cancel_status(deadline))
            stream.cancel()   # no-op when it finished; else the engine frees its pages at the next step
            self._untrack(stream)

    async def _stream_events(self, stream: RequestStream, call: _Call, context, deadline: float | None):
        """The delta events of one accepted request, then its stop event (or an abort)."""
        first_start = first_token = None
        while True:
            timeout = None if deadline is None else deadline - time.monotonic()
            try:
                delivery = await asyncio.wait_for(stream.next(), timeout)
            except TimeoutError:
                stream.cancel()
                await self._abort(context, call, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  "the deadline passed before generation finished: give it a longer deadline "
                                  "or lower max_tokens")
            out = delivery.output
            if first_start is None:
                first_start = delivery.step_start
            if first_token is None and out.new_token_ids:
                first_token = delivery.step_end
            event = delta_event(out)
            if event is not None:
                yield event
            if not out.finished:
                continue
            if out.finish_reason == FinishReason.ERROR:
                await self._abort(context, call, grpc.StatusCode.INTERNAL, out.error or "the engine failed")
            if out.finish_reason == FinishReason.CANCELLED and stream.shutdown:
                await self._abort(context, call, grpc.StatusCode.UNAVAILABLE,
                                  f"the server shut down after {out.output_tokens} tokens of this reply: "
                                  "retry on another server")
            stop_reason = STOP_REASONS[out.finish_reason]
            end = delivery.step_end
            ttft = None if first_token is None else first_token - call.arrival
            self.metrics.request_completed(
                stop_reason=STOP_REASON_NAMES[stop_reason], output_tokens=out.output_tokens, ttft_s=ttft,
                e2e_s=end - call.arrival)
            call.end("ok")
            yield pb.MessagesEvent(stop=pb.MessageStop(
                stop_reason=stop_reason,
                usage=pb.Usage(input_tokens=out.prompt_tokens, output_tokens=out.output_tokens,
                               cached_input_tokens=out.cached_prompt_tokens),
                timings=pb.Timings(queue_ms=1e3 * (first_start - call.arrival),
                                   ttft_ms=0.0 if ttft is None else 1e3 * ttft,
                                   total_ms=1e3 * (end - call.arrival))))
            return

    # ---- the unary RPCs ----

    async def CountTokens(self, request: pb.CountTokensRequest, context) -> pb.CountTokensResponse:
        await self._check_size(request, context)
        served = await self._require_serving(context)
        try:
            parse_headers(context.invocation_metadata())
            ids = served.translator.prompt_ids(request)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.CountTokensResponse(input_tokens=len(ids))

    async def CostEstimate(self, request: pb.CostEstimateRequest, context) -> pb.CostEstimateResponse:
        await self._check_size(request, context)
        served = await self._require_serving(context)
        try:
            parse_headers(context.invocation_metadata())
            served.translator.check_max_tokens(request.max_tokens)
            ids = served.translator.prompt_ids(request)
            served.translator.check_fits(len(ids), request.max_tokens)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        stats = served.runner.stats
        # The prefill rate from representative steps only (cost.PrefillRate), not the engine's median over
        # every step, which starts out as the tiny warm-up's.
        rate = served.runner.prefill_rate
        measured = cost.Measured(stats.decode_step_ms, rate.tokens_per_s if rate is not None else 0.0,
                                 served.runner.decode_batch)
        try:
            c = cost.estimate(len(ids), request.max_tokens, request.ByteSize(), served.kv_bytes_per_token,
                              measured, self.prices)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return pb.CostEstimateResponse(
            estimated_cost_usd=c.estimated_cost_usd, input_tokens=len(ids), max_output_tokens=request.max_tokens,
            gpu_usd_per_hour=self.prices.gpu_usd_per_hour, transfer_usd_per_gb=self.prices.transfer_usd_per_gb,
            hbm_usd_per_gb_hour=self.prices.hbm_usd_per_gb_hour,
            breakdown=pb.CostBreakdown(
                stack="stratum", compute_usd=c.compute_usd, hbm_usd=c.hbm_usd, transfer_usd=c.transfer_usd,
                compute_seconds=c.compute_seconds, kv_gb_hours=c.kv_gb_hours, transfer_gb=c.transfer_gb,
                decode_step_ms=measured.decode_step_ms, prefill_tokens_per_s=measured.prefill_tokens_per_s,
                decode_batch=max(1.0, measured.decode_batch), kv_bytes_per_token=served.kv_bytes_per_token))

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        served = self.served
        return pb.HealthResponse(
            ready=self.state == SERVING, state=self.state, device=self.device.device, platform=self.device.platform,
            cuda_version=self.device.cuda_version, hbm_bandwidth_gbps=self.hbm_bandwidth_gbps,
            model=served.model_info if served else None, version=stratum_jax.__version__,
            jax_version=jax.__version__)

    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.MetricsSnapshot:
        served = await self._require_loaded(context)
        s = served.runner.stats
        input_tokens, output_tokens = self.metrics.token_counts()
        return pb.MetricsSnapshot(
            queued=s.queued, running=s.running, in_flight=len(self.active),
            kv_pages_total=s.kv_pages_total, kv_pages_used=s.kv_pages_total - s.kv_pages_free,
            kv_pages_free=s.kv_pages_free, kv_tokens_total=s.kv_tokens_total, kv_tokens_used=s.kv_tokens_used,
            prefix_cache_hits=s.prefix_cache_hits, prefix_cache_queries=s.prefix_cache_queries,
            cache_hit_rate=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            preemptions=s.preemptions, steps=s.steps, decode_step_ms=s.decode_step_ms,
            prefill_tokens_per_s=s.prefill_tokens_per_s, input_tokens=input_tokens, output_tokens=output_tokens,
            requests_by_status=self.metrics.status_counts(), accepted=served.runner.accepted,
            finished=served.runner.finished, ttft=_summary(self.metrics.recent_ttft.summary()),
            tpot=_summary(self.metrics.recent_tpot.summary()), e2e=_summary(self.metrics.recent_e2e.summary()),
            draining=self.state == DRAINING, dmlp=_dmlp_status(served.runner.engine))

    async def Profile(self, request: pb.ProfileRequest, context) -> pb.ProfileResponse:
        served = await self._require_loaded(context)
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

    # ---- draining ----

    def shutdown_streams(self) -> None:
        """Cancels every in-flight stream; each ends with UNAVAILABLE once the engine frees it."""
        for stream in list(self.active):
            stream.shutdown = True
            stream.cancel()

    # ---- helpers ----

    async def _require_loaded(self, context) -> Served:
        if self.served is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading: retry shortly")
        return self.served

    async def _require_serving(self, context, call: _Call | None = None) -> Served:
        if self.state == SERVING and self.served is not None:
            return self.served
        message = ("the server is draining and takes no new requests: retry on another server"
                   if self.state == DRAINING else "the model is still loading: retry shortly")
        if call is not None:
            call.end("unavailable")
        await context.abort(grpc.StatusCode.UNAVAILABLE, message)

    async def _check_size(self, request, context, call: _Call | None = None) -> None:
        """RESOURCE_EXHAUSTED (counted for Messages) when the request is over --max-message-bytes."""
        size = request.ByteSize()     # the serialized size: what came over the wire
        if self.max_message_bytes is None or size <= self.max_message_bytes:
            return
        message = (f"the request is {size} bytes, over this server's limit of {self.max_message_bytes} bytes: "
                   "send a shorter request, or start the server with a larger --max-message-bytes")
        if call is not None:
            await self._abort(context, call, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def _abort(self, context, call: _Call, code: grpc.StatusCode, message: str):
        call.end(code.name.lower())
        await context.abort(code, message)

    def _record_headers(self, headers: RequestHeaders) -> None:
        # Recorded now, acted on later (the traffic split and the long-context engine).
        self.metrics.routes.labels(headers.route).inc()
        if headers.weight is not None:
            self.metrics.weights.observe(headers.weight)

    def _track(self, stream: RequestStream) -> None:
        self.active.add(stream)
        self.metrics.in_flight.set(len(self.active))
        self.idle.clear()

    def _untrack(self, stream: RequestStream) -> None:
        self.active.discard(stream)
        self.metrics.in_flight.set(len(self.active))
        if not self.active:
            self.idle.set()


def _deadline(context, now: float) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else now + remaining


def _cancel_status(deadline: float | None) -> str:
    return "deadline_exceeded" if deadline is not None and time.monotonic() >= deadline else "cancelled"


def _dmlp_status(engine) -> pb.DmlpStatus | None:
    from stratum_jax.dmlp.runtime import dmlp_status
    status = dmlp_status(getattr(engine, "cache_policy", None), getattr(engine, "dmlp_tuner", None))
    return None if status is None else pb.DmlpStatus(**status)


def _summary(s: LatencySummary) -> pb.LatencySummary:
    return pb.LatencySummary(count=s.count, mean_ms=1e3 * s.mean_s, p50_ms=1e3 * s.p50_s, p95_ms=1e3 * s.p95_s,
                             p99_ms=1e3 * s.p99_s)
