"""What CostEstimate prices a request with: the per-token rates of one pool's recent bills, medians.

A bill (serving/cost.py `bill`) is what one request was charged of the steps that ran it, so its rates per
token (cost.TokenRates: device seconds charged and step seconds, per billed prompt token and per output token)
carry the load that request met. The estimate for the next request takes the median of each rate over the
last `window` bills of the pool: each request counts once, so the price is the one a typical recent request
paid. The window does not decay with time: a server that ran a thousand requests under load, then two alone,
and then sat idle still quotes the busy price (the two are outliers of the median), while a server whose
load has really changed follows once half the window has been billed at the new load.

Before the pool's first bill (and for the prefill rates, until a bill prefilled at least one prompt token)
the estimate uses the start-up measurements it is given (`fallback`).

Fed and read on the server's event loop only (Generation, at each request's end; the servicer's
CostEstimate), so it takes no lock.
"""
from __future__ import annotations

import collections
import statistics

from serving.cost import Measured, TokenRates


class RecentRates:
    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError(f"the window of recent bills must hold at least 1, got {window}")
        self.window = window
        # (device s, step s) per billed prompt token, and per output token, of the latest bills that have any
        self._prefill: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self._decode: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)

    def __len__(self) -> int:
        return max(len(self._prefill), len(self._decode))

    def add(self, rates: TokenRates) -> None:
        """One bill's rates; a part that was not timed (step seconds 0: no prompt token billed, no output
        token, or steps the engine could not time) says nothing about the load and is left out."""
        if rates.prefill_step_s > 0:
            self._prefill.append((rates.prefill_device_s, rates.prefill_step_s))
        if rates.decode_step_s > 0:
            self._decode.append((rates.decode_device_s, rates.decode_step_s))

    def rates(self) -> TokenRates | None:
        """The medians of the window (None before any bill; a part with no bill yet is 0)."""
        if not (self._prefill or self._decode):
            return None
        prefill_device, prefill_step = _medians(self._prefill)
        decode_device, decode_step = _medians(self._decode)
        return TokenRates(prefill_device, prefill_step, decode_device, decode_step)

    def measured(self, fallback: Measured) -> Measured:
        """The estimate's inputs: the window's medians, and `fallback`'s figures for a part it has none of."""
        rates = self.rates()
        if rates is None:
            return fallback
        recent = Measured.of_rates(rates)
        prefill = recent if self._prefill else fallback
        decode = recent if self._decode else fallback
        return Measured(decode_step_ms=decode.decode_step_ms, prefill_tokens_per_s=prefill.prefill_tokens_per_s,
                        decode_batch=decode.decode_batch, prefill_batch=prefill.prefill_batch)


def _medians(pairs) -> tuple[float, float]:
    if not pairs:
        return 0.0, 0.0
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
