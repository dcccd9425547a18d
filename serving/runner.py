"""Runs the engine on one dedicated thread and streams its outputs to asyncio handlers.

The engine is not thread-safe, so exactly one thread (this runner's) ever calls it. Handlers talk to that
thread through an inbox of commands (add, cancel, profile); the thread drains the inbox, runs one
`engine.step()` when there is work, and hands each StepOutput to the handler's event loop with
`call_soon_threadsafe`. With no work it sleeps on a condition variable, so an idle server burns no CPU.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from typing import Protocol

import jax

from serving.profiling import ProfileCapture, ProfileResult
from stratum_jax.request import FinishReason, InvalidRequestError, QueueFullError, SamplingParams, StepOutput

log = logging.getLogger(__name__)

_MAX_STEP_FAILURES = 3   # consecutive engine.step() exceptions before the runner stops taking work


class RunnerClosedError(RuntimeError):
    """The runner is stopping, or its engine failed: no new requests are taken."""


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One StepOutput, with the wall times of the engine step that produced it."""

    output: StepOutput
    step_start: float
    step_end: float


class RequestStream:
    """The asyncio end of one request. Deliveries arrive in order; exactly one has output.finished."""

    def __init__(self, runner: "EngineRunner", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self._runner = runner
        self._loop = loop
        self._queue: asyncio.Queue[Delivery] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = loop.create_future()
        self.finished = False
        self.shutdown = False          # set when the server cancelled it while shutting down

    async def next(self) -> Delivery:
        delivery = await self._queue.get()
        if delivery.output.finished:
            self.finished = True
        return delivery

    def cancel(self) -> None:
        """Asks the engine to drop the request; its pages are freed at the next step."""
        if not self.finished:
            self._runner.cancel(self.request_id)

    # ---- called from the engine thread ----

    def _settle(self, error: BaseException | None) -> None:
        def settle() -> None:
            if self._accepted.done():
                return
            if error is None:
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(error)
        self._call(settle)

    def _deliver(self, delivery: Delivery) -> None:
        self._call(self._queue.put_nowait, delivery)

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the handler's loop is closed: nobody is listening any more
            pass


@dataclasses.dataclass
class _Add:
    prompt_ids: list[int]
    params: SamplingParams
    stream: RequestStream


@dataclasses.dataclass
class _Cancel:
    request_id: str


@dataclasses.dataclass
class _Profile:
    capture: ProfileCapture


class _CancelAll:
    pass


class ServingEngine(Protocol):
    """What the runner drives (stratum_jax.engine.Engine; tests use small fakes). Not thread-safe: the
    runner calls it from its one engine thread."""

    last_step: object | None          # the latest step read back (StepTiming), or None
    idle_tick_s: float | None         # how often to `tick` while idle; None: never

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str: ...

    def cancel(self, request_id: str) -> bool: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...

    def tick(self) -> None: ...

    def stats(self): ...


class EngineRunner:
    """Owns the engine thread. `submit`, `cancel` and `profile` may be called from any thread."""

    def __init__(self, engine: ServingEngine, metrics=None, name: str = "stratum-engine", prefill_rate=None) -> None:
        self.engine = engine
        self.prefill_rate = prefill_rate   # a serving.cost.PrefillRate fed after every step, or None
        self._idle_tick_s = engine.idle_tick_s   # None unless the cache policy wants ticks
        self.metrics = metrics
        self._cond = threading.Condition()
        self._inbox: list[object] = []
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._busy = False                              # engine.has_unfinished(), as of the last step
        self._closed: str | None = None                 # why new requests are refused
        self._stop = False
        self._profile: ProfileCapture | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._step_failures = 0
        # Written by the engine thread, read by others; each is replaced whole, never mutated, so reads
        # need no lock. (This first stats() call is safe: the engine thread has not started yet.) It also
        # publishes what loading and warm-up did (compile counts) before the first request.
        self._publish_stats()
        self.accepted = 0
        self.finished = 0

    # ---- any thread ----

    def start(self) -> None:
        self._thread.start()

    async def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestStream:
        """Adds a request to the engine; returns its stream once the engine accepted it.

        Raises InvalidRequestError / QueueFullError from the engine, or RunnerClosedError.
        """
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        with self._cond:
            if self._stop:     # the thread may be gone: nobody would answer the add
                raise RunnerClosedError(self._closed)
            self._inbox.append(_Add(prompt_ids, params, stream))
            self._cond.notify()
        try:
            await asyncio.shield(stream._accepted)
        except asyncio.CancelledError:
            # The caller went away while the add was in the inbox: the cancel command follows the add
            # in FIFO order, so it finds the request wherever it got to.
            self.cancel(request_id)
            raise
        return stream

    def cancel(self, request_id: str) -> None:
        self._post(_Cancel(request_id))

    def profile(self, capture: ProfileCapture) -> Future:
        """Starts capturing the next engine steps; the future resolves to a ProfileResult."""
        with self._cond:
            if self._stop:
                capture.fail(RunnerClosedError(self._closed))
            else:
                self._inbox.append(_Profile(capture))
                self._cond.notify()
        return capture.future

    def close(self, reason: str) -> None:
        """Refuses new requests from now on (running ones continue)."""
        with self._cond:
            self._closed = self._closed or reason

    def stop(self, timeout: float = 10.0) -> None:
        """Cancels everything, lets the engine finish those cancellations, and ends the thread."""
        with self._cond:
            self._closed = self._closed or "the server is shutting down"
            self._stop = True
            self._inbox.append(_CancelAll())
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _post(self, command) -> None:
        with self._cond:
            self._inbox.append(command)
            self._cond.notify()

    # ---- the engine thread ----

    def _run(self) -> None:
        while True:
            idle_ticked = False
            with self._cond:
                while not (self._inbox or self._busy or self._stop or self._profile_expired()):
                    timeout = self._idle_wait()
                    if not self._cond.wait(timeout) and timeout == self._idle_tick_s:
                        idle_ticked = True      # the idle tick is due (a profile deadline is not)
                        break
                commands, self._inbox = self._inbox, []
                closed, stop = self._closed, self._stop
            if idle_ticked and not commands:
                self.engine.tick()
            with jax.profiler.TraceAnnotation("stratum.scheduler.admit"):
                for command in commands:
                    self._apply(command, closed)
            if self._busy:
                self._step()
            elif commands:
                self._publish_stats()
            if self._profile is not None and self._profile_expired():
                self._end_profile()
            if stop and not self._busy:
                break
        if self._profile is not None:
            self._end_profile()

    def _apply(self, command, closed: str | None) -> None:
        if isinstance(command, _Add):
            self._add(command, closed)
        elif isinstance(command, _Cancel):
            if command.request_id in self._streams:
                self.engine.cancel(command.request_id)
                self._busy = True   # the cancellation is carried out (pages freed) by the next step
        elif isinstance(command, _Profile):
            self._begin_profile(command.capture)
        elif isinstance(command, _CancelAll):
            for request_id in list(self._streams):
                self.engine.cancel(request_id)
            self._busy = self._busy or bool(self._streams)

    def _add(self, command: _Add, closed: str | None) -> None:
        stream = command.stream
        if closed is not None:
            stream._settle(RunnerClosedError(closed))
            return
        if stream.request_id in self._streams:
            stream._settle(InvalidRequestError(
                f"request_id {stream.request_id!r} is already in flight: send a unique request_id or none"))
            return
        try:
            self.engine.add_request(command.prompt_ids, command.params, request_id=stream.request_id)
        except (InvalidRequestError, QueueFullError) as e:
            stream._settle(e)
            return
        except Exception as e:   # an engine bug must not take the server down: refuse this one request
            log.exception("engine.add_request failed for %s", stream.request_id)
            stream._settle(RuntimeError(f"the engine could not take the request: {e}"))
            return
        self._streams[stream.request_id] = stream
        self.accepted += 1
        self._busy = True
        stream._settle(None)

    def _step(self) -> None:
        start = time.monotonic()
        try:
            with jax.profiler.StepTraceAnnotation("stratum.engine_step", step_num=self.stats.steps):
                outputs = self.engine.step()
        except Exception as e:
            self._step_failed(e)
            return
        end = time.monotonic()
        self._step_failures = 0
        if self.prefill_rate is not None:
            self.prefill_rate.observe(self.engine.last_step)
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            deliveries.append((stream, Delivery(out, start, end)))
            if out.finished:
                del self._streams[out.request_id]
                self.finished += 1
                if self.metrics is not None:   # counted here, so cancelled requests' tokens count too
                    self.metrics.record_tokens(out.prompt_tokens, out.cached_prompt_tokens, out.output_tokens)
        self._busy = self.engine.has_unfinished()
        self._publish_stats()
        # Bookkeeping and stats first, deliveries last: a handler that sees this step's outputs then reads
        # counters and stats at least as new as the step (a cancelled request's pages already free), so
        # nothing needs to sleep or poll for them.
        for stream, delivery in deliveries:
            stream._deliver(delivery)
        if self._profile is not None and self._profile.after_step():
            self._end_profile()

    def _step_failed(self, error: Exception) -> None:
        """Ends every in-flight request with an error output, so each still gets one terminal message."""
        log.exception("engine.step() failed; failing the %d in-flight requests", len(self._streams))
        self._step_failures += 1
        now = time.monotonic()
        for request_id, stream in self._streams.items():
            try:
                self.engine.cancel(request_id)
            except Exception:
                pass
            out = StepOutput(request_id, [], "", finished=True, finish_reason=FinishReason.ERROR,
                             error=f"the engine failed while running this request: {error}")
            stream._deliver(Delivery(out, now, now))
            self.finished += 1
        self._streams.clear()
        self._busy = False
        if self._step_failures >= _MAX_STEP_FAILURES:
            self.close(f"the engine failed {self._step_failures} steps in a row: {error}")

    def _publish_stats(self) -> None:
        self.stats = self.engine.stats()
        if self.metrics is not None:
            self.metrics.observe_engine(self.stats)

    # ---- profiling (engine thread) ----

    def _begin_profile(self, capture: ProfileCapture) -> None:
        if self._profile is not None:
            capture.fail(RuntimeError("a profile is already being captured: wait for it to finish"))
            return
        try:
            capture.begin()
        except Exception as e:
            capture.fail(e)
            return
        self._profile = capture

    def _end_profile(self) -> None:
        capture, self._profile = self._profile, None
        capture.end()

    def _profile_expired(self) -> bool:
        return self._profile is not None and self._profile.expired()

    def _profile_wait(self) -> float | None:
        return None if self._profile is None else max(0.0, self._profile.remaining_s())

    def _idle_wait(self) -> float | None:
        """How long the idle engine thread may sleep: until a profile ends or the engine's idle tick
        (a DMLP feeding online fine-tuning wants one per horizon), else until woken."""
        waits = [w for w in (self._profile_wait(), self._idle_tick_s) if w is not None]
        return min(waits) if waits else None


__all__ = ["Delivery", "EngineRunner", "ProfileResult", "RequestStream", "RunnerClosedError"]
