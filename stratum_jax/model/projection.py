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
and the [rows, 2I] product's round trip through HBM. q/k/v's split-K partials go unsummed to the fused RoPE and KV
write (`Matmul.rope_kv_write`, pallas_kernels/rope_kv_write.py): one kernel where XLA ran three. The o and down
projections' partials go unsummed (`Matmul.unsummed`) to the residual add and the norm after it
(`Matmul.residual_rmsnorm`, pallas_kernels/residual_rmsnorm.py): one kernel a layer boundary, with both outputs
written, where XLA ran three for the two boundaries of a layer and recomputed the residual stream.

With the norms folded into the weights (`DecodeKernelMatmul.norms_folded`, --fold-norms: model/fused.py `fold_norms`)
a decode layer drops both of those kernels (pallas_kernels/norm_fold.py): o's and down's residual adds run inside their
GEMMs (`Matmul.residual_matmul`), and the norms' row scales inside q/k/v's (`rope_kv_write` with `row_norm_eps`) and
gate/up's (`Matmul.gated_normed`). Each of those falls back to XLA's ops where its kernel does not take the shapes,
computing the same function (the norm weights are ones after the fold).
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp

from pallas_kernels.decode_matmul import (TuningConfig, decode_gated_matmul, decode_matmul, decode_matmul_partials,
                                          default_k_splits, sum_partials, supports)
from pallas_kernels.l2_prefetch import L2Prefetch, prefetch_plan
from pallas_kernels.norm_fold import (cluster_tiling, decode_gated_matmul_normed, decode_matmul_partials_sumsq,
                                      decode_matmul_residual, residual_resource_problem)
from pallas_kernels.residual_rmsnorm import residual_rmsnorm, supports as residual_rmsnorm_supports
from pallas_kernels.rope_kv_write import HEAD_DIMS as ROPE_KV_WRITE_HEAD_DIMS, FirstTiles, RowNorm, rope_kv_write
from stratum_jax.kv.slot_write import padding_slots


class RopeKVWrite(NamedTuple):
    """What the q/k/v projection fused with RoPE and the KV write needs beside x and the weight
    (`Matmul.rope_kv_write`): cos, sin [T, D/2] float32 of each token row's RoPE angles, the rows' write slots
    [T] int32 (>= num_slots: padding, not written), and the layer's pools k_pool, v_pool [Hkv, num_slots, D].
    first_tiles: the decode rows' page tables (pallas_kernels/rope_kv_write.py `FirstTiles`), where the write may
    prefetch attention's first K/V tiles into L2 (`DecodeKernelMatmul.l2_prefetch_mb`); None: no such prefetch."""
    cos: jax.Array
    sin: jax.Array
    slots: jax.Array
    k_pool: jax.Array
    v_pool: jax.Array
    first_tiles: FirstTiles | None = None
    # x is the un-normalised residual stream and the input norm (weight folded into w) is applied in the write, with
    # this epsilon (`Matmul.norms_folded`); None: x is already normalised.
    row_norm_eps: float | None = None


class Unsummed(NamedTuple):
    """A projection's product left as its split-K partials for the residual add that consumes it (`Matmul.unsummed`):
    parts [S, R, N] float32 (bfloat16 when S = 1), R >= the token rows (the rows past them are padding)."""
    parts: jax.Array

    def summed(self, rows: int, dtype) -> jax.Array:
        """[rows, N] in dtype: the partials summed over S in order in fp32, rounded once (as the kernels sum them)."""
        return sum_partials(self.parts[:, :rows], dtype)


class NextWeight(NamedTuple):
    """The weight of the projection a layer boundary's norm feeds (`Matmul.residual_rmsnorm`): weight [N, K] as that
    projection multiplies it, gated when it is the gated MLP's fused gate_up [2I, K] (`Matmul.gated`), else a plain
    product's (`Matmul.__call__` / `rope_kv_write`)."""
    weight: jax.Array
    gated: bool = False


