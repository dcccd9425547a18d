"""XLA compilations in this process, counted through `jax.monitoring`, and jax's persistent cache.

jax records one backend-compile event per executable it builds (a fresh XLA compile or one loaded from
the persistent compilation cache), with the function's name. `CompileWatch` counts them; once the
engine has compiled every step shape and the server reports SERVING (`mark_serving`), each further
compile is logged as a WARNING naming the function: it ran on the request path, which is a bug.
"""
from __future__ import annotations

import collections
import logging
import os
import threading

import jax

log = logging.getLogger(__name__)

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """Counts backend compiles while installed (`install` / `close`). Thread-safe counters."""

    def __init__(self) -> None:
        self.total = 0                 # compiles seen since install
        self.after_serving = 0         # of those, after mark_serving
        self.seconds = 0.0
        self.by_function: collections.Counter[str] = collections.Counter()   # compiles per function name
        self._serving = False
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> "CompileWatch":
        if not self._installed:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._installed = True
        return self

    def close(self) -> None:
        if self._installed:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
            self._installed = False

    def mark_serving(self) -> None:
        """From now on a compile is unexpected: it is logged as a WARNING."""
        self._serving = True

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.total += 1
            self.seconds += duration
            self.by_function[kwargs.get("fun_name", "?")] += 1
            if self._serving:
                self.after_serving += 1
        if self._serving:
            log.warning("XLA compile after SERVING (on the request path): %s took %.2f s; every step shape "
                        "should be compiled at warm-up", kwargs.get("fun_name", "?"), duration)


def enable_persistent_cache(cache_dir: str | None) -> None:
    """Points jax's persistent compilation cache at `cache_dir` (None or "": off), caching every entry,
    so that a restart loads the step executables instead of compiling them."""
    if not cache_dir:
        return
    cache_dir = os.path.expanduser(cache_dir)
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("persistent compilation cache: %s", cache_dir)
