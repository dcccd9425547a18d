"""How the model's projections multiply: XLA's dot, or the weight-streaming Pallas kernel for a decode step's
few token rows (pallas_kernels/decode_matmul.py).

A `Matmul` is what `Linear` and `ShardedFusedLinear` call for y = x @ w.T, and for the gated MLP's
silu(x @ w_gate.T) * (x @ w_up.T) from a fused gate_up weight (`Matmul.gated`). The engine picks one per engine
(`resolve_projections`, from --projections) and the step hands it to `llama.forward`; everything else
(tests, HF parity, training, prefill over a long prompt) gets XLA's dot.

Why a kernel for some projections only: a decode step's GEMM reads its weights once, and XLA's GEMMs stream
them well when the output has enough column tiles to fill the GPU (llama's gate/up and LM head: on a par with
the kernel on the H200). The projections with few output columns (q/k/v, o, down: N <= 6144) XLA splits over
K with an extra reduction and streams at 35-75% of the read ceiling; the kernel's split-K is faster there
(BENCHMARKS.md, "Decode projections: the weight-streaming kernel"). gate/up streams as fast on either, but on the
kernel (`decode_gated_matmul`) the activation runs in the GEMM's epilogue: the step loses the activation's kernel
and the [rows, 2I] product's round trip through HBM.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Protocol

import jax
import jax.numpy as jnp

from pallas_kernels.decode_matmul import TuningConfig, decode_gated_matmul, decode_matmul, supports


class Matmul(Protocol):
    """How a model's projections multiply."""

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [..., K] @ w [N, K].T -> [..., N] in x.dtype."""

    def gated(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """The gated MLP's activation input: x [..., K], w [2I, K] (gate rows, then up rows) ->
        silu(x @ w[:I].T) * (x @ w[I:].T) [..., I] in x.dtype, each product rounded to x.dtype first."""


# The kernel is used up to this many token rows: a decode step's batch. Beyond it x's tiles, which every CTA
# re-reads, grow past the weight tiles and the GEMM stops being weight-bound.
KERNEL_MAX_ROWS = 128
# Plain projections with more output columns than this go to XLA: from llama-1b's gate/up (16384 columns, 128 tiles
# of 128) up, XLA's GEMM fills the GPU without splitting K and matched the kernel on the H200. (The model's gate/up
# goes through `gated` instead, where the kernel also saves the activation's kernel.)
KERNEL_MAX_COLUMNS = 8192
# 64-column tiles: the fastest or within 5% of it for every llama-1b/8b q/k/v, o and down projection at 64
# rows on the H200 (decode_gemm.py sweep, BENCHMARKS.md).
KERNEL_CONFIG = TuningConfig(tile_n=64)


def xla_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w[N, K].T -> [..., N] in x.dtype (XLA's dot, fp32 accumulation inside)."""
    return jnp.einsum("...i,oi->...o", x, w)


def xla_gated(x: jax.Array, w: jax.Array) -> jax.Array:
    """`Matmul.gated` on XLA's dot: silu(gate) * up of x @ w.T's two halves. The ops are the ones the model ran
    before the gated kernel existed (the product, a unit axis, the split, a reshape of each half), so a step on
    this path (a prefill chunk, a model on CPU) compiles to the program it did."""
    i = w.shape[0] // 2
    y = xla_matmul(x, w)[..., None, :]
    gate, up = (part.reshape(*x.shape[:-1], i) for part in jnp.split(y, [i], axis=-1))
    return jax.nn.silu(gate) * up


# The gated kernel's configs: the column tiles as one wave of one CTA an SM, with as deep a ring as SMEM holds.
# 64-column tiles (128 weight rows: gate and up) with 6 stages where I / 64 tiles fit the SMs (llama-1b: 128),
# else 128-column tiles with 4 stages (llama-8b: 112 CTAs). The fastest of five configs for each on the H200 at 64
# rows (benchmarks/decode_gemm.py --parts gate_up_act, BENCHMARKS.md session 25). At 65-128 rows the wide tile's two
# accumulators would take 256 registers a thread: the narrow one then (not timed).
GATED_NARROW_CONFIG = TuningConfig(tile_n=64, num_stages=6)
GATED_WIDE_CONFIG = TuningConfig(tile_n=128, num_stages=4)
_NUM_SMS = 132      # H100 / H200


def gated_kernel_config(i: int, rows: int, k: int) -> TuningConfig | None:
    """The gated kernel's TuningConfig for I output columns at `rows` token rows and K (see GATED_NARROW_CONFIG);
    None when neither fits a CTA (`decode_matmul.supports`)."""
    order = ((GATED_NARROW_CONFIG, GATED_WIDE_CONFIG) if i // GATED_NARROW_CONFIG.tile_n <= _NUM_SMS
             else (GATED_WIDE_CONFIG, GATED_NARROW_CONFIG))
    return next((c for c in order if supports(rows, i, k, c, gated=True)), None)


def kernel_takes(rows: int, n: int, k: int, dtype) -> bool:
    """Whether `DecodeKernelMatmul` sends an [rows, k] x [n, k] product to the kernel."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and rows <= KERNEL_MAX_ROWS and n <= KERNEL_MAX_COLUMNS
            and supports(rows, n, k, KERNEL_CONFIG))


def gated_kernel_takes(rows: int, i: int, k: int, dtype) -> bool:
    """Whether `DecodeKernelMatmul.gated` sends x [rows, k] and a gate_up weight [2i, k] to the kernel: a decode
    step's rows of a bf16 model, at any width (the kernel streams gate/up as fast as XLA's GEMM and saves the
    activation's kernel)."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and rows <= KERNEL_MAX_ROWS
            and gated_kernel_config(i, rows, k) is not None)


@dataclasses.dataclass(frozen=True)
class DecodeKernelMatmul:
    """A `Matmul`: the Pallas kernels where `kernel_takes` / `gated_kernel_takes` say so, XLA's dot otherwise.
    Frozen (hashable): it is part of the model modules' static configuration. interpret: run the kernel in the Mosaic GPU
    interpreter (CPU tests)."""

    interpret: bool = False

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        rows = math.prod(x.shape[:-1])
        n, k = w.shape
        if not kernel_takes(rows, n, k, x.dtype) or w.dtype != x.dtype:
            return xla_matmul(x, w)
        y = decode_matmul(x.reshape(rows, k), w, config=KERNEL_CONFIG, interpret=self.interpret)
        return y.reshape(*x.shape[:-1], n)

    def gated(self, x: jax.Array, w: jax.Array) -> jax.Array:
        rows = math.prod(x.shape[:-1])
        i, k = w.shape[0] // 2, w.shape[1]
        if not gated_kernel_takes(rows, i, k, x.dtype) or w.dtype != x.dtype or w.shape[0] % 2:
            return xla_gated(x, w)
        y = decode_gated_matmul(x.reshape(rows, k), w, config=gated_kernel_config(i, rows, k),
                                interpret=self.interpret)
        return y.reshape(*x.shape[:-1], i)


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
