"""kv/slot_write.py: a step's K/V rows scattered into the slot pool with `unique_indices` declared, which holds only if
every write slot of a step is distinct, the padding rows' included (they get num_slots + their index)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from packing_cases import NUM_SLOTS, TILE, packing_runner, packing_sequences
from stratum_jax.kv.slot_write import padding_slots, write_slot_rows
from stratum_jax.scheduler.base import ScheduledBatch


def test_rows_land_in_their_slots_and_padding_is_dropped():
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((2, 64, 4)).astype(np.float32)
    slots = np.array([5, 63, padding_slots(64, 2), 0, padding_slots(64, 4)], np.int32)
    rows = rng.standard_normal((2, 5, 4)).astype(np.float32)
    got = np.asarray(write_slot_rows(jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(rows)))
    want = pool.copy()
    for t, s in enumerate(slots):
        if s < 64:
            want[:, s] = rows[:, t]
    np.testing.assert_array_equal(got, want)


def test_packed_steps_write_distinct_slots_padding_included():
    """The engine's packing (decode rows, prefill chunks, padding rows, padding tiles): every write slot distinct,
    live ones in range, padding ones out of range (dropped)."""
    runner = packing_runner(attn_stats=False)
    a, b, c = packing_sequences()
    steps = [ScheduledBatch([], [], [b, c, a], [3, 12, 22]), ScheduledBatch([b, c], [1, 1], [a], [8])]
    for batch, want_live in zip(steps, (3 + 12 + 22, 2 + 8)):
        packed, _ = runner._packed_inputs(batch, 7 * TILE)
        slots = np.asarray(packed.write_slots)
        live = np.asarray(packed.positions) >= 0
        assert live.sum() == want_live and (~live).sum() > 0
        assert len(set(slots.tolist())) == slots.size
        assert (slots[live] < NUM_SLOTS).all() and (slots[~live] >= NUM_SLOTS).all()
        for seq, n in zip(batch.prefill, batch.chunk_lens):
            seq.num_computed += n
        for seq in batch.seqs:
            if seq.num_computed == seq.num_tokens or seq in batch.decode:
                seq.num_computed = seq.num_tokens
                seq.output_ids.append(1)
