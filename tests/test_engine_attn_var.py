"""The engine carries each request's attention-score variance (decode.py's attn_score_var) to the two
places that use it: the page-size rule (a re-admitted request's hint) and the DMLP feature attn_var5
(block snapshots, hence the --trace-out log). It is measured only when the DMLP policy or the event log
reads it (--cache-policy dmlp, --trace-out)."""
import json
import math

import numpy as np
import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.cache_policy import LruPolicy
from stratum_jax.engine import Engine
from stratum_jax.model.loader import load_model
from stratum_jax.request import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


class RecordingLru(LruPolicy):
    """LRU that records the page-size hints the scheduler asks with."""

    def __init__(self):
        self.hints = []

    def page_size_for(self, hints, prefix_blocks=(), now_ms=0.0):
        self.hints.append(hints)
        return super().page_size_for(hints, prefix_blocks, now_ms)


def test_not_measured_when_nothing_reads_it(tiny):
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024), model=tiny)
    rid = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=6, **GREEDY))
    seq = engine.requests[rid]
    while engine.has_unfinished():
        engine.step()
    assert seq.attn_var5 is None


def test_sequence_keeps_the_last_five_token_variances(tiny, tmp_path):
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, decode_steps=4,
                                  trace_out=str(tmp_path / "e.jsonl")), model=tiny)
    rid = engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=12, **GREEDY))
    seq = engine.requests[rid]
    assert seq.attn_var5 is None                       # nothing measured before the first step
    seen = []
    while engine.has_unfinished():
        engine.step()
        if rid in engine.requests:
            seen.append(list(seq.recent_attn_var))
    values = seq.recent_attn_var
    assert len(values) == 5                            # a bounded window: the last 5 tokens only
    assert all(math.isfinite(v) and v > 0 for v in values)
    assert seq.attn_var5 == pytest.approx(float(np.mean(values)))
    # Prompt tokens are not measured (decode.py): the window stays empty through prefill, then each decode
    # call of 4 steps appends one value per token. (With async scheduling the first step() returns before
    # the prefill's results are read.)
    first = next(i for i, s in enumerate(seen) if s)
    assert first >= 1 and len(seen[first]) == 4 and len(seen[first + 1]) == 5


def test_readmitted_request_brings_its_variance_to_the_page_size_rule(tiny, tmp_path):
    policy = RecordingLru()
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=512, max_batch_size=16,
                                  max_queue=64, trace_out=str(tmp_path / "e.jsonl")), model=tiny, policy=policy)
    rng = np.random.default_rng(3)
    for _ in range(24):
        prompt = rng.integers(3, 250, size=int(rng.integers(40, 80))).tolist()
        engine.add_request(prompt, SamplingParams(max_tokens=40, **GREEDY))
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().preemptions > 0, "the pool was meant to force preemption"
    known = [h.attention_score_variance for h in policy.hints if h.attention_score_variance is not None]
    unknown = [h for h in policy.hints if h.attention_score_variance is None]
    assert len(unknown) >= 24          # every first admission (retried while the pool is full): not measured
    assert known and all(math.isfinite(v) and v > 0 for v in known)


def test_trace_out_logs_attn_var5_once_measured(tiny, tmp_path):
    path = tmp_path / "events.jsonl"
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, page_size=8,
                                  trace_out=str(path)), model=tiny)
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=30, **GREEDY))
    engine.close()
    created = [json.loads(line) for line in path.read_text().splitlines()]
    created = [e for e in created if e["event"] == "created"]
    # 20 prompt tokens + 30 generated: pages 0-1 after prefill (no decoded token yet: null, never 0), pages
    # 2-5 during decode.
    assert len(created) == 6
    assert [e["features"]["attn_var5"] is None for e in created] == [True, True, False, False, False, False]
    assert all(e["features"]["attn_var5"] > 0 for e in created[2:])


def test_gpu_idle_fraction_is_measured_and_logged(tiny, tmp_path):
    """The engine times each device step; the idle share of the last second reaches EngineStats and the
    gpu_idle_frac feature of every block event after the first step."""
    path = tmp_path / "events.jsonl"
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, page_size=8,
                                  trace_out=str(path)), model=tiny)
    assert engine.stats().gpu_idle_frac is None
    engine.generate([list(range(3, 23))], SamplingParams(max_tokens=30, **GREEDY))
    engine.close()
    st = engine.stats()
    assert 0.0 <= st.gpu_idle_frac <= 1.0 and st.gpu_idle_gap_ms is not None and st.gpu_idle_gap_ms >= 0.0
    created = [json.loads(line) for line in path.read_text().splitlines()]
    values = [e["features"]["gpu_idle_frac"] for e in created if e["event"] == "created"]
    assert values and all(v is not None and 0.0 <= v <= 1.0 for v in values)
