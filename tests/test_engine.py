"""The engine on the `tiny` preset: batching invariance, prefix caching, preemption without leaks,
determinism, stop conditions and bad input."""
import random

import pytest

from engine_load import run_random_load
from stratum_jax.config import RuntimeConfig
from stratum_jax.engine import Engine
from stratum_jax.model.loader import load_model
from stratum_jax.request import FinishReason, InvalidRequestError, QueueFullError, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


def make_engine(tiny, **kw):
    defaults = dict(model="tiny", max_context=256, kv_pool_tokens=4096, max_batch_size=16, prefill_chunk=32,
                    max_tokens_cap=256)
    defaults.update(kw)
    return Engine(RuntimeConfig(**defaults), model=tiny)


def _prompts(n, seed=0, shared=40):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 250) for _ in range(shared)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 60))]
        out.append((prefix if i % 2 == 0 else []) + body)
    return out


def _run_alone(engine, prompt, params):
    (res,) = engine.generate([prompt], params)
    return res.token_ids


def test_batching_invariance_with_staggered_arrivals(tiny):
    """16 requests of different lengths, half sharing a prefix, arriving while others decode, give the
    greedy tokens each gives alone."""
    prompts = _prompts(16)
    params = [SamplingParams(max_tokens=8 + (i % 5) * 3, **GREEDY) for i in range(16)]
    alone_engine = make_engine(tiny, enable_prefix_caching=False)
    alone = [_run_alone(alone_engine, p, sp) for p, sp in zip(prompts, params)]

    engine = make_engine(tiny)
    got: dict[str, list[int]] = {}
    ids = []
    pending = list(zip(prompts, params))
    finished = 0
    while finished < 16:
        # Two arrivals per step, so new prompts prefill while earlier requests decode.
        for _ in range(2):
            if pending:
                p, sp = pending.pop(0)
                ids.append(engine.add_request(p, sp))
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished += out.finished
    assert [got[i] for i in ids] == alone
    assert engine.stats().prefix_cache_hits > 0


def test_prefix_cache_hits_and_output_unchanged(tiny):
    prompts = _prompts(1, seed=3, shared=0)[0] * 3 + [7, 8, 9]          # > several pages
    sp = SamplingParams(max_tokens=12, **GREEDY)
    engine = make_engine(tiny, page_size=16)
    first = engine.generate([prompts], sp)[0]
    second = engine.generate([prompts], sp)[0]
    st = engine.stats()
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == ((len(prompts) - 1) // 16) * 16 > 0
    assert st.prefix_cache_hits == second.cached_prompt_tokens // 16
    assert second.token_ids == first.token_ids
    # With caching off, the same tokens come out too.
    assert make_engine(tiny, enable_prefix_caching=False).generate([prompts], sp)[0].token_ids == first.token_ids


def test_prefix_cache_across_page_sizes(tiny):
    """A second request follows the page size under which its prefix is cached, whatever its length."""
    prompt = _prompts(1, seed=4, shared=0)[0] * 4
    engine = make_engine(tiny)
    engine.generate([prompt], SamplingParams(max_tokens=150, **GREEDY))     # long: large pages
    res = engine.generate([prompt + [5]], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert res.cached_prompt_tokens > 0


def test_no_leaks_with_preemption_and_cancellation(tiny):
    """200 random requests, random cancellations, a pool small enough to force preemption: every page is
    free afterwards and every request got exactly one final output."""
    engine = make_engine(tiny, kv_pool_tokens=512, max_context=128, max_batch_size=16, max_queue=400)
    finals = run_random_load(engine, random.Random(7), requests=200, shared_fraction=0.3, params=lambda rng: SamplingParams(
        max_tokens=rng.randrange(1, 40), temperature=0.9, seed=rng.randrange(1000), ignore_eos=True))
    assert len(finals) == 200 and set(finals.values()) == {1}
    st = engine.stats()
    assert st.preemptions > 0, "the pool was meant to be small enough to force preemption"
    assert st.kv_tokens_used == 0 and st.running == 0 and st.queued == 0
    engine.pool.check_invariants()


def test_sampling_determinism(tiny):
    prompt = [5, 6, 7, 8, 9, 10]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=42, ignore_eos=True)
    a = make_engine(tiny).generate([prompt], sp)[0].token_ids
    engine = make_engine(tiny)
    noise = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(3)]
    b = engine.generate([[1, 2, 3], prompt, [9] * 30, [4, 4]], [noise[0], sp, noise[1], noise[2]])[1].token_ids
    assert a == b
    c = make_engine(tiny).generate([prompt], SamplingParams(**{**sp.__dict__, "seed": 43}))[0].token_ids
    assert c != a