class Matmul(Protocol):
    """How a model's projections multiply."""

    # The model's RMSNorm weights are folded into the projections after them (model/fused.py `fold_norms`, all norm
    # weights ones): its layers then run the folded decode layer (`rope_kv_write` with `row_norm_eps`,
    # `gated_normed`, `residual_matmul`).
    norms_folded: bool

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [..., K] @ w [N, K].T -> [..., N] in x.dtype."""

    def gated(self, x: jax.Array, w: jax.Array, next_weight: NextWeight | None = None) -> jax.Array:
        """The gated MLP's activation input: x [..., K], w [2I, K] (gate rows, then up rows) ->
        silu(x @ w[:I].T) * (x @ w[I:].T) [..., I] in x.dtype, each product rounded to x.dtype first. next_weight:
        the down projection, which the kernel may start bringing into L2 (no value changes)."""

    def rope_kv_write(self, x: jax.Array, w: jax.Array, write: RopeKVWrite,
                      num_q_heads: int) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """The fused q/k/v projection with RoPE on q and k and the K/V rows written into the pools: x [T, K], w
        [(Hq + 2 Hkv) * D, K] (q rows, then k, then v) -> (q [T, Hq, D] rotated, k_pool, v_pool), each value rounded
        as the unfused path rounds it; None where this Matmul does not fuse them (the caller then projects,
        rotates and writes as before). With `write.row_norm_eps` x is the un-normalised stream and the rows are
        scaled by their RMS (the norm's weight folded into w) before rounding; None then too where not fused (the
        caller normalises x and calls again without it)."""

    def gated_normed(self, x: jax.Array, w: jax.Array, eps: float) -> jax.Array | None:
        """`gated` of the RMS-normalised rows of x [T, K] (unit norm weight: the norm's weight is folded into w),
        with the rows' scale taken inside the GEMM; None where this Matmul does not fuse them (the caller
        normalises and calls `gated`)."""

    def residual_matmul(self, x: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array | None:
        """residual [T, N] + x [T, K] @ w [N, K].T, the product rounded to x.dtype before the add (as the unfused path
        rounds it), in one kernel; None where this Matmul does not fuse them (the caller multiplies and adds)."""

    def unsummed(self, x: jax.Array, w: jax.Array) -> Unsummed | None:
        """x [T, K] @ w [N, K].T left as split-K partials for `residual_rmsnorm`; None where this Matmul does not run
        that product on a split-K kernel whose partials `residual_rmsnorm` takes (the caller then multiplies)."""

    def residual_rmsnorm(self, residual: jax.Array, pending: Unsummed, weight: jax.Array, eps: float,
                         next_weight: NextWeight | None = None) -> tuple[jax.Array, jax.Array] | None:
        """residual [T, H] plus `pending` summed, and llama's RMSNorm of that sum: (x [T, H], x's norm times weight
        [H]), each rounded as the unfused path rounds it; None where this Matmul does not fuse them (the caller
        then sums, adds and normalises). next_weight: the projection the norm feeds, which the kernel may start
        bringing into L2 (no value changes)."""

    def prefetch_plan(self, rows: int, next_weight: NextWeight) -> L2Prefetch | None:
        """What part of next_weight the kernel before its GEMM should prefetch into L2 at `rows` token rows (the
        decode attention kernel ahead of o, pallas_kernels/l2_prefetch.py); None for no prefetch."""


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
# ... but where 64-column tiles give more CTAs than SMs and 96-column ones one CTA an SM (llama's q/k/v: 1b 192 ->
# 128 CTAs, 8b 192 -> 128), the 96-column tiles: 5.60 -> 5.32 us (1b) and 15.5 -> 15.3 us (8b) at 64 rows on the
# H200 (decode_gemm.py, BENCHMARKS.md #18 session 28).
ONE_WAVE_CONFIG = TuningConfig(tile_n=96)
# ... except a long-K projection wide enough for one CTA an SM on 128-column tiles split 4 ways (K >= 3 N, N >= 4096:
# llama-8b's down projection, 33.4 against 34.9 us at 64 rows on the H200, sessions 13 and 26; the same tiles were
# slower on llama-1b's down, 8b's q/k/v, and no faster on 8b's o).
LONG_K_CONFIG = TuningConfig(tile_n=128, k_splits=4)
_NUM_SMS = 132      # H100 / H200


def _ctas(n: int, k: int, config: TuningConfig) -> int:
    """The kernel's grid size for an [n, k] weight under config: column tiles times the split."""
    return n // config.tile_n * (config.k_splits or default_k_splits(n, k, config.tile_n))


