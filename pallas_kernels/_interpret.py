"""Run Mosaic GPU Pallas kernels on a machine without a GPU (CI, laptops).

jax 0.11.2 ships a Mosaic GPU *interpreter*: `plgpu.force_gpu_interpret_mode` makes every
`plgpu.kernel` inside its dynamic scope run as a CPU simulation of the kernel's threads, SMEM,
barriers and TMA copies (uninitialised SMEM reads as NaN, out-of-bounds reads raise). Tracing a
Mosaic GPU kernel also needs to know the target GPU, which CPU-only jax cannot tell it, so we
install an abstract mesh whose device claims to be an H100 (sm_90, the Hopper code path).

    with mosaic_gpu_interpret():
        out = paged_attention(...)      # runs the real kernel body, on CPU

The same context is what `paged_attention(..., interpret=True)` enters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.experimental.pallas.mosaic_gpu as plgpu

# Any Hopper device kind works; the interpreter only uses it to pick the sm_90 lowering paths.
_ABSTRACT_DEVICE_KIND = "NVIDIA H100 80GB HBM3"


@contextlib.contextmanager
def mosaic_gpu_interpret(*, detect_races: bool = False) -> Iterator[None]:
    """Context manager: run Mosaic GPU kernels in the Pallas interpreter on CPU.

    Args:
      detect_races: turn on the interpreter's happens-before race detector (slow; for debugging).
    """
    device = jax.sharding.AbstractDevice(
        device_kind=_ABSTRACT_DEVICE_KIND, platform="gpu", num_cores=8)
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    params = plgpu.InterpretGPUParams(detect_races=detect_races)
    with jax.sharding.use_abstract_mesh(mesh), plgpu.force_gpu_interpret_mode(params):
        yield


def interpret_mode_active() -> bool:
    """True while Mosaic GPU kernels are being traced for the interpreter (inside
    `mosaic_gpu_interpret()` or any `plgpu.force_gpu_interpret_mode` scope).

    Kernels use it to pick the variant of a step that the interpreter implements (it has no
    `pl.run_state` and no WGMMA with a register operand) - same math, different plumbing."""
    from jax._src import config as jax_config
    return isinstance(jax_config.pallas_tpu_interpret_mode_context_manager.value, plgpu.InterpretGPUParams)
