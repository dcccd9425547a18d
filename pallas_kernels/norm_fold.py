"""A decode layer's residual adds and RMSNorms folded into its GEMMs: two kernels a layer fewer (Mosaic GPU, Hopper).

A llama layer's decode step runs 8 kernels today (BENCHMARKS.md #18): norm, q/k/v GEMM, RoPE + KV write, attention,
o GEMM, residual add + norm (`residual_rmsnorm`), gate/up GEMM, down GEMM (its split-K sum and residual add fall to
the next layer's `residual_rmsnorm`). The two norm kernels move under a megabyte each and still take 2.3-2.9 us on
the H200, mostly ramp and drain; the step's time over its byte floor is mostly such fixed costs a kernel
(benchmarks/KERNEL_NOTES.md, "The 1b step over its byte floor"). This module removes their work from the chain:

- **The residual add moves into the GEMM before it** (`decode_matmul_residual`, for o and down): the projection's K
  splits run as one thread-block cluster; after a cluster barrier each CTA reads the splits' fp32 partials from its
  peers' shared memory ("dsmem") or through an exchange buffer in L2 ("l2"), sums them in split order, rounds, adds
  the residual and writes its share of the rows of the new residual stream x. No [S, R, H] partials leave the
  kernel for another launch to sum.
- **The norm moves into the GEMM after it**: rms_norm(x) * g @ W.T equals rsqrt(mean(x^2) + eps) * (x @ (W * g).T)
  row by row, so the norm weight g is folded into the next projection's weight once at load (`fold_norm_weight`),
  and the row's scale, a per-row statistic of x, is taken from the x tiles the GEMM streams anyway (every CTA reads
  all of x's K). gate/up (`decode_gated_matmul_normed`, no split-K) applies it to its accumulators before the
  activation; q/k/v (`decode_matmul_partials_sumsq`, split-K) leaves each split's sums of squares [S, R] beside its
  partials, and `rope_kv_write`, which sums the partials anyway, applies the scale (`rope_kv_write.RowNorm`).

The folded layer: q/k/v GEMM -> RoPE + KV write -> attention -> o GEMM + residual -> gate/up GEMM -> down GEMM +
residual, 6 kernels. The final norm before the LM head stays XLA's (the LM head may be tied to the embedding).

Numerics: the residual add is the unfused path's exactly (the split-K sum in split order in fp32, rounded, then the
bf16 add). The folded norm is the same function up to bf16 rounding in other places: the unfused path rounds the
normalized row to bf16 and multiplies by g in bf16 before its GEMM; the fold rounds W * g to bf16 once and scales the
fp32 products. Both are one bf16 rounding of each term (relative 2^-9); `tests/test_norm_fold.py` bounds the
difference against the unfused kernels' outputs.

Testing: jax 0.11.2's GPU interpreter deadlocks now and then on a cluster barrier of several blocks (3-5 of 8 runs
on a 2-core machine), so CI interprets `decode_matmul_residual` only with one block a cluster; the multi-block
cluster is checked by lowering for CUDA on CPU, and on the GPU by `tests/test_norm_fold.py -m gpu`.

Status (2026-12-05): wired into the engine behind --fold-norms (model/fused.py `fold_norms`, llama.DecoderLayer's
folded path), off: on the H200 the folded layer is still slower than the unfused one. With o's and down's K split
in clusters of 4 (1b) the layer lost 11-12 us; in clusters of 2 on half-width tiles (`cluster_tiling`, the engine's
choice since) 2.8 us (1b) and 2.1 us (8b): o and down with the residual add cost more than the norm kernels they
replace (BENCHMARKS.md #18 sessions 32-33). The peer shared-memory exchange ("dsmem") was slower than "l2" in every
cluster shape: jax 0.11.2 lowers a peer's SMEM ref only whole, so each block reads all the partials.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import decode_matmul as dm
from pallas_kernels.decode_matmul import TuningConfig

MAX_CLUSTER = 8          # thread blocks a cluster may hold on Hopper without the non-portable opt-in


def fold_norm_weight(norm_weight, w):
    """w [N, K] bf16 with the preceding RMSNorm's weight [K] folded into its columns: (w * g) in fp32, rounded
    once to w's dtype. `decode_gated_matmul_normed(x, fold_norm_weight(g, w))` ~ gated(rms_norm(x) * g, w)."""
    if norm_weight.ndim != 1 or w.ndim != 2 or norm_weight.shape[0] != w.shape[1]:
        raise ValueError(f"fold_norm_weight: the norm weight must be [K] and w [N, K], got {norm_weight.shape} and "
                         f"{w.shape}")
    return (w.astype(jnp.float32) * norm_weight.astype(jnp.float32)[None, :]).astype(w.dtype)


def cluster_k_splits(n: int, k: int, tile_n: int, rows: int = 64) -> int:
    """`decode_matmul_residual`'s default split: as `default_k_splits` (about one CTA an SM), from the splits a
    cluster takes (a power of two up to MAX_CLUSTER that divides the rows and the K tiles)."""
    tiles, k_tiles = n // tile_n, k // dm._TILE_K
    best = 1
    for s in (1, 2, 4, 8):
        if s > MAX_CLUSTER or rows % s or k_tiles % s or k_tiles // s < 4:
            continue
        best = s
        if dm.fills_the_gpu(tiles * s):
            break
    return best