def kernel_config(rows: int, n: int, k: int) -> TuningConfig | None:
    """The plain kernel's config for an [rows, k] x [n, k] product (LONG_K_CONFIG where it applies and fits a CTA,
    ONE_WAVE_CONFIG where it makes one CTA an SM of what KERNEL_CONFIG makes more than an SM's worth of, else
    KERNEL_CONFIG); None where none fits (`decode_matmul.supports`)."""
    order = (LONG_K_CONFIG, KERNEL_CONFIG) if n >= 4096 and k >= 3 * n else (KERNEL_CONFIG,)
    if (n % ONE_WAVE_CONFIG.tile_n == 0 and n % KERNEL_CONFIG.tile_n == 0
            and _ctas(n, k, KERNEL_CONFIG) > _NUM_SMS >= _ctas(n, k, ONE_WAVE_CONFIG)):
        order = (ONE_WAVE_CONFIG,) + order
    return next((c for c in order if supports(rows, n, k, c)), None)


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
# else wider tiles: 112 columns with 5 stages where they divide I (llama-8b: 128 CTAs, 58.3 against 59.2 us for
# 128-column tiles with 4 stages, 112 CTAs; decode_gemm.py --parts gate_up_act, BENCHMARKS.md #18 session 28), then
# 128 with 4 stages (the fastest of five configs at 8b in session 25). At 65-128 rows a wide tile's two
# accumulators would take more than 128 registers a thread: the narrow one then (not timed).
GATED_NARROW_CONFIG = TuningConfig(tile_n=64, num_stages=6)
GATED_WIDE_CONFIGS = (TuningConfig(tile_n=112, num_stages=5), TuningConfig(tile_n=128, num_stages=4))


def gated_kernel_config(i: int, rows: int, k: int) -> TuningConfig | None:
    """The gated kernel's TuningConfig for I output columns at `rows` token rows and K (see GATED_NARROW_CONFIG);
    None when none fits a CTA (`decode_matmul.supports`)."""
    order = ((GATED_NARROW_CONFIG, *GATED_WIDE_CONFIGS) if i // GATED_NARROW_CONFIG.tile_n <= _NUM_SMS
             else (*GATED_WIDE_CONFIGS, GATED_NARROW_CONFIG))
    return next((c for c in order if supports(rows, i, k, c, gated=True)), None)


def kernel_takes(rows: int, n: int, k: int, dtype) -> bool:
    """Whether `DecodeKernelMatmul` sends an [rows, k] x [n, k] product to the kernel."""
    return (jnp.dtype(dtype) == jnp.bfloat16 and rows <= KERNEL_MAX_ROWS and n <= KERNEL_MAX_COLUMNS
            and kernel_config(rows, n, k) is not None)


def rope_kv_write_takes(rows: int, n: int, k: int, dtype, pool_dtype, head_dim: int) -> bool:
    """Whether `DecodeKernelMatmul.rope_kv_write` fuses the q/k/v projection of [rows, k] x [n, k] with RoPE and the
    KV write: where the projection runs on the kernel, into bf16 pools, at a head_dim the fused kernel takes."""
    return (kernel_takes(rows, n, k, dtype) and jnp.dtype(pool_dtype) == jnp.bfloat16
            and head_dim in ROPE_KV_WRITE_HEAD_DIMS and n % head_dim == 0)


def unsummed_kernel_config(rows: int, n: int, k: int, dtype) -> TuningConfig | None:
    """The kernel's config where `DecodeKernelMatmul.unsummed` leaves [rows, k] x [n, k] as partials (the product
    runs on the kernel and the residual add + norm kernel takes its partials), else None."""
    if not kernel_takes(rows, n, k, dtype):
        return None
    config = kernel_config(rows, n, k)
    splits = config.k_splits or default_k_splits(n, k, config.tile_n)
    return config if residual_rmsnorm_supports(splits, rows, n, jnp.float32 if splits > 1 else dtype) else None


