"""Prefetching the next GEMM's first weight tiles into L2 from the kernel before it (Mosaic GPU, Hopper).

A decode step runs ~8 kernels a layer back to back, and each weight-streaming GEMM (`decode_matmul`) spends its first
microseconds waiting on HBM for the first tiles of its ring while the kernel before it, a small one like the
residual add and norm (`residual_rmsnorm`, under a megabyte of traffic), left HBM idle (BENCHMARKS.md #18: the
step's kernels each pay a ramp and a drain; programmatic dependent launch, which would overlap them, is dropped inside
XLA's command buffers). Here the kernel before a GEMM issues `cp.async.bulk.prefetch` (TMA prefetch to L2: no SMEM, no
barrier, nothing to wait for) for the part of the GEMM's weight that it reads first, so the GEMM's first stages come
from L2: the norm kernel (`residual_rmsnorm`) at its start, ahead of q/k/v and gate/up; the gated gate/up GEMM in each
CTA's epilogue, once its own tiles are in (its grid's drain), ahead of down; the swapped decode-attention kernel the
same way, ahead of o. (The fused q/k/v write prefetches attention's first K/V tiles itself: pallas_kernels/
rope_kv_write.py.)

What the GEMM reads first: its CTA (column tile n, K split s) streams w[n * tile_n : +tile_n, s * K/S : +K/S] in K
order, and every CTA starts at once (one wave), so the first `prefix` columns of each of the S K ranges, over all N
rows, are what the whole grid waits on first. `L2Prefetch` names that region; `issue_prefetch` spreads its TMA boxes
(at most 256 x 256 elements: the TMA box limit) over the issuing kernel's CTAs.

The prefetch changes no value (the interpreter runs it as a no-op), so a kernel's numerics are those without it.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

BOX = 256      # elements a TMA box dimension holds at most
_COL_ALIGN = 64    # a prefix is whole 64-column (128-byte) weight tiles, what decode_matmul's ring copies


class WeightPrefetch(NamedTuple):
    """A weight [rows, cols] bf16 and the `L2Prefetch` plan of it: what a kernel's prefetch_weight / prefetch
    arguments take, handed as one value through layers that only pass it on (decode attention)."""
    weight: object
    plan: "L2Prefetch"


def _box(extent: int, align: int) -> int:
    """The largest multiple of `align`, at most BOX, that divides extent."""
    for size in range(BOX - BOX % align, 0, -align):
        if extent % size == 0:
            return size
    raise ValueError(f"no box of a multiple of {align} elements divides {extent}")


@dataclasses.dataclass(frozen=True)
class L2Prefetch:
    """The part of a bf16 weight [rows, cols] to prefetch: the first `prefix` columns of each of `splits` equal column
    ranges, all rows (decode_matmul's CTAs read those first; module docstring).

    Attributes:
      rows: the weight's N (output features), a multiple of 8.
      cols: its K (input features), a multiple of 64 * splits.
      splits: the GEMM's split-K (1 for the gated GEMM).
      prefix: columns of each split to prefetch, a multiple of 64 in [64, cols / splits].
    """

    rows: int
    cols: int
    splits: int
    prefix: int

    def __post_init__(self):
        for name in ("rows", "cols", "splits", "prefix"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"L2Prefetch.{name} must be a positive int, got {value!r}")
        if self.rows % 8:
            raise ValueError(f"L2Prefetch.rows ({self.rows}) must be a multiple of 8")
        if self.cols % (_COL_ALIGN * self.splits):
            raise ValueError(f"L2Prefetch.cols ({self.cols}) must be a multiple of {_COL_ALIGN} x splits "
                             f"({self.splits})")
        if self.prefix % _COL_ALIGN or self.prefix > self.cols // self.splits:
            raise ValueError(f"L2Prefetch.prefix ({self.prefix}) must be a multiple of {_COL_ALIGN} and at most a "
                             f"split's {self.cols // self.splits} columns")

    @property
    def box_shape(self) -> tuple[int, int]:
        """(rows, cols) of one TMA prefetch box."""
        return _box(self.rows, 8), _box(self.prefix, _COL_ALIGN)

    @property
    def boxes_per_split(self) -> tuple[int, int]:
        """Boxes down the rows, and across one split's prefix."""
        box_rows, box_cols = self.box_shape
        return self.rows // box_rows, self.prefix // box_cols

    @property
    def num_boxes(self) -> int:
        down, across = self.boxes_per_split
        return down * across * self.splits

    @property
    def nbytes(self) -> int:
        """Bytes the prefetch brings into L2 (bf16)."""
        return self.rows * self.prefix * self.splits * 2

    def box_origin(self, index):
        """The (row, col) of box `index` (an int32 scalar, traced or not): boxes ordered split-major, then across
        the prefix, then down the rows, so consecutive CTAs fetch neighbouring boxes of one split's prefix."""
        box_rows, box_cols = self.box_shape
        down, across = self.boxes_per_split
        per_split = down * across
        split, within = index // per_split, index % per_split
        row = (within % down) * box_rows
        col = split * (self.cols // self.splits) + (within // down) * box_cols
        return row, col


def prefetch_plan(weight_shape: tuple[int, int], *, splits: int, fraction: float) -> L2Prefetch | None:
    """The `L2Prefetch` of the first `fraction` of each K split of a weight [N, K] (rounded down to whole 64-column
    tiles, at least one), or None for fraction 0."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"prefetch fraction must be in [0, 1], got {fraction}")
    if fraction == 0.0:
        return None
    rows, cols = weight_shape
    split_cols = cols // splits
    prefix = max(_COL_ALIGN, int(split_cols * fraction) // _COL_ALIGN * _COL_ALIGN)
    return L2Prefetch(rows=rows, cols=cols, splits=splits, prefix=min(prefix, split_cols))


def check_prefetch_args(caller: str, weight, plan: L2Prefetch | None) -> None:
    """Raises ValueError, saying what to fix, unless weight and plan are both None or a bf16 weight of the plan's
    shape and its plan (a kernel's optional prefetch arguments)."""
    if (weight is None) != (plan is None):
        raise ValueError(f"{caller}: pass prefetch_weight and prefetch together (or neither)")
    if plan is not None and (tuple(weight.shape) != (plan.rows, plan.cols) or weight.dtype != jnp.bfloat16):
        raise ValueError(f"{caller}: prefetch_weight must be bfloat16 {(plan.rows, plan.cols)} (the plan's shape), "
                         f"got {tuple(weight.shape)} {weight.dtype}")


def issue_prefetch(weight_gmem, plan: L2Prefetch, *, cta, num_ctas: int) -> None:
    """Inside a Mosaic GPU kernel body: CTA `cta` of `num_ctas` issues its share of the plan's boxes (box i goes to
    CTA i mod num_ctas). weight_gmem is the [rows, cols] bf16 weight in GMEM. Nothing to wait for: the copies land in
    L2 while the kernel (and the next) runs."""
    if tuple(weight_gmem.shape) != (plan.rows, plan.cols):
        raise ValueError(f"issue_prefetch: the weight is {tuple(weight_gmem.shape)}, the plan is for "
                         f"{(plan.rows, plan.cols)}")
    box_rows, box_cols = plan.box_shape
    for j in range(-(-plan.num_boxes // num_ctas)):
        index = cta + j * num_ctas
        whole_round = (j + 1) * num_ctas <= plan.num_boxes       # every CTA has a box in this round
        row, col = plan.box_origin(index if whole_round else jnp.minimum(index, plan.num_boxes - 1))
        plgpu.async_prefetch(weight_gmem.at[pl.ds(pl.multiple_of(row, 8), box_rows),
                                            pl.ds(pl.multiple_of(col, _COL_ALIGN), box_cols)],
                             predicate=None if whole_round else index < plan.num_boxes)


def prefetch_counts(plan: L2Prefetch) -> np.ndarray:
    """How many of the plan's boxes cover each element of the weight, [rows, cols] int32 (host-side, for tests: 1 on
    the region, 0 elsewhere)."""
    box_rows, box_cols = plan.box_shape
    counts = np.zeros((plan.rows, plan.cols), np.int32)
    for index in range(plan.num_boxes):
        row, col = (int(v) for v in plan.box_origin(index))
        counts[row:row + box_rows, col:col + box_cols] += 1
    return counts
