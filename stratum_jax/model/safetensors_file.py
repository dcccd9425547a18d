"""Zero-copy reads of a safetensors file: each tensor as a read-only numpy view of the memory-mapped file.

The safetensors library's own readers return a copy (`get_tensor` builds a bytes object, then an array);
loading a checkpoint through them costs an extra host copy of every tensor. Here the view points at the
file's pages, so device_put reads them straight into device memory: one copy, file -> device.

Format: an 8-byte little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}, then the data; offsets are relative to its start.
"""
from __future__ import annotations

import json
import math
import mmap
from pathlib import Path

import jax.numpy as jnp
import numpy as np

# Safetensors dtype codes this reader can view (little-endian, as the format stores them).
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
          "BF16": np.dtype(jnp.bfloat16)}  # ml_dtypes' bfloat16
_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class SafetensorsFile:
    """One open safetensors file. `names`, `dtype(name)` (the format's code, e.g. "BF16"), `shape(name)`,
    and `array(name)`: a read-only numpy view [shape] of the tensor's bytes. Raises ValueError (saying
    what is wrong) for a file that is not valid safetensors; the views keep the mapping alive."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ValueError(f"{size} bytes, too short for a header")
            f.seek(0)
            n = int.from_bytes(f.read(8), "little")
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"header length {n} does not fit the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"header is not JSON ({e})") from e
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
            header.pop("__metadata__", None)
            self._start, data_len = 8 + n, size - 8 - n
            self._entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
            for name, e in header.items():
                self._entries[name] = _entry(name, e, data_len)
            _check_tiling(self._entries, data_len)
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only view of the file's pages (no copy). Only for dtypes in DTYPES."""
        code, shape, begin, _ = self._entries[name]
        if code not in DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {code}; readable: {', '.join(DTYPES)}")
        count = math.prod(shape)
        return np.frombuffer(self._map, DTYPES[code], count, self._start + begin).reshape(shape)


def _entry(name: str, e, data_len: int) -> tuple[str, tuple[int, ...], int, int]:
    """Validates one header entry -> (dtype code, shape, begin, end)."""
    try:
        code, shape, (begin, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
    except (TypeError, KeyError, ValueError) as err:
        raise ValueError(f"tensor {name!r}: malformed header entry {e!r}") from err
    if not (isinstance(code, str) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_len):
        raise ValueError(f"tensor {name!r}: header entry {e!r} is out of range (data is {data_len} bytes)")
    if code in DTYPES and end - begin != math.prod(shape) * DTYPES[code].itemsize:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {list(shape)} of {code}")
    return code, shape, begin, end


def _check_tiling(entries: dict[str, tuple[str, tuple[int, ...], int, int]], data_len: int) -> None:
    """The tensors must cover the data exactly, in offset order, as the format requires (and the safetensors
    library checks): two tensors sharing bytes, or bytes no tensor owns, mean a corrupt header."""
    pos = 0
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if begin != pos:
            what = "overlaps the tensor before it" if begin < pos else f"leaves bytes {pos}..{begin} unowned"
            raise ValueError(f"tensor {name!r} at data offset {begin} {what}; the header is corrupt")
        pos = end
    if pos != data_len:
        raise ValueError(f"the tensors end at data offset {pos} but the data is {data_len} bytes; the header is "
                         "corrupt or the file has trailing bytes")
