"""The device's memory bandwidth, measured as an on-device copy (`y = x + 1` over a large float32 buffer, so
every byte is read once and written once), timed after a compile-and-warm run: bytes moved = 2 x buffer
size. On a GPU that is HBM bandwidth; on CPU host memory bandwidth (small buffers may partly hit the caches).
Used by the server's start-up report (serving/hardware.py) and DKVC's precision fallback (kv/precision.py).
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

GPU_COPY_BYTES = 1 << 30     # 1 GiB: far past the L2 of any GPU
CPU_COPY_BYTES = 64 << 20    # 64 MiB: past most CPU caches, yet quick on a CI runner
REPEATS = 5


def measure_copy_bandwidth_gbps(nbytes: int | None = None, repeats: int = REPEATS) -> float:
    """The best of `repeats` timed on-device copies, in GB/s (1e9 bytes/s)."""
    device = jax.devices()[0]
    if nbytes is None:
        nbytes = GPU_COPY_BYTES if device.platform == "gpu" else CPU_COPY_BYTES
    x = jnp.zeros((nbytes // 4,), jnp.float32, device=device)
    step = jax.jit(lambda a: a + 1.0)
    step(x).block_until_ready()   # compile and warm
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del x
    return 2 * nbytes / best / 1e9