ENGINE_CLUSTER = 2       # blocks a cluster in the engine's choice (`cluster_tiling`)


def cluster_tiling(n: int, k: int, tile_n: int, rows: int = 64) -> tuple[int, int]:
    """(tile_n, k_splits) the engine runs `decode_matmul_residual` with for [rows, k] x [n, k]: clusters of
    ENGINE_CLUSTER blocks, the column tile narrowed from tile_n (the plain kernel's) to the widest multiple of 8
    dividing n that still gives about one CTA an SM, at most to half (the narrowing measured). On the H200 this was the fastest fold measured; clusters of 4 on
    the plain tiles were 8 us a layer slower, and so were clusters of 2 on them (half a wave) (BENCHMARKS.md #18
    sessions 32-33). (tile_n, 1) where the K range cannot be split in two (fewer than 8 K tiles) or the rows do not
    halve."""
    k_tiles = k // dm._TILE_K
    if k_tiles % ENGINE_CLUSTER or k_tiles // ENGINE_CLUSTER < 4 or rows % ENGINE_CLUSTER:
        return tile_n, 1
    narrowest = tile_n
    for width in range(tile_n, max(8, tile_n // 2) - 1, -8):
        if n % width:
            continue
        narrowest = width
        if dm.fills_the_gpu(n // width * ENGINE_CLUSTER):
            break
    return narrowest, ENGINE_CLUSTER


def decode_matmul_residual_reference(x, w, residual):
    """residual + x @ w.T as the unfused path computes it: fp32 products rounded to residual's dtype, then added."""
    return residual + dm.decode_matmul_reference(x, w, out_dtype=residual.dtype)


EXCHANGES = ("dsmem", "l2")


def decode_matmul_residual(x, w, residual, *, config: TuningConfig | None = None, exchange: str = "l2",
                           interpret: bool = False):
    """residual + x @ w.T for a decode step's rows, its split-K summed inside the kernel (module docstring).

    Args:
      x: [M, K] bf16 activations, 1 <= M <= 256.
      w: [N, K] bf16 weight (torch's [out, in] layout); K a multiple of 64, N a multiple of config.tile_n.
      residual: [M, N] bf16, the residual stream the product is added to.
      config: TuningConfig; k_splits None picks `cluster_k_splits`; a given split must be 1, 2, 4 or 8 and divide
        the padded rows and the K tiles.
      exchange: how a cluster's blocks read each other's fp32 partials: "l2" (through a global buffer: TMA stores,
        then loads; the faster on the H200, BENCHMARKS.md #18 session 33) or "dsmem" (from the peers' shared memory:
        jax 0.11.2 lowers only whole peer refs, so every block reads all S partials); the same values either way.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns the new residual stream [M, N] bf16: `decode_matmul_residual_reference`'s values.
    """
    config = config or TuningConfig()
    if exchange not in EXCHANGES:
        raise ValueError(f"decode_matmul_residual: exchange must be one of {EXCHANGES}, got {exchange!r}")
    dm.check_inputs(x, w, dataclasses.replace(config, k_splits=None))     # shapes and dtypes; the split below
    m, k = x.shape
    n = w.shape[0]
    if residual.shape != (m, n) or residual.dtype != x.dtype:
        raise ValueError(f"decode_matmul_residual: residual must be [{m}, {n}] {x.dtype} (x's rows, w's outputs), "
                         f"got {residual.shape} {residual.dtype}")
    rows = -(-m // dm._ROWS) * dm._ROWS
    splits = config.k_splits or cluster_k_splits(n, k, config.tile_n, rows)
    if splits not in (1, 2, 4, 8) or rows % splits:
        raise ValueError(f"decode_matmul_residual: k_splits must be 1, 2, 4 or 8 (a cluster's blocks, each summing "
                         f"rows / k_splits of the {rows} padded rows), got {splits}")
    config = dataclasses.replace(config, k_splits=splits)
    dm.check_inputs(x, w, config)
    problem = residual_resource_problem(rows, k, config, exchange)
    if problem:
        raise ValueError(f"decode_matmul_residual: {problem}")
    return dm._run(x, w, out_dtype=jnp.dtype(x.dtype), config=config, gated=False, interpret=interpret,
                   residual=residual, exchange=exchange)


def residual_resource_problem(rows: int, k: int, config: TuningConfig, exchange: str = "l2") -> str | None:
    """What to lower when a `decode_matmul_residual` CTA would need more SMEM or registers than the GPU gives:
    the plain kernel's ring and fp32 tile, plus the residual's and the output's bf16 tiles ([rows, tile_n] with the
    "dsmem" exchange, [rows / S, tile_n] with "l2")."""
    smem, regs = dm.cta_resources(rows, k, config, out_itemsize=4)
    smem += 2 * (rows if exchange == "dsmem" else rows // config.k_splits) * config.tile_n * 2
    if smem > dm._SMEM_LIMIT:
        return (f"{rows} rows with {config} need {smem // 1024} KB of SMEM a CTA (at most {dm._SMEM_LIMIT // 1024}): "
                "lower num_stages or tile_n")
    if regs > dm._ACC_REGISTERS:
        return (f"{rows} rows with tile_n={config.tile_n} need {regs} accumulator registers a thread (at most "
                f"{dm._ACC_REGISTERS}): lower tile_n")
    return None


def decode_matmul_partials_sumsq(x, w_folded, *, config: TuningConfig | None = None, interpret: bool = False):
    """The q/k/v projection of the un-normalized stream with the input norm folded in: (`decode_matmul_partials`
    of x and w_folded, the rows' sums of squares of x over each split's K range [S, R] fp32). `rope_kv_write` with
    `RowNorm(sumsq, K, eps)` sums the partials and applies the rows' scale (module docstring).

    Args:
      x: [M, K] bf16, the residual stream (not normalized), 1 <= M <= 256.
      w_folded: [N, K] bf16, the fused q/k/v weight with the input norm's weight folded in.
      config: TuningConfig; k_splits None picks `default_k_splits`.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns (parts [S, R, N] float32 (x.dtype when S = 1), sumsq [S, R] float32); R = M rounded up to 64.
    """
    config = dm._checked_config(x, w_folded, config, jnp.dtype(x.dtype))
    return dm._run(x, w_folded, out_dtype=jnp.dtype(x.dtype), config=config, gated=False, interpret=interpret,
                   partials=True, row_sumsq=True)


def decode_matmul_partials_sumsq_reference(x, w_folded, splits: int):
    """`decode_matmul_partials_sumsq`'s values: [S, R, N] fp32 partials over K's S equal ranges and [S, R] fp32 sums
    of x^2 over each (rows past M zero)."""
    m, k = x.shape
    rows = -(-m // dm._ROWS) * dm._ROWS
    xs = jnp.pad(x, ((0, rows - m), (0, 0))).reshape(rows, splits, k // splits).transpose(1, 0, 2)
    ws = w_folded.reshape(w_folded.shape[0], splits, k // splits).transpose(1, 0, 2)
    parts = jnp.einsum("smk,snk->smn", xs, ws, preferred_element_type=jnp.float32)
    x32 = xs.astype(jnp.float32)
    return parts, jnp.sum(x32 * x32, axis=-1)


def decode_gated_matmul_normed_reference(x, w_folded, *, eps: float):
    """silu(g_n) * u_n for [g, u] = x @ w_folded.T (fp32), each row scaled by rsqrt(mean(x^2) + eps) and rounded to
    x's dtype before the activation: `decode_gated_matmul_normed`'s values (w_folded = fold_norm_weight(g, w))."""
    x32 = x.astype(jnp.float32)
    inv_rms = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    prod = jnp.einsum("mk,nk->mn", x, w_folded, preferred_element_type=jnp.float32) * inv_rms
    gate, up = (p.astype(x.dtype).astype(jnp.float32) for p in jnp.split(prod, 2, axis=-1))
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def decode_gated_matmul_normed(x, w_folded, *, eps: float, config: TuningConfig | None = None,
                               interpret: bool = False):
    """The gated MLP's input to down_proj from the un-normalized residual stream: silu(.) * (.) of
    rms_norm(x) * g @ [w_gate; w_up].T, with g folded into w (`fold_norm_weight`) and the norm's row scale taken
    inside the kernel (module docstring).

    Args:
      x: [M, K] bf16, the residual stream (not normalized), 1 <= M <= 256.
      w_folded: [2I, K] bf16, the fused gate_up weight with the post-attention norm's weight folded in.
      eps: the norm's epsilon.
      config: TuningConfig; k_splits None or 1 (the norm and the activation need whole sums).
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns [M, I] in x.dtype: `decode_gated_matmul_normed_reference`'s values.
    """
    config = config or TuningConfig()
    if w_folded.ndim != 2 or w_folded.shape[0] % 2:
        raise ValueError(f"decode_gated_matmul_normed: w must be [2I, K] (gate rows, then up rows), got "
                         f"{w_folded.shape}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"decode_gated_matmul_normed: eps must be a positive float, got {eps!r}")
    dm.check_inputs(x, jax.ShapeDtypeStruct((w_folded.shape[0] // 2, w_folded.shape[1]), w_folded.dtype), config)
    if config.k_splits not in (None, 1):
        raise ValueError(f"decode_gated_matmul_normed: k_splits must be None or 1, got {config.k_splits}")
    config = dataclasses.replace(config, k_splits=1)
    dm.check_resources(x.shape[0], x.shape[1], config, gated=True, out_itemsize=jnp.dtype(x.dtype).itemsize)
    return dm._run(x, w_folded, out_dtype=jnp.dtype(x.dtype), config=config, gated=True, interpret=interpret,
                   row_norm_eps=eps)