def test_bad_requests_rejected_without_disturbing_others(tiny):
    engine = make_engine(tiny, max_queue=3)
    good = engine.add_request([1, 2, 3], SamplingParams(max_tokens=6, **GREEDY))
    cases = [
        ([], SamplingParams(), "empty"),
        ([1] * 250, SamplingParams(max_tokens=10), "context"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 2], SamplingParams(top_p=2.0), "top_p"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1, 2], SamplingParams(max_tokens=1000), "cap"),
        ([10**6], SamplingParams(), "token ids"),
    ]
    for prompt, sp, msg in cases:
        with pytest.raises(InvalidRequestError, match=msg):
            engine.add_request(prompt, sp)
    with pytest.raises(InvalidRequestError, match="already in flight"):
        engine.add_request([1], SamplingParams(), request_id=good)
    engine.add_request([1], SamplingParams(max_tokens=1))
    engine.add_request([1], SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError):
        engine.add_request([1], SamplingParams(max_tokens=1))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == good]
    assert sum(len(o.new_token_ids) for o in outs) == 6 and outs[-1].finish_reason == FinishReason.LENGTH


def test_stop_conditions(tiny):
    engine = make_engine(tiny)
    prompt = [20, 21, 22, 23]
    base = engine.generate([prompt], SamplingParams(max_tokens=20, **GREEDY))[0]
    stop_tok = base.token_ids[5]
    r = engine.generate([prompt], SamplingParams(max_tokens=20, stop_token_ids=(stop_tok,), **GREEDY))[0]
    assert r.finish_reason == FinishReason.STOP_TOKEN
    assert r.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]
    text = base.text
    if len(text) >= 6:
        stop = text[3:6]
        r = engine.generate([prompt], SamplingParams(max_tokens=20, stop_strings=(stop,), **GREEDY))[0]
        assert r.finish_reason == FinishReason.STOP_STRING
        assert r.text == text[:text.index(stop)]


def test_logprobs_and_prompt_logprobs(tiny):
    engine = make_engine(tiny)
    prompt = list(range(30, 70))
    r = engine.generate([prompt], SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=2, **GREEDY))[0]
    assert len(r.logprobs) == 5 and all(len(x) == 4 for x in r.logprobs)
    for tok, lp in zip(r.token_ids, r.logprobs):
        assert lp[0].token_id == tok and lp[1].token_id == tok           # greedy = top-1
        assert lp[0].logprob == pytest.approx(lp[1].logprob, abs=1e-5)
    assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] == []
    assert all(e[0].token_id == t for e, t in zip(r.prompt_logprobs[1:], prompt[1:]))
    # Chunked prefill (chunk 32 < 40 prompt tokens) gives the same prompt logprobs as one chunk.
    one = make_engine(tiny, prefill_chunk=64).generate(
        [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1, **GREEDY))[0]
    for a, b in zip(r.prompt_logprobs[1:], one.prompt_logprobs[1:]):
        assert a[0].logprob == pytest.approx(b[0].logprob, abs=1e-4)


def test_fragmentation_accounting(tiny):
    """Allocated vs written tokens: a 5-token request on 256-token pages wastes most of its page."""
    for page_size, waste_at_least in ((256, 200), (8, 0)):
        engine = make_engine(tiny, page_size=page_size)
        engine.add_request([3, 4, 5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
        engine.step()                          # prefill: 5 tokens written
        st = engine.stats()
        assert st.kv_tokens_written == 5
        assert st.kv_tokens_used == max(page_size, 8)
        assert st.kv_tokens_used - st.kv_tokens_written >= waste_at_least


def test_trace_out_block_event_log_reads_back(tiny, tmp_path):
    """--trace-out writes created/accessed/freed block events that the DMLP trace reader accepts."""
    from training.traces import read_stratum_log
    import json
    path = tmp_path / "events.jsonl"
    engine = make_engine(tiny, page_size=8, kv_pool_tokens=256, max_context=128, trace_out=str(path))
    prompt = list(range(30, 70))
    sp = SamplingParams(max_tokens=4, **GREEDY)
    engine.generate([prompt], sp)
    engine.generate([prompt + [1, 2]], sp)                       # reuses the cached prefix pages
    engine.generate([[9] * 120, [8] * 120], SamplingParams(max_tokens=8, **GREEDY))   # evicts the cache
    engine.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = {e["event"] for e in events}
    assert {"created", "accessed", "freed"} <= kinds
    accessed = [e for e in events if e["event"] == "accessed"]
    assert len(accessed) == len(prompt) // 8                    # every full page of the shared prompt
    assert accessed[0]["features"]["depth"] == 0 and accessed[0]["features"]["attn_var5"] is None
    stream = read_stratum_log(str(path))
    assert stream.num_events == sum(e["event"] in ("created", "accessed") for e in events)


def test_kv_tokens_written_counts_shared_pages_once(tiny):
    """The vectorised written-slot count equals a page-by-page count (a shared prefix page once, at its most
    written copy) at every step of a load with shared prefixes."""
    engine = make_engine(tiny)
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(48)]
    for i in range(10):
        engine.add_request(shared + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))],
                           SamplingParams(max_tokens=6, **GREEDY))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        written: dict[int, int] = {}
        for seq in engine.scheduler.running:
            ps = seq.blocks.page_size
            for i, page in enumerate(seq.blocks.pages):
                n = min(ps, max(0, seq.num_computed - i * ps))
                written[page.start_slot] = max(written.get(page.start_slot, 0), n)
        assert engine.stats().kv_tokens_written == sum(written.values())
        checked += bool(written)
    assert checked > 3
