"""--kv-precision at start-up: which KV cache the engine really gets, and building it.

Fallbacks (each logged with its reason):
  - fp8-delta on a GPU without fp8 (compute capability < 8.9) -> fp16-delta;
  - any delta precision on a GPU whose measured device-copy bandwidth is below
    HBM_BANDWIDTH_THRESHOLD_GBPS -> bf16 (the design's HBM2 rule: there the extra anchor reads and the
    rebuild are not paid back by the smaller pages).
On a CPU neither check applies (there is no HBM, and fp8 is emulated): the requested precision runs, as the
tests and the quality study need.
"""
from __future__ import annotations

import logging

import jax

from stratum_jax.kv.anchor import fit_anchor, warmup_windows
from stratum_jax.kv.delta_cache import DeltaKV, init_delta_cache, num_slots_of
from stratum_jax.model.llama import init_kv_cache

log = logging.getLogger(__name__)

# Device-copy bandwidth (stratum_jax/bandwidth.py's measurement: read + write of a 1 GiB buffer) below which
# delta KV falls back to bf16. HBM2/HBM2e parts (V100, A100, H100 PCIe) measure below 2 TB/s; HBM3 parts
# (H100 SXM ~3 TB/s, H200 4.0-4.1 TB/s in BENCHMARKS.md) above.
HBM_BANDWIDTH_THRESHOLD_GBPS = 2000.0
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)


def _capability(device) -> tuple[int, int] | None:
    """The device's compute capability as (major, minor), or None where jax does not report it."""
    text = getattr(device, "compute_capability", None)
    if text is None:
        return None
    major, _, minor = str(text).partition(".")
    return int(major), int(minor or 0)


def resolve_precision(requested: str, *, platform: str, capability: tuple[int, int] | None,
                      bandwidth_gbps: float | None) -> tuple[str, str]:
    """-> (precision to run, why). platform: jax's backend ("gpu", "cpu", ...); capability: the GPU's
    compute capability (None: unknown, trusted); bandwidth_gbps: the measured copy bandwidth (None: not
    measured, e.g. for bf16)."""
    if requested == "bf16":
        return "bf16", "requested"
    if platform != "gpu":
        return requested, f"requested; on {platform} no fp8 or HBM-bandwidth check applies"
    if bandwidth_gbps is not None and bandwidth_gbps < HBM_BANDWIDTH_THRESHOLD_GBPS:
        return "bf16", (f"{requested} refused: measured memory bandwidth {bandwidth_gbps:.0f} GB/s is below "
                        f"the {HBM_BANDWIDTH_THRESHOLD_GBPS:.0f} GB/s threshold (HBM2-class memory), "
                        "falling back to bf16 KV")
    if requested == "fp8-delta" and capability is not None and capability < FP8_MIN_COMPUTE_CAPABILITY:
        return "fp16-delta", (f"fp8-delta refused: the GPU's compute capability {capability[0]}.{capability[1]} "
                              f"has no fp8 (needs >= 8.9), falling back to fp16-delta")
    return requested, f"requested; memory bandwidth {bandwidth_gbps or 0:.0f} GB/s"


def kv_bytes_per_slot(kv_cache) -> int:
    """Bytes one token slot takes over all layers: K and V (bf16 pools), or their deltas plus an eighth of
    their granule's scales (DKVC); the resident anchor is not per slot and not counted."""
    total = 0.0
    for layer in kv_cache:
        arrays = ((layer.k_delta, layer.v_delta, layer.scales) if isinstance(layer, DeltaKV)
                  else tuple(layer))
        total += sum(a.nbytes / num_slots_of(layer) for a in arrays)
    return round(total)


def start_kv_cache(requested: str, model, num_slots: int, sharding=None, fp8_scale: str = "granule"):
    """The engine's KV cache for --kv-precision `requested` -> (precision, cache, anchor choice or None).

    bf16: `init_kv_cache` exactly as before. A delta precision: the checks above, then the anchor from a
    warm-up run (stratum_jax/kv/anchor.py) and the delta pools (stratum_jax/kv/delta_cache.py); fp8 deltas
    with `fp8_scale` "head" keep one fixed scale per layer and KV head (the warm-up's max floors)."""
    if requested == "bf16":
        return "bf16", init_kv_cache(model.config, num_slots, sharding=sharding), None
    device = jax.devices()[0]
    bandwidth = None
    if device.platform == "gpu":
        from stratum_jax.bandwidth import measure_copy_bandwidth_gbps   # the server's start-up probe too
        bandwidth = measure_copy_bandwidth_gbps()
    precision, why = resolve_precision(requested, platform=device.platform, capability=_capability(device),
                                       bandwidth_gbps=bandwidth)
    log.log(logging.WARNING if precision != requested else logging.INFO, "KV precision: %s (%s)", precision, why)
    fixed = precision == "fp8-delta" and fp8_scale == "head"
    if fp8_scale == "head" and not fixed:
        log.warning("--fp8-scale head has no effect: the KV cache runs %s", precision)
    if precision == "bf16":
        return "bf16", init_kv_cache(model.config, num_slots, sharding=sharding), None
    choice = fit_anchor(model.params, model.config, warmup_windows(model.tokenizer))
    floors = choice.max_floors if fixed else choice.floors
    return precision, init_delta_cache(choice.anchors, floors, num_slots, precision, sharding=sharding,
                                       fixed_scales=fixed), choice
