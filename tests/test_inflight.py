"""Async scheduling's bookkeeping (stratum_jax/inflight.py), without a model: what a dispatched step does to
its sequences' counters, which steps are read when, and which rows of a step read back still count."""
import types

import pytest

from stratum_jax.inflight import InFlight, account_dispatch, row_is_live, token_read
from stratum_jax.request import RequestState, SamplingParams
from stratum_jax.scheduler.base import ScheduledBatch
from stratum_jax.sequence import Sequence


def _seq(rid: str, prompt_len: int, outputs: int = 0) -> Sequence:
    return Sequence(request_id=rid, prompt_ids=list(range(1, prompt_len + 1)), params=SamplingParams(max_tokens=32),
                    seed=0, detokenizer=None, output_ids=list(range(outputs)))


def _step(batch: ScheduledBatch):
    """What InFlight reads of a dispatched step (model_runner.InFlightStep): its batch."""
    return types.SimpleNamespace(batch=batch)


def test_dispatch_accounts_computed_and_pending_tokens():
    """Decode rows: their steps' tokens count as computed and pending. A middle prefill chunk: computed,
    still PREFILLING, nothing pending. A last chunk: DECODING with its first token pending."""
    dec = _seq("d", 10, outputs=3)
    dec.num_computed = dec.num_tokens - 1
    mid, last = _seq("m", 40), _seq("l", 12)
    last.num_computed = 4
    before = dec.num_computed
    account_dispatch(_step(ScheduledBatch(decode=[dec], decode_steps=[3], prefill=[mid, last], chunk_lens=[16, 8])))
    assert (dec.num_computed, dec.num_pending) == (before + 3, 3)
    assert dec.num_tokens == 10 + 3 + 3       # the scheduler sees the pending tokens
    assert (mid.num_computed, mid.num_pending, mid.state) == (16, 0, RequestState.PREFILLING)
    assert (last.num_computed, last.num_pending, last.state) == (12, 1, RequestState.DECODING)
    for _ in range(3):
        token_read(dec)
    assert dec.num_pending == 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_steps_are_read_one_behind_only_with_async(async_scheduling):
    """With async scheduling each step is read once the next is dispatched (or drained); without it,
    right after its own dispatch, and nothing stays in flight."""
    inflight = InFlight(async_scheduling)
    steps = [_step(ScheduledBatch([], [], [_seq(f"s{i}", 4)], [4])) for i in range(3)]
    read = []
    for step in steps:
        read.append(inflight.advance(step))
    read.append(inflight.advance(None))           # a step with nothing to dispatch
    if async_scheduling:
        assert read == [[], [steps[0]], [steps[1]], [steps[2]]]
    else:
        assert read == [[steps[0]], [steps[1]], [steps[2]], []]
    assert inflight.step is None and inflight.drain() is None
    inflight.advance(steps[0])
    assert inflight.drain() is (steps[0] if async_scheduling else None)
    assert inflight.step is None


def test_rows_go_stale_on_preemption_or_end():
    """A row read back counts only if its sequence has the epoch it was dispatched with and is still the
    table's sequence for its id."""
    seq = _seq("a", 5)
    table = {"a": seq}
    assert row_is_live(seq, 0, table)
    seq.epoch += 1                                 # preempted after dispatch
    assert not row_is_live(seq, 0, table) and row_is_live(seq, 1, table)
    assert not row_is_live(seq, 1, {})              # finished or cancelled
    assert not row_is_live(seq, 1, {"a": _seq("a", 5)})   # the id now names another request
