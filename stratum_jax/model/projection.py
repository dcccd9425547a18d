"""How the model's projections multiply: XLA's dot, or the weight-streaming Pallas kernel for a decode step's
few token rows (pallas_kernels/decode_matmul.py).

A `Matmul` is what `Linear` and `ShardedFusedLinear` call for y = x @ w.T. The engine picks one per engine
(`resolve_projections`, from --projections) and the step hands it to `llama.forward`; everything else
(tests, HF parity, training, prefill over a long prompt) gets XLA's dot.

Why a kernel for some projections only: a decode step's GEMM reads its weights once, and XLA's GEMMs stream
them well when the output has enough column tiles to fill the GPU (llama's gate/up and LM head: on a par with
the kernel on the H200). The projections with few output columns (q/k/v, o, down: N <= 6144) XLA splits over
K with an extra reduction and streams at 35-75% of the read ceiling; the kernel's split-K is faster there
(BENCHMARKS.md, "Decode projections: the weight-streaming kernel").
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.decode_matmul import TuningConfig, decode_matmul, supports

# (x [..., K], w [N, K]) -> x @ w.T [..., N] in x.dtype
Matmul = Callable[[jax.Array, jax.Array], jax.Array]

# The kernel is used up to this many token rows: a decode step's batch. Beyond it x's tiles, which every CTA
# re-reads, grow past the weight tiles and the GEMM stops being weight-bound.
KERNEL_MAX_ROWS = 128
# Projections with more output columns than this go to XLA: from llama-1b's gate/up (16384 columns, 128 tiles of
# 128) up, XLA's GEMM fills the GPU without splitting K and matched the kernel on the H200.
KERNEL_MAX_COLUMNS = 8192
# 64-column tiles: the fastest or within 5% of it for every llama-1b/8b q/k/v, o and down projection at 64
# rows on the H200 (decode_gemm.py sweep, BENCHMARKS.md).
KERNEL_CONFIG = TuningConfig(tile_n=64)


def xla_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] in x.dtype (XLA's dot, fp32 accumulation inside)."""
    return jnp.einsum("...i,oi->...o", x, w)


def kernel_takes(rows: int, n: int, k: int, dtype) -> bool:
    """Whether `DecodeKernelMatmul` sends an [rows, k] x [n, k] product to the kernel."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and rows <= KERNEL_MAX_ROWS and n <= KERNEL_MAX_COLUMNS
            and supports(rows, n, k, KERNEL_CONFIG))


@dataclasses.dataclass(frozen=True)
class DecodeKernelMatmul:
    """A `Matmul`: the Pallas kernel where `kernel_takes` says so, XLA's dot otherwise. Frozen (hashable): it
    is part of the model modules' static configuration. interpret: run the kernel in the Mosaic GPU
    interpreter (CPU tests)."""

    interpret: bool = False

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        rows = math.prod(x.shape[:-1])
        n, k = w.shape
        if not kernel_takes(rows, n, k, x.dtype) or w.dtype != x.dtype:
            return xla_matmul(x, w)
        y = decode_matmul(x.reshape(rows, k), w, config=KERNEL_CONFIG, interpret=self.interpret)
        return y.reshape(*x.shape[:-1], n)


def resolve_projections(config, model_config, *, on_hopper: bool, tensor_parallel: int) -> str:
    """--projections: "kernel" or "xla". "auto" = the kernel on a Hopper GPU for a bf16 model on one device
    (under tensor parallelism the projections are GSPMD-partitioned dots, which a Pallas call is not), else
    XLA. An explicit "kernel" that cannot run is an error that says what to change."""
    choice = config.projections
    if choice == "auto":
        return "kernel" if on_hopper and model_config.dtype == "bfloat16" and tensor_parallel == 1 else "xla"
    if choice == "kernel":
        if not on_hopper and not config.interpret_kernels:
            raise ValueError("--projections kernel needs an NVIDIA Hopper GPU (sm_90); on CPU add "
                             "--interpret-kernels (slow, for tests) or use --projections xla")
        if model_config.dtype != "bfloat16":
            raise ValueError(f"--projections kernel multiplies bfloat16 weights; the model is {model_config.dtype}: "
                             "add --dtype bfloat16 or use --projections xla")
        if tensor_parallel != 1:
            raise ValueError("--projections kernel runs on one device; with --tensor-parallel "
                             f"{tensor_parallel} use --projections xla (or auto)")
    return choice


def step_matmul(projections: str, *, interpret: bool) -> Matmul | None:
    """The Matmul a step runs for a resolved --projections value (None: the model's default, XLA's dot)."""
    return DecodeKernelMatmul(interpret=interpret) if projections == "kernel" else None
