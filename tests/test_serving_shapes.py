"""Issue #10's CPU evidence: after warm-up a randomized load compiles nothing, every greedy output equals
the request's output alone, and prefill chunks ride along with decode (running streams never stall)."""
import random

import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.loader import load_model
from stratum_jax.request import FinishReason, SamplingParams
from stratum_jax.step_shapes import all_step_shapes, bucket_for, prefill_buckets

MAX_CONTEXT = 192
CONFIG = dict(model="tiny", max_context=MAX_CONTEXT, kv_pool_tokens=1024, max_batch_size=8, prefill_chunk=32,
              max_num_batched_tokens=8 + 64, max_tokens_cap=64, decode_steps=4)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


def test_step_shapes_follow_the_config():
    config = RuntimeConfig(model="tiny", max_batch_size=32, max_num_batched_tokens=2048, prefill_chunk=512)
    assert prefill_buckets(config) == (128, 256, 512, 1024, 1920)      # tiles of 128 within 2048 - 32
    shapes = [str(s) for s in all_step_shapes(config)]
    assert shapes[:5] == ["decode(sampled=False, logprobs=False)", "decode(sampled=False, logprobs=True)",
                          "decode(sampled=True, logprobs=False)", "decode(sampled=True, logprobs=True)",
                          "packed(prefill_tokens=128)"]
    assert len(shapes) == 4 + 5 + 3 + 1                  # decode variants, buckets, re-samplers, prompt logprobs
    assert bucket_for(129, prefill_buckets(config)) == 256 and bucket_for(1920, prefill_buckets(config)) == 1920
    with pytest.raises(ValueError, match="exceed the step budget"):
        bucket_for(1921, prefill_buckets(config))
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        RuntimeConfig(model="tiny", max_batch_size=32, max_num_batched_tokens=40)


def _random_params(rng: random.Random, i: int) -> SamplingParams:
    sampled = rng.random() < 0.4
    return SamplingParams(
        max_tokens=rng.randrange(1, 24), temperature=0.8 if sampled else 0.0, top_p=rng.choice([1.0, 0.9]),
        top_k=rng.choice([0, 5]), seed=i, ignore_eos=True, logprobs=rng.choice([0, 0, 3]),
        prompt_logprobs=rng.choice([0, 0, 0, 2]), stop_strings=rng.choice([(), (), ("a",), ("zz", "\x07")]))


def test_random_load_compiles_nothing_after_warmup_and_matches_alone(tiny):
    engine = Engine(RuntimeConfig(**CONFIG), model=tiny)
    engine.warmup(progress=False)
    engine.mark_serving()
    compiled = engine.compiles.total
    assert not engine.runner.missing_shapes() and engine.compiles.after_serving == 0

    rng = random.Random(7)
    prompts, params, outputs, finals = {}, {}, {}, {}
    cancelled = set()
    submitted, i = 0, 0
    while submitted < 40 or engine.has_unfinished():
        # 1 to max-batch-size requests in flight, prompts of 1 token up to the whole context.
        room = CONFIG["max_batch_size"] - len(engine.scheduler.running) - len(engine.scheduler.waiting)
        for _ in range(rng.randrange(0, max(1, room) + 1)):
            if submitted >= 40:
                break
            sp = _random_params(rng, i)
            length = rng.choice([1, 2, rng.randrange(3, 40), rng.randrange(40, MAX_CONTEXT - sp.max_tokens + 1)])
            prompt = [rng.randrange(3, 250) for _ in range(length)]
            rid = engine.add_request(prompt, sp)
            prompts[rid], params[rid] = prompt, sp
            submitted += 1
            i += 1
        live = [r for r in prompts if r not in finals and r not in cancelled]
        if live and rng.random() < 0.08:
            victim = rng.choice(live)
            engine.cancel(victim)
            cancelled.add(victim)
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert engine.compiles.after_serving == 0, "a step shape compiled after warm-up"
    assert engine.compiles.total == compiled
    assert set(finals) == set(prompts)
    assert sum(f == FinishReason.CANCELLED for f in finals.values()) >= 1

    # Greedy requests that ran to completion give what they give alone.
    greedy = [r for r in prompts if params[r].temperature == 0 and finals[r] != FinishReason.CANCELLED]
    assert len(greedy) >= 10
    alone = Engine(RuntimeConfig(**CONFIG), model=tiny)
    for rid in greedy:
        (res,) = alone.generate([prompts[rid]], params[rid])
        assert res.token_ids == outputs[rid], rid


def test_prefill_chunks_ride_along_with_decode(tiny):
    """A long prompt arriving while four streams decode is prefilled in chunks inside the same steps:
    every running stream gets a token in every step until it finishes."""
    engine = Engine(RuntimeConfig(**CONFIG), model=tiny)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    running = [engine.add_request([5 + i] * 6, sp) for i in range(4)]
    for _ in range(3):
        engine.step()
    engine.add_request(list(range(3, 160)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    kinds = []
    while any(r in engine.requests for r in running):
        outs = {o.request_id: o for o in engine.step()}
        kinds.append(engine.last_step.kind)
        for rid in running:
            if rid in engine.requests or rid in outs:
                assert outs[rid].new_token_ids, f"{rid} stalled in a {kinds[-1]} step"
    assert kinds.count("mixed") >= 3          # 157 prompt tokens at <= 32 per step, beside the decodes
