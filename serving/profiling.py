"""Profiler sessions: capture the next N engine steps into a trace directory TensorBoard/XProf can open.

A capture starts `jax.profiler.start_trace` on the engine thread right away and stops it after N engine
steps, or at its timeout if the server is idle. The trace lands in
`<trace_dir>/plugins/profile/<run>/*.xplane.pb`; open it with `tensorboard --logdir <trace_dir>` (the
profile plugin) or `xprof --logdir <trace_dir>`. The engine thread marks its phases with
`jax.profiler` annotations (stratum.scheduler.admit, stratum.engine_step, and the engine's own
prefill/decode/sampling annotations), which show up as named ranges on the host timeline.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import time
from concurrent.futures import Future

import jax

DEFAULT_STEPS = 10
MAX_STEPS = 10_000
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 600.0
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    trace_dir: str
    steps_captured: int
    files: list[str]      # relative to trace_dir


def trace_dir_for(profile_root: str | pathlib.Path, name: str) -> pathlib.Path:
    """Where a capture goes: a fresh sub-directory of the server's --profile-dir.

    Clients only choose a plain name, never a path, so a remote caller can't write outside profile_root.
    """
    if name and not _NAME.match(name):
        raise ValueError(f"profile name {name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                         "(it names a sub-directory of the server's --profile-dir)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = pathlib.Path(profile_root) / (name or f"profile-{stamp}")
    path, n = base, 1
    while path.exists():           # never mix two captures in one directory
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def check_request(num_steps: int, timeout_s: float) -> tuple[int, float]:
    """Defaults and bounds of a Profile request; raises ValueError saying what to send."""
    num_steps = num_steps or DEFAULT_STEPS
    timeout_s = timeout_s or DEFAULT_TIMEOUT_S
    if not 1 <= num_steps <= MAX_STEPS:
        raise ValueError(f"num_steps must be in [1, {MAX_STEPS}], got {num_steps}")
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s}")
    return num_steps, timeout_s


class ProfileCapture:
    """One capture. begin/after_step/end run on the engine thread; `future` is awaited by the RPC."""

    def __init__(self, trace_dir: pathlib.Path, num_steps: int, timeout_s: float) -> None:
        self.trace_dir = pathlib.Path(trace_dir)
        self.num_steps = num_steps
        self.timeout_s = timeout_s
        self.future: Future[ProfileResult] = Future()
        self._steps = 0
        self._deadline = time.monotonic() + timeout_s

    def begin(self) -> None:
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self._deadline = time.monotonic() + self.timeout_s
        jax.profiler.start_trace(str(self.trace_dir))

    def after_step(self) -> bool:
        """Counts a step; True when the capture has all the steps it asked for."""
        self._steps += 1
        return self._steps >= self.num_steps

    def remaining_s(self) -> float:
        return self._deadline - time.monotonic()

    def expired(self) -> bool:
        return self.remaining_s() <= 0

    def end(self) -> None:
        try:
            jax.profiler.stop_trace()
        except Exception as e:
            self.fail(e)
            return
        files = sorted(str(p.relative_to(self.trace_dir)) for p in self.trace_dir.rglob("*") if p.is_file())
        self.future.set_result(ProfileResult(str(self.trace_dir), self._steps, files))

    def fail(self, error: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(error)
