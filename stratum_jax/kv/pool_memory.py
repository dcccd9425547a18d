"""Whether the KV pools --kv-pool-tokens asks for fit the device, checked before they are allocated.

Without this check a pool too large for the device failed inside XLA's allocator (a RESOURCE_EXHAUSTED traceback on
the GPU) or, on CPU, got the process killed by the OS, neither naming the flag to change. The pools' size is known
from the config before any allocation: layers x 2 (K and V) x kv heads x slots x head_dim x the element size of the
precision (bf16 and fp16 deltas 2 bytes, fp8 deltas 1; fp8's per-granule scales are under 1% more and not counted).
"""
from __future__ import annotations

import os

import jax

# bytes an element of the pools, by --kv-precision
_ELEMENT_BYTES = {"bf16": 2, "fp16-delta": 2, "fp8-delta": 1}


def pool_bytes(model_config, num_slots: int, precision: str, devices: int = 1) -> int:
    """Bytes of KV pools one device holds: all layers' K and V pools of num_slots slots, kv heads split over
    `devices` (tensor parallelism). model_config: the checkpoint's (not a per-device) ModelConfig."""
    itemsize = _ELEMENT_BYTES.get(precision, 2)
    heads = -(-model_config.num_kv_heads // devices)
    return model_config.num_layers * 2 * heads * num_slots * model_config.head_dim * itemsize


def free_bytes(device: jax.Device) -> int | None:
    """Memory the device can still allocate: a GPU's allocator limit less what is in use (the weights); on CPU the
    host memory the kernel says is available now (MemAvailable: free plus reclaimable cache, less what other
    processes hold), else its physical memory; None where unknown."""
    if device.platform == "cpu":
        return _host_available_bytes()
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))


def _host_available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_pool_fits(kv_pool_tokens: int, num_slots: int, model_config, precision: str, *, devices: int = 1,
                    device: jax.Device | None = None) -> None:
    """Raises ValueError, naming --kv-pool-tokens and how many tokens would fit, when the pools cannot fit `device`
    (default: the first device)."""
    device = device or jax.devices()[0]
    free = free_bytes(device)
    need = pool_bytes(model_config, num_slots, precision, devices)
    if free is None or need <= free:
        return
    per_token = pool_bytes(model_config, 1, precision, devices)
    fits = int(free * 0.9) // per_token // 256 * 256      # 10% left for the step's activations, whole 256-slot units
    where = "host memory" if device.platform == "cpu" else f"free on {device.device_kind}"
    raise ValueError(f"--kv-pool-tokens {kv_pool_tokens} needs {need / 2**30:.1f} GiB of {precision} KV pools a "
                     f"device ({per_token} bytes a token over {model_config.num_layers} layers), but only "
                     f"{free / 2**30:.1f} GiB is {where}: lower --kv-pool-tokens to at most about {fits}"
                     + (" or use --kv-precision fp8-delta" if precision != "fp8-delta" else ""))
