"""The KV block event log (`--trace-out`): the engine's record of every block's life, for training.

JSONL, one event per line:

    {"event": "accessed", "timestamp_ms": 1234.5, "block_id": "9f2c...", "request_id": "req-17",
     "features": {"depth": 3, "blocks_after": 10, "fill": 1.0, "input_tokens": 6000, "max_tokens": 256,
                  "gen_frac": 0.0, "attn_var5": null, "kv_hbm_frac": 0.71, "queue_wait_ms": 3.2,
                  "gpu_idle_frac": 0.12}}

- `event`: `created` (a request computed the block), `accessed` (a request reused it: a prefix hit,
  also after a recall), `evicted` (HBM -> host tier), `recalled` (host -> HBM), `freed` (dropped).
- `timestamp_ms`: engine clock in ms, non-decreasing through the file.
- `block_id`: string or integer content id; a block freed and later created again with the same content
  keeps its id, and that counts as a reuse.
- `request_id`: string or integer; required for `created` and `accessed`, optional otherwise.
- `features`: names from `stratum_jax.block_info.FEATURE_NAMES`, numbers or null (null = missing).
  `created`/`accessed` need `depth`. The reader (training/traces.py) recomputes the history features
  from the event sequence.
"""
from __future__ import annotations

import json
import math
import os
import threading
from typing import IO

import numpy as np

from stratum_jax.block_info import FEATURE_NAMES

EVENTS = ("created", "accessed", "evicted", "recalled", "freed")
ACCESS_EVENTS = ("created", "accessed")


class StratumEventLogWriter:
    """Writes the block event log, one JSON line per event; thread-safe, safe to call from the engine.

    Usage: `w = StratumEventLogWriter(path); w.write("accessed", t_ms, block_id, request_id, {...});
    w.close()` (or use it as a context manager). Lines are flushed per write so a crash loses at most
    the line being written; the reader then reports that last line by number.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._fh: IO[str] = open(path, "a", encoding="utf-8", buffering=1)

    def write(self, event: str, timestamp_ms: float, block_id, request_id=None,
              features: dict | None = None) -> None:
        if event not in EVENTS:
            raise ValueError(f"event must be one of {EVENTS}, got {event!r}")
        bad = [k for k in (features or {}) if k not in FEATURE_NAMES]
        if bad:
            raise ValueError(f"unknown features {bad}; known: {FEATURE_NAMES}")
        rec = {"event": event, "timestamp_ms": float(timestamp_ms), "block_id": block_id,
               "request_id": request_id, "features": _jsonable(features or {})}
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._lock:
            self._fh.write(line)

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                os.fsync(self._fh.fileno())
                self._fh.close()

    def __enter__(self) -> "StratumEventLogWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(features: dict) -> dict:
    """NaN/None -> null, numpy scalars -> Python numbers."""
    return {k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else
                (int(v) if isinstance(v, (int, np.integer)) else float(v))) for k, v in features.items()}
