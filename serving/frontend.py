"""One generation call's life, whatever the transport: the checks before the engine, the engine's events,
and the bookkeeping after (the terminal status, latencies, in-flight tracking, cancellation).

gRPC's `Messages` (servicer.py) and HTTP's `/v1/chat/completions` and `/v1/completions` (http.py) are thin
adapters over `Generation`: each turns its request into a `GenerateRequest`, its headers into pairs, and
maps the `Failure` of a `RequestFailed` and the events (StepOutput deltas, then one `Finished`) into its
own wire format. Every call ends in exactly one way, counted once in `stratum_requests_total` under the
status names of gRPC (ok, invalid_argument, resource_exhausted, ...), whichever transport it came by.

A server may run several pools (serving/stacks.py: the Stratum stack, the baseline, the long-context pool),
each an engine on its own runner. `Generation.start` picks one per call (serving/routing.py: the route, then
the x-stratum-weight split) and the call's metrics go to that pool's `stack` series; a call refused before a
pool is chosen (a bad header, a malformed request) belongs to no pool and is counted under stack="router"
(`Frontend.router_metrics`, stratum_jax/metrics.py RouterMetrics), as is the prompt-length entropy.
"""
from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
import uuid
from typing import AsyncIterator, Callable, Iterable, NoReturn

from serving import cost
from serving.headers import RequestHeaders, parse_headers
from serving.recent_rates import RecentRates
from serving.routing import LONG_CONTEXT_ROUTE, RouteDecision, Router, goes_to_stratum
from serving.stacks import BASELINE, LONG_CONTEXT, STRATUM
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.runner import EngineRunner, RequestStream, RunnerClosedError
from serving.translate import (STOP_REASON_NAMES, STOP_REASONS, GenerateRequest, Translator,
                               UnknownModelError)
from stratum_jax.metrics import ServingMetrics
from stratum_jax.request import FinishReason, InvalidRequestError, QueueFullError, SamplingParams, StepOutput

log = logging.getLogger(__name__)

STARTING, SERVING, DRAINING = "starting", "serving", "draining"


class Failure(enum.Enum):
    """Why a call ended without a reply. Each transport maps these to its own codes (gRPC status, HTTP
    status); two of them share a gRPC code but not an HTTP status (413 vs 429, 404 vs 400)."""

    INVALID_ARGUMENT = enum.auto()
    UNKNOWN_MODEL = enum.auto()        # a subset of INVALID_ARGUMENT: the request names another model
    UNAUTHENTICATED = enum.auto()
    TOO_LARGE = enum.auto()            # over --max-message-bytes
    QUEUE_FULL = enum.auto()
    UNAVAILABLE = enum.auto()          # loading, draining, or shut down mid-reply
    DEADLINE_EXCEEDED = enum.auto()
    INTERNAL = enum.auto()

    @property
    def status(self) -> str:
        """The label this failure is counted under in stratum_requests_total."""
        return _STATUS_LABELS.get(self, self.name.lower())


_STATUS_LABELS = {Failure.UNKNOWN_MODEL: "invalid_argument", Failure.TOO_LARGE: "resource_exhausted",
                  Failure.QUEUE_FULL: "resource_exhausted"}


