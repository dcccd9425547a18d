"""The Mosaic GPU interpreter without its per-callback device_put: the same kernels, run ~3x faster in tests.

jax's Pallas Mosaic GPU interpreter runs a kernel as Python callbacks (`io_callback`), one per memory access,
barrier and thread step: thousands to tens of thousands for one small attention call. jax 0.11.2's
`io_callback_impl` first `jax.device_put`s every callback argument (mostly scalar indices) to the CPU device, ~1 ms
a callback, which was two thirds of an interpreted kernel's time on the 2-core CI machine (cProfile of the engine's
interpreted step: 91 s of 139 s in device_put). The interpreter only reads those arguments: it copies values into
its own buffers (`np.array(value)`) and turns ids into ints (`shared_memory._to_int`, which accepts jax arrays and
Python ints).

`install()` hands the interpreter's callbacks (and only those: any other io_callback keeps jax's path) numpy
copies of their arguments, and lets `_to_int` take numpy scalars as it takes jax ones (`.item()`). Nothing the
kernel computes changes: `tests/test_fast_interpreter.py` runs kernels both ways and compares the bits. It is
installed for the test suite by conftest.py; `STRATUM_PLAIN_INTERPRETER=1` runs the suite on the interpreter as jax
ships it. On a jax whose internals differ from what it patches, `install()` does nothing and says why (the suite is
then only slower).
"""
from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np

INTERPRETER_MODULE_PREFIX = "jax._src.pallas.mosaic_gpu.interpret."
_IO_CALLBACK_PARAMS = ["args", "result_avals", "callback", "sharding", "ordered"]


def _callback_module(callback) -> str:
    """The module of the Python function behind a `_FlatCallback` (through functools.partial wrappers)."""
    func = getattr(callback, "callback_func", None)
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__module__", "") or ""


def is_interpreter_callback(callback) -> bool:
    return _callback_module(callback).startswith(INTERPRETER_MODULE_PREFIX)


def unsupported_reason() -> str | None:
    """Why `install()` cannot patch this jax (None when it can)."""
    try:
        from jax._src import callback as jax_callback
        from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    except ImportError as e:
        return f"jax has no Mosaic GPU interpreter where expected ({e})"
    impl = getattr(jax_callback, "io_callback_impl", None)
    if impl is None or list(inspect.signature(impl).parameters) != _IO_CALLBACK_PARAMS:
        return "jax._src.callback.io_callback_impl is not the function this patch replaces"
    if not callable(getattr(shared_memory, "_to_int", None)):
        return "the interpreter has no shared_memory._to_int"
    return None


@functools.cache
def install() -> str | None:
    """Patch this process's jax (once). Returns None when installed, else why not."""
    reason = unsupported_reason()
    if reason is not None:
        return reason
    from jax._src import callback as jax_callback
    from jax._src import config, tree_util, xla_bridge
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory

    jax_io_callback_impl, jax_to_int = jax_callback.io_callback_impl, shared_memory._to_int

    def io_callback_impl(*args, result_avals, callback, sharding, ordered):
        if not is_interpreter_callback(callback):
            return jax_io_callback_impl(*args, result_avals=result_avals, callback=callback, sharding=sharding,
                                        ordered=ordered)
        cpu_device = xla_bridge.local_devices(backend="cpu")[0]
        with config.default_device(cpu_device):
            # copies: XLA may lend the callback views of its own buffers
            return tree_util.tree_map(np.asarray, callback(*(np.array(a) for a in args)))

    def to_int(x):     # what jax's _to_int does for a jax array, for its numpy copy
        if isinstance(x, (np.ndarray, np.generic)):
            return x.item()
        return jax_to_int(x)

    _JAX_ORIGINALS.update(io_callback_impl=jax_io_callback_impl, to_int=jax_to_int)
    jax_callback.io_callback_impl = io_callback_impl
    shared_memory._to_int = to_int
    return None


_JAX_ORIGINALS: dict = {}


@contextlib.contextmanager
def plain_interpreter():
    """Inside: jax's own io_callback path again (for the test that compares both)."""
    from jax._src import callback as jax_callback
    from jax._src.pallas.mosaic_gpu.interpret import shared_memory
    fast = jax_callback.io_callback_impl, shared_memory._to_int
    if _JAX_ORIGINALS:
        jax_callback.io_callback_impl, shared_memory._to_int = _JAX_ORIGINALS["io_callback_impl"], \
            _JAX_ORIGINALS["to_int"]
    try:
        yield
    finally:
        jax_callback.io_callback_impl, shared_memory._to_int = fast
