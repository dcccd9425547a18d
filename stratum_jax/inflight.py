"""Async scheduling's bookkeeping: the one dispatched step whose results the host has not read yet, and the
sequence counters that let the next step be scheduled before they are read.

With async scheduling (the default) step N+1 is on the device before the host reads step N's results. So
a step's effects on its sequences are applied when it is dispatched (`InFlight.advance`): its tokens'
K/V count as computed (`Sequence.num_computed`), each row that samples has one more pending token
(`Sequence.num_pending`: sampled, still only on the device, where the next step takes it through
decode.TokenFeed), and a chunk that reaches the end of its prompt moves its sequence to DECODING. When the
results are read, each token taken turns one pending token into an output id (`token_read`). A preempted
sequence (scheduler/fcfs.py) drops its pending tokens and bumps its epoch, so that the rows of steps
dispatched before are stale (`row_is_live`), as are those of a request that ended meanwhile.
"""
from __future__ import annotations

from typing import Mapping

from stratum_jax.model_runner import InFlightStep
from stratum_jax.request import RequestState
from stratum_jax.sequence import Sequence


class InFlight:
    """async_scheduling: read each step only after the next one is dispatched (else right after its own
    dispatch). Engine thread only."""

    def __init__(self, async_scheduling: bool):
        self.async_scheduling = async_scheduling
        self.step: InFlightStep | None = None          # dispatched, results not read yet

    def advance(self, launched: InFlightStep | None) -> list[InFlightStep]:
        """`launched` was just dispatched (None: nothing was this step). Applies its effects to its
        sequences and returns the steps to read now, oldest first: the step dispatched before it, and
        without async scheduling `launched` itself."""
        if launched is not None:
            account_dispatch(launched)
        previous, self.step = self.step, launched
        to_read = [previous] if previous is not None else []
        if launched is not None and not self.async_scheduling:
            self.step = None
            to_read.append(launched)
        return to_read

    def drain(self) -> InFlightStep | None:
        """Takes the step in flight, if any, to be read without dispatching another."""
        step, self.step = self.step, None
        return step


def account_dispatch(step: InFlightStep) -> None:
    """What a dispatched step will have done once it runs, applied now so the next step can be scheduled
    before its results are read: chunks are computed, decode rows have their tokens computed, and every
    row that samples has one more token pending."""
    batch = step.batch
    for seq, n in zip(batch.decode, batch.decode_steps):
        seq.num_computed += n
        seq.num_pending += n
    for seq, n in zip(batch.prefill, batch.chunk_lens):
        seq.num_computed += n
        if seq.num_computed < seq.num_tokens:
            seq.state = RequestState.PREFILLING
        else:                             # the chunk reaches the end: it samples the first token
            seq.state = RequestState.DECODING
            seq.num_pending += 1


def row_is_live(seq: Sequence, epoch: int, requests: Mapping[str, Sequence]) -> bool:
    """Whether a step's row for seq still counts: epoch is seq's at dispatch; the row is stale if seq was
    preempted since (its epoch moved on), or finished or cancelled (it left `requests`)."""
    return seq.epoch == epoch and requests.get(seq.request_id) is seq


def token_read(seq: Sequence) -> None:
    """One of seq's pending tokens reached the host (the caller appends it to seq.output_ids)."""
    seq.num_pending -= 1
