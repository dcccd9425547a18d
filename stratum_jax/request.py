"""Requests as the engine sees them: sampling parameters (validated once), lifecycle states, outputs.

This is the narrow contract between the engine and its drivers (CLI, gRPC servicer, benchmarks).
"""
from __future__ import annotations

import dataclasses
import enum
import math

from stratum_jax.request_usage import RequestUsage


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says what to fix. Other requests are not affected."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its configured limit."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` means greedy.

    top_k == 0 disables top-k; top_p == 1 disables nucleus sampling. `seed` makes sampling reproducible
    per request regardless of batch composition. `logprobs` / `prompt_logprobs` ask for the top-K
    log-probabilities (plus the chosen token's) of generated / prompt tokens; 0 means none.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: int = 0

    MAX_LOGPROBS = 20

    def validate(self, *, max_tokens_cap: int | None = None) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_tokens_cap is not None and self.max_tokens > max_tokens_cap:
            bad(f"max_tokens={self.max_tokens} is over this server's cap of {max_tokens_cap}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            bad(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if not isinstance(k, int) or not (0 <= k <= self.MAX_LOGPROBS):
                bad(f"{name} must be an integer in [0, {self.MAX_LOGPROBS}], got {k!r}")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop_strings):
            bad("stop_strings must be non-empty strings")


class RequestState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    CANCELLED = "cancelled"


class FinishReason(str, enum.Enum):
    EOS = "eos"                      # the model produced an end-of-sequence token
    STOP_TOKEN = "stop_token"        # one of stop_token_ids
    STOP_STRING = "stop_string"      # one of stop_strings appeared in the text
    LENGTH = "length"                # max_tokens reached, or the context is full
    CANCELLED = "cancelled"          # cancelled by the caller
    ERROR = "error"                  # the engine could not serve it (message in StepOutput.error)


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclasses.dataclass
class StepOutput:
    """What one engine step produced for one request. Exactly one output per request has finished=True."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    # For each new token: the chosen token's logprob first, then the top-K (when logprobs > 0).
    logprobs: list[list[TokenLogprob]] | None = None
    prompt_logprobs: list[list[TokenLogprob]] | None = None   # sent once, with the first output
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    output_tokens: int = 0       # total so far
    usage: RequestUsage | None = None   # on the final output: the device time it was charged (request_usage.py)


@dataclasses.dataclass
class GenerationResult:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[list[TokenLogprob]] | None
    prompt_logprobs: list[list[TokenLogprob]] | None
    prompt_tokens: int
    cached_prompt_tokens: int
