"""EngineRunner semantics against a small fake engine: fast, deterministic, and able to fail on purpose.

The end-to-end behaviour with the real engine is in test_serving.py; this file pins down the runner's
own contract: one terminal output per accepted request, cancels, rejections, engine failures, profiles.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from serving.profiling import ProfileCapture
from serving.runner import EngineRunner, RunnerClosedError
from stratum_jax.request import FinishReason, InvalidRequestError, QueueFullError, SamplingParams, StepOutput


@dataclasses.dataclass
class FakeStats:
    queued: int = 0
    running: int = 0
    kv_pages_total: int = 100
    kv_pages_free: int = 100
    kv_tokens_total: int = 800
    kv_tokens_used: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    preemptions: int = 0
    steps: int = 0
    decode_step_ms: float = 1.0
    prefill_tokens_per_s: float = 1000.0


class FakeEngine:
    """The Engine contract in miniature: each step emits token 7 for every request; one page per request.

    `emit_limit` makes timing irrelevant: a request emits at most that many tokens and then stays in flight,
    emitting nothing, until it is cancelled. Without it a "long" request could finish before the test's
    next command reaches the engine thread (this fake steps in microseconds), which made tests flaky.
    """

    last_step = None
    idle_tick_s = None

    def __init__(self, max_queue: int = 4, emit_limit: int | None = None) -> None:
        self.max_queue = max_queue
        self.emit_limit = emit_limit
        self.requests: dict[str, dict] = {}
        self.steps = 0
        self.fail_steps = 0          # the next N steps raise

    def add_request(self, prompt_ids, params: SamplingParams, request_id=None) -> str:
        params.validate()
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(self.requests) >= self.max_queue:
            raise QueueFullError("the queue is full")
        self.requests[request_id] = dict(prompt=len(prompt_ids), params=params, out=0, cancel=False)
        return request_id

    def cancel(self, request_id) -> bool:
        if request_id not in self.requests:
            return False
        self.requests[request_id]["cancel"] = True
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def tick(self) -> None:
        pass

    def step(self) -> list[StepOutput]:
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("simulated device error")
        self.steps += 1
        outputs = []
        for rid, r in list(self.requests.items()):
            if r["cancel"]:
                del self.requests[rid]
                outputs.append(StepOutput(rid, [], "", finished=True, finish_reason=FinishReason.CANCELLED,
                                          prompt_tokens=r["prompt"], output_tokens=r["out"]))
                continue
            if self.emit_limit is not None and r["out"] >= self.emit_limit:
                continue             # stalled: in flight until cancelled
            r["out"] += 1
            done = r["out"] >= r["params"].max_tokens
            if done:
                del self.requests[rid]
            outputs.append(StepOutput(rid, [7], "x", finished=done,
                                      finish_reason=FinishReason.LENGTH if done else None,
                                      prompt_tokens=r["prompt"], output_tokens=r["out"]))
        if not outputs:
            time.sleep(0.001)        # every request is stalled: don't spin the engine thread at full speed
        return outputs

    def stats(self) -> FakeStats:
        used = len(self.requests)
        return FakeStats(running=used, kv_pages_free=100 - used, kv_tokens_used=8 * used, steps=self.steps)


HANG_GUARD_S = 120


async def drain(stream) -> list[StepOutput]:
    outs = []
    while True:
        # A hang guard only: generous, because a step can wait behind a profiler start (jax.profiler) that
        # takes seconds on a loaded 2-core CI machine (a 5 s guard failed there once).
        outs.append((await asyncio.wait_for(stream.next(), HANG_GUARD_S)).output)
        if outs[-1].finished:
            return outs


@pytest.fixture
def runner():
    r = EngineRunner(FakeEngine())
    r.start()
    yield r
    r.stop()


@pytest.fixture
def stalling_runner():
    """Requests emit one token, then stay in flight until cancelled."""
    r = EngineRunner(FakeEngine(emit_limit=1))
    r.start()
    yield r
    r.stop()


def test_streams_every_token_then_one_terminal_output(runner):
    async def go():
        stream = await runner.submit([1, 2], SamplingParams(max_tokens=3), "a")
        return await drain(stream)

    outs = asyncio.run(go())
    assert [o.new_token_ids for o in outs] == [[7], [7], [7]]
    assert [o.finished for o in outs] == [False, False, True]
    assert runner.accepted == runner.finished == 1


def test_rejections_come_back_as_exceptions(stalling_runner):
    runner = stalling_runner

    async def go():
        with pytest.raises(InvalidRequestError):
            await runner.submit([], SamplingParams(), "empty")
        streams = [await runner.submit([1], SamplingParams(max_tokens=1000), f"r{i}") for i in range(4)]
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await runner.submit([1], SamplingParams(), "r0")
        with pytest.raises(QueueFullError):
            await runner.submit([1], SamplingParams(), "one-too-many")
        for s in streams:
            s.cancel()
        return [(await drain(s))[-1].finish_reason for s in streams]

    assert asyncio.run(go()) == [FinishReason.CANCELLED] * 4


def test_cancel_frees_at_the_next_step(stalling_runner):
    runner = stalling_runner

    async def go():
        stream = await runner.submit([1], SamplingParams(max_tokens=10_000), "long")
        await stream.next()
        stream.cancel()
        outs = await drain(stream)
        # No sleep: the runner publishes a step's stats before it delivers that step's outputs, so the
        # handler that sees the cancellation also sees the freed pages.
        return outs, runner.stats

    outs, stats = asyncio.run(go())
    assert outs[-1].finish_reason == FinishReason.CANCELLED
    assert stats.kv_pages_free == stats.kv_pages_total
    assert runner.accepted == runner.finished


def test_engine_failure_ends_in_flight_requests_with_an_error(stalling_runner):
    runner = stalling_runner

    async def go():
        stream = await runner.submit([1], SamplingParams(max_tokens=10_000), "doomed")   # stalls: never ends
        await stream.next()
        runner.engine.fail_steps = 1
        outs = await drain(stream)
        after = await runner.submit([1], SamplingParams(max_tokens=1), "after")   # the server keeps serving
        return outs[-1], await drain(after)

    last, after = asyncio.run(go())
    assert last.finish_reason == FinishReason.ERROR and "simulated device error" in last.error
    assert after[-1].finish_reason == FinishReason.LENGTH


def test_repeated_engine_failures_close_the_runner(runner):
    async def go():
        runner.engine.fail_steps = 3
        for i in range(3):
            stream = await runner.submit([1], SamplingParams(max_tokens=5), f"f{i}")
            assert (await drain(stream))[-1].finish_reason == FinishReason.ERROR
        with pytest.raises(RunnerClosedError, match="3 steps in a row"):
            await runner.submit([1], SamplingParams(), "refused")

    asyncio.run(go())


def test_stop_cancels_everything(stalling_runner):
    runner = stalling_runner

    async def go():
        stream = await runner.submit([1], SamplingParams(max_tokens=10_000), "x")
        await stream.next()
        await asyncio.to_thread(runner.stop)
        return await drain(stream)

    assert asyncio.run(go())[-1].finish_reason == FinishReason.CANCELLED
    with pytest.raises(RunnerClosedError):
        asyncio.run(runner.submit([1], SamplingParams(), "late"))


def test_profile_of_an_idle_engine_stops_at_its_timeout(runner, tmp_path):
    capture = ProfileCapture(tmp_path / "idle", num_steps=5, timeout_s=0.3)
    result = runner.profile(capture).result(timeout=30)
    assert result.steps_captured == 0
    assert any(f.endswith(".xplane.pb") for f in result.files)


def test_profile_counts_engine_steps(runner, tmp_path):
    async def go():
        future = runner.profile(ProfileCapture(tmp_path / "busy", num_steps=2, timeout_s=30))
        second = runner.profile(ProfileCapture(tmp_path / "second", num_steps=2, timeout_s=30))
        stream = await runner.submit([1], SamplingParams(max_tokens=4), "p")
        await drain(stream)
        return await asyncio.wrap_future(future), second

    result, second = asyncio.run(go())
    assert result.steps_captured == 2
    with pytest.raises(RuntimeError, match="already being captured"):
        second.result(timeout=HANG_GUARD_S)


def test_idle_engine_gets_periodic_ticks_only_when_it_asks():
    """An engine with `idle_tick_s` (a DMLP feeding online fine-tuning) is ticked while idle; one without
    is never woken (an idle server burns no CPU)."""

    class TickingEngine(FakeEngine):
        def __init__(self, idle_tick_s):
            super().__init__()
            self.idle_tick_s = idle_tick_s
            self.ticks = 0

            self.five_ticks = threading.Event()

        def tick(self):
            self.ticks += 1
            if self.ticks >= 5:
                self.five_ticks.set()

    ticking, plain = TickingEngine(0.02), TickingEngine(None)
    runners = [EngineRunner(ticking), EngineRunner(plain)]
    for r in runners:
        r.start()
    # Wait for the ticks themselves, not for a fixed time (a loaded machine may tick late).
    reached = ticking.five_ticks.wait(30)
    for r in runners:
        r.stop()
    assert reached, f"only {ticking.ticks} idle ticks in 30 s"
    assert plain.ticks == 0


def test_runner_feeds_the_prefill_rate_from_representative_steps_only():
    from types import SimpleNamespace

    from serving.cost import PrefillRate

    class TimedEngine(FakeEngine):
        """Reports each step as a prefill of the prompts it has not seen yet (0.01 s per step)."""

        def __init__(self):
            super().__init__()
            self.seen = set()
            self.last_step = None

        def step(self):
            fresh = [rid for rid in self.requests if rid not in self.seen]
            self.seen.update(fresh)
            tokens = sum(self.requests[rid]["prompt"] for rid in fresh)
            self.last_step = SimpleNamespace(kind="prefill" if fresh else "decode", num_tokens=tokens or 1,
                                             prefill_tokens=tokens, seconds=0.01)
            return super().step()

    rate = PrefillRate(min_tokens=64)
    r = EngineRunner(TimedEngine(), prefill_rate=rate)
    r.start()
    try:
        async def go(prompt_len, rid):
            await drain(await r.submit([1] * prompt_len, SamplingParams(max_tokens=2), rid))

        asyncio.run(go(3, "warm-up sized"))
        assert rate.tokens_per_s == 0.0          # a 3-token prefill is not representative
        asyncio.run(go(100, "representative"))
        assert rate.tokens_per_s == pytest.approx(100 / 0.01)
    finally:
        r.stop()
