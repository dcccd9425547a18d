"""The device's memory bandwidth, measured as an on-device copy (`y = x + 1` over a large float32 buffer, so
every byte is read once and written once), timed after a compile-and-warm run: bytes moved = 2 x buffer
size. On a GPU that is HBM bandwidth; on CPU host memory bandwidth (small buffers may partly hit the caches).
Used by the server's start-up report (serving/hardware.py) and DKVC's precision fallback (kv/precision.py).
The read bandwidth (a bf16 sum) and the bf16 matmul rate are the peaks the step utilization metrics are
measured against (stratum_jax/step_work.py).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

GPU_COPY_BYTES = 1 << 30     # 1 GiB: far past the L2 of any GPU
CPU_COPY_BYTES = 64 << 20    # 64 MiB: past most CPU caches, yet quick on a CI runner
REPEATS = 5
CHAIN = 8                    # calls per timing on a GPU (_best_seconds); on CPU one: dispatch is no
                             # cost next to a CPU copy, and tests start many servers


def measure_copy_bandwidth_gbps(nbytes: int | None = None, repeats: int = REPEATS) -> float:
    """The best of `repeats` timed on-device copies, in GB/s (1e9 bytes/s)."""
    device = jax.devices()[0]
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device.platform == "gpu" else CPU_COPY_BYTES
    x = jnp.zeros((nbytes // 4,), jnp.float32, device=device)
    seconds = _best_seconds(jax.jit(lambda a: a + 1.0), x, repeats, feed_back=True)
    del x
    return 2 * nbytes / seconds / 1e9


def _best_seconds(fn, x, repeats: int, feed_back: bool = False) -> float:
    """Seconds per call of fn(x): the best of `repeats` timings of `chain` calls dispatched back to back and
    waited for once, so the host's dispatch and wait latency (~0.1-0.2 ms, as long as a 1 GiB read on an
    H200) is paid once per chain, not per call. feed_back: each call takes the previous one's output (same
    shape and dtype), so only two buffers are alive however long the chain."""
    chain = CHAIN if x.devices().pop().platform == "gpu" else 1
    y = fn(x)
    y.block_until_ready()     # compile and warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        y = x
        for _ in range(chain):
            y = fn(y if feed_back else x)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - start) / chain)
    return best


def measure_read_bandwidth_gbps(nbytes: int | None = None, repeats: int = REPEATS) -> float:
    """Bytes read per second by a large bf16 sum to one float32 (a read-only stream: the ceiling of a step
    that reads weights and KV and writes little), best of `repeats`, in GB/s."""
    device = jax.devices()[0]
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device.platform == "gpu" else CPU_COPY_BYTES
    x = jnp.ones((nbytes // 2,), jnp.bfloat16, device=device)
    seconds = _best_seconds(jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x, repeats)
    del x
    return nbytes / seconds / 1e9


def measure_matmul_tflops(size: int | None = None, repeats: int = REPEATS) -> float:
    """bf16 matmul rate (float32 accumulation inside, bf16 out) of a square [size, size] product, best of
    `repeats`, in TFLOP/s: the compute ceiling a step's GEMMs can approach. size: 8192 on a GPU, 512
    elsewhere (servers in tests start often). Each product multiplies the previous one by itself (values overflow to inf; the tensor cores'
    rate does not depend on them)."""
    device = jax.devices()[0]
    if size is None:
        size = 8192 if device.platform == "gpu" else 512
    a = jnp.full((size, size), 0.5, jnp.bfloat16, device=device)
    seconds = _best_seconds(jax.jit(lambda m: jnp.dot(m, m)), a, repeats, feed_back=True)
    return 2 * size**3 / seconds / 1e12


def measure_device_peaks(devices: int = 1):
    """The utilization gauges' ceilings (step_work.DevicePeaks): one device's read bandwidth and bf16 matmul
    rate, times the `devices` a step runs on (tensor parallelism: each reads and multiplies its shard)."""
    from stratum_jax.step_work import DevicePeaks
    return DevicePeaks(measure_read_bandwidth_gbps() * 1e9 * devices, measure_matmul_tflops() * 1e12 * devices)
