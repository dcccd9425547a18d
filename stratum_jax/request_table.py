"""The engine's requests in flight, by id: admission (the request's checks, its id and seed), cancellation,
and a request's end (its final output, out of the scheduler and the table)."""
from __future__ import annotations

import collections.abc
import itertools
from typing import Iterator

import numpy as np

from stratum_jax.config import RuntimeConfig
from stratum_jax.model.tokenizer import IncrementalDetokenizer
from stratum_jax.outputs import OutputProcessor
from stratum_jax.request import (FinishReason, InvalidRequestError, QueueFullError, RequestState, SamplingParams,
                                 StepOutput)
from stratum_jax.scheduler.base import Scheduler
from stratum_jax.sequence import Sequence


class RequestTable(collections.abc.Mapping[str, Sequence]):
    """config: the engine's (max_context already fixed for the model); vocab_size: the model's; tokenizer:
    for each request's detokenizer; scheduler: where admitted requests queue and ended ones leave;
    outputs: writes a request's final output. A read-only mapping of id -> Sequence. Engine thread only."""

    def __init__(self, config: RuntimeConfig, vocab_size: int, tokenizer, scheduler: Scheduler,
                 outputs: OutputProcessor):
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.outputs = outputs
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seed_rng = np.random.default_rng(config.seed)   # seeds of requests that give none

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Checks a request and queues it; returns its id. Raises InvalidRequestError (saying what to fix)
        or QueueFullError."""
        params.validate(max_tokens_cap=self.config.max_tokens_cap)
        prompt_ids = _token_list(prompt_ids)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) + params.max_tokens > self.config.max_context:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"limit of {self.config.max_context} tokens: shorten the prompt or lower max_tokens")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFullError(f"the queue is full ({self.config.max_queue} waiting requests); retry later")
        seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**63))
        seq = Sequence(request_id=request_id, prompt_ids=prompt_ids, params=params, seed=seed,
                       detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_ids))
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Marks a request cancelled (False: no such request in flight); the engine's next step ends it."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        seq.cancel_requested = True
        return True

    def cancelled(self) -> list[Sequence]:
        """The requests marked cancelled and not ended yet."""
        return [s for s in self._seqs.values() if s.cancel_requested]

    def finish(self, seq: Sequence, reason: FinishReason, outputs: dict[str, StepOutput]) -> None:
        """Ends seq: its final output into `outputs`, its attention-score variance to the page-size rule's
        scale, out of the scheduler (its pages back) and of the table."""
        self.outputs.finish(seq, reason, outputs)
        if seq.attn_var5 is not None:
            self.scheduler.variance_scale.observe(seq.attn_var5)
        seq.state = RequestState.CANCELLED if reason == FinishReason.CANCELLED else RequestState.FINISHED
        self.scheduler.remove(seq)
        del self._seqs[seq.request_id]

    # -- the mapping (get and `in` straight from the dict: they run per row of every step) --------------
    def get(self, request_id: str, default=None) -> Sequence | None:
        return self._seqs.get(request_id, default)

    def __getitem__(self, request_id: str) -> Sequence:
        return self._seqs[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __iter__(self) -> Iterator[str]:
        return iter(self._seqs)


def _token_list(prompt_ids) -> list[int]:
    """prompt_ids as a list of Python ints, as `[int(t) for t in prompt_ids]` gives, through numpy when they
    are a list, tuple or array of integers already (a long prompt's admission path: 32K tokens took ~30 ms
    item by item on a 2-core CPU). Anything else (floats, bools, strings, iterators) goes item by item as
    before, with the same results and errors."""
    if isinstance(prompt_ids, (list, tuple, np.ndarray)):
        arr = np.asarray(prompt_ids)
        if arr.ndim == 1 and arr.dtype.kind in "iu":
            return arr.tolist()
    return [int(t) for t in prompt_ids]
