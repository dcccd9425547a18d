"""Recall from the host tier, or recompute? The choice by measured cost (issue #12: "recall is chosen over
recompute when the measured copy time is lower").

A matched prefix whose pages are partly in the host tier can either be recalled (one host->device copy of
those pages) or be cut at its first host page, whose tokens and every token after it in the prefix are then
prefilled again. Both costs come from measurements, never from constants:
  copy time      = bytes to recall / the measured host->device bandwidth of recent recall batches
                   (kv/transfer.py reports each batch's bytes, tokens and upload seconds);
  recompute time = tokens to recompute / the engine's measured prefill throughput (its recent steps).
Until both are measured the tier recalls (the first recall is what measures the copy). Each choice is
logged at DEBUG, and a change of choice at INFO with both estimates, so a log says why a prefix was
recomputed although its pages were on the host.
"""
from __future__ import annotations

import collections
import logging
from typing import Callable

log = logging.getLogger(__name__)


class RecallChoice:
    """prefill_tokens_per_s: the engine's measured prefill throughput now (None while unmeasured)."""

    def __init__(self, prefill_tokens_per_s: Callable[[], float | None], window: int = 16):
        self.prefill_tokens_per_s = prefill_tokens_per_s
        # Recall whatever the estimates say (still counted and logged): benchmarks/host_tier.py --recall always,
        # so that a CPU run, whose cheap prefill makes the measured choice recompute, schedules like a GPU run.
        self.always_recall = False
        self._copies: collections.deque[tuple[int, int, float]] = collections.deque(maxlen=window)
        self.recalled = 0          # choices made, each way
        self.recomputed = 0
        self._last: bool | None = None

    def observe_copy(self, nbytes: int, tokens: int, seconds: float) -> None:
        """One recall batch: `nbytes` bytes of `tokens` tokens' KV uploaded in `seconds`."""
        if nbytes > 0 and tokens > 0 and seconds > 0:
            self._copies.append((nbytes, tokens, seconds))

    def copy_bandwidth(self) -> float | None:
        """Bytes per second of the recent recall uploads (their total bytes over their total time)."""
        if not self._copies:
            return None
        return sum(c[0] for c in self._copies) / sum(c[2] for c in self._copies)

    def bytes_per_token(self) -> float | None:
        if not self._copies:
            return None
        return sum(c[0] for c in self._copies) / sum(c[1] for c in self._copies)

    def estimates(self, recall_tokens: int, recompute_tokens: int) -> tuple[float, float] | None:
        """(copy seconds, recompute seconds), or None while either rate is unmeasured."""
        bw, per_token, tps = self.copy_bandwidth(), self.bytes_per_token(), self.prefill_tokens_per_s()
        if bw is None or per_token is None or not tps:
            return None
        return recall_tokens * per_token / bw, recompute_tokens / tps

    def should_recall(self, recall_tokens: int, recompute_tokens: int) -> bool:
        """recall_tokens: tokens of the prefix's host pages (what a recall copies); recompute_tokens: tokens
        from its first host page to its end (what a cut there prefills again)."""
        est = self.estimates(recall_tokens, recompute_tokens)
        recall = self.always_recall or est is None or est[0] <= est[1]
        if recall:
            self.recalled += 1
        else:
            self.recomputed += 1
        what = "recall" if recall else "recompute"
        if est is None:
            log.debug("host tier: recall %d tokens (copy or prefill rate not measured yet)", recall_tokens)
        else:
            level = logging.INFO if recall != self._last else logging.DEBUG
            log.log(level, "host tier: %s - copying %d tokens takes ~%.2f ms at %.1f GB/s, recomputing %d "
                    "tokens ~%.2f ms at %.0f tok/s", what, recall_tokens, est[0] * 1e3, self.copy_bandwidth() / 1e9,
                    recompute_tokens, est[1] * 1e3, self.prefill_tokens_per_s())
            self._last = recall
        return recall