class RequestFailed(Exception):
    """A call ends with `failure`; `message` says what to fix and goes to the client unchanged."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure
        self.message = message


@dataclasses.dataclass
class Pool:
    """One engine the server runs: a stack (stratum, baseline) or the long-context pool."""

    name: str                    # its `stack` label: stratum, baseline or long-context
    runner: EngineRunner
    translator: Translator       # with this pool's context cap
    kv_bytes_per_token: int      # what its KV pages hold per token (the cost model's kv)
    metrics: ServingMetrics | None = None   # its series; None = the frontend's (set by Frontend.set_served)
    recent: RecentRates = dataclasses.field(default_factory=RecentRates)   # its recent bills' rates

    def measured(self) -> cost.Measured:
        """What CostEstimate prices a request with on this pool: the medians of its recent bills' per-token rates
        (serving/recent_rates.py); before its first bill, the step times measured at start-up (the decode step
        median, cost.PrefillRate's representative prefill rate) with the steps to itself (B = S = 1)."""
        return self.recent.measured(self.calibrated())

    def calibrated(self) -> cost.Measured:
        rate = self.runner.prefill_rate
        return cost.Measured(self.runner.stats.decode_step_ms, rate.tokens_per_s if rate is not None else 0.0,
                             decode_batch=1.0)


@dataclasses.dataclass
class Served:
    """Everything that exists once the model is loaded and warmed. `runner`, `translator` and
    `kv_bytes_per_token` are the Stratum stack's (the first pool's); `pools` holds every pool by name (just
    the Stratum stack unless the server runs more); `router` decides the long-context route."""

    runner: EngineRunner
    translator: Translator
    model_info: pb.ModelInfo
    kv_bytes_per_token: int
    pools: dict[str, Pool] = dataclasses.field(default_factory=dict)
    router: Router | None = None
    stratum_weight: float = 1.0     # the split of calls without x-stratum-weight

    def __post_init__(self) -> None:
        if not self.pools:
            self.pools = {STRATUM: Pool(STRATUM, self.runner, self.translator, self.kv_bytes_per_token)}
        if self.router is None:
            self.router = Router(long_context=LONG_CONTEXT in self.pools)


@dataclasses.dataclass(frozen=True)
class Started:
    """What the engine accepted."""

    request_id: str
    prompt_tokens: int
    model: str
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Finished:
    """The last event of a call that ran to a stop reason."""

    finish_reason: FinishReason
    prompt_tokens: int
    cached_prompt_tokens: int
    output_tokens: int
    queue_ms: float      # arrival until the start of the engine step that gave the first output
    ttft_ms: float       # arrival until the first token (0 when there was none)
    total_ms: float      # arrival until the last token
    stack: str = STRATUM          # the pool that served it
    route: str = "default"        # default or long-context
    metered: cost.Cost | None = None   # metered usage (None from an engine that reports no usage)
    measured: cost.Measured | None = None   # the rates that reproduce the bill (cost.meter with them)
    kv_bytes_per_token: int = 0


class Frontend:
    """The state both transports share: whether the model is served, the in-flight calls, the metrics."""

    def __init__(self, metrics: ServingMetrics, max_message_bytes: int | None = None,
                 prices: cost.Prices | None = None) -> None:
        self.metrics = metrics                       # the Stratum stack's series
        self.router_metrics = metrics.router()       # stack="router": what happens before a pool is chosen
        self.prices = prices or cost.Prices()    # metered usage
        # Enforced here rather than by the transports (gRPC's is set to accept more, see server.py), so that
        # an oversized call is counted and its error says which flag raises the limit.
        self.max_message_bytes = max_message_bytes
        self.state = STARTING
        self.served: Served | None = None
        self.active: set[RequestStream] = set()   # accepted streams not yet ended, of both transports
        self.idle = asyncio.Event()                # set whenever `active` is empty
        self.idle.set()
        self._active_by_stack: dict[str, int] = {}

    def set_served(self, served: Served) -> None:
        for pool in served.pools.values():
            if pool.metrics is None:
                pool.metrics = self.metrics if pool.name == self.metrics.stack else self.metrics.for_stack(pool.name)
        self.served = served
        self.state = SERVING

    def generation(self, timeout_s: float | None = None) -> Generation:
        """A new call, arriving now; `timeout_s` is its deadline (None: none)."""
        return Generation(self, timeout_s)

    def require_loaded(self) -> Served:
        if self.served is None:
            raise RequestFailed(Failure.UNAVAILABLE, "the model is still loading: retry shortly")
        return self.served

    def require_serving(self) -> Served:
        if self.state == SERVING and self.served is not None:
            return self.served
        raise RequestFailed(Failure.UNAVAILABLE,
                            "the server is draining and takes no new requests: retry on another server"
                            if self.state == DRAINING else "the model is still loading: retry shortly")

    def check_size(self, size: int) -> None:
        """TOO_LARGE when a request of `size` bytes (as it came over the wire) is over --max-message-bytes."""
        if self.max_message_bytes is not None and size > self.max_message_bytes:
            raise RequestFailed(
                Failure.TOO_LARGE,
                f"the request is {size} bytes, over this server's limit of {self.max_message_bytes} bytes: "
                "send a shorter request, or start the server with a larger --max-message-bytes")

    def shutdown_streams(self) -> None:
        """Cancels every in-flight call; each ends with UNAVAILABLE once the engine frees it."""
        for stream in list(self.active):
            stream.shutdown = True
            stream.cancel()

    def choose_pool(self, served: Served, headers: RequestHeaders, request_id: str, prompt_tokens: int,
                    prompt_text: str | None) -> tuple[Pool, RouteDecision]:
        """The pool of one call: the long-context pool when routed there (the header, or the classifier),
        else the Stratum stack or the baseline by the x-stratum-weight split of the call's key (its
        x-stratum-session, else its request id). Logs and counts the decision."""
        decision = served.router.decide(headers.route, prompt_tokens, prompt_text)
        self.router_metrics.prompt_length_entropy.set(decision.entropy_bits)
        if decision.route == LONG_CONTEXT_ROUTE:
            if LONG_CONTEXT not in served.pools:
                raise InvalidRequestError(
                    "x-stratum-route: long-context needs a long-context pool, and this server runs none: send "
                    "x-stratum-route: default, or start the server with long-context in --stacks")
            pool = served.pools[LONG_CONTEXT]
        else:
            weight = served.stratum_weight if headers.weight is None else headers.weight
            to_stratum = BASELINE not in served.pools or goes_to_stratum(headers.session or request_id, weight)
            pool = served.pools[STRATUM if to_stratum else BASELINE]
        pool.metrics.record_route(decision.route, decision.reason)
        pool.metrics.routes.labels(headers.route).inc()
        if headers.weight is not None:
            pool.metrics.weights.observe(headers.weight)
        log.debug("%s -> %s (route %s: %s, prompt-length entropy %.2f bits)", request_id, pool.name,
                  decision.route, decision.reason, decision.entropy_bits)
        return pool, decision

    def in_flight(self, stack: str) -> int:
        """Accepted streams of `stack` not ended yet."""
        return self._active_by_stack.get(stack, 0)

    def _track(self, stream: RequestStream, metrics: ServingMetrics) -> None:
        self.active.add(stream)
        self._active_by_stack[metrics.stack] = self._active_by_stack.get(metrics.stack, 0) + 1
        metrics.in_flight.set(self._active_by_stack[metrics.stack])
        self.idle.clear()

    def _untrack(self, stream: RequestStream, metrics: ServingMetrics) -> None:
        if stream in self.active:
            self.active.discard(stream)
            self._active_by_stack[metrics.stack] -= 1
            metrics.in_flight.set(self._active_by_stack[metrics.stack])
        if not self.active:
            self.idle.set()


class Generation:
    """One call: `start`, then `events`, and always `close` (in a finally), whatever happened.

    `start` and `events` raise RequestFailed with the terminal status already counted. A call that ends
    without one (the client cancelled, disconnected or ran out of time: the transport cancels or closes the
    handler) is counted as cancelled or deadline_exceeded by `close`, which also asks the engine to drop it.
    """

    def __init__(self, frontend: Frontend, timeout_s: float | None) -> None:
        self.frontend = frontend
        self.arrival = time.monotonic()
        self.deadline = None if timeout_s is None else self.arrival + timeout_s
        self.status: str | None = None
        self.stream: RequestStream | None = None
        self.pool: Pool | None = None          # chosen in start()
        self.route = "default"
        self.size = 0                          # the request's bytes on the wire (metered transfer)

    @property
    def metrics(self) -> ServingMetrics:
        """The series of this call's pool (chosen in start())."""
        return self.pool.metrics

    def end(self, status: str) -> None:
        """Records the terminal status, under its pool, or under stack="router" when it ended before a pool was
        chosen; later calls are no-ops."""
        if self.status is None:
            self.status = status
            (self.pool.metrics if self.pool is not None else self.frontend.router_metrics).request_ended(status)

    def fail(self, failure: Failure, message: str) -> NoReturn:
        self.end(failure.status)
        raise RequestFailed(failure, message)

    async def start(self, size: int, headers: Iterable[tuple[str, str]],
                    parse: Callable[[], GenerateRequest]) -> Started:
        """Checks the call (size, state, headers, then `parse()` and the translation) and hands it to the
        engine; returns once the engine accepted it. `parse` raises InvalidRequestError for bad input."""
        frontend = self.frontend
        self.size = size
        try:
            frontend.check_size(size)
            served = frontend.require_serving()
        except RequestFailed as e:
            self.fail(e.failure, e.message)
        try:
            routing = parse_headers(headers)
            request = parse()
            # Tokenized with the widest context cap first (the long-context pool's, when there is one), so the
            # router sees the length; a pool with a smaller cap then checks it against its own.
            widest = max(served.pools.values(), key=lambda p: p.translator.limits.max_context)
            prompt_ids, params = widest.translator.generate_request(request)
            request_id = request.request_id or uuid.uuid4().hex
            pool, decision = frontend.choose_pool(served, routing, request_id, len(prompt_ids), _prompt_text(request))
            self.pool, self.route = pool, decision.route
            if pool is not widest:
                prompt_ids, params = pool.translator.generate_request(request)
        except UnknownModelError as e:
            self.fail(Failure.UNKNOWN_MODEL, str(e))
        except InvalidRequestError as e:
            self.fail(Failure.INVALID_ARGUMENT, str(e))
        except Exception as e:   # a bug (say, in a tokenizer), not the client's fault: still one clean status
            log.exception("could not read a request")
            self.fail(Failure.INTERNAL, f"the server could not read the request: {e}")
        if self.deadline is not None and self.deadline <= time.monotonic():
            self.fail(Failure.DEADLINE_EXCEEDED,
                      "the deadline passed before the request was queued: give it a longer deadline")
        try:
            stream = await pool.runner.submit(prompt_ids, params, request_id)
        except InvalidRequestError as e:
            self.fail(Failure.INVALID_ARGUMENT, str(e))
        except QueueFullError as e:
            self.fail(Failure.QUEUE_FULL, f"{e}: the server is at capacity, retry with backoff")
        except RunnerClosedError as e:
            self.fail(Failure.UNAVAILABLE, f"{e}: retry on another server")
        except asyncio.CancelledError:
            self.end(self._cancel_status())
            raise
        except RuntimeError as e:
            self.fail(Failure.INTERNAL, str(e))
        self.stream = stream
        frontend._track(stream, self.metrics)
        log.debug("%s accepted on %s: %d prompt tokens, max_tokens %d, route %s, weight %s", request_id,
                  pool.name, len(prompt_ids), params.max_tokens, self.route, routing.weight)
        return Started(request_id, len(prompt_ids), pool.translator.limits.model_name, params)

    async def events(self) -> AsyncIterator[StepOutput | Finished]:
        """The outputs with tokens or text, in order, then one Finished (or a RequestFailed)."""
        stream = self.stream
        first_start = first_token = None
        while True:
            timeout = None if self.deadline is None else self.deadline - time.monotonic()
            try:
                delivery = await asyncio.wait_for(stream.next(), timeout)
            except TimeoutError:
                stream.cancel()
                self.fail(Failure.DEADLINE_EXCEEDED, "the deadline passed before generation finished: give it a "
                          "longer deadline or lower max_tokens")
            out = delivery.output
            if first_start is None:
                first_start = delivery.step_start
            if first_token is None and out.new_token_ids:
                first_token = delivery.step_end
            if out.new_token_ids or out.text_delta:
                yield out
            if not out.finished:
                continue
            if out.finish_reason == FinishReason.ERROR:
                self.fail(Failure.INTERNAL, out.error or "the engine failed")
            if out.finish_reason == FinishReason.CANCELLED and stream.shutdown:
                self.fail(Failure.UNAVAILABLE, f"the server shut down after {out.output_tokens} tokens of this "
                          "reply: retry on another server")
            end = delivery.step_end
            ttft = None if first_token is None else first_token - self.arrival
            self.metrics.request_completed(
                stop_reason=STOP_REASON_NAMES[STOP_REASONS[out.finish_reason]], output_tokens=out.output_tokens,
                ttft_s=ttft, e2e_s=end - self.arrival)
            pool = self.pool
            metered = measured = None
            if out.usage is not None:       # what it was charged of its steps (stratum_jax/request_usage.py)
                metered = cost.bill(out.prompt_tokens, out.cached_prompt_tokens, out.output_tokens, self.size,
                                    pool.kv_bytes_per_token, out.usage, self.frontend.prices)
                rates = cost.TokenRates.of_usage(out.usage, out.prompt_tokens - out.cached_prompt_tokens,
                                                 out.output_tokens)
                measured = cost.Measured.of_rates(rates)
                pool.recent.add(rates)
                self.metrics.record_metered(compute_usd=metered.compute_usd, hbm_usd=metered.hbm_usd,
                                            transfer_usd=metered.transfer_usd, output_tokens=out.output_tokens)
            self.end("ok")
            yield Finished(out.finish_reason, out.prompt_tokens, out.cached_prompt_tokens, out.output_tokens,
                           queue_ms=1e3 * (first_start - self.arrival), ttft_ms=0.0 if ttft is None else 1e3 * ttft,
                           total_ms=1e3 * (end - self.arrival), stack=pool.name, route=self.route,
                           metered=metered, measured=measured, kv_bytes_per_token=pool.kv_bytes_per_token)
            return

    def close(self) -> None:
        """Ends the call: without a recorded status the client went away, so it counts as cancelled (or
        deadline_exceeded), and the engine drops the request and frees its pages at its next step."""
        self.end(self._cancel_status())
        if self.stream is not None:
            self.stream.cancel()   # a no-op when it finished
            self.frontend._untrack(self.stream, self.metrics)
            self.stream = None

    def _cancel_status(self) -> str:
        return "deadline_exceeded" if self.deadline is not None and time.monotonic() >= self.deadline else "cancelled"


def _prompt_text(request: GenerateRequest) -> str | None:
    """The text the --route-regex classifier reads: the system prompt and every message, or the plain
    prompt; None for a prompt sent as token ids."""
    if request.prompt is not None:
        return request.prompt if isinstance(request.prompt, str) else None
    return "\n".join([request.system] + [m.content for m in request.messages])
