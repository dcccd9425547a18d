"""A projection's split-K sum, the residual add and the RMSNorm after it, in one kernel (a Pallas Mosaic GPU kernel
for Hopper).

In a decode step the o projection and the down projection (`decode_matmul_partials`) leave fp32 partials [S, R, H]
(their split-K), and XLA ran the rest of the layer boundary as three small kernels: the post-attention residual add
(with o's partial sum), the post-attention norm, and the next layer's input norm (with the down projection's partial
sum and the residual add again, recomputed rather than written). Each moves under a megabyte and costs 1.5-2.9 us on
the H200, mostly ramp and drain (BENCHMARKS.md, #18 session 26). This kernel does one boundary in one launch and
writes both of its outputs: the new residual stream and its norm.

Design
------
*Grid.* One CTA (one warpgroup) per token row: the norm reduces over the whole hidden row, so a row must sit in one
CTA, and a decode step's 64-128 rows give 64-128 CTAs. A CTA copies its row's partials [S, H] (fp32, 32 KB at
llama-1b's S 4 x H 2048 or 8b's 2 x 4096, just written and so in L2), its residual row and the norm weight, as
[.., H / 256, 256] boxes (TMA boxes are at most 256 elements a dimension), and writes both [H] bf16 outputs with TMA
stores.

*Numerics, as the model's unfused ops:* the partials summed over S in order in fp32 and rounded to bf16 (what
`decode_matmul` returns), added to the residual in fp32 and rounded to bf16 (the model's bf16 add), then
`llama.rms_norm`: x * rsqrt(mean(x^2) + eps) in fp32, rounded to bf16, times the weight (a bf16 product). The mean's
sum runs in another order than XLA's reduction, so the norm can differ from the unfused one by an fp32 rounding of
the row's scale (a bf16 output then rarely differs by one step).

*L2 prefetch (optional).* The kernel moves under a megabyte and leaves HBM idle; given the next GEMM's weight and an
`L2Prefetch` plan, its CTAs also issue TMA prefetches of the part of that weight the GEMM reads first
(pallas_kernels/l2_prefetch.py). No value changes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.decode_matmul import sum_partials
from pallas_kernels.l2_prefetch import L2Prefetch, check_prefetch_args, issue_prefetch

BOX = 256              # elements a TMA box dimension holds at most: a row is copied as [H / 256, 256]
MAX_HIDDEN = 8192      # a CTA's row: S x H fp32 partials in SMEM (S <= 4 at 8192: 128 KB)
_SMEM_LIMIT = 200 * 1024


def residual_rmsnorm_reference(parts, residual, weight, *, eps: float):
    """`residual_rmsnorm` in jnp: the partials summed in order and rounded to the residual's dtype, added to it,
    and the sum's RMSNorm (llama.rms_norm). Returns (x [R, H], h [R, H]) in residual.dtype."""
    x = residual + sum_partials(parts, residual.dtype)
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return x, weight * x32.astype(x.dtype)


def check_inputs(parts, residual, weight) -> None:
    """Raises ValueError, saying what to fix, for shapes and dtypes the kernel does not take."""
    if parts.ndim != 3 or parts.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"residual_rmsnorm: parts must be [S, R, H] float32 or bfloat16, got {parts.shape} "
                         f"{parts.dtype}")
    s, r_parts, h = parts.shape
    if residual.ndim != 2 or residual.shape[1] != h or not 1 <= residual.shape[0] <= r_parts \
            or residual.dtype != jnp.bfloat16:
        raise ValueError(f"residual_rmsnorm: residual must be [R, H] bfloat16 with H = {h} and 1 <= R <= {r_parts} "
                         f"(the partials' rows), got {residual.shape} {residual.dtype}")
    if weight.shape != (h,) or weight.dtype != jnp.bfloat16:
        raise ValueError(f"residual_rmsnorm: weight must be [H] = [{h}] bfloat16, got {weight.shape} {weight.dtype}")
    if h % BOX or h > MAX_HIDDEN:
        raise ValueError(f"residual_rmsnorm: H ({h}) must be a multiple of {BOX} and at most {MAX_HIDDEN}")
    if smem_bytes(s, h, parts.dtype) > _SMEM_LIMIT:
        raise ValueError(f"residual_rmsnorm: {s} partials of {h} {jnp.dtype(parts.dtype).name} do not fit a CTA's "
                         f"SMEM ({smem_bytes(s, h, parts.dtype)} bytes > {_SMEM_LIMIT}): sum some before the call")


def smem_bytes(splits: int, hidden: int, parts_dtype) -> int:
    """SMEM of one CTA: the row's partials, the residual row, the weight and the two output rows."""
    return splits * hidden * jnp.dtype(parts_dtype).itemsize + 4 * hidden * 2


def supports(splits: int, rows: int, hidden: int, parts_dtype=jnp.float32) -> bool:
    """Whether the kernel takes partials [splits, rows, hidden] of this dtype (bf16 residual and weight)."""
    return (hidden % BOX == 0 and hidden <= MAX_HIDDEN and rows >= 1
            and smem_bytes(splits, hidden, parts_dtype) <= _SMEM_LIMIT)


