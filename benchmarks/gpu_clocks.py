"""The GPU's clocks, power and throttle reasons, sampled with nvidia-smi while a benchmark runs.

Why: the same llama-8b fp8 decode step took 9.52 ms on one loan of the H200 and 9.98 ms on another while the bf16
step moved 1% (BENCHMARKS.md, session 21). A step bound by its kernels' instruction chains follows the SM clock; a
step bound by HBM does not. Recording the clocks under load beside every timed run lets the next comparison say
which it was instead of guessing.

    with ClockSampler() as clocks:
        ...                          # the timed work
    record["gpu_clocks"] = clocks.summary()     # None where nvidia-smi is absent (CPU runs)
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
from typing import Callable

# nvidia-smi --query-gpu fields, in the order parse_sample reads them. The last one's name changed across drivers
# (clocks_event_reasons.active on recent ones); a query that fails is retried without it.
BASE_FIELDS = ("clocks.sm", "clocks.max.sm", "clocks.mem", "power.draw", "power.limit", "temperature.gpu")
REASON_FIELD = "clocks_throttle_reasons.active"


def nvidia_smi_runner(gpu_index: int = 0) -> Callable[[], str | None] | None:
    """A callable returning one CSV line for GPU `gpu_index` (BASE_FIELDS, then the throttle reasons when the
    driver knows the field), or None when nvidia-smi is not installed."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    fields = [",".join(BASE_FIELDS + (REASON_FIELD,)), ",".join(BASE_FIELDS)]

    def run() -> str | None:
        while fields:
            out = subprocess.run([exe, f"--id={gpu_index}", f"--query-gpu={fields[0]}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
            if out.returncode == 0:
                return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
            fields.pop(0)       # this driver lacks a field: the shorter query from now on
        return None
    return run


def parse_sample(line: str) -> dict:
    """One nvidia-smi CSV line (BASE_FIELDS [, reasons]) -> {sm_mhz, max_sm_mhz, mem_mhz, power_w, power_limit_w,
    temperature_c[, throttle_reasons]}; a field nvidia-smi reports as [N/A] becomes None."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) not in (len(BASE_FIELDS), len(BASE_FIELDS) + 1):
        raise ValueError(f"nvidia-smi sample {line!r}: expected {len(BASE_FIELDS)} or {len(BASE_FIELDS) + 1} "
                         "comma-separated fields")

    def number(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:      # "[N/A]", "[Not Supported]"
            return None
    keys = ("sm_mhz", "max_sm_mhz", "mem_mhz", "power_w", "power_limit_w", "temperature_c")
    sample = {k: number(v) for k, v in zip(keys, parts)}
    if len(parts) > len(BASE_FIELDS):
        sample["throttle_reasons"] = parts[-1]
    return sample


def summarize(samples: list[dict]) -> dict | None:
    """Samples -> {samples, sm_mhz_median, sm_mhz_min, sm_mhz_max, max_sm_mhz, mem_mhz_median, power_w_median,
    power_limit_w, temperature_c_max, throttle_reasons (distinct values seen, sorted)}; None without samples."""
    if not samples:
        return None

    def values(key):
        return [s[key] for s in samples if s.get(key) is not None]

    def agg(fn, key):
        v = values(key)
        return fn(v) if v else None
    return {
        "samples": len(samples),
        "sm_mhz_median": agg(statistics.median, "sm_mhz"), "sm_mhz_min": agg(min, "sm_mhz"),
        "sm_mhz_max": agg(max, "sm_mhz"), "max_sm_mhz": agg(max, "max_sm_mhz"),
        "mem_mhz_median": agg(statistics.median, "mem_mhz"), "power_w_median": agg(statistics.median, "power_w"),
        "power_limit_w": agg(max, "power_limit_w"), "temperature_c_max": agg(max, "temperature_c"),
        "throttle_reasons": sorted({s["throttle_reasons"] for s in samples if s.get("throttle_reasons")}),
    }


class ClockSampler:
    """Context manager: one sample on entry, one every `interval_s` from a background thread, one on exit.
    runner: returns one CSV line (or None); defaults to nvidia-smi on GPU 0, and with no runner nothing is
    sampled and summary() is None."""

    def __init__(self, runner: Callable[[], str | None] | None = None, interval_s: float = 0.25):
        self._runner = runner if runner is not None else nvidia_smi_runner()
        self._interval_s = interval_s
        self._samples: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample_once(self) -> None:
        if self._runner is None:
            return
        line = self._runner()
        if line:
            sample = parse_sample(line)
            with self._lock:
                self._samples.append(sample)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample_once()

    def __enter__(self) -> "ClockSampler":
        self.sample_once()
        if self._runner is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-clock-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample_once()

    def summary(self) -> dict | None:
        with self._lock:
            return summarize(list(self._samples))
