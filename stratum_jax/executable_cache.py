"""Step programs exported to disk with `jax.export`, so that a restart skips tracing and lowering.

jax's persistent compilation cache (`--compilation-cache-dir`) saves XLA's compile, but a restart still
traces and lowers every step shape before it can look the executable up, and for the engine's steps that
is most of a warm start: each packed step's Python (16 layers with two Pallas kernels each at llama-1b)
takes 3-4 s to trace and lower on an H200 host (BENCHMARKS.md). This cache keeps each step shape's
lowered program (StableHLO, serialized by `jax.export`) under `<cache dir>/stratum_exports/`. A restart
deserializes it and lowers only a call to it (milliseconds); its XLA compile is then a hit in the
persistent cache, because cold and warm starts compile the same exported program.

A file is found by a digest of everything that changes the program: the step's name and static key
(shape, geometry, model config, slot count, KV layout), the device count, the jax, jaxlib and flax
versions and the jax options tracing reads, the backend and device kind, and the source of the packages
that are traced (`stratum_jax`, `pallas_kernels`): any code change exports afresh. A file that cannot be
read is logged, exported again and replaced; writes are atomic (a temporary file renamed), so a crash
leaves no partial file behind.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import logging
import os
import pathlib
import tempfile
from typing import Any, Callable

import flax
import jax
import jax.export
import jaxlib

from stratum_jax.attention import RowTables
from stratum_jax.decode import DecodeResult, PackedBatch, StepResult, TokenFeed
from stratum_jax.kv.delta_cache import DeltaKV
from stratum_jax.sampling import SamplingArrays

log = logging.getLogger(__name__)

SUBDIRECTORY = "stratum_exports"
SUFFIX = ".jax_exported"
# Every code change exports afresh, so old files pile up: past this many the oldest (by last write) go.
MAX_FILES = 256
_TRACED_PACKAGES = ("stratum_jax", "pallas_kernels")


def _register_pytrees() -> None:
    """Exported programs record their input and output trees; these dataclass nodes (no static fields)
    must be nameable in the file."""
    for cls in (PackedBatch, RowTables, TokenFeed, StepResult, DecodeResult, SamplingArrays, DeltaKV):
        jax.export.register_pytree_node_serialization(
            cls, serialized_name=f"stratum_jax.{cls.__name__}",
            serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


_register_pytrees()


@functools.cache
def source_digest() -> str:
    """sha256 over the Python source of the traced packages (relative paths and contents)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for package in _TRACED_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _load_kernel_runtime() -> None:
    """A program read back calls Mosaic GPU kernels that nothing in this process has traced, and the
    kernels' modules are imported lazily (stratum_jax/attention.py). Importing Mosaic GPU is what points
    XLA at its runtime library (MOSAIC_GPU_RUNTIME_LIB_PATH); without it the kernels' compile fails
    with "Symbols not found: mosaic_gpu_launch_kernel" (seen on an H200)."""
    if jax.default_backend() == "gpu":
        importlib.import_module("jax.experimental.mosaic.gpu")


class ExportedSteps:
    """Lowers step programs through an on-disk export cache (or directly, with no directory)."""

    def __init__(self, cache_dir: str | None):
        self.directory = (pathlib.Path(os.path.expanduser(cache_dir)) / SUBDIRECTORY) if cache_dir else None
        self.hits = 0        # programs read back from disk
        self.exports = 0     # programs exported (and written) this process

    def path_for(self, name: str, key: Any) -> pathlib.Path:
        device = jax.devices()[0]
        # What else changes the traced program: flax (the model's modules) and the jax options that tracing reads.
        options = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision)
        text = repr((name, key, jax.__version__, jaxlib.__version__, flax.__version__, options,
                     jax.default_backend(), device.device_kind, jax.device_count(), source_digest()))
        return self.directory / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:32]}{SUFFIX}"

    def lower(self, name: str, key: Any, jitted: Callable, args: tuple, static: dict,
              donate_argnums: tuple[int, ...] = ()) -> jax.stages.Lowered:
        """`jitted.lower(*args, **static)`, but through the export cache: returns the lowering of a jit
        of the exported program (same inputs, outputs and donation), read from disk when present.
        name: a file-name-safe label; key: the static key of the program (its repr must be stable)."""
        if self.directory is None:
            return jitted.lower(*args, **static)
        path = self.path_for(name, key)
        exported = self._read(path)
        if exported is None:
            exported = jax.export.export(jitted)(*args, **static)
            self._write(path, exported.serialize())
            self.exports += 1
        else:
            self.hits += 1
            _load_kernel_runtime()
        return jax.jit(exported.call, donate_argnums=donate_argnums).lower(*args)

    def _read(self, path: pathlib.Path) -> jax.export.Exported | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot read the exported step %s (%s): exporting it again", path, e)
            return None
        try:
            return jax.export.deserialize(bytearray(data))
        except Exception as e:      # a truncated or foreign file: any parse error means "not usable"
            log.warning("the exported step %s is not readable (%s: %s): exporting it again and replacing it",
                        path, type(e).__name__, e)
            return None

    def _write(self, path: pathlib.Path, data: bytes | bytearray) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            self._prune(path.parent)
        except OSError as e:        # a read-only or full disk costs the next start its speed, not this one
            log.warning("cannot write the exported step %s (%s): the next start will trace it again", path, e)

    @staticmethod
    def _prune(directory: pathlib.Path) -> None:
        files = sorted(directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime_ns)
        for old in files[:max(0, len(files) - MAX_FILES)]:
            old.unlink(missing_ok=True)
