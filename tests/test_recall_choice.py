"""The host tier on jax's pinned_host memory, and the choice between recalling a prefix's host pages and
recomputing them by measured costs (kv/transfer.py, kv/recall_choice.py)."""
import logging

import jax
import numpy as np
import pytest

from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.recall_choice import RecallChoice
from stratum_jax.kv.transfer import KvTransfers, host_memory_kind, run_transfers
from test_host_tier import PS, _cache, _fill, _page_values


def test_choice_by_measured_copy_and_prefill_rates_both_ways(caplog):
    rate = {"tps": None}
    choice = RecallChoice(lambda: rate["tps"])
    assert choice.should_recall(64, 64)                      # nothing measured yet: recall (it measures)
    choice.observe_copy(nbytes=1_000_000, tokens=1000, seconds=0.001)   # 1 GB/s, 1,000 bytes a token
    assert choice.should_recall(64, 64)                      # prefill still unmeasured
    rate["tps"] = 10_000.0
    # Copy 1,000 tokens: 1 MB at 1 GB/s = 1 ms; recompute 1,000 tokens at 10,000 tok/s = 100 ms.
    assert choice.estimates(1000, 1000) == pytest.approx((0.001, 0.1))
    with caplog.at_level(logging.INFO, logger="stratum_jax.kv.recall_choice"):
        assert choice.should_recall(1000, 1000)
        rate["tps"] = 1e7                                    # a prefill 1,000x faster: 0.1 ms
        assert not choice.should_recall(1000, 1000)
    assert [r.getMessage().split(" - ")[0] for r in caplog.records] == ["host tier: recall", "host tier: recompute"]
    # The recompute side counts every token from the first host page on, not just the host pages'.
    rate["tps"] = 1e6                                        # copy 100 tokens: 0.1 ms
    assert not choice.should_recall(100, 50) and choice.should_recall(100, 1000)
    assert (choice.recalled, choice.recomputed) == (4, 2)
    # Bandwidth is total bytes over total time of the recent batches.
    choice.observe_copy(nbytes=3_000_000, tokens=3000, seconds=0.001)
    assert choice.copy_bandwidth() == pytest.approx(2e9)
    # always_recall (benchmarks/host_tier.py --recall always) recalls where the estimates say recompute.
    assert not choice.should_recall(100, 10)               # copy 100 tokens: 50 us; recompute 10: 10 us
    choice.always_recall = True
    assert choice.should_recall(100, 10) and (choice.recalled, choice.recomputed) == (5, 3)


def _prefix_half_on_host(pool, cache):
    """A 2-page prefix [a (HBM), b (host tier)] and the tokens that match it."""
    tokens = list(range(2 * PS)) + [0]
    a, ha = _fill(pool, tokens[:PS])
    b, hb = _fill(pool, tokens[PS:2 * PS], ha)
    want = _page_values(cache, b)
    pool.release(b)
    pool.release(a)
    hogs = [pool.allocate(PS) for _ in range(15)]          # b evicted to the host tier (a stays cached)
    return tokens, ha, hb, want, hogs


@pytest.mark.parametrize("prefill_tps, recalled", [(1e3, True), (1e12, False)])
def test_pool_recalls_or_cuts_the_prefix_by_the_choice(prefill_tps, recalled):
    pool = PagePool(256, host_tokens=1024)
    cache = _cache(256)
    pool.recall_choice = choice = RecallChoice(lambda: prefill_tps)
    # Measured: 16 bytes a token at 1.6 GB/s, so copying the 16-token page takes 0.16 us; recomputing it
    # takes 16 ms at 1,000 tok/s (recall) or 16 ps at 1e12 tok/s (recompute).
    choice.observe_copy(nbytes=16_000, tokens=1000, seconds=1e-5)
    tokens, ha, hb, want, hogs = _prefix_half_on_host(pool, cache)
    pool.release(hogs[0])                                   # room for a recall
    cache = run_transfers(cache, pool.take_transfers())
    pages = pool.acquire_prefix(pool.match_prefix(tokens, PS, 2), 2)
    assert [p.content_hash for p in pages] == ([ha, hb] if recalled else [ha])
    if recalled:
        cache = run_transfers(cache, pool.take_transfers())
        np.testing.assert_array_equal(_page_values(cache, pages[1]), want)
    else:
        assert hb in pool.host and not pool.take_transfers().recalls   # back in the tier, no copy booked
    assert (choice.recalled, choice.recomputed) == ((1, 0) if recalled else (0, 1))


