"""Trace formats: the Mooncake request trace and the engine's own block event log (`--trace-out`).

Both reduce to one `AccessStream`: every time a request uses a KV block, in time order. That is all the
label maker and the cache simulator need. Every malformed line raises `TraceFormatError` naming the
file and the line.

Stratum event log: the engine's `--trace-out`, schema in `stratum_jax/kv/event_log.py` (its writer).
History features (recency, counts, age, sharers, fan-out, prefix hit share) are recomputed from the
event sequence on reading, so replays and live traffic agree; logged values of those are accepted and
ignored.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Iterator

import numpy as np

from stratum_jax.block_info import FEATURE_NAMES, SEED_FEATURES
from stratum_jax.kv.event_log import ACCESS_EVENTS, EVENTS

MOONCAKE_BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A malformed trace line. str() reads `path:line: what is wrong`."""

    def __init__(self, path: str, line: int, msg: str):
        super().__init__(f"{path}:{line}: {msg}")
        self.path, self.line = path, line


@dataclasses.dataclass
class AccessStream:
    """Block accesses in time order, E events over B distinct blocks and R requests.

    Times are simulated ms: trace time divided by the replay's time scale.
    Columns, shape [E]: `t_ms` (float64), `block` (int64, 0..B-1), `request` (int64, 0..R-1), `depth`
    (float64) and the per-event features `blocks_after`, `fill`, `input_tokens`, `max_tokens` (float64,
    NaN = missing). `seed`: float64 [E, len(SEED_FEATURES)], NaN = missing.
    `t_end_ms`: end of the observed window (labels past it are unknown).
    `file_starts`: index of the first event of each file the stream was read from.
    """

    source: str
    t_ms: np.ndarray
    block: np.ndarray
    request: np.ndarray
    depth: np.ndarray
    blocks_after: np.ndarray
    fill: np.ndarray
    input_tokens: np.ndarray
    max_tokens: np.ndarray
    seed: np.ndarray
    block_ids: list
    t_end_ms: float
    file_starts: list[int] = dataclasses.field(default_factory=lambda: [0])

    @property
    def num_events(self) -> int:
        return len(self.t_ms)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def rescaled(self, time_scale: float) -> "AccessStream":
        """The same stream with its times divided by `time_scale` (equal to reading it at that scale
        when this one was read at scale 1)."""
        if not time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        return dataclasses.replace(self, t_ms=self.t_ms / time_scale, t_end_ms=self.t_end_ms / time_scale,
                                   file_starts=list(self.file_starts))


class _Columns:
    """Accumulates per-event columns while a reader walks a file."""

    def __init__(self):
        self.rows: dict[str, list] = {k: [] for k in (
            "t_ms", "block", "request", "depth", "blocks_after", "fill", "input_tokens", "max_tokens")}
        self.seed: list[list[float]] = []
        self.block_index: dict = {}
        self.request_index: dict = {}

    def add(self, t_ms, block_key, request_key, depth, blocks_after, fill, input_tokens, max_tokens, seed):
        """One access; keys are any hashables, mapped to dense indices in order of appearance."""
        r = self.rows
        r["t_ms"].append(t_ms)
        r["block"].append(self.block_index.setdefault(block_key, len(self.block_index)))
        r["request"].append(self.request_index.setdefault(request_key, len(self.request_index)))
        r["depth"].append(depth)
        r["blocks_after"].append(blocks_after)
        r["fill"].append(fill)
        r["input_tokens"].append(input_tokens)
        r["max_tokens"].append(max_tokens)
        self.seed.append(seed)

    def build(self, source: str, t_end_ms: float) -> AccessStream:
        r = self.rows
        f64 = lambda k: np.asarray(r[k], dtype=np.float64)
        return AccessStream(
            source=source, t_ms=f64("t_ms"), block=np.asarray(r["block"], np.int64),
            request=np.asarray(r["request"], np.int64), depth=f64("depth"),
            blocks_after=f64("blocks_after"), fill=f64("fill"), input_tokens=f64("input_tokens"),
            max_tokens=f64("max_tokens"),
            seed=np.asarray(self.seed, np.float64).reshape(-1, len(SEED_FEATURES)),
            block_ids=list(self.block_index), t_end_ms=t_end_ms)