def residual_kernel_config(rows: int, n: int, k: int, dtype, *, one_block: bool = False) -> TuningConfig | None:
    """`DecodeKernelMatmul.residual_matmul`'s config for [rows, k] x [n, k]: the plain kernel's ring, its K split as
    one two-block cluster on narrower column tiles (`norm_fold.cluster_tiling`; one_block: the plain tile, no
    split); None where the product does not run on the kernel or the cluster's CTA would not fit."""
    if not kernel_takes(rows, n, k, dtype):
        return None
    config = kernel_config(rows, n, k)
    padded = -(-rows // 64) * 64
    tile_n, splits = (config.tile_n, 1) if one_block else cluster_tiling(n, k, config.tile_n, padded)
    config = dataclasses.replace(config, tile_n=tile_n, k_splits=splits)
    return None if residual_resource_problem(padded, k, config) else config


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
    interpreter (CPU tests). l2_prefetch_mb: the residual add + norm kernel (ahead of q/k/v and gate/up), the gated
    GEMM (ahead of down) and, through `prefetch_plan`, the decode attention kernel (ahead of o) also prefetch into L2
    up to this many MB of the next projection's weight, the tiles its GEMM reads first (pallas_kernels/l2_prefetch.py);
    and, any budget > 0, the fused q/k/v write prefetches each decode row's first K/V tile for attention (given
    `RopeKVWrite.first_tiles`). 0: off. norms_folded: the `Matmul` attribute (set by the engine once the weights are
    folded)."""

    interpret: bool = False
    l2_prefetch_mb: float = 0.0
    norms_folded: bool = False

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        rows = math.prod(x.shape[:-1])
        n, k = w.shape
        if not kernel_takes(rows, n, k, x.dtype) or w.dtype != x.dtype:
            return xla_matmul(x, w)
        y = decode_matmul(x.reshape(rows, k), w, config=kernel_config(rows, n, k), interpret=self.interpret)
        return y.reshape(*x.shape[:-1], n)

    def gated(self, x: jax.Array, w: jax.Array, next_weight: NextWeight | None = None) -> jax.Array:
        rows = math.prod(x.shape[:-1])
        i, k = w.shape[0] // 2, w.shape[1]
        if not gated_kernel_takes(rows, i, k, x.dtype) or w.dtype != x.dtype or w.shape[0] % 2:
            return xla_gated(x, w)
        y = decode_gated_matmul(x.reshape(rows, k), w, config=gated_kernel_config(i, rows, k),
                                interpret=self.interpret, **self._prefetch_kwargs(rows, next_weight))
        return y.reshape(*x.shape[:-1], i)

    def rope_kv_write(self, x: jax.Array, w: jax.Array, write: RopeKVWrite,
                      num_q_heads: int) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        rows, k = x.shape
        num_kv_heads, num_slots, head_dim = write.k_pool.shape
        if (not rope_kv_write_takes(rows, w.shape[0], k, x.dtype, write.k_pool.dtype, head_dim)
                or w.dtype != x.dtype or write.v_pool.dtype != write.k_pool.dtype):
            return None
        # The projection's split-K partials [S, R, N] (R: rows rounded up to 64) go to the fused kernel unsummed; the
        # padding rows get rotation angles 0 and slots past the pool (not written).
        config = kernel_config(rows, w.shape[0], k)
        row_norm = None
        if write.row_norm_eps is None:
            parts = decode_matmul_partials(x, w, config=config, interpret=self.interpret)
        else:       # the folded input norm: each split's sums of x^2 beside its partials, the scale in the write
            parts, sumsq = decode_matmul_partials_sumsq(x, w, config=config, interpret=self.interpret)
            row_norm = RowNorm(sumsq, k, write.row_norm_eps)
        pad = parts.shape[1] - rows
        cos, sin = (jnp.pad(a, ((0, pad), (0, 0))) for a in (write.cos, write.sin))
        slots = jnp.concatenate([write.slots.astype(jnp.int32),
                                 padding_slots(num_slots, jnp.arange(rows, rows + pad, dtype=jnp.int32))])
        # With a prefetch budget, the write also brings each decode row's first K/V tile into L2 for attention.
        first_tiles = write.first_tiles if self.l2_prefetch_mb > 0 else None
        with jax.named_scope("kv_write"):       # the profile's part for the fused kernel (the GEMM stays q/k/v's)
            q, k_pool, v_pool = rope_kv_write(parts, cos, sin, slots, write.k_pool, write.v_pool,
                                              num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                              first_tiles=first_tiles, row_norm=row_norm, interpret=self.interpret)
        return q[:rows], k_pool, v_pool

    def gated_normed(self, x: jax.Array, w: jax.Array, eps: float) -> jax.Array | None:
        rows, (n2, k) = x.shape[0], w.shape
        if x.ndim != 2 or w.dtype != x.dtype or n2 % 2 or not gated_kernel_takes(rows, n2 // 2, k, x.dtype):
            return None
        return decode_gated_matmul_normed(x, w, eps=eps, config=gated_kernel_config(n2 // 2, rows, k),
                                          interpret=self.interpret)

    def residual_matmul(self, x: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array | None:
        n, k = w.shape
        if (x.ndim != 2 or w.dtype != x.dtype or residual.shape != (x.shape[0], n) or residual.dtype != x.dtype):
            return None
        # Interpreted, the split stays in one block: jax 0.11.2's interpreter deadlocks now and then on a cluster
        # barrier of several blocks (pallas_kernels/norm_fold.py's docstring).
        config = residual_kernel_config(x.shape[0], n, k, x.dtype, one_block=self.interpret)
        if config is None:
            return None
        return decode_matmul_residual(x, w, residual, config=config, interpret=self.interpret)

    def unsummed(self, x: jax.Array, w: jax.Array) -> Unsummed | None:
        n, k = w.shape
        config = unsummed_kernel_config(x.shape[0], n, k, x.dtype) if x.ndim == 2 and w.dtype == x.dtype else None
        if config is None:
            return None
        return Unsummed(decode_matmul_partials(x, w, config=config, interpret=self.interpret))

    def residual_rmsnorm(self, residual: jax.Array, pending: Unsummed, weight: jax.Array, eps: float,
                         next_weight: NextWeight | None = None) -> tuple[jax.Array, jax.Array] | None:
        splits, _, hidden = pending.parts.shape
        if (residual.ndim != 2 or residual.dtype != jnp.bfloat16 or weight.dtype != jnp.bfloat16
                or not residual_rmsnorm_supports(splits, residual.shape[0], hidden, pending.parts.dtype)):
            return None
        return residual_rmsnorm(pending.parts, residual, weight, eps=eps, interpret=self.interpret,
                                **self._prefetch_kwargs(residual.shape[0], next_weight))

    def _prefetch_kwargs(self, rows: int, next_weight: NextWeight | None) -> dict:
        """A kernel's prefetch_weight / prefetch keywords for next_weight at `rows` token rows (`prefetch_plan`),
        or {} for no prefetch."""
        plan = None if next_weight is None else self.prefetch_plan(rows, next_weight)
        return {} if plan is None else dict(prefetch_weight=next_weight.weight, prefetch=plan)

    def prefetch_plan(self, rows: int, next_weight: NextWeight) -> L2Prefetch | None:
        """What of next_weight to prefetch ahead of its GEMM at `rows` token rows: the first l2_prefetch_mb MB of
        it (all of it when smaller), spread over the starts of the GEMM's K splits, which its CTAs read first;
        None when prefetching is off or the projection does not run on this Matmul's kernel."""
        w = next_weight.weight
        if self.l2_prefetch_mb <= 0 or w.ndim != 2 or w.dtype != jnp.bfloat16:
            return None
        n, k = w.shape
        if next_weight.gated:
            if not gated_kernel_takes(rows, n // 2, k, w.dtype):
                return None
            splits = 1
        else:
            if not kernel_takes(rows, n, k, w.dtype):
                return None
            config = kernel_config(rows, n, k)
            splits = config.k_splits or default_k_splits(n, k, config.tile_n)
        return prefetch_plan((n, k), splits=splits, fraction=min(1.0, self.l2_prefetch_mb * 2**20 / (n * k * 2)))


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


def l2_prefetch_note(l2_prefetch_mb: float, projections: str, attention_backend: str) -> str | None:
    """What --l2-prefetch-mb does in an engine with these resolved backends, for the start-up log (None when off)."""
    if l2_prefetch_mb <= 0:
        return None
    if projections != "kernel":
        return (f"--l2-prefetch-mb {l2_prefetch_mb:g} has no effect: it needs the Pallas projections (--projections "
                f"resolved to {projections!r})")
    ahead_of_o = ("o (by the decode attention kernel, bf16 pools, --decode-kernel swapped)"
                  if attention_backend == "kernel" else "not o (the attention is not the Pallas kernel)")
    return (f"L2 prefetch: up to {l2_prefetch_mb:g} MB of each decode GEMM's weight ahead of it: q/k/v and gate/up "
            f"(by the norm kernels), down (by the gate/up GEMM), {ahead_of_o}; each decode row's first 64 keys and "
            f"values ahead of attention (by the fused q/k/v write)")


def fold_norms_note(fold_norms: bool, norms_folded: bool, projections: str) -> str | None:
    """What --fold-norms does in an engine with these resolved projections, for the start-up log (None: nothing to
    say). norms_folded: the model's weights are folded (by this engine, or by another sharing the model)."""
    if norms_folded and projections == "kernel":
        return ("norms folded into q/k/v and gate/up: a decode layer runs 6 kernels (the residual adds and the norms "
                "inside the GEMMs; pallas_kernels/norm_fold.py)")
    if norms_folded:
        return ("the model's norm weights are folded into q/k/v and gate/up (by another engine on this model); the "
                f"steps run the unfused layer on them (--projections resolved to {projections!r}), the same function")
    if fold_norms:
        return (f"--fold-norms has no effect: it needs the Pallas projections (--projections resolved to "
                f"{projections!r})")
    return None


def step_matmul(projections: str, *, interpret: bool, l2_prefetch_mb: float = 0.0,
                norms_folded: bool = False) -> Matmul | None:
    """The Matmul a step runs for a resolved --projections value (None: the model's default, XLA's dot).
    norms_folded: the model's norm weights are folded (--fold-norms); only the kernel path runs the folded layer."""
    return (DecodeKernelMatmul(interpret=interpret, l2_prefetch_mb=l2_prefetch_mb, norms_folded=norms_folded)
            if projections == "kernel" else None)
