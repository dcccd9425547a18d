"""Admission's room check against the prefix cache: a queued request's own cached prefix pages are free room
only until it takes them.

Regression (found in benchmarks/host_tier.py's multi-turn workload: 30 of its 33 preemptions on the CPU): the
check counted the prefix's unowned cached pages as room for the request's new pages, so a request whose
tail did not fit was admitted, preempted itself at its first chunk, went back to the queue and was admitted
again the next step, over and over.
"""
from stratum_jax.config import RuntimeConfig
from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.request import SamplingParams
from stratum_jax.scheduler import build_scheduler
from stratum_jax.scheduler.base import StepCosts
from stratum_jax.sequence import Sequence

PS = 16                               # every request's page size (--page-size)
POOL_PAGES = 32                       # a 512-token pool


def _setup():
    config = RuntimeConfig(model="tiny", max_context=512, kv_pool_tokens=POOL_PAGES * PS, page_size=PS,
                           max_batch_size=4, prefill_chunk=512, max_num_batched_tokens=1024, scheduler="fcfs")
    pool = PagePool(config.kv_pool_slots)
    return build_scheduler(config, pool), pool


def _seq(name, token_ids):
    return Sequence(request_id=name, prompt_ids=list(token_ids), params=SamplingParams(max_tokens=4, temperature=0.0),
                    seed=0, detokenizer=None, arrival_time=0.0)


def _cache_prefix(pool, token_ids):
    """Leaves token_ids' full pages in the prefix cache, unowned (as a finished request does)."""
    blocks = BlockTable(pool, PS)
    assert blocks.ensure_capacity(len(token_ids))
    blocks.register_full_pages(token_ids, len(token_ids))
    blocks.release()


COSTS = StepCosts(now_s=0.0, idle_gap_ms=0.0, prefill_ms_per_token=0.05, decode_ms_per_step=2.0)
PREFIX = list(range(1000, 1000 + 10 * PS))        # 10 pages, cached
OTHER = list(range(3000, 3000 + 20 * PS))         # 20 pages, running
TAIL = list(range(5000, 5000 + 4 * PS))           # 4 pages past the prefix


def test_a_request_whose_tail_does_not_fit_beside_its_own_cached_prefix_waits():
    sched, pool = _setup()
    _cache_prefix(pool, PREFIX)
    assert pool.free_slots == POOL_PAGES * PS            # cached pages nobody owns count as free
    sched.add(_seq("other", OTHER))
    assert [s.request_id for s in sched.schedule(COSTS).prefill] == ["other"]
    assert pool.free_slots == (POOL_PAGES - 20) * PS     # 2 free pages + the 10 cached ones
    # 12 pages look free, and the new request needs 4 + 1 past its prefix, but 10 of the 12 are its prefix.
    waiting = _seq("waiting", PREFIX + TAIL)
    sched.add(waiting)
    for _ in range(3):
        batch = sched.schedule(COSTS)
        assert [s.request_id for s in batch.prefill] == ["other"]
        assert sched.preemptions == 0 and list(sched.waiting) == [waiting] and waiting.blocks is None
    assert pool.free_slots == (POOL_PAGES - 20) * PS     # its prefix is still cached, still unowned
    pool.check_invariants()

    # Once the running request ends there is room: admitted with its 10 cached pages, its tail prefilled.
    sched.remove(sched.running[0])
    batch = sched.schedule(COSTS)
    assert batch.prefill == [waiting] and batch.chunk_lens == [len(TAIL)]
    assert waiting.num_computed == len(PREFIX) and sched.preemptions == 0
    pool.check_invariants()


def test_a_request_that_fits_beside_its_cached_prefix_is_admitted_at_once():
    """The control: 2 more free pages than the request above needs past its prefix (4 + 1)."""
    sched, pool = _setup()
    _cache_prefix(pool, PREFIX)
    sched.add(_seq("other", OTHER[:-7 * PS]))             # 13 pages: 9 free beside the 10 cached
    sched.schedule(COSTS)
    waiting = _seq("waiting", PREFIX + TAIL)
    sched.add(waiting)
    batch = sched.schedule(COSTS)
    assert waiting in batch.prefill and waiting.num_computed == len(PREFIX) and sched.preemptions == 0