def _lines(path: str) -> Iterator[tuple[int, dict]]:
    """Yields (line number, parsed JSON object); blank lines are skipped."""
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise TraceFormatError(path, 0, f"cannot open: {e.strerror}") from None
    with fh:
        for no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceFormatError(path, no, f"not UTF-8 text (byte {e.start + 1} of the line); a trace is "
                                                 f"JSON lines") from None
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise TraceFormatError(path, no, f"not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(path, no, "expected a JSON object")
            yield no, obj


def _finite(v) -> bool:
    """Whether the number v is finite and within float range (JSON's integers have no bound)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _number(path, no, obj, key, *, integer=False, minimum=0.0, required=True):
    v = obj.get(key)
    if v is None and not required:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not _finite(v) or v < minimum:
        kind = "an integer" if integer else "a finite number"
        raise TraceFormatError(path, no, f"'{key}' must be {kind} >= {minimum:g}, got {v!r:.40}")
    return v


def _check_time(path, no, t, last):
    if t < last:
        raise TraceFormatError(path, no, f"timestamp {t} goes back in time (previous {last})")
    return t


def _features(path, no, feats) -> dict:
    if not isinstance(feats, dict):
        raise TraceFormatError(path, no, "'features' must be an object")
    for k, v in feats.items():
        if k not in FEATURE_NAMES:
            raise TraceFormatError(path, no, f"unknown feature {k!r}")
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v)):
            raise TraceFormatError(path, no, f"feature {k!r} must be a finite number or null, got {v!r}")
    return feats


def mooncake_records(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) for each request of a Mooncake trace, every line checked (`read_mooncake`):
    TraceFormatError names the file and line of the first bad one."""
    last = 0.0
    for no, obj in _lines(path):
        last = _check_time(path, no, _number(path, no, obj, "timestamp"), last)
        n_in = _number(path, no, obj, "input_length", integer=True, minimum=1)
        _number(path, no, obj, "output_length", integer=True)
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not ids or not all(
                isinstance(h, int) and not isinstance(h, bool) for h in ids):
            raise TraceFormatError(path, no, "'hash_ids' must be a non-empty list of integers")
        want = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != want:
            raise TraceFormatError(path, no, f"{len(ids)} hash_ids for input_length {n_in}; a "
                                   f"{MOONCAKE_BLOCK_TOKENS}-token block each means {want}")
        if len(set(ids)) != len(ids):
            again = next(h for i, h in enumerate(ids) if h in ids[:i])
            raise TraceFormatError(path, no, f"hash id {again} appears twice in 'hash_ids': each block of a "
                                   f"prompt hashes its whole prefix, so one prompt cannot repeat an id")
        yield no, obj


def _mooncake_rows(path: str, time_scale: float) -> Iterator[tuple]:
    """Rows for `_Columns.add`, one per prompt block, from a Mooncake trace (see `read_mooncake`)."""
    nan_seed = [math.nan] * len(SEED_FEATURES)
    for no, obj in mooncake_records(path):
        last, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        tail_fill = (n_in - MOONCAKE_BLOCK_TOKENS * (len(ids) - 1)) / MOONCAKE_BLOCK_TOKENS
        for d, h in enumerate(ids):
            yield (path, no, last / time_scale, h, (path, no), d, len(ids) - 1 - d,
                   tail_fill if d == len(ids) - 1 else 1.0, n_in, n_out, nan_seed)


def _stratum_rows(path: str, time_scale: float) -> Iterator[tuple]:
    """Rows for `_Columns.add`, one per created/accessed event, from an engine event log."""
    last = 0.0
    for no, obj in _lines(path):
        ev = obj.get("event")
        if ev not in EVENTS:
            raise TraceFormatError(path, no, f"'event' must be one of {list(EVENTS)}, got {ev!r}")
        last = _check_time(path, no, _number(path, no, obj, "timestamp_ms"), last)
        block = obj.get("block_id")
        if isinstance(block, bool) or not isinstance(block, (str, int)):
            raise TraceFormatError(path, no, f"'block_id' must be a string or integer, got {block!r}")
        feats = _features(path, no, obj.get("features", {}))
        if ev not in ACCESS_EVENTS:
            yield (path, no, last / time_scale, None)   # bounds the observed window only
            continue
        req = obj.get("request_id")
        if isinstance(req, bool) or not isinstance(req, (str, int)):
            raise TraceFormatError(path, no, f"'{ev}' needs 'request_id' (string or integer), got {req!r}")
        depth = feats.get("depth")
        if depth is None or depth != int(depth) or depth < 0:
            raise TraceFormatError(path, no, f"'{ev}' needs features.depth, an integer >= 0")
        g = lambda k: math.nan if feats.get(k) is None else float(feats[k])
        yield (path, no, last / time_scale, block, req, depth, g("blocks_after"), g("fill"),
               g("input_tokens"), g("max_tokens"), [g(k) for k in SEED_FEATURES])


_ROWS = {"mooncake": _mooncake_rows, "stratum": _stratum_rows}


def read_timeline(paths: list[str], fmt: str, time_scale: float = 1.0) -> AccessStream:
    """One `AccessStream` from consecutive pieces of one timeline (block ids shared, time continuing
    across files), e.g. a warm-up file followed by the file to evaluate.

    fmt: 'mooncake' (see `read_mooncake`) or 'stratum' (the event log of this module's docstring).
    time_scale: simulated ms = trace ms / time_scale (1000 replays the trace 1000x faster).
    """
    rows = _ROWS.get(fmt)
    if rows is None:
        raise ValueError(f"unknown trace format {fmt!r}; use 'stratum' or 'mooncake'")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    cols, last, starts = _Columns(), -math.inf, []
    for path in paths:
        starts.append(len(cols.rows["t_ms"]))
        for row in rows(path, time_scale):
            path_, no, t_ms = row[:3]
            if t_ms < last:
                raise TraceFormatError(path_, no, f"timestamp goes back in time across files "
                                       f"({t_ms * time_scale} after {last * time_scale})")
            last = t_ms
            if row[3] is not None:
                cols.add(*row[2:])
    if not cols.rows["t_ms"]:
        raise TraceFormatError(paths[-1], 0, "no block accesses in the file")
    stream = cols.build(",".join(paths), last)
    stream.file_starts = starts
    return stream


def read_mooncake(path: str, time_scale: float = 1.0) -> AccessStream:
    """Reads a Mooncake trace: one request per line with `timestamp` (ms), `input_length`,
    `output_length` and `hash_ids` (one per 512-token prompt block; equal ids = reusable prefix block).

    Each request uses its blocks in prompt order at its arrival time. The last block is partial unless
    the prompt fills it (`fill` < 1). Mooncake carries none of the seed features: they stay NaN.
    """
    return read_timeline([path], "mooncake", time_scale)


def read_stratum_log(path: str, time_scale: float = 1.0) -> AccessStream:
    """Reads the engine's block event log (schema in this module's docstring). `created` and
    `accessed` events become accesses; tier events are validated and bound the observed window."""
    return read_timeline([path], "stratum", time_scale)


def read_traces(paths: list[str], fmt: str, time_scale: float = 1.0) -> list[AccessStream]:
    """Each file as its own timeline."""
    return [read_timeline([p], fmt, time_scale) for p in paths]
