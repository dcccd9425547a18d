"""Which engine serves a request: the traffic split between stacks, and long-context routing.

The split (x-stratum-weight w in [0, 1]). A request goes to the Stratum stack when u < w, else to the
baseline, where u in [0, 1) is a hash of the request's key: its x-stratum-session header when it sends one,
else its request id (generated when the client sends none). The hash is blake2b (8 bytes, as a big-endian
integer / 2^64), so the choice is deterministic: a retry with the same session key or request id lands on
the same stack, and over many keys the Stratum share is w (within sampling error: ±3% over 2,000 keys is
about 3 standard errors at w = 0.5). Without the header the server's --stratum-weight applies.

Routing (x-stratum-route). `long-context` sends the request to the long-context pool (its own KV pool and
engine settings: larger pages, a higher context cap). `default`, or no header, lets the classifier decide:
  - it keeps the prompt lengths of the last `window` requests in log2 bins (bin k holds lengths in
    [2^k, 2^(k+1))) and their Shannon entropy H = -sum p_k log2 p_k, in bits
    (stratum_prompt_length_entropy_bits);
  - while H <= --route-entropy-bits (default 2.1, the design's figure) the traffic is homogeneous enough
    that one pool serves it: everything goes to the default pool (reason low_entropy);
  - above it, a request whose prompt has at least --route-long-prompt-tokens tokens (reason length) or whose
    prompt text matches --route-regex (reason regex) goes to the long-context pool, the rest stay (short).
The request's own length is added to the window before it is classified. A server without a long-context
pool routes everything to the default pool and refuses the header with INVALID_ARGUMENT.
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import re
import threading

DEFAULT_ROUTE, LONG_CONTEXT_ROUTE = "default", "long-context"
DEFAULT_ENTROPY_BITS = 2.1     # the design's threshold for classification routing
DEFAULT_ENTROPY_WINDOW = 512   # recent prompts whose lengths make the distribution


def split_point(key: str) -> float:
    """The request's place u in [0, 1) on the split: blake2b of the key, 64 bits, / 2^64."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def goes_to_stratum(key: str, weight: float) -> bool:
    """True when the request with this key goes to the Stratum stack at weight `weight` (0 never, 1 always)."""
    return split_point(key) < weight


def length_bin(tokens: int) -> int:
    """The log2 bin of a prompt length: floor(log2(tokens)) (bin 0 holds 1 token; 0 tokens count as bin 0)."""
    return max(1, int(tokens)).bit_length() - 1


def entropy_bits(counts) -> float:
    """Shannon entropy (bits) of a histogram given as bin counts; 0.0 for an empty one."""
    counts = [c for c in counts if c > 0]
    total = sum(counts)
    if total == 0:
        return 0.0
    return max(0.0, -sum(c / total * math.log2(c / total) for c in counts))


class PromptLengthEntropy:
    """The prompt lengths of the last `window` requests, in log2 bins, and their entropy. Thread-safe."""

    def __init__(self, window: int = DEFAULT_ENTROPY_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"--route-entropy-window must be >= 1, got {window}")
        self._recent: collections.deque[int] = collections.deque(maxlen=window)
        self._counts: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, prompt_tokens: int) -> float:
        """Adds one prompt length; returns the entropy (bits) with it."""
        b = length_bin(prompt_tokens)
        with self._lock:
            if len(self._recent) == self._recent.maxlen:
                old = self._recent[0]
                self._counts[old] -= 1
            self._recent.append(b)
            self._counts[b] += 1
            return entropy_bits(self._counts.values())

    def bits(self) -> float:
        with self._lock:
            return entropy_bits(self._counts.values())


@dataclasses.dataclass(frozen=True)
class RouteDecision:
    route: str      # DEFAULT_ROUTE or LONG_CONTEXT_ROUTE
    reason: str     # header, length, regex, short, low_entropy, no_pool
    entropy_bits: float


class Router:
    """Decides each request's pool (the module docstring's rules). `long_context` says whether the server
    runs a long-context pool; without one every request goes to the default pool."""

    def __init__(self, *, long_context: bool, entropy_threshold_bits: float = DEFAULT_ENTROPY_BITS,
                 long_prompt_tokens: int | None = None, prompt_regex: str | None = None,
                 window: int = DEFAULT_ENTROPY_WINDOW) -> None:
        self.long_context = long_context
        self.entropy_threshold_bits = entropy_threshold_bits
        self.long_prompt_tokens = long_prompt_tokens
        self.prompt_regex = None if not prompt_regex else re.compile(prompt_regex, re.IGNORECASE)
        self.lengths = PromptLengthEntropy(window)

    def decide(self, header_route: str, prompt_tokens: int, prompt_text: str | None) -> RouteDecision:
        """header_route: the x-stratum-route value ("default" when absent); prompt_text: the prompt's text
        for the regex (None: not available, e.g. a prompt sent as token ids)."""
        bits = self.lengths.add(prompt_tokens)
        if header_route == LONG_CONTEXT_ROUTE:
            return RouteDecision(LONG_CONTEXT_ROUTE, "header", bits)
        if not self.long_context:
            return RouteDecision(DEFAULT_ROUTE, "no_pool", bits)
        if bits <= self.entropy_threshold_bits:
            return RouteDecision(DEFAULT_ROUTE, "low_entropy", bits)
        if self.long_prompt_tokens is not None and prompt_tokens >= self.long_prompt_tokens:
            return RouteDecision(LONG_CONTEXT_ROUTE, "length", bits)
        if self.prompt_regex is not None and prompt_text is not None and self.prompt_regex.search(prompt_text):
            return RouteDecision(LONG_CONTEXT_ROUTE, "regex", bits)
        return RouteDecision(DEFAULT_ROUTE, "short", bits)


def check_regex(pattern: str | None) -> None:
    """ValueError naming --route-regex when the pattern does not compile."""
    if pattern:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"--route-regex {pattern!r} is not a valid regular expression: {e}") from None
