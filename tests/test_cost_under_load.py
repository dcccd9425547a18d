"""Estimate and bill on a live engine through a busy phase and an idle tail (issue #13).

On an H200 replay the bills came out 57-86% below CostEstimate for the same requests: the estimate was taken
after the replay's tail, when the server's inputs (the decode-batch mean, the median decode step) described
one or two requests, while each bill had been priced under load. Here the same happens on the `tiny` engine
with scripted device times, so every figure is deterministic:

- every step's device time is FIXED_S (the weights read once, shared by its rows) + PER_TOKEN_S per token it
  processes (the engine's measured time is replaced by that, before anything reads it);
- the busy phase submits BUSY alike requests before the runner thread starts, so the engine schedules them
  all from its first step (no thread timing decides which step a request joins);
- the idle tail is one request decoding alone for TAIL_TOKENS steps.

Then CostEstimate's pricing (`cost.estimate` with the pool's measured inputs, what the servicer calls) for a
request like the busy ones is compared with the busy requests' own bills (their MessageStop `metered`).
"""
from __future__ import annotations

import asyncio
import statistics

import pytest

from serving import cost
from serving.frontend import Finished, Frontend, Pool, Served
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.runner import EngineRunner
from serving.server import _calibrate
from serving.stacks import STRATUM
from serving.translate import GenerateRequest, Limits, Translator
from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.metrics import ServingMetrics
from stratum_jax.model.loader import load_model

FIXED_S, PER_TOKEN_S = 0.020, 0.0005       # a step's scripted device time: FIXED_S + PER_TOKEN_S x its tokens
BATCH, BUSY, PROMPT, MAX_TOKENS, TAIL_TOKENS = 8, 32, 40, 24, 60
CONFIG = RuntimeConfig(model="tiny", scheduler="fcfs", max_batch_size=BATCH, max_queue=64, max_context=256,
                       max_tokens_cap=64, prefill_chunk=32, kv_pool_tokens=4096, max_num_batched_tokens=64,
                       decode_steps=1)


def scripted_device_time(engine: Engine) -> None:
    """Replaces the engine's measured step device time with FIXED_S + PER_TOKEN_S x the step's tokens."""
    record = engine.recorder.record_timing

    def timed(batch, device_s, work=None):
        record(batch, FIXED_S + PER_TOKEN_S * batch.num_tokens, work)

    engine.recorder.record_timing = timed


def prompt(i: int) -> list[int]:
    """PROMPT distinct token ids (no prefix-cache hits between requests)."""
    return [3 + (i * 37 + 11 * k) % 240 for k in range(PROMPT)]


async def run(frontend: Frontend, i: int, max_tokens: int) -> Finished:
    generation = frontend.generation()
    try:
        await generation.start(0, (), lambda: GenerateRequest(prompt=prompt(i), max_tokens=max_tokens,
                                                              temperature=0.0, ignore_eos=True,
                                                              request_id=f"r{i}"))
        async for event in generation.events():
            if isinstance(event, Finished):
                return event
    finally:
        generation.close()


async def busy_then_idle(frontend: Frontend, runner: EngineRunner) -> tuple[list[Finished], Finished]:
    busy = [asyncio.create_task(run(frontend, i, MAX_TOKENS)) for i in range(BUSY)]
    await asyncio.sleep(0)          # each task runs to its submit: all BUSY adds are in the runner's inbox
    runner.start()                  # so its first loop takes them all at once
    finished = await asyncio.gather(*busy)
    tail = await run(frontend, BUSY, TAIL_TOKENS)
    return finished, tail


@pytest.fixture(scope="module")
def replay():
    engine = Engine(CONFIG, model=load_model("tiny", dtype="float32", seed=0))
    scripted_device_time(engine)
    rate = cost.PrefillRate(min_tokens=32)
    _calibrate(engine, rate)        # what the server does at start-up: a prefill rate and a decode step time
    metrics = ServingMetrics()
    runner = EngineRunner(engine, metrics, prefill_rate=rate)
    translator = Translator(engine.tokenizer, Limits("tiny", CONFIG.max_context, CONFIG.max_tokens_cap))
    pool = Pool(STRATUM, runner, translator, cost.kv_bytes_per_token(engine.model_config), metrics)
    frontend = Frontend(metrics)
    frontend.set_served(Served(runner, translator, pb.ModelInfo(name="tiny"), pool.kv_bytes_per_token,
                               pools={STRATUM: pool}))
    try:
        busy, tail = asyncio.run(busy_then_idle(frontend, runner))
    finally:
        runner.stop()
    return pool, busy, tail


def test_an_estimate_taken_after_the_idle_tail_prices_a_busy_request_as_it_was_billed(replay):
    """The H200 failure mode. Before the fix the estimate here came out 4.3x the median busy bill: it read
    B = 1.005 and t_step = 20.5 ms from the tail's single request."""
    pool, busy, tail = replay
    assert all(f.output_tokens == MAX_TOKENS and f.cached_prompt_tokens == 0 and f.metered is not None
               for f in busy)
    bills = [f.metered.estimated_cost_usd for f in busy]
    estimate = cost.estimate(PROMPT, MAX_TOKENS, 0, pool.kv_bytes_per_token, pool.measured(),
                             cost.Prices()).estimated_cost_usd
    # Most busy requests ran in full batches of BATCH and were billed the same to 1% (the steady state); the
    # first few shared their prefill with fewer rows, the last few decoded while the batch drained, and paid
    # up to 2x more. The estimate is for a request like these under the same load: the steady state's bill,
    # which is the median bill. 1% allows the median of per-token rates (what the estimate takes) to differ
    # from the per-token rates of the median bill.
    assert abs(estimate - statistics.median(bills)) <= 0.01 * statistics.median(bills), (estimate, bills)
    # On average the burst's bills are 0-10% above it: its drain (the last BATCH requests) paid more.
    assert 0.0 <= statistics.fmean(bills) / estimate - 1 <= 0.10, (estimate, bills)


def test_a_bill_is_priced_with_the_batch_the_request_shared(replay):
    """The tail request decoded alone: each of its steps is charged to it whole, so per output token it pays
    about BATCH times what a busy request paid (its steps are a little cheaper: one row instead of BATCH)."""
    pool, busy, tail = replay
    per_token = tail.metered.compute_seconds / tail.output_tokens
    busy_per_token = statistics.median(f.metered.compute_seconds / f.output_tokens for f in busy)
    assert 0.6 * BATCH <= per_token / busy_per_token <= BATCH
    assert tail.measured.decode_batch == pytest.approx(1.0)
    step = FIXED_S + PER_TOKEN_S     # a decode step of one row
    assert tail.measured.decode_step_ms == pytest.approx(1e3 * step * (TAIL_TOKENS - 1) / TAIL_TOKENS)
    # The bill's reported rates give the bill back through the formula.
    again = cost.meter(PROMPT, 0, TAIL_TOKENS, 0, pool.kv_bytes_per_token, tail.measured, cost.Prices())
    assert again.estimated_cost_usd == pytest.approx(tail.metered.estimated_cost_usd)
