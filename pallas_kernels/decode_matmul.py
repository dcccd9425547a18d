"""Weight-streaming GEMM for the decode step: y = x @ w.T with few rows (a Pallas Mosaic GPU kernel for Hopper).

In a decode step every projection multiplies a handful of token rows (M <= 64 at batch 64) by a large weight
matrix, so the GEMM is bound by reading the weights once: the byte floor is N * K * 2 bytes over the read
bandwidth. XLA's GEMMs reach 35-68% of that floor on the small llama-1b projections (BENCHMARKS.md, "The decode
step, profiled by model part"): their output tiles give too few thread blocks to keep every SM streaming.

Design
------
*Grid.* One CTA (one warpgroup) per (output column tile n, K split s). The CTA streams its weight slab
w[n * tile_n : +tile_n, s * K/S : +K/S] through a ring of `num_stages` SMEM buffers (TMA copies of
[tile_n, tile_k] tiles, 128-byte swizzled), alongside the matching [M, tile_k] tile of x (re-read from L2 by
every CTA; x is tiny), and accumulates x @ w_tile.T with WGMMA into a [M, tile_n] fp32 accumulator. The
weight tile is WGMMA's B operand as it lies in memory (K-major, torch's [out, in] layout), so nothing is
transposed. The pipeline is `plgpu.emit_pipeline` with one WGMMA left in flight (delay_release=1).

*Split-K.* A projection with few output tiles (llama-1b's o_proj and down_proj: N = 2048, 16 tiles of 128) would
run on 16 of 132 SMs; splitting K over S CTAs gives every SM a slab. Each split writes an fp32 partial
[S, M, N] and the wrapper sums them (XLA fuses that sum into the consumer, e.g. the residual add). The partials
are M * N * 4 bytes per split, small beside the weights at decode sizes, and stay in L2.

*Rows.* M is padded to a multiple of 64 (WGMMA's M); rows past M are zeros and their outputs are dropped.

Numerics: bf16 inputs, fp32 accumulation, output rounded once to `out_dtype` (split-K sums the fp32
partials first), as XLA's dot with fp32 accumulation does.

*Gated variant* (`decode_gated_matmul`): the gated MLP's input to down_proj, silu(x @ w_gate.T) * (x @ w_up.T),
from the engine's fused gate_up weight [2I, K] (gate rows, then up rows). Each CTA streams the gate rows and the
up rows of its output columns (two weight tiles a step, two accumulators) and applies the activation in its
epilogue, so the step has no separate activation kernel and never writes the [M, 2I] product. No split-K (the
activation is not linear); llama's gate/up has enough output tiles to fill the GPU without it.

*L2 prefetch (gated, optional).* Given the down projection's weight and an `L2Prefetch` plan, each CTA, once its own
weight tiles are all in, issues TMA prefetches of its share of the tiles the down GEMM reads first
(pallas_kernels/l2_prefetch.py): HBM, idle in the grid's drain, starts on the next kernel's bytes. No value changes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels._interpret import interpret_mode_active, mosaic_gpu_interpret
from pallas_kernels.cluster_exchange import fence_for_peers
from pallas_kernels.l2_prefetch import L2Prefetch, check_prefetch_args, issue_prefetch

_ROWS = 64             # WGMMA M
_TILE_K = 64           # bf16 elements in one 128-byte swizzled row: one WGMMA K group per tile
_NUM_SMS = 132         # H100 SXM / H200; for the default split only
_MAX_ROWS = 256        # beyond this the GEMM is no longer weight-bound: use XLA's
_SMEM_LIMIT = 226 * 1024   # the H100/H200's 227 KB of dynamic SMEM a CTA, less 1 KB for barriers and alignment
_ACC_REGISTERS = 128       # fp32 accumulator registers a thread may hold (of 255; addressing, epilogue: the rest)
_TRANSFORMS = (plgpu.TilingTransform((8, _TILE_K)), plgpu.SwizzleTransform(128))
_ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)      # [rows] vectors: one value a row of a WGMMA accumulator


@dataclasses.dataclass(frozen=True)
class TuningConfig:
    """Static knobs (each distinct config compiles its own kernel).

    Attributes:
      tile_n: output columns per CTA, a multiple of 8 up to 256 (WGMMA's N): 64 and 128 in most of the engine's
        configs; a width in between (96, 112) where it makes the column tiles one CTA an SM.
      num_stages: weight tiles in flight per CTA (SMEM ring depth), >= 2. SMEM per CTA is about
        num_stages * (tile_n + M) * 128 bytes plus the output tile.
      k_splits: CTAs sharing one column tile's K range (split-K); None picks one from the grid size.
    """

    tile_n: int = 128
    num_stages: int = 6
    k_splits: int | None = None

    def __post_init__(self):
        if not isinstance(self.tile_n, int) or self.tile_n % 8 or not 8 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 8 in [8, 256], got {self.tile_n!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"num_stages must be an int >= 2, got {self.num_stages!r}")
        if self.k_splits is not None and (not isinstance(self.k_splits, int) or not 1 <= self.k_splits <= 64):
            raise ValueError(f"k_splits must be None or an int in [1, 64], got {self.k_splits!r}")


def fills_the_gpu(ctas: int) -> bool:
    """Whether a grid of `ctas` one-CTA-an-SM blocks is about one wave: the split rules stop growing there."""
    return ctas >= _NUM_SMS * 0.9


def default_k_splits(n: int, k: int, tile_n: int) -> int:
    """The smallest split that gives at least about one CTA per SM, keeping each split's K range a
    whole number of at least 4 tiles (so the pipeline has something to overlap)."""
    tiles = n // tile_n
    k_tiles = k // _TILE_K
    best = 1
    for s in range(1, 65):
        if k_tiles % s or k_tiles // s < 4:
            continue
        best = s
        if fills_the_gpu(tiles * s):
            break
    return best


def decode_matmul_reference(x, w, *, out_dtype=None):
    """x [M, K] @ w[N, K].T with fp32 accumulation -> [M, N] in out_dtype (default x.dtype)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return jnp.einsum("mk,nk->mn", x, w, preferred_element_type=jnp.float32).astype(out_dtype)


def sum_partials(parts, dtype):
    """Split-K partials [S, ...] -> their sum over S in order, in fp32, rounded once to dtype: how the consumers of
    `decode_matmul_partials` (the fused RoPE/KV write, the residual add + norm) and their references sum them."""
    y = parts[0].astype(jnp.float32)
    for s in range(1, parts.shape[0]):
        y = y + parts[s].astype(jnp.float32)
    return y.astype(dtype)


def decode_gated_matmul_reference(x, w):
    """silu(x @ w[:I].T) * (x @ w[I:].T) for w [2I, K], each product rounded to x.dtype first (as XLA's dot
    and then the activation compute it) -> [M, I] in x.dtype."""
    gate, up = jnp.split(decode_matmul_reference(x, w), 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)


def check_inputs(x, w, config: TuningConfig) -> None:
    """Raises ValueError, saying what to fix, for shapes and dtypes the kernel does not take."""
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"decode_matmul: x must be [M, K] and w [N, K], got {x.shape} and {w.shape}")
    (m, k), (n, k2) = x.shape, w.shape
    if k != k2:
        raise ValueError(f"decode_matmul: K mismatch: x has {k} columns, w has {k2}")
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"decode_matmul: x and w must be bfloat16, got {x.dtype} and {w.dtype}")
    if not 1 <= m <= _MAX_ROWS:
        raise ValueError(f"decode_matmul: M must be in [1, {_MAX_ROWS}] (a decode step's rows), got {m}")
    if k % _TILE_K:
        raise ValueError(f"decode_matmul: K ({k}) must be a multiple of {_TILE_K}")
    if n % config.tile_n:
        raise ValueError(f"decode_matmul: N ({n}) must be a multiple of tile_n ({config.tile_n})")
    if config.k_splits is not None and (k // _TILE_K) % config.k_splits:
        raise ValueError(f"decode_matmul: K / {_TILE_K} ({k // _TILE_K}) must be a multiple of k_splits "
                         f"({config.k_splits})")


def cta_resources(m: int, k: int, config: TuningConfig, *, gated: bool = False,
                  out_itemsize: int = 2) -> tuple[int, int]:
    """(SMEM bytes, fp32 accumulator registers a thread) of one CTA for M rows and K (config.k_splits resolved;
    None counts as 1): the ring of [rows, 64] x tiles and one (gated: two) [tile_n, 64] weight tiles a stage, and
    the [rows, tile_n] output tile (out_itemsize: 4 for split-K's fp32 partials)."""
    rows = -(-m // _ROWS) * _ROWS
    weight_tiles = 2 if gated else 1
    stages = min(config.num_stages, k // (config.k_splits or 1) // _TILE_K)
    smem = stages * (rows + weight_tiles * config.tile_n) * _TILE_K * 2 + rows * config.tile_n * out_itemsize
    return smem, weight_tiles * rows * config.tile_n // 128


def resource_problem(m: int, k: int, config: TuningConfig, *, gated: bool, out_itemsize: int) -> str | None:
    """What to lower when a CTA would need more SMEM or accumulator registers than the GPU gives (the compile
    would fail on the GPU; the interpreter has no such limit), else None."""
    smem, regs = cta_resources(m, k, config, gated=gated, out_itemsize=out_itemsize)
    if smem > _SMEM_LIMIT:
        return (f"{m} rows with {config} need {smem // 1024} KB of SMEM a CTA (at most {_SMEM_LIMIT // 1024}): "
                "lower num_stages or tile_n")
    if regs > _ACC_REGISTERS:
        return (f"{m} rows with tile_n={config.tile_n} need {regs} accumulator registers a thread (at most "
                f"{_ACC_REGISTERS}): lower tile_n")
    return None


def check_resources(m: int, k: int, config: TuningConfig, *, gated: bool, out_itemsize: int) -> None:
    """Raises ValueError with `resource_problem`'s message, if any."""
    problem = resource_problem(m, k, config, gated=gated, out_itemsize=out_itemsize)
    if problem:
        raise ValueError(f"decode_matmul: {problem}")


def supports(m: int, n: int, k: int, config: TuningConfig | None = None, *, gated: bool = False) -> bool:
    """Whether `decode_matmul` (gated: `decode_gated_matmul`, n its I) takes these shapes under config, SMEM and
    registers included (for callers choosing between it and XLA's dot)."""
    config = config or TuningConfig()
    if not (1 <= m <= _MAX_ROWS and k % _TILE_K == 0 and n % config.tile_n == 0):
        return False
    splits = 1 if gated else config.k_splits or default_k_splits(n, k, config.tile_n)
    if (k // _TILE_K) % splits or (gated and config.k_splits not in (None, 1)):
        return False
    return resource_problem(m, k, dataclasses.replace(config, k_splits=splits), gated=gated,
                            out_itemsize=4 if splits > 1 else 2) is None


def decode_matmul(x, w, *, out_dtype=None, config: TuningConfig | None = None, interpret: bool = False):
    """y = x @ w.T for a decode step's few rows, streaming w once (Mosaic GPU kernel).

    Args:
      x: [M, K] bf16 activations, 1 <= M <= 256.
      w: [N, K] bf16 weight in torch's [out_features, in_features] layout; K a multiple of 64, N a multiple
        of config.tile_n.
      out_dtype: output dtype (default x.dtype).
      config: TuningConfig; k_splits None picks `default_k_splits`.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns [M, N] in out_dtype.
    """
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    config = _checked_config(x, w, config, out_dtype)
    return _run(x, w, out_dtype=out_dtype, config=config, gated=False, interpret=interpret)


def decode_matmul_partials(x, w, *, config: TuningConfig | None = None, interpret: bool = False):
    """`decode_matmul`'s product before its split-K sum, for a consumer that sums it itself (the fused RoPE and
    KV write, pallas_kernels/rope_kv_write.py): x [M, K] bf16, w [N, K] bf16 -> [S, R, N], S = the config's
    split (default_k_splits when None), R = M rounded up to 64 (rows past M are zeros); float32 when S > 1, else
    x.dtype. Summed over S and rounded to x.dtype, its first M rows are `decode_matmul(x, w)`."""
    out_dtype = jnp.dtype(x.dtype)
    config = _checked_config(x, w, config, out_dtype)
    return _run(x, w, out_dtype=out_dtype, config=config, gated=False, interpret=interpret, partials=True)


def _checked_config(x, w, config: TuningConfig | None, out_dtype) -> TuningConfig:
    """The plain kernel's config with its split resolved (default_k_splits when None), after the shape and CTA
    resource checks (each raises ValueError saying what to fix)."""
    config = config or TuningConfig()
    check_inputs(x, w, config)
    if config.k_splits is None:
        config = dataclasses.replace(config, k_splits=default_k_splits(w.shape[0], w.shape[1], config.tile_n))
    check_resources(x.shape[0], x.shape[1], config, gated=False,
                    out_itemsize=4 if config.k_splits > 1 else out_dtype.itemsize)
    return config


def _run(x, w, *, out_dtype, config, gated, interpret, partials=False, prefetch_weight=None, prefetch=None,
         residual=None, row_norm_eps=None, row_sumsq=False, exchange="l2"):
    """`_decode_matmul` compiled, or in the Mosaic GPU interpreter (interpret, or inside an active one); the
    static `interpreted` keeps the two traces apart in jit's cache."""
    kwargs = dict(out_dtype=out_dtype, config=config, gated=gated, partials=partials, prefetch=prefetch,
                  row_norm_eps=row_norm_eps, row_sumsq=row_sumsq, exchange=exchange)
    if interpret:
        with mosaic_gpu_interpret():
            return _decode_matmul(x, w, prefetch_weight, residual, interpreted=True, **kwargs)
    return _decode_matmul(x, w, prefetch_weight, residual, interpreted=interpret_mode_active(), **kwargs)


def decode_gated_matmul(x, w, *, config: TuningConfig | None = None, prefetch_weight=None,
                        prefetch: L2Prefetch | None = None, interpret: bool = False):
    """silu(x @ w_gate.T) * (x @ w_up.T) for a decode step's few rows, streaming w once (module docstring).

    Args:
      x: [M, K] bf16 activations, 1 <= M <= 256.
      w: [2I, K] bf16: the gate projection's I rows, then the up projection's (the engine's fused gate_up_proj
        on one device); K a multiple of 64, I a multiple of config.tile_n.
      config: TuningConfig; its k_splits must be None or 1 (the activation needs whole sums).
      prefetch_weight: the next GEMM's bf16 weight [N', K'] (the down projection's), with `prefetch` the part of it
        to bring into L2 as the CTAs finish streaming w; both or neither.
      prefetch: an `L2Prefetch` plan for prefetch_weight's shape.
      interpret: run in the Mosaic GPU interpreter on CPU (tests).
    Returns [M, I] in x.dtype; both products are rounded to x.dtype before the activation, as the unfused path
    (XLA's dot, then silu(gate) * up) rounds them.
    """
    config = config or TuningConfig()
    if w.ndim != 2 or w.shape[0] % 2:
        raise ValueError(f"decode_gated_matmul: w must be [2I, K] (gate rows, then up rows), got {w.shape}")
    check_inputs(x, jax.ShapeDtypeStruct((w.shape[0] // 2, w.shape[1]), w.dtype), config)    # gate's half
    if config.k_splits not in (None, 1):
        raise ValueError(f"decode_gated_matmul: k_splits must be None or 1 (the activation needs whole sums), "
                         f"got {config.k_splits}")
    config = dataclasses.replace(config, k_splits=1)
    check_resources(x.shape[0], x.shape[1], config, gated=True, out_itemsize=jnp.dtype(x.dtype).itemsize)
    check_prefetch_args("decode_gated_matmul", prefetch_weight, prefetch)
    return _run(x, w, out_dtype=jnp.dtype(x.dtype), config=config, gated=True, interpret=interpret,
                prefetch_weight=prefetch_weight, prefetch=prefetch)


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "gated", "interpreted", "partials", "prefetch",
                                             "row_norm_eps", "row_sumsq", "exchange"))
def _decode_matmul(x, w, prefetch_weight=None, residual=None, *, out_dtype, config, gated=False, interpreted=False,
                   partials=False, prefetch=None, row_norm_eps=None, row_sumsq=False, exchange="l2"):
    # `interpreted` only keys the jit cache: interpreted and compiled traces never share an entry. partials: the
    # kernel's [S, R, N] output as it is (`decode_matmul_partials`). prefetch: an L2Prefetch of prefetch_weight.
    # residual [M, N]: the split-K summed inside the kernel's cluster and added to it (`cluster_residual`), the
    # partials exchanged through `exchange` ("dsmem": the peers' shared memory; "l2": a global buffer).
    # row_norm_eps: the rows' RMS scale applied in the gated epilogue; row_sumsq (partials): also the rows' sums of
    # squares of x over each split's K range, [S, R] fp32 (pallas_kernels/norm_fold.py).
    del interpreted
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]       # output columns
    rows = -(-m // _ROWS) * _ROWS
    if rows != m:
        x = jnp.pad(x, ((0, rows - m), (0, 0)))
        if residual is not None:
            residual = jnp.pad(residual, ((0, rows - m), (0, 0)))
    splits = config.k_splits
    partial_dtype = out_dtype if splits == 1 or residual is not None else jnp.dtype(jnp.float32)
    kernel = _build_kernel(rows=rows, n=n, k=k, out_dtype=partial_dtype, config=config, gated=gated,
                           prefetch=prefetch, row_norm_eps=row_norm_eps,
                           cluster_residual=exchange if residual is not None else None, row_sumsq=row_sumsq)
    if residual is not None:
        y = kernel(x, w, residual)
        return (y[0] if exchange == "l2" else y)[:m]     # l2: the second output is the exchange buffer
    y = kernel(x, w, *(() if prefetch is None else (prefetch_weight,)))
    if row_sumsq:
        return y          # (partials [S, rows, N], sums of squares [S, rows])
    if partials:
        return y
    y = y[0] if splits == 1 else jnp.sum(y, axis=0)
    return y[:m].astype(out_dtype)


def _build_kernel(*, rows, n, k, out_dtype, config, gated=False, prefetch=None, row_norm_eps=None,
                  cluster_residual=None, row_sumsq=False):
    """Returns f(x [rows, K], w [N, K]) -> [S, rows, N] partials (S = config.k_splits) in out_dtype; gated:
    f(x, w [2N, K]) -> [1, rows, N], silu(x @ w[:N].T) * (x @ w[N:].T) (`decode_gated_matmul`). prefetch: f takes
    the next weight as a third argument and each CTA prefetches its share of the plan once its tiles are in.
    row_norm_eps (gated only): each product is scaled by its row's rsqrt(mean(x^2) + eps) before the activation,
    the mean taken over the x tiles the CTA streams anyway (`pallas_kernels/norm_fold.py`). cluster_residual
    ("dsmem" or "l2"): f(x, w, residual [rows, N]) -> residual + x @ w.T [rows, N] in out_dtype: a column tile's S
    splits run as one cluster and sum their partials inside the kernel, read from the peers' shared memory
    ("dsmem") or through an [S, rows, N] fp32 exchange buffer in global memory ("l2", a second output). row_sumsq
    (plain): f(x, w) -> (partials, [S, rows] fp32 sums of x^2 over each split's K range), the rows' norm statistic
    for the kernel that sums the partials (rope_kv_write's row_norm)."""
    tile_n, splits = config.tile_n, config.k_splits
    k_len = k // splits
    k_steps = k_len // _TILE_K
    stages = min(config.num_stages, k_steps)
    row_norm = row_norm_eps is not None
    if row_norm and (not gated or splits != 1):
        raise ValueError("row_norm_eps is for the gated kernel, which has no split-K")
    if row_sumsq and (gated or cluster_residual or prefetch is not None):
        raise ValueError("row_sumsq is for the plain kernel's partials")
    row_stats = row_norm or row_sumsq       # the x tiles' sums of squares are accumulated
    rows_per_split = rows // splits      # cluster_residual: the rows each split sums and writes

    def body(x_gmem, w_gmem, *rest):
        if cluster_residual == "l2":
            residual_gmem, out_gmem, parts_gmem, out_smem, part_smem, res_smem, barriers = rest
            next_weight = []
        elif cluster_residual:
            residual_gmem, out_gmem, out_smem, part_smem, res_smem, barriers = rest
            parts_gmem, next_weight = None, []
        elif row_sumsq:
            out_gmem, sumsq_gmem, out_smem, sumsq_smem = rest
            next_weight = []
        else:
            *next_weight, out_gmem, out_smem = rest
        col = lax.axis_index("n")
        split = lax.axis_index("k")
        n0 = pl.multiple_of(col * tile_n, tile_n)
        k0 = pl.multiple_of(split * k_len, _TILE_K)

        # The weight rows this CTA streams: its tile_n rows, or (gated) its gate rows and the matching up rows.
        w_rows = [n0, n + n0] if gated else [n0]
        if cluster_residual:
            # The residual rows this block will add come in while the GEMM runs: off the epilogue's chain (dsmem:
            # the whole tile's, see _cluster_sum_and_add).
            r0 = pl.multiple_of(split * rows_per_split, rows_per_split)
            res_rows = pl.ds(r0, rows_per_split) if cluster_residual == "l2" else pl.ds(0, rows)
            plgpu.copy_gmem_to_smem(residual_gmem.at[res_rows, pl.ds(n0, tile_n)], res_smem, barriers[-1])

        def accumulate(*acc_refs):
            def step(_, x_tile, *w_tiles_and_carry):
                w_tiles = w_tiles_and_carry[:len(acc_refs)]
                for acc_ref, w_tile in zip(acc_refs, w_tiles, strict=True):
                    plgpu.wgmma(acc_ref, x_tile, w_tile.transpose((1, 0)))
                if row_stats:
                    # The rows' sums of squares from the x tile the WGMMA reads (SMEM, already in): the norm's
                    # statistic costs no extra bytes, only a register pass over a [rows, 64] tile a step.
                    x32 = plgpu.load(x_tile, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                    carry = w_tiles_and_carry[-1] + jnp.sum(x32 * x32, axis=1)
                plgpu.wgmma_wait(1)      # keep one WGMMA in flight; its slot is released a step late
                return carry if row_stats else None

            w_spec = plgpu.BlockSpec((tile_n, _TILE_K), lambda kk: (0, kk), transforms=_TRANSFORMS, delay_release=1)
            init = plgpu.layout_cast(jnp.zeros((rows,), jnp.float32), _ROW_LAYOUT) if row_stats else None
            pipeline = plgpu.emit_pipeline(
                step, grid=(k_steps,), max_concurrent_steps=stages, init_carry=init,
                in_specs=[
                    plgpu.BlockSpec((rows, _TILE_K), lambda kk: (0, kk), transforms=_TRANSFORMS, delay_release=1),
                    *[w_spec] * len(w_rows),
                ])
            sumsq = pipeline(x_gmem.at[:, pl.ds(k0, k_len)],
                             *[w_gmem.at[pl.ds(r0, tile_n), pl.ds(k0, k_len)] for r0 in w_rows])
            plgpu.wgmma_wait(0)
            return tuple(acc_ref[...] for acc_ref in acc_refs) + ((sumsq,) if row_stats else ())

        accs = pl.run_scoped(accumulate, *[plgpu.ACC((rows, tile_n), jnp.float32)] * len(w_rows))
        if row_stats:
            *accs, sumsq = accs
        if row_sumsq:
            # Every column tile's CTA of a split has the same sums: the first column tile's writes them.
            @pl.when(col == 0)
            def _():
                sumsq_smem[...] = sumsq
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(sumsq_smem, sumsq_gmem.at[split])
        if row_norm:
            inv_rms = lax.rsqrt(sumsq * (1.0 / k) + row_norm_eps)
            accs = [a * lax.broadcast_in_dim(inv_rms, a.shape, [0]) for a in accs]
        if prefetch is not None:       # this CTA's weight tiles are all in: HBM can start on the next kernel's
            issue_prefetch(next_weight[0], prefetch, cta=split * (n // tile_n) + col, num_ctas=n // tile_n * splits)
        if cluster_residual:
            _cluster_sum_and_add(accs[0], split, r0, n0, out_gmem=out_gmem, parts_gmem=parts_gmem, out_smem=out_smem,
                                 part_smem=part_smem, res_smem=res_smem, barriers=barriers, splits=splits,
                                 rows_per_split=rows_per_split, tile_n=tile_n)
            return
        if gated:
            # Each product rounded to the output dtype first, as the unfused path's dot outputs are.
            gate, up = (a.astype(out_dtype).astype(jnp.float32) for a in accs)
            out_smem[...] = (gate / (1.0 + jnp.exp(-gate)) * up).astype(out_dtype)
        else:
            out_smem[...] = accs[0].astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[split, :, pl.ds(n0, tile_n)])
        plgpu.wait_smem_to_gmem(0)

    # The function's name is the kernel's name in a profile, `<name>_mosaic_gpu_kernel`: decode_matmul_{N}x{K} or
    # decode_gated_matmul_{N}x{K}, so a trace tells the projections apart (benchmarks/profile_decode.py attributes
    # each to its model part; benchmarks/device_trace.py counts them all as matmuls).
    variant = "_residual" if cluster_residual else "_normed" if row_stats else ""
    body.__name__ = body.__qualname__ = f"decode_{'gated_' if gated else ''}matmul{variant}_{n}x{k}"
    if cluster_residual:
        out = jax.ShapeDtypeStruct((rows, n), out_dtype)
        out_rows = rows_per_split if cluster_residual == "l2" else rows
        # barriers: the cluster's, (l2: the S partials' loads,) the residual's load.
        barriers = (plgpu.ClusterBarrier(collective_axes=("k",), num_arrivals=1),
                    *((plgpu.Barrier(num_arrivals=splits),) if cluster_residual == "l2" else ()),
                    plgpu.Barrier(num_arrivals=1))
        return plgpu.kernel(
            body, out_type=(out, jax.ShapeDtypeStruct((splits, rows, n), jnp.float32)) if cluster_residual == "l2"
            else out,
            grid=(n // tile_n,), grid_names=("n",), cluster=(splits,), cluster_names=("k",),
            # out, partial, residual (dsmem: the whole tile's out and residual, _cluster_sum_and_add), barriers
            scratch_types=[plgpu.SMEM((out_rows, tile_n), out_dtype),
                           plgpu.SMEM((rows, tile_n), jnp.float32),
                           plgpu.SMEM((out_rows, tile_n), out_dtype),
                           barriers])
    if row_sumsq:
        return plgpu.kernel(
            body, out_type=(jax.ShapeDtypeStruct((splits, rows, n), out_dtype),
                            jax.ShapeDtypeStruct((splits, rows), jnp.float32)),
            grid=(n // tile_n, splits), grid_names=("n", "k"),
            scratch_types=[plgpu.SMEM((rows, tile_n), out_dtype), plgpu.SMEM((rows,), jnp.float32)])
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, rows, n), out_dtype), grid=(n // tile_n, splits),
        grid_names=("n", "k"), scratch_types=[plgpu.SMEM((rows, tile_n), out_dtype)])


def _cluster_sum_and_add(acc, split, r0, n0, *, out_gmem, parts_gmem, out_smem, part_smem, res_smem, barriers, splits,
                         rows_per_split, tile_n):
    """The split-K sum inside a cluster, then the residual add (inside `_build_kernel`'s body, cluster_residual).

    Each of the column tile's S blocks holds its fp32 partial [rows, tile_n]; after a cluster barrier the partials are
    summed in split order, the sum rounded to the output dtype and added to the residual's rows (loaded while the GEMM
    ran), and block s stores rows [s * rows / S, +rows / S): the same values as summing `decode_matmul_partials` with
    `sum_partials` and adding the residual, with no separate kernel for the sum. The exchange:
    - "dsmem" (parts_gmem None): every block reads all S partials from the peers' shared memory and sums the whole
      tile (S times the reads a row split needs, but jax 0.11.2 lowers a peer's shared memory only unsliced); a
      second cluster barrier keeps every block, and its shared memory, alive until its peers have read it.
    - "l2": through the global exchange buffer parts_gmem (TMA stores, the barrier, TMA loads of this block's rows).
    """
    cluster_barrier, *load_barrier, res_barrier = barriers
    part_smem[...] = acc
    plgpu.commit_smem()          # every thread's writes done (a warpgroup barrier) before the one arriving thread
    if parts_gmem is None:
        fence_for_peers(async_proxy=False)
        plgpu.barrier_arrive(cluster_barrier)
        plgpu.barrier_wait(cluster_barrier)
        fence_for_peers(async_proxy=False)
        # A plain strided register layout for the whole tile (none is inferred for the peers' reads).
        strided = plgpu.Layout.WG_STRIDED(part_smem.shape, 4)
        if interpret_mode_active():
            # jax 0.11.2's interpreter has no peer shared memory (cluster_ref): one block a cluster reads its own.
            if splits != 1:
                raise NotImplementedError("the Mosaic GPU interpreter cannot read a peer's shared memory: interpret "
                                          "decode_matmul_residual with k_splits=1 or exchange='l2'")
            y = plgpu.load(part_smem, (), layout=strided)
        else:
            y = plgpu.load(plgpu.cluster_ref(part_smem, {"k": 0}), (), layout=strided)
            for s in range(1, splits):
                y = y + plgpu.load(plgpu.cluster_ref(part_smem, {"k": s}), (), layout=strided)
        _add_and_store(y, res_smem, res_barrier, out_smem, strided)
        plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(r0, rows_per_split)],
                                out_gmem.at[pl.ds(r0, rows_per_split), pl.ds(n0, tile_n)])
        # No block may leave (and free its shared memory) before every peer has read it.
        fence_for_peers(async_proxy=False)
        plgpu.barrier_arrive(cluster_barrier)
        plgpu.barrier_wait(cluster_barrier)
    else:
        plgpu.copy_smem_to_gmem(part_smem, parts_gmem.at[split, :, pl.ds(n0, tile_n)])
        plgpu.wait_smem_to_gmem(0)
        fence_for_peers()
        plgpu.barrier_arrive(cluster_barrier)
        plgpu.barrier_wait(cluster_barrier)
        fence_for_peers()
        # part_smem is free again (its store has completed): it takes the S partials' slices of this block's rows.
        for s in range(splits):
            plgpu.copy_gmem_to_smem(parts_gmem.at[s, pl.ds(r0, rows_per_split), pl.ds(n0, tile_n)],
                                    part_smem.at[pl.ds(s * rows_per_split, rows_per_split)], load_barrier[0])
        plgpu.barrier_wait(load_barrier[0])
        y = part_smem[pl.ds(0, rows_per_split)]
        for s in range(1, splits):
            y = y + part_smem[pl.ds(s * rows_per_split, rows_per_split)]
        _add_and_store(y, res_smem, res_barrier, out_smem)
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[pl.ds(r0, rows_per_split), pl.ds(n0, tile_n)])
    plgpu.wait_smem_to_gmem(0)


def _add_and_store(y, res_smem, res_barrier, out_smem, layout=None):
    """out_smem = the residual's rows (res_smem, once its load is in) + y (the summed fp32 partials) rounded to the
    output dtype first, then the add rounded: the unfused path's two roundings. Ends with a warpgroup barrier, after
    which every thread's reads of y's sources are done. layout: y's (and the residual's load's), where given."""
    plgpu.barrier_wait(res_barrier)
    dtype = out_smem.dtype
    res = res_smem[...] if layout is None else plgpu.load(res_smem, (), layout=layout)
    out_smem[...] = (res.astype(jnp.float32) + y.astype(dtype).astype(jnp.float32)).astype(dtype)
    plgpu.commit_smem()
