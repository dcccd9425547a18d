"""Batches packed by the engine's own ModelRunner, shared by the tests of what a packed step computes
(test_attention_stats.py) and of what it writes (test_slot_write.py): a 4-row runner with tiles of 8 and three
greedy sequences with block tables in pages of 32, 8 and 16 tokens."""
from __future__ import annotations

from stratum_jax.config import RuntimeConfig
from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.model_runner import ModelRunner
from stratum_jax.request import SamplingParams
from stratum_jax.sequence import Sequence

NUM_SLOTS = 4096
ROWS = 4
TILE = 8


def packing_runner(backend="reference", attn_stats=True):
    """The engine's ModelRunner (only its input packing and StepGeometry are used): 4 rows, tiles of 8,
    block tables for 64 tokens, 2 decode steps per call."""
    config = RuntimeConfig(model="tiny", max_batch_size=ROWS, max_context=64, kv_pool_tokens=NUM_SLOTS,
                           prefill_chunk=TILE, max_num_batched_tokens=ROWS + 64, decode_steps=2)
    return ModelRunner(config, model=None, num_slots=NUM_SLOTS, backend=backend, attn_stats=attn_stats)


def packing_sequences():
    """Greedy sequences of 30, 3 and 12 prompt tokens in pages of 32, 8 and 16 (room for 4 more tokens)."""
    pool = PagePool(NUM_SLOTS, enable_prefix_caching=False)
    seqs = []
    for name, prompt, page_size in (("a", [7, 9, 11] * 10, 32), ("b", [3, 4, 5], 8), ("c", list(range(40, 52)), 16)):
        seq = Sequence(name, prompt, SamplingParams(temperature=0.0), seed=0, detokenizer=None)
        seq.blocks = BlockTable(pool, page_size)
        assert seq.blocks.ensure_capacity(len(prompt) + 4)
        seqs.append(seq)
    return seqs
