"""The Mooncake trace as benchmarks/serving.py replays it: trace lines, arrival times at a rate, and prompts built
from each request's hash ids (the same text for the same id, so shared leading ids share a prompt prefix). Pure:
no server, no clock."""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import random

import numpy as np


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    index: int                  # line number in the trace (0-based)
    timestamp_ms: int | float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_line(path, i: int, raw: bytes) -> TraceRequest:
    """Line i (0-based) of a Mooncake-format trace; ValueError names the file, the line and what is wrong. Types
    are not coerced: a string, float or bool where the format has an integer is an error, not a guess."""
    where = f"{path}:{i + 1}"
    try:
        d = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte {e.start + 1} of the line)") from None
    except ValueError as e:
        raise ValueError(f"{where}: not a Mooncake trace line ({e}): {raw[:120]!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a JSON object with timestamp, input_length, output_length, hash_ids")
    t = d.get("timestamp")
    if not (_is_int(t) or isinstance(t, float)) or not 0 <= t <= 2**53:
        raise ValueError(f"{where}: 'timestamp' must be a number of ms in [0, 2^53], got {t!r:.40}")
    for key in ("input_length", "output_length"):
        if not _is_int(d.get(key)) or d[key] < 1:
            raise ValueError(f"{where}: '{key}' must be an integer >= 1, got {d.get(key)!r}")
    ids = d.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(h) for h in ids):
        raise ValueError(f"{where}: 'hash_ids' must be a non-empty list of integers, got {ids!r:.80}")
    return TraceRequest(i, d["timestamp"], d["input_length"], d["output_length"], tuple(ids))


def load_trace(path: pathlib.Path, start: int, count: int) -> list[TraceRequest]:
    """Lines [start, start + count) of a Mooncake-format trace (blank lines are skipped and not counted); raises
    ValueError naming a bad line."""
    if start < 0 or count <= 0:
        raise ValueError(f"--window-start must be >= 0 and --num-requests > 0, got {start} and {count}")
    out = []
    seen = 0
    with open(path, "rb") as f:
        for i, raw in enumerate(f):
            if not raw.strip():
                continue
            seen += 1
            if seen <= start:
                continue
            if len(out) == count:
                break
            out.append(parse_line(path, i, raw))
    if len(out) < count:
        raise ValueError(f"{path} has {start + len(out)} requests: the window [{start}, {start + count}) runs "
                         f"past its end; lower --window-start or --num-requests")
    return out


def arrival_offsets(timestamps_ms, rate: float, *, slot_ms: float = 0.0, keys=None, salt: str = "") -> list[float]:
    """Seconds after the window's first timestamp, time compressed by `rate` (2 = twice as fast).

    slot_ms > 0 spreads each request over the recorded slot its timestamp names: it arrives at a uniform
    offset in [timestamp, timestamp + slot_ms), drawn from (salt, its key). Given how many requests a slot
    holds, that is how a Poisson process places them, so clumps stay possible; the same (salt, key) always
    gives the same offset, so configs replaying one rate see the same arrivals."""
    if rate <= 0:
        raise ValueError(f"a rate must be > 0, got {rate}")
    if slot_ms < 0:
        raise ValueError(f"a slot must be >= 0 ms, got {slot_ms}")
    keys = range(len(timestamps_ms)) if keys is None else keys
    t0 = min(timestamps_ms)
    return [(t - t0 + (random.Random(f"{salt}/arrival/{k}").random() * slot_ms if slot_ms else 0.0)) / 1000.0 / rate
            for t, k in zip(timestamps_ms, keys, strict=True)]


def trace_slot_ms(timestamps_ms) -> float | None:
    """The trace's timestamp resolution: the median gap between consecutive distinct timestamps (None with
    fewer than two). The Mooncake conversation trace stamps its requests in 3 s slots: 1,180 distinct
    timestamps for 12,031 requests, every two consecutive ones 2,997-3,003 ms apart."""
    distinct = sorted(set(timestamps_ms))
    if len(distinct) < 2:
        return None
    return float(np.median(np.diff(distinct)))


@functools.lru_cache(maxsize=1 << 16)     # popular ids (id 0 starts most prompts) are built once
def block_text(salt: str, hash_id, n_bytes: int) -> str:
    """The text of one block: n_bytes of ASCII pseudo-words, a function of (salt, hash_id) only."""
    rng = random.Random(f"{salt}/{hash_id}")      # str seeds are hashed with sha512: stable across runs
    parts, size = [], 0
    while size < n_bytes:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) + " "
        parts.append(word)
        size += len(word)
    return "".join(parts)[:n_bytes]


def build_prompt(hash_ids, n_bytes: int, block_bytes: int, salt: str, request_key) -> str:
    """The hash ids' blocks in order, cut to n_bytes; if they are too short, blocks unique to this request
    (keyed by request_key) fill the rest."""
    if n_bytes < 0 or block_bytes <= 0:
        raise ValueError(f"need n_bytes >= 0 and block_bytes > 0, got {n_bytes} and {block_bytes}")
    blocks = [block_text(salt, h, block_bytes) for h in hash_ids[: -(-n_bytes // block_bytes)]]
    j = 0
    while len(blocks) * block_bytes < n_bytes:
        blocks.append(block_text(salt, f"fill-{request_key}-{j}", block_bytes))
        j += 1
    return "".join(blocks)[:n_bytes]


@dataclasses.dataclass(frozen=True)
class Shape:
    """How the trace's lengths become one server's requests."""
    length_scale: float
    block_tokens: int           # tokens per hash-id block after scaling
    bytes_per_token: float      # text bytes per prompt token (measured via CountTokens)
    template_tokens: int        # tokens the chat template adds around an empty user message
    max_context: int            # prompt + max_tokens limit (already less the margin)
    max_tokens_cap: int


def scaled_lengths(r: TraceRequest, shape: Shape) -> tuple[int, int, bool]:
    """(prompt tokens, max_tokens, clipped) for one trace request under `shape`."""
    floor_in = shape.template_tokens + 1
    out = max(1, round(r.output_length * shape.length_scale))
    want_in = max(floor_in, round(r.input_length * shape.length_scale))
    out_c = min(out, shape.max_tokens_cap, shape.max_context - floor_in)
    in_c = min(want_in, shape.max_context - out_c)
    return in_c, out_c, (in_c, out_c) != (want_in, out)


def prompt_for(r: TraceRequest, shape: Shape, salt: str) -> tuple[str, int, int, bool]:
    """(user message text, target prompt tokens, max_tokens, clipped)."""
    n_in, n_out, clipped = scaled_lengths(r, shape)
    block_bytes = max(1, round(shape.block_tokens * shape.bytes_per_token))
    n_bytes = max(1, round((n_in - shape.template_tokens) * shape.bytes_per_token))
    return build_prompt(r.hash_ids, n_bytes, block_bytes, salt, r.index), n_in, n_out, clipped
