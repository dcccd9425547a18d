"""The engine's per-request usage (stratum_jax/request_usage.py): each step's device time divided over its
rows' tokens, summed per request and handed over on the final output."""
from __future__ import annotations

import types

import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.loader import load_model
from stratum_jax.request import SamplingParams
from stratum_jax.request_usage import RequestUsage, charge_step


def _seq():
    return types.SimpleNamespace(usage=RequestUsage())


def test_a_step_is_divided_over_its_tokens():
    a, b, c = _seq(), _seq(), _seq()
    # 2 decode rows (one token each) and a 38-token prefill chunk: 40 tokens in a 0.4 s step.
    batch = types.SimpleNamespace(decode=[a, b], decode_steps=[1, 1], prefill=[c], chunk_lens=[38], num_tokens=40)
    charge_step(batch, 0.4)
    assert a.usage.decode_device_s == pytest.approx(0.01) and a.usage.decode_step_s == pytest.approx(0.4)
    assert c.usage.prefill_device_s == pytest.approx(0.38) and c.usage.prefill_step_s == pytest.approx(0.4)
    assert (a.usage.decode_tokens, c.usage.prefill_tokens, c.usage.decode_tokens) == (1, 38, 0)
    # Alone in a 2-step decode call: the whole step is its own.
    charge_step(types.SimpleNamespace(decode=[a], decode_steps=[2], prefill=[], chunk_lens=[], num_tokens=2), 0.05)
    assert a.usage.decode_device_s == pytest.approx(0.06) and a.usage.decode_tokens == 3
    # An untimed step charges nothing.
    charge_step(batch, 0.0)
    assert b.usage.decode_tokens == 1 and b.usage.device_s == pytest.approx(0.01)


def test_the_engine_hands_every_timed_second_to_the_requests_it_ran():
    """Without async scheduling no step runs after a request's final output, so the usages on the final outputs
    add up to the device time of all the steps (scripted here: 10 ms + 1 ms per token)."""
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, max_batch_size=4,
                                  prefill_chunk=16, max_num_batched_tokens=32, async_scheduling=False),
                    model=load_model("tiny", dtype="float32", seed=0))
    record, total = engine.recorder.record_timing, []

    def timed(batch, device_s, work=None):
        total.append(0.010 + 0.001 * batch.num_tokens)
        record(batch, total[-1], work)

    engine.recorder.record_timing = timed
    lengths = {"a": (30, 5), "b": (12, 9), "c": (50, 3)}
    for i, (rid, (prompt, out)) in enumerate(lengths.items()):
        ids = [3 + (i * 61 + 7 * k) % 240 for k in range(prompt)]      # no shared prefix: nothing cached
        engine.add_request(ids, SamplingParams(max_tokens=out, temperature=0.0,
                                                                      ignore_eos=True), request_id=rid)
    usage = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.cached_prompt_tokens == 0
                usage[out.request_id] = out.usage
    assert sum(u.device_s for u in usage.values()) == pytest.approx(sum(total))
    for rid, (prompt, out) in lengths.items():
        # The last prompt chunk samples the first token; every later one is a decode token.
        assert (usage[rid].prefill_tokens, usage[rid].decode_tokens) == (prompt, out - 1)
        assert usage[rid].prefill_step_s >= usage[rid].prefill_device_s > 0