@pytest.mark.parametrize("memory_kind", ["pinned_host", None])
def test_pages_live_in_pinned_host_memory_and_the_copy_is_measured(memory_kind):
    """On this backend (CPU: jax 0.11 has pinned_host there too) pages are pinned_host jax arrays, and a
    recall batch reports its bytes, tokens and seconds to the choice. None: the numpy fallback of a
    device without host memory kinds, byte for byte as well."""
    assert host_memory_kind(jax.devices()[0])[0] == "pinned_host"
    pool = PagePool(256, host_tokens=1024)
    cache = _cache(256)
    transfers = KvTransfers(sync=True)
    transfers.memory_kind = memory_kind
    transfers.recall_choice = choice = RecallChoice(lambda: None)
    tokens, ha, hb, want, hogs = _prefix_half_on_host(pool, cache)
    cache = transfers.run(cache, pool.take_transfers())
    data = pool.host.get(hb).data
    if memory_kind is None:
        assert isinstance(data, np.ndarray)
    else:
        assert isinstance(data, jax.Array) and data.sharding.memory_kind == "pinned_host"
    pool.release(hogs[0])
    pages = pool.acquire_prefix(pool.match_prefix(tokens, PS, 2), 2)
    cache = transfers.run(cache, pool.take_transfers())
    np.testing.assert_array_equal(_page_values(cache, pages[1]), want)
    assert choice.bytes_per_token() == data.nbytes / PS and choice.copy_bandwidth() > 0


@pytest.mark.parametrize("counts, observed", [((0, 1), False), ((5, 5), True)])
def test_a_recall_batch_that_compiled_is_not_a_copy_measurement(counts, observed):
    """The first recall of a shape compiles inside its timed upload: the choice must not take that as the
    copy rate (it would then recompute what it should recall). `counts`: what compile_count reads before
    and after the upload (0 then 1: something compiled)."""
    pool = PagePool(256, host_tokens=1024)
    cache = _cache(256)
    reads = iter(counts)
    transfers = KvTransfers(sync=True, compile_count=lambda: next(reads))
    transfers.recall_choice = choice = RecallChoice(lambda: None)
    tokens, ha, hb, want, hogs = _prefix_half_on_host(pool, cache)
    cache = transfers.run(cache, pool.take_transfers())          # offloads only: compile_count not read
    pool.release(hogs[0])
    pages = pool.acquire_prefix(pool.match_prefix(tokens, PS, 2), 2)
    cache = transfers.run(cache, pool.take_transfers())
    np.testing.assert_array_equal(_page_values(cache, pages[1]), want)
    assert transfers.stats.recall_batches == 1
    assert (choice.copy_bandwidth() is not None) == observed


class _Memory:
    def __init__(self, kind):
        self.kind = kind


class _Device:
    platform, device_kind = "gpu", "fake"

    def __init__(self, *kinds):
        self.kinds = kinds

    def addressable_memories(self):
        return [_Memory(k) for k in self.kinds]


def test_host_memory_kind_falls_back_with_a_reason():
    assert host_memory_kind(_Device("device", "pinned_host", "unpinned_host"))[0] == "pinned_host"
    kind, why = host_memory_kind(_Device("device", "unpinned_host"))
    assert kind == "unpinned_host" and "no pinned_host" in why
    kind, why = host_memory_kind(_Device("device"))
    assert kind is None and "numpy" in why
