"""What a scheduler is to the engine: the batch it returns and the `Scheduler` Protocol that FCFS and HAB
implement. The engine drives it: `add` on arrival, `observe` with the last step's costs, `schedule` once
per step, `remove` when a request ends."""
from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

from stratum_jax.page_size import VarianceScale
from stratum_jax.sequence import Sequence


@dataclasses.dataclass
class ScheduledBatch:
    """One engine step's work.

    decode: running sequences that take decode tokens, `decode_steps[i]` each (more than 1 only when the
    step has no prefill: then the engine runs a multi-step decode call). prefill: sequences that process
    `chunk_lens[i]` prompt tokens (a chunk that reaches the end of the prompt samples the first token).
    """

    decode: list[Sequence]
    decode_steps: list[int]
    prefill: list[Sequence]
    chunk_lens: list[int]

    @property
    def kind(self) -> str:
        if not self.prefill:
            return "decode"
        return "mixed" if self.decode else "prefill"

    @property
    def seqs(self) -> list[Sequence]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(self.decode_steps) + sum(self.chunk_lens)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What the engine measured, for schedulers that weigh compute (HAB). Times in ms on the engine clock.

    now_s: time.monotonic() when `schedule` is called (the clock of Sequence.arrival_time);
    idle_gap_ms: device idle time between the end of the previous step's results and this call (0 before
    the first step); prefill_ms_per_token /
    decode_ms_per_step: recent medians (None until measured).
    """

    now_s: float
    idle_gap_ms: float
    prefill_ms_per_token: float | None
    decode_ms_per_step: float | None


class Scheduler(Protocol):
    """The contract the engine drives. `waiting` and `running` are read for stats and prefetch."""

    waiting: collections.deque[Sequence]
    running: list[Sequence]
    preemptions: int
    triggers: int                    # HAB trigger events (0 for FCFS)
    variance_scale: VarianceScale

    def add(self, seq: Sequence) -> None:
        """A new request joins the queue."""

    def remove(self, seq: Sequence) -> None:
        """A request ended (finished or cancelled): out of the queues, pages given back."""

    def schedule(self, costs: StepCosts) -> ScheduledBatch | None:
        """The next step's work, or None when nothing can run."""
