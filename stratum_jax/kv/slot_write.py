"""Writing a step's K/V rows into a layer's slot pool, inside the jit step.

Every slot a step writes is distinct: a token owns its slot (pages are private while written; a shared
prefix is never recomputed), and padding rows get distinct out-of-range slots (`padding_slots`), which the
scatter drops. So the scatter is declared `unique_indices`: XLA then need not guard against two rows landing on
one slot, and its GPU scatter kernels got a third faster on the H200 (BENCHMARKS.md, #18, session 24).
"""
from __future__ import annotations

import jax


def padding_slots(num_slots: int, rows):
    """Distinct out-of-range write slots for padding rows: num_slots + rows (rows: int array, numpy or jax), so the
    step's write slots stay unique with the padding included (module docstring)."""
    return num_slots + rows


def write_slot_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    """pool [H, num_slots, D] with rows [H, T, D] written at slots [T] int32 (distinct; >= num_slots: padding,
    dropped). Returns the updated pool."""
    return pool.at[:, slots].set(rows, mode="drop", unique_indices=True)


__all__ = ["padding_slots", "write_slot_rows"]
