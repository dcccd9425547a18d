"""A small synthetic conversation workload in the Mooncake format, for tests and overhead benchmarks.

It imitates the shape of the real conversation trace: every prompt starts with one shared system block
(id 0); a conversation continues with a probability that grows with its turn count, after a
log-normal think time, and the next prompt repeats the previous one's full blocks before adding new
ones (the old partial tail block is never reused). Not a stand-in for the real trace in any result.
"""
from __future__ import annotations

import heapq
import json

import numpy as np

BLOCK = 512


def conversation_trace(n_requests: int, seed: int = 0, rate_per_s: float = 2.0,
                       think_median_s: float = 60.0) -> list[dict]:
    """Mooncake records ({timestamp, input_length, output_length, hash_ids}) in time order."""
    rng = np.random.default_rng(seed)
    next_id = 1
    events: list[tuple[float, int, list[int], int]] = []   # (time ms, tiebreak, full blocks, turn)
    t, out, tie = 0.0, [], 0
    while len(out) < n_requests:
        t += rng.exponential(1000.0 / rate_per_s)
        heapq.heappush(events, (t, tie, [0], 1))            # a new conversation
        tie += 1
        while events and events[0][0] <= t and len(out) < n_requests:
            ts, _, prefix, turn = heapq.heappop(events)
            new = int(rng.integers(1, 8))
            ids = prefix + list(range(next_id, next_id + new + 1))   # + new full blocks + a tail
            next_id += new + 1
            tail = int(rng.integers(1, BLOCK))
            out.append({"timestamp": int(ts), "input_length": BLOCK * (len(ids) - 1) + tail,
                        "output_length": int(rng.integers(1, 800)), "hash_ids": ids})
            if rng.random() < min(0.9, 0.3 + 0.15 * turn):
                think = rng.lognormal(np.log(think_median_s * 1000.0), 0.6)
                heapq.heappush(events, (ts + think, tie, ids[:-1], turn + 1))
                tie += 1
    out.sort(key=lambda r: r["timestamp"])
    return out


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