def residual_rmsnorm(parts, residual, weight, *, eps: float, prefetch_weight=None,
                     prefetch: L2Prefetch | None = None, interpret: bool = False):
    """The new residual stream and its RMSNorm, from a projection's split-K partials (module docstring).

    Args:
      parts: [S, R', H] float32 split-K partials (or bfloat16 with S = 1) of the projection whose output is added
        to the residual (`decode_matmul_partials`), R' >= R: the GEMM's padding rows are passed as they are (no
        slice, so no copy) and not read.
      residual: [R, H] bfloat16, the residual stream before the add.
      weight: [H] bfloat16, the norm's weight.
      eps: the norm's epsilon.
      prefetch_weight: the next GEMM's bf16 weight [N, K] (the one h feeds), with `prefetch` the part of it to bring
        into L2 while this kernel runs; both or neither.
      prefetch: an `L2Prefetch` plan for prefetch_weight's shape.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns (x [R, H] = residual + sum(parts), h [R, H] = RMSNorm(x) * weight), both bfloat16.
    """
    check_inputs(parts, residual, weight)
    check_prefetch_args("residual_rmsnorm", prefetch_weight, prefetch)
    if interpret:
        with mosaic_gpu_interpret():
            return _residual_rmsnorm(parts, residual, weight, prefetch_weight, eps=float(eps), prefetch=prefetch,
                                     interpreted=True)
    return _residual_rmsnorm(parts, residual, weight, prefetch_weight, eps=float(eps), prefetch=prefetch,
                             interpreted=interpret_mode_active())


@functools.partial(jax.jit, static_argnames=("eps", "prefetch", "interpreted"))
def _residual_rmsnorm(parts, residual, weight, prefetch_weight, *, eps, prefetch, interpreted=False):
    del interpreted       # keys jit's cache only: interpreted and compiled traces never share an entry
    s, r_parts, h = parts.shape
    r, c = residual.shape[0], h // BOX
    kernel = _build_kernel(splits=s, rows=r, hidden=h, eps=eps, parts_dtype=parts.dtype, prefetch=prefetch)
    args = (parts.reshape(s, r_parts, c, BOX), residual.reshape(r, c, BOX), weight.reshape(1, c, BOX))
    x, normed = kernel(*args, *(() if prefetch is None else (prefetch_weight,)))
    return x.reshape(r, h), normed.reshape(r, h)


def _build_kernel(*, splits, rows, hidden, eps, parts_dtype, prefetch=None):
    """f(parts [S, R' >= R, C, 256], residual [R, C, 256], weight [1, C, 256][, next weight [N, K]]) -> (x, h)
    [R, C, 256] bf16."""
    c = hidden // BOX
    dtype = jnp.bfloat16

    def body(parts_gmem, res_gmem, w_gmem, *rest):
        *next_weight, x_gmem, h_gmem = rest
        row_index = lax.axis_index("rows")
        row = pl.ds(row_index, 1)

        def scoped(parts_smem, res_smem, w_smem, x_smem, h_smem, loaded):
            plgpu.copy_gmem_to_smem(parts_gmem.at[:, row], parts_smem, loaded)
            plgpu.copy_gmem_to_smem(res_gmem.at[row], res_smem, loaded)
            plgpu.copy_gmem_to_smem(w_gmem, w_smem, loaded)
            if prefetch is not None:        # after this row's own copies, which the CTA waits on
                issue_prefetch(next_weight[0], prefetch, cta=row_index, num_ctas=rows)
            plgpu.barrier_wait(loaded)
            y = parts_smem.at[0][...].astype(jnp.float32)            # [1, C, 256]
            for s in range(1, splits):
                y = y + parts_smem.at[s][...].astype(jnp.float32)
            y = y.astype(dtype).astype(jnp.float32)                  # what decode_matmul returns
            x = (res_smem[...].astype(jnp.float32) + y).astype(dtype)
            x_smem[...] = x
            x32 = x.astype(jnp.float32)
            mean_square = jnp.sum(x32 * x32) / hidden
            normed = (x32 * lax.rsqrt(mean_square + eps)).astype(dtype)
            h_smem[...] = (w_smem[...].astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(x_smem, x_gmem.at[row])
            plgpu.copy_smem_to_gmem(h_smem, h_gmem.at[row])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(
            scoped,
            plgpu.SMEM((splits, 1, c, BOX), parts_dtype), plgpu.SMEM((1, c, BOX), dtype),
            plgpu.SMEM((1, c, BOX), dtype), plgpu.SMEM((1, c, BOX), dtype), plgpu.SMEM((1, c, BOX), dtype),
            plgpu.Barrier(num_arrivals=3))

    # The name a profile shows: residual_rmsnorm_mosaic_gpu_kernel (benchmarks/device_trace.py).
    body.__name__ = body.__qualname__ = "residual_rmsnorm"
    out = jax.ShapeDtypeStruct((rows, c, BOX), dtype)
    return plgpu.kernel(body, out_type=(out, out), grid=(rows,), grid_names=("rows",))
