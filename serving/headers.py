"""The request headers (gRPC metadata) stratum.v1 reads: x-stratum-weight, x-stratum-route,
x-stratum-session, x-api-key.

x-stratum-weight (a number in [0, 1]) is the share of traffic for the Stratum stack (serving/routing.py
splits on it); x-stratum-route (default or long-context) picks the pool; x-stratum-session (1 to 128
printable ASCII characters) is the key the split hashes instead of the request id, so every request of a
session lands on the same stack.
"""
from __future__ import annotations

import dataclasses
import math

from stratum_jax.request import InvalidRequestError

WEIGHT_HEADER = "x-stratum-weight"
ROUTE_HEADER = "x-stratum-route"
SESSION_HEADER = "x-stratum-session"
MAX_SESSION_CHARS = 128
API_KEY_HEADER = "x-api-key"
ROUTES = ("default", "long-context")


@dataclasses.dataclass(frozen=True)
class RequestHeaders:
    weight: float | None = None   # share of traffic for the Stratum stack; None = the server's default
    route: str = "default"
    session: str | None = None    # the split's key when given (else the request id)


def metadata_dict(metadata) -> dict[str, str]:
    """gRPC metadata as a dict. Binary (-bin) headers are skipped: none of ours are binary."""
    out: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            out[key.lower()] = value
    return out


def parse_headers(metadata) -> RequestHeaders:
    """Validates the routing headers; raises InvalidRequestError naming the header and what to send."""
    headers = metadata_dict(metadata)
    weight = None
    raw = headers.get(WEIGHT_HEADER)
    if raw is not None:
        try:
            weight = float(raw.strip())
        except ValueError:
            weight = math.nan
        if not (math.isfinite(weight) and 0.0 <= weight <= 1.0):
            raise InvalidRequestError(f"{WEIGHT_HEADER} must be a number in [0, 1], got {raw!r}")
    route = headers.get(ROUTE_HEADER, "default").strip()
    if route not in ROUTES:
        raise InvalidRequestError(f"{ROUTE_HEADER} must be one of {', '.join(ROUTES)}, got {route!r}")
    session = headers.get(SESSION_HEADER)
    if session is not None and not (0 < len(session) <= MAX_SESSION_CHARS
                                    and all(33 <= ord(c) < 127 for c in session)):
        raise InvalidRequestError(f"{SESSION_HEADER} must be 1 to {MAX_SESSION_CHARS} printable ASCII characters "
                                  f"without spaces, got {session[:40]!r}")
    return RequestHeaders(weight=weight, route=route, session=session)
