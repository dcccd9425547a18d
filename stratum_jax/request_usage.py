"""What one request used of the device: its share of the measured time of every step that ran it.

A step's device time is divided over the tokens it processed (prompt-chunk tokens and decode tokens alike),
and each row is charged its tokens' share. Per token, because that is how a step's work grows: its linear
layers (most of its FLOPs) do the same work per token whatever the row, and the weights it reads once are
shared by all of them. A decode row alone in its step pays the whole step; among 40 others it pays a 41st of
it; a decode row riding along a 2,000-token prefill chunk pays 1/2,001. (Attention's context-dependent part
is not apportioned by context: a simplification, documented in serving/cost.py.)

The engine charges every step it reads back (StepRecorder.record_timing) to the sequences of its batch, and
hands the sum over to the request's final StepOutput (`usage`). A step read back after its request finished
(with async scheduling, the one extra token computed after a stop) is not on the bill. A step the engine could
not time (it ran while the host was busy elsewhere, so its end was not seen) is charged at the engine's recent
measured rates instead (`StepRecorder.estimated_step_s`), and that part is kept apart in `estimated_device_s`;
before any step was measured such a step charges nothing.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stratum_jax.scheduler.base import ScheduledBatch


@dataclasses.dataclass
class RequestUsage:
    """Sums over the steps that ran one request. Seconds of device time; a prefill step after a preemption
    (recompute) is charged like the first."""

    prefill_tokens: int = 0          # prompt tokens it prefilled (a recompute counts again)
    decode_tokens: int = 0           # decode tokens it computed
    prefill_device_s: float = 0.0    # its prompt tokens' share of the device time of the steps it prefilled in
    decode_device_s: float = 0.0     # its decode tokens' share of the device time of the steps it decoded in
    prefill_step_s: float = 0.0      # the whole device time of those prefill steps (how long it waited on them)
    decode_step_s: float = 0.0       # the whole device time of those decode steps
    estimated_device_s: float = 0.0  # the part of device_s charged at recent rates for steps that were not timed

    @property
    def device_s(self) -> float:
        """All the device time it was charged."""
        return self.prefill_device_s + self.decode_device_s

    def snapshot(self) -> "RequestUsage":
        """A copy that later charges (a step read after the final output) leave alone."""
        return dataclasses.replace(self)


def charge_step(batch: ScheduledBatch, device_s: float, *, estimated: bool = False) -> None:
    """Divides one step's `device_s` (measured, or with `estimated` an estimate at recent rates) over its rows'
    tokens (module docstring) into each sequence's `usage`. batch.decode[i] computed batch.decode_steps[i]
    tokens, batch.prefill[i] batch.chunk_lens[i]."""
    tokens = batch.num_tokens
    if device_s <= 0 or tokens <= 0:
        return
    per_token = device_s / tokens
    for seq, n in zip(batch.decode, batch.decode_steps):
        usage = seq.usage
        usage.decode_tokens += n
        usage.decode_device_s += n * per_token
        usage.decode_step_s += device_s
        if estimated:
            usage.estimated_device_s += n * per_token
    for seq, n in zip(batch.prefill, batch.chunk_lens):
        usage = seq.usage
        usage.prefill_tokens += n
        usage.prefill_device_s += n * per_token
        usage.prefill_step_s += device_s
        if estimated:
            usage.estimated_device_s += n * per_token
