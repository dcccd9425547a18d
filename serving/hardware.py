"""What the server runs on: the device, its CUDA version, and its memory bandwidth measured once at start-up.

The bandwidth is an on-device copy (`y = x + 1` over a large float32 buffer, so every byte is read once
and written once), timed after a compile-and-warm run: bytes moved = 2 x buffer size. On a GPU that is HBM
bandwidth; on CPU it is host memory bandwidth (small buffers may partly hit the caches).
"""
from __future__ import annotations

import dataclasses
import re

import jax

from stratum_jax.bandwidth import measure_copy_bandwidth_gbps  # noqa: F401  (the engine measures it too: DKVC)


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    device: str          # device kind, e.g. "NVIDIA H200" or "cpu"
    platform: str        # "gpu" or "cpu" (the jax backend)
    cuda_version: str    # e.g. "12.8"; "" when the backend is not CUDA
    device_count: int


def device_info() -> DeviceInfo:
    device = jax.devices()[0]
    return DeviceInfo(device=device.device_kind, platform=device.platform, cuda_version=_cuda_version(device),
                      device_count=jax.device_count())


def _cuda_version(device) -> str:
    """The CUDA version the jax backend reports (e.g. platform_version "cuda 12080" -> "12.8"), or ""."""
    if device.platform != "gpu":
        return ""
    try:
        text = device.client.platform_version
    except Exception:
        return ""
    match = re.search(r"cuda\D*(\d+)", text or "", re.I)
    if not match:
        return ""
    number = int(match.group(1))   # CUDA's encoding: 1000 * major + 10 * minor
    return f"{number // 1000}.{number % 1000 // 10}" if number >= 1000 else str(number)
