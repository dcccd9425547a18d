"""A request in flight: its tokens, sampling state, KV block table and streamed-text state."""
from __future__ import annotations

import collections
import dataclasses
import time

from stratum_jax.kv.block_table import BlockTable
from stratum_jax.request import FinishReason, RequestState, SamplingParams, TokenLogprob
from stratum_jax.request_usage import RequestUsage


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int                                   # effective seed (the request's, or one the engine drew)
    detokenizer: object                         # IncrementalDetokenizer
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    admit_order: int = 0                        # larger = admitted later (preempted first)
    state: RequestState = RequestState.QUEUED
    output_ids: list[int] = dataclasses.field(default_factory=list)   # sampled tokens the host has read
    blocks: BlockTable | None = None
    # Tokens whose K/V are in the cache once every dispatched step has run: the engine advances it when it
    # dispatches a step, not when the results come back (async scheduling, inflight.py).
    num_computed: int = 0
    # Tokens sampled by a dispatched step whose results the host has not read yet (they follow
    # output_ids; their ids are only on the device, and the next step feeds them back there).
    num_pending: int = 0
    # Bumped when the sequence is preempted: results of steps dispatched before that are stale.
    epoch: int = 0
    cached_prompt_tokens: int = 0               # prompt tokens served by the prefix cache
    cancel_requested: bool = False
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    # Streaming text: what was emitted, and text held back because it may begin a stop string.
    emitted_text: str = ""
    pending_text: str = ""
    prompt_logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs_sent: bool = False
    first_token_time: float | None = None
    admit_time: float | None = None             # first admission (queue wait = admit - arrival)
    queue_wait_recorded: bool = False
    # Attention-score variance of the latest decoded tokens (one value per token; prompt tokens are not
    # measured: decode.py), newest last. Feeds the page-size rule and the DMLP's attn_var5.
    recent_attn_var: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=5))
    # Chain hashes of the tokens while queued, per page size (host-tier prefetch looks them up each step):
    # (token count they cover, {page size: hashes}).
    queued_chain_hashes: tuple[int, dict[int, list[bytes]]] | None = None
    # Its share of the device time of the steps that ran it (request_usage.py): the metered bill's input.
    usage: RequestUsage = dataclasses.field(default_factory=RequestUsage)

    @property
    def attn_var5(self) -> float | None:
        """Mean attention-score variance over the last 5 tokens (stratum_jax/decode.py defines it per
        token: the variance of the softmax inputs over the context, averaged over heads and layers);
        None before the request's first step."""
        if not self.recent_attn_var:
            return None
        return sum(self.recent_attn_var) / len(self.recent_attn_var)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the decode hot path)."""
        if end > self.num_known_tokens:
            raise ValueError(f"tokens [{start}, {end}) of {self.request_id} reach past the {self.num_known_tokens} "
                             "the host has read (the rest are pending on the device)")
        n_prompt = len(self.prompt_ids)
        if start >= n_prompt:
            return self.output_ids[start - n_prompt:end - n_prompt]
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - n_prompt]

    @property
    def num_tokens(self) -> int:
        """Prompt and sampled tokens, counting those still pending on the device (the scheduler's view)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt and sampled tokens the host has read (len(all_token_ids))."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        """Sampled tokens, counting those still pending on the device."""
        return len(self.output_ids) + self.num_pending

    @property
    def is_prefilling(self) -> bool:
        """True while tokens other than the last one still need their K/V computed."""
        return self.num_computed < self.num_tokens - 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs > 0 and not self.prompt_logprobs_sent
