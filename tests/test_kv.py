"""The buddy allocator, the page pool with prefix caching, and block tables."""
import random

import numpy as np
import pytest

from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.buddy import BuddyAllocator, order_for_page_size
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.page_size import DefaultPageSizeRule, PageSizeHints


def test_order_for_page_size():
    assert [order_for_page_size(p) for p in (8, 16, 32, 64, 128, 256)] == [0, 1, 2, 3, 4, 5]
    for bad in (0, 4, 24, 512):
        with pytest.raises(ValueError, match="page size"):
            order_for_page_size(bad)


def test_buddy_split_and_merge_by_hand():
    b = BuddyAllocator(32)                      # one order-5 block
    a = b.alloc(0)                              # splits 32 -> 16+8+4+2+1+1
    assert a == 0 and b.free_base_pages == 31
    c = b.alloc(0)
    assert c == 1
    d = b.alloc(1)
    assert d == 2                               # aligned to 2
    e = b.alloc(3)
    assert e == 8 and e % 8 == 0
    assert b.alloc(5) is None                   # no whole top block left
    for start in (a, c, d, e):
        b.free(start)
    assert b.free_base_pages == 32 and b.largest_free_order() == 5   # fully merged back
    with pytest.raises(ValueError, match="double free"):
        b.free(a)


def test_buddy_random_alloc_free_keeps_invariants():
    rng = random.Random(0)
    b = BuddyAllocator(32 * 8)
    live = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            b.free(live.pop(rng.randrange(len(live))))
        else:
            order = rng.randrange(6)
            start = b.alloc(order)
            if start is not None:
                assert start % (1 << order) == 0
                live.append(start)
        b.check_invariants()
    for s in live:
        b.free(s)
    assert b.free_base_pages == 256 and b.largest_free_order() == 5


def test_prefix_cache_hits_and_eviction():
    pool = PagePool(256)
    table = BlockTable(pool, 16)
    tokens = list(range(40))
    assert table.ensure_capacity(40)
    table.register_full_pages(tokens, 40)         # two full pages (32 tokens) registered
    assert pool.cached_pages == 2
    table.release()
    assert pool.free_slots == 256                  # cached pages are evictable, so they count as free
    hit = pool.match_prefix(tokens, 16, (len(tokens) - 1) // 16)
    assert len(hit) == 2
    other = pool.match_prefix([99] + tokens[1:], 16, 2)
    assert other == []                             # a different first token breaks the chain
    assert pool.match_prefix(tokens, 8, 4) == []   # page size is part of the hash
    pool.acquire_prefix(hit, queried_pages=2)
    assert pool.prefix_hits == 2 and pool.prefix_queries == 2
    # Fill the pool: allocation must evict nothing that is owned.
    pages = [pool.allocate(16) for _ in range(14)]
    assert all(p is not None for p in pages)
    assert pool.allocate(16) is None               # the two hit pages are owned and not evictable
    for p in hit + pages:
        pool.release(p)
    pool.check_invariants()
    pages = [pool.allocate(256)]                   # evicts both cached pages to merge a 256 block
    assert pages[0] is not None and pool.evictions == 2 and pool.cached_pages == 0


def test_block_table_slots_mixed_sizes():
    pool = PagePool(1024)
    for page_size in (8, 64, 256):
        t = BlockTable(pool, page_size)
        assert t.ensure_capacity(300)
        pos = np.arange(300)
        slots = t.slots(0, 300)
        assert len(set(slots.tolist())) == 300
        for p, s in zip(pos[::37], slots[::37]):
            page = t.pages[p // page_size]
            assert s == page.start_slot + p % page_size and page.start_slot % page_size == 0
        t.release()
    assert pool.free_slots == 1024
    pool.check_invariants()


def test_page_size_rule():
    rule = DefaultPageSizeRule()
    assert rule(PageSizeHints(expected_tokens=100)) == 8
    assert rule(PageSizeHints(expected_tokens=4096)) == 256
    assert rule(PageSizeHints(expected_tokens=1024)) == 64
    assert rule(PageSizeHints(expected_tokens=4096, shared_prefix_tokens=512)) == 32
    assert rule(PageSizeHints(expected_tokens=1024, attention_score_variance=5.0)) == 128


def test_variance_scale_judges_against_the_running_median():
    from stratum_jax.page_size import VarianceScale
    scale = VarianceScale(window=3)
    assert scale.relative(2.0) is None                       # nothing seen yet
    for v in (1.0, 2.0, 4.0):
        scale.observe(v)
    assert scale.relative(None) is None
    assert scale.relative(4.0) == pytest.approx(2.0)         # median 2
    scale.observe(8.0)                                       # window slides: 2, 4, 8
    assert scale.relative(4.0) == pytest.approx(1.0)
    rule = DefaultPageSizeRule()
    base = rule(PageSizeHints(expected_tokens=1024))
    assert rule(PageSizeHints(expected_tokens=1024, attention_score_variance=scale.relative(8.0))) == 2 * base
    assert rule(PageSizeHints(expected_tokens=1024, attention_score_variance=scale.relative(4.0))) == base
