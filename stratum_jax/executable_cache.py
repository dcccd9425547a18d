"""Compiled step executables on disk, found without tracing: what lets a warm restart skip lowering.

jax's persistent compilation cache (`compile_watch.enable_persistent_cache`) saves XLA's compile, but it
is keyed by the lowered module, so every start still traces and lowers every step shape, the Pallas
kernels included (their Mosaic GPU lowering runs in Python, one shape at a time: on the H200 host a
start spent 120 of its 134 s there with a warm XLA cache; BENCHMARKS.md). This cache stores each
compiled executable (`jax.experimental.serialize_executable`) in `<compilation cache dir>/executables/`
under a key computed from everything that determines it, without lowering:

  - the runner's own key (step shape, step geometry, model config, KV slots, KV layout);
  - the tree structure, shapes, dtypes and shardings of the arguments (params, KV cache);
  - jax and jaxlib versions, the backend, device kind and platform version;
  - the content of every source file of stratum_jax/ and pallas_kernels/ (a code change is a miss);
  - environment variables that change what is traced or compiled (XLA_*, JAX_*, STRATUM_*) and the jax
    config flags that change lowering.

Entries are written atomically (temporary file, then rename). An entry that cannot be read or loaded is
logged, deleted and compiled again: a bad cache never stops a start. Multi-device (tensor-parallel)
engines do not use it. The files are pickles: keep the directory as private as the XLA cache beside it.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import pickle
import tempfile

import jax
from jax.experimental import serialize_executable

log = logging.getLogger(__name__)

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_SOURCE_DIRS = ("stratum_jax", "pallas_kernels")
_ENV_PREFIXES = ("XLA_", "JAX_", "STRATUM_")
_JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_threefry_partitionable")
FORMAT = 1          # bump when the entry layout changes


@functools.cache
def source_fingerprint() -> str:
    """sha256 of every .py file under stratum_jax/ and pallas_kernels/ (path and content)."""
    h = hashlib.sha256()
    for d in _SOURCE_DIRS:
        for path in sorted((_ROOT / d).rglob("*.py")):
            h.update(str(path.relative_to(_ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _environment() -> tuple:
    device = jax.devices()[0]
    try:
        platform_version = device.client.platform_version
    except AttributeError:         # a client without one (the CPU client has it; this is defensive)
        platform_version = ""
    import jaxlib
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    flags = tuple((name, str(getattr(jax.config, name, None))) for name in _JAX_FLAGS)
    return (FORMAT, jax.__version__, jaxlib.__version__, jax.default_backend(), device.device_kind,
            platform_version, env, flags, source_fingerprint())


def _describe_args(args) -> str:
    """Tree structure, shapes, dtypes and shardings of a call's arguments."""
    leaves, tree = jax.tree_util.tree_flatten(args)

    def leaf(x):
        sharding = getattr(x, "sharding", None)      # numpy arrays and scalars have none
        return (tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)), str(sharding))
    return repr((str(tree), [leaf(x) for x in leaves]))


class ExecutableCache:
    """Compiled executables under `directory` (created on first store)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(os.path.expanduser(directory))
        self.hits = 0
        self.misses = 0

    def key(self, runner_key: tuple, example_args) -> str:
        """The entry name of an executable: runner_key (a tuple of frozen dataclasses and values with stable
        reprs) plus the arguments it is called with (arrays or ShapeDtypeStructs)."""
        text = repr((runner_key, _describe_args(example_args), _environment()))
        return hashlib.sha256(text.encode()).hexdigest()

    def _path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.exe"

    def load(self, key: str):
        """The compiled executable stored under `key`, or None (absent, unreadable, or not loadable here)."""
        path = self._path(key)
        if not path.exists():
            self.misses += 1
            return None
        try:
            serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
            exe = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree)
        except Exception as e:      # noqa: BLE001 - a bad entry of any kind: compile instead, and drop it
            log.warning("executable cache: dropping unreadable entry %s (%s: %s); compiling instead",
                        path.name, type(e).__name__, e)
            path.unlink(missing_ok=True)
            self.misses += 1
            return None
        self.hits += 1
        return exe

    def store(self, key: str, compiled) -> None:
        """Writes a compiled executable under `key` (atomically). A failure is logged, not raised: the
        executable is in memory either way."""
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as e:      # noqa: BLE001 - e.g. a backend that cannot serialize, a full disk
            log.warning("executable cache: could not store %s (%s: %s)", key[:12], type(e).__name__, e)
