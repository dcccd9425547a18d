"""The host-memory KV tier: evicted prefix pages move to host memory and come back byte for byte, on a
prefix hit or by prefetch for queued requests, without leaks (kv/host_tier.py, kv/transfer.py)."""
import json
import random
import time

import jax.numpy as jnp
import numpy as np
import pytest

from dmlp_checkpoint import write_checkpoint
from engine_load import run_random_load
from stratum_jax.config import RuntimeConfig
from stratum_jax.cache_policy import LruPolicy
from stratum_jax.engine import Engine
from stratum_jax.kv.host_tier import HostPage, HostTier
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.prefix_hash import prompt_chain_hashes
from stratum_jax.kv.recall_choice import RecallChoice
from stratum_jax.kv.transfer import KvTransfers, run_transfers
from stratum_jax.model.loader import load_model
from stratum_jax.phase_times import top_level_total
from stratum_jax.request import SamplingParams
from training.traces import read_traces

GREEDY = dict(temperature=0.0, ignore_eos=True)
PS = 16


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


def make_engine(tiny, **kw):
    defaults = dict(model="tiny", max_context=256, kv_pool_tokens=512, max_batch_size=4, prefill_chunk=64,
                    max_tokens_cap=256, page_size=PS)
    defaults.update(kw)
    return Engine(RuntimeConfig(**defaults), model=tiny)


def _prompts(n, length, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]


def _slots_of(engine, prompt):
    """The HBM pages holding `prompt`'s cached prefix and their KV, read from the device cache."""
    pages = engine.pool.match_prefix(prompt, PS, (len(prompt) - 1) // PS)
    slots = np.concatenate([np.arange(p.start_slot, p.start_slot + PS) for p in pages])
    kv = np.stack([np.stack([np.asarray(k)[:, slots], np.asarray(v)[:, slots]]) for k, v in engine.kv_cache])
    return pages, kv


# ---- engine level --------------------------------------------------------------------------------

def test_evicted_prefix_comes_back_from_the_host_tier_byte_for_byte(tiny, tmp_path):
    prompt, *others = _prompts(5, 150, seed=1)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    log = tmp_path / "blocks.jsonl"
    engine = make_engine(tiny, kv_host_tokens=4096, trace_out=str(log))
    first = engine.generate([prompt], sp)[0]
    pages, kv_before = _slots_of(engine, prompt)
    assert len(pages) == 9
    for other in others:                          # 4 x 150 tokens through a 512-token pool: prompt's pages go
        engine.generate([other], sp)
    assert not any(h in engine.pool._by_hash for h in prompt_chain_hashes(prompt)[PS])
    assert all(h in engine.pool.host for h in prompt_chain_hashes(prompt)[PS])
    again = engine.generate([prompt], sp)[0]
    st = engine.stats()
    assert again.cached_prompt_tokens == 9 * PS and st.kv_host_hits == 9
    assert again.token_ids == first.token_ids
    pages_after, kv_after = _slots_of(engine, prompt)
    assert [p.start_slot for p in pages_after] != [p.start_slot for p in pages]   # really moved
    np.testing.assert_array_equal(kv_after, kv_before)
    assert st.kv_offloaded_pages >= 9 and st.kv_recalled_pages >= 9
    assert 0 < st.kv_host_tokens_used <= st.kv_host_tokens_total == 4096
    engine.pool.check_invariants()
    engine.close()
    events = [json.loads(line) for line in log.read_text().splitlines()]
    moves = [e for e in events if e["event"] in ("evicted", "recalled")]
    assert {e["event"] for e in moves} == {"evicted", "recalled"}
    assert all(e["features"].get("depth") is not None for e in moves)     # each with its block's features
    read_traces([str(log)], "stratum")          # the trainer reads the log, host-tier events included


def test_without_a_host_tier_the_evicted_prefix_is_recomputed(tiny):
    """The control for the test above: same traffic, no host tier, no hit."""
    prompt, *others = _prompts(5, 150, seed=1)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    engine = make_engine(tiny)
    first = engine.generate([prompt], sp)[0]
    for other in others:
        engine.generate([other], sp)
    again = engine.generate([prompt], sp)[0]
    assert again.cached_prompt_tokens == 0 and again.token_ids == first.token_ids
    assert engine.stats().kv_host_hits == 0 and engine.stats().kv_host_tokens_total == 0


def test_recalls_after_the_first_compile_nothing_and_their_time_is_broken_down(tiny):
    """Two prompts that each fill the pool, so each pushes the other's 14 pages to the host tier, then
    recalled in turn. Regression: the engine started its cache uncommitted, a recall's scatter returns it
    committed (its pages reach the device by a device_put to an explicit sharding), and a step compiled
    right after it (here the 16-token tail's bucket; a prompt is one 256-token chunk) keeps it committed
    from then on. jit keys executables on that, so the second recall compiled _gather, _page_of and
    _scatter again, on the request path. Also: the recall's breakdown (Engine.phases) names its parts and
    stays within its time."""
    a, b = _prompts(2, 240, seed=3)
    sp = SamplingParams(max_tokens=1, **GREEDY)
    engine = make_engine(tiny, kv_pool_tokens=256, kv_host_tokens=4096, max_batch_size=1, prefill_chunk=256)
    # Always recall (no prefill rate known): on CPU the measured choice may rightly prefer recomputing.
    engine.pool.recall_choice = RecallChoice(lambda: None)
    engine.generate([a], sp)
    engine.generate([b], sp)                       # pushes a's pages out
    engine.generate([a], sp)                       # the first recall (compiles the copies' shapes)
    compiles, offloaded = engine.compiles.total, engine.stats().kv_offloaded_pages
    for prompt in (b, a):
        before, t = engine.phases.snapshot(), time.perf_counter()
        [res] = engine.generate([prompt], sp)
        wall, parts = time.perf_counter() - t, engine.phases.since(before)
        assert res.cached_prompt_tokens == 14 * PS
    assert engine.compiles.total == compiles, dict(engine.compiles.by_function)
    assert engine.stats().kv_host_hits == 3 * 14
    # The last two runs evicted a prompt that had itself been recalled: its 14 recalled pages went back to the
    # tier with the copies kept since (kv/host_tier.py); only the page computed after its recall was copied out.
    st = engine.stats()
    assert st.kv_host_reused_pages == 2 * 14 and st.kv_offloaded_pages - offloaded == 2, st
    assert {"add_requests", "schedule", "schedule.match_prefix", "schedule.acquire_prefix", "transfers",
            "transfers.offload_start", "transfers.upload", "transfers.upload.scatter", "dispatch", "collect",
            "postprocess"} <= set(parts)
    assert 0 < top_level_total(parts) <= wall
    assert parts["transfers.upload.scatter"] + parts["transfers.upload.wait"] <= parts["transfers.upload"] <= parts["transfers"]
    engine.pool.check_invariants()


def test_after_warmup_the_host_tier_compiles_nothing(tiny):
    """Warm-up runs every copy shape (copy batch size x page size), so a served load that offloads and
    recalls contexts of several lengths and page sizes (adaptive pages) compiles nothing: before, each
    new copy size compiled its gather/scatter bucket on the request path. Also the copy batches cover
    recalls longer than the smallest batch."""
    sp = SamplingParams(max_tokens=2, **GREEDY)
    engine = make_engine(tiny, page_size=None, max_context=1024, kv_pool_tokens=1024, kv_host_tokens=8192,
                         max_batch_size=1, prefill_chunk=512, max_num_batched_tokens=512, max_tokens_cap=8)
    engine.pool.recall_choice = RecallChoice(lambda: None)        # always recall (see the test above)
    engine.warmup(progress=False)
    engine.mark_serving()
    prompts = _prompts(3, 700, seed=5) + _prompts(2, 90, seed=6)
    first = {i: engine.generate([p], sp)[0].token_ids for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):                 # each was pushed out by the ones after it
        res = engine.generate([p], sp)[0]
        assert res.token_ids == first[i]
    stats = engine.stats()
    assert stats.kv_offloaded_pages > 0 and stats.kv_host_hits > 0
    assert max(engine.transfers.stats.recall_seconds, default=0) > 0
    assert engine.compiles.after_serving == 0, dict(engine.compiles.by_function)
    engine.pool.check_invariants()


def test_copy_batches_hold_whole_pages_of_one_size_at_fixed_sizes():
    from stratum_jax.kv.transfer import COPY_BATCH_PAGES, COPY_BATCH_SLOTS, copy_batches
    sizes = [256] * 40 + [8, 16, 16] + [64] * 3 + [256] + [8] * 40
    batches = copy_batches(sizes)
    assert [b[0] for b in batches] == [0] + [end for _, end, _ in batches[:-1]]     # consecutive, in order
    assert batches[-1][1] == len(sizes)
    for first, end, padded in batches:
        used = sum(sizes[first:end])
        assert len(set(sizes[first:end])) == 1 and end - first <= COPY_BATCH_PAGES
        assert padded in COPY_BATCH_SLOTS and used <= padded
        assert padded == min(b for b in COPY_BATCH_SLOTS if b >= used)
    assert [end - first for first, end, _ in batches] == [32, 8, 1, 2, 3, 1, 32, 8]
    assert copy_batches([8]) == [(0, 1, COPY_BATCH_SLOTS[0])] and copy_batches([]) == []


def test_pinning_the_tier_that_does_not_fit_says_what_to_fix(monkeypatch):
    """Pinning happens at start-up (`--kv-host-pin-at-start`); a tier larger than what can be pinned
    fails there, naming the flag and the pool limit, not on the request path."""
    import jax
    from stratum_jax.kv import transfer

    calls = []

    def device_put(x, where):
        calls.append(where.memory_kind)
        if len(calls) > 2:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")
        return x
    monkeypatch.setattr(transfer.jax, "device_put", device_put)
    monkeypatch.setattr(transfer, "PIN_CHUNK_BYTES", 1 << 10)
    with pytest.raises(RuntimeError, match="--kv-host-tokens.*XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"):
        transfer.pin_host_memory(8 << 10, jax.devices()[:1], "pinned_host")
    assert calls == ["pinned_host"] * 3
    calls.clear()
    transfer.pin_host_memory(2 << 10, jax.devices()[:1], "pinned_host")       # two chunks: fits
    assert calls == ["pinned_host"] * 2


def test_queued_requests_prefix_is_prefetched_before_admission(tiny):
    """With one running slot, a queued request's host-tier pages are recalled while it waits, so it is
    admitted with an HBM hit (counted as prefetched, not as a host hit)."""
    prompt, *others = _prompts(5, 150, seed=2)
    sp = SamplingParams(max_tokens=8, **GREEDY)
    engine = make_engine(tiny, kv_host_tokens=4096, max_batch_size=1)
    first = engine.generate([prompt], sp)[0]
    for other in others:
        engine.generate([other], sp)
    assert sum(h in engine.pool.host for h in prompt_chain_hashes(prompt)[PS]) == 9
    blocker = engine.add_request([5] * 40, SamplingParams(max_tokens=30, **GREEDY))   # shares nothing
    engine.step()                                           # blocker admitted, holds the one slot
    rid = engine.add_request(prompt, sp)
    engine.step()
    assert engine.stats().kv_prefetched_pages == 9          # prompt's pages while it waited
    assert all(h in engine.pool._by_hash for h in prompt_chain_hashes(prompt)[PS])
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out[rid] == first.token_ids
    assert engine.stats().kv_host_hits == 0                 # it found them in HBM
    del blocker


@pytest.mark.parametrize("policy", ["lru", "dmlp"])
def test_no_leaks_with_host_tier_preemption_and_cancellation(tiny, policy, tmp_path):
    """Random load (shared prefixes, cancellations, preemption) through a small pool and host tier."""
    kw = {}
    if policy == "dmlp":
        kw = dict(cache_policy="dmlp", dmlp_checkpoint=write_checkpoint(tmp_path / "ck"))
    engine = make_engine(tiny, kv_pool_tokens=512, max_context=128, max_batch_size=16, max_queue=400,
                         page_size=None, kv_host_tokens=1024, **kw)
    # Always recall: the measured recall-or-recompute choice (tested in test_recall_choice.py) follows
    # copy and prefill timings, which would make the host hits asserted below depend on the machine's load.
    engine.pool.recall_choice = RecallChoice(lambda: None)
    finals = run_random_load(engine, random.Random(11), requests=80, shared_fraction=0.5,
                             params=lambda rng: SamplingParams(max_tokens=rng.randrange(1, 40), temperature=0.9,
                                                               seed=rng.randrange(1000), ignore_eos=True))
    assert len(finals) == 80 and set(finals.values()) == {1}
    st = engine.stats()
    assert st.preemptions > 0 and st.kv_offloaded_pages > 0 and st.kv_host_hits > 0
    assert st.kv_tokens_used == 0 and st.running == 0 and st.queued == 0
    assert st.kv_host_tokens_used <= 1024
    engine.pool.check_invariants()


def test_bad_host_tier_flags_say_what_to_fix():
    with pytest.raises(ValueError, match="--kv-host-tokens"):
        RuntimeConfig(kv_host_tokens=-1)
    with pytest.raises(ValueError, match="--kv-prefetch-pages"):
        RuntimeConfig(kv_prefetch_pages=-5)
    with pytest.raises(ValueError, match="needs prefix caching"):
        RuntimeConfig(kv_host_tokens=1024, enable_prefix_caching=False)
    from stratum_jax.serve import build_parser
    cfg = RuntimeConfig.from_cli_args(build_parser().parse_args(["--kv-host-tokens", "8192",
                                                                 "--kv-prefetch-pages", "0"]))
    assert cfg.kv_host_tokens == 8192 and cfg.kv_prefetch_pages == 0


# ---- pool level: the copies, with a small fake cache ---------------------------------------------

def _cache(num_slots, layers=2, heads=2, dim=4):
    """Per layer (k, v) [heads, num_slots, dim] where every value names its slot, layer and k/v."""
    base = np.arange(num_slots, dtype=np.float32)[None, :, None]
    return [(jnp.asarray(np.broadcast_to(base + 1000 * l, (heads, num_slots, dim)).copy()),
             jnp.asarray(np.broadcast_to(base + 1000 * l + 500, (heads, num_slots, dim)).copy()))
            for l in range(layers)]


def _page_values(cache, page):
    return np.stack([np.asarray(k)[:, page.start_slot:page.start_slot + page.page_size] for k, _ in cache])


def _fill(pool, tokens, parent=None):
    page = pool.allocate(PS)
    h = pool.register_full_page(page, parent, tokens, depth=0, request_id="r")
    return page, h


def test_recalled_then_evicted_again_in_one_pass_keeps_its_data():
    """A page recalled and evicted again before the copies run: its host copy is the recall's source,
    and the moot recall copy is not run (it would overwrite the slot's new owner)."""
    pool = PagePool(256, host_tokens=1024)
    cache = _cache(256)
    a, ha = _fill(pool, list(range(16)))
    want = _page_values(cache, a)
    pool.release(a)
    hogs = [pool.allocate(PS) for _ in range(16)]           # the pool is full: a goes to the host tier
    assert ha in pool.host and pool.allocate(PS) is None
    cache = run_transfers(cache, pool.take_transfers())
    for p in hogs:
        pool.release(p)
    # One scheduling pass: recall a, let it go, fill the pool so it is evicted again, then recall it again.
    [page] = pool.acquire_prefix(pool.match_prefix(list(range(16)) + [0], PS, 1), 1)
    pool.release(page)
    hogs = [pool.allocate(PS) for _ in range(16)]
    assert ha in pool.host and pool.host.get(ha).same_as is not None
    for p in hogs[:1]:
        pool.release(p)                                       # unhashed: its slots are free again
    [again] = pool.acquire_prefix(pool.match_prefix(list(range(16)) + [0], PS, 1), 1)
    pending = pool.take_transfers()
    assert list(pending.recalls) == [again.start_slot]        # the first recall's copy was dropped
    cache = run_transfers(cache, pending)
    np.testing.assert_array_equal(_page_values(cache, again), want)
    # The first recall's source let go of its host memory (the alias took it); the second recall's source
    # stays as the clean copy of the HBM page (a kept copy: not a tier page).
    source = pending.recalls[again.start_slot]
    assert ha not in pool.host and source.kept and again.host_copy is source and source.data is not None
    pool.check_invariants()


@pytest.mark.parametrize("max_pages", [10, 2])
def test_prefetch_takes_policy_order_parents_first_and_spares_queued_prefixes(max_pages):
    class DeepestFirst(LruPolicy):
        def prefetch_order(self, candidates, now_ms):
            return [b.block_id for b in sorted(candidates, key=lambda b: b.depth, reverse=True)]

    pool = PagePool(256, host_tokens=2048, policy=DeepestFirst())
    tokens = list(range(100, 164)) + [0]
    parent, chain = None, []
    for i in range(4):                                       # a queued prompt's 4-page prefix ...
        page, parent = _fill(pool, tokens[i * PS:(i + 1) * PS], parent)
        page.meta.depth = i
        chain.append((page, parent))
    for page, _ in chain:
        pool.release(page)
    hogs = [pool.allocate(PS) for _ in range(16)]           # ... all in the host tier now
    assert all(h in pool.host for _, h in chain)
    for p in hogs[:6]:
        pool.release(p)
    cached = [_fill(pool, [7 + i] * PS)[0] for i in range(6)]   # 6 idle cached pages, 10 owned ones
    for p in cached:
        pool.release(p)
    pool.take_transfers()
    keep = cached[:2]                                        # say another queued request's prefix
    host, hbm = pool.host_candidates(prompt_chain_hashes(tokens))
    assert [c.content_hash for c in host] == [h for _, h in chain] and hbm == []
    n = min(max_pages, 4)
    assert pool.prefetch(host, max_pages=max_pages, keep=keep) == n
    # The policy asked deepest first, but a page only comes after its parent.
    assert [h in pool._by_hash for _, h in chain] == [i < n for i in range(4)]
    assert [hp.content_hash for hp in pool.take_transfers().recalls.values()] == [h for _, h in chain[:n]]
    assert all(pool._by_hash.get(p.content_hash) is p for p in keep)     # spared
    assert sum(p.content_hash in pool._by_hash for p in cached[2:]) == 4 - n  # room came from these
    pool.check_invariants()


def test_host_tier_drops_oldest_beyond_capacity():
    dropped = []
    tier = HostTier(32, on_drop=dropped.append)
    pages = [HostPage(bytes([i]) * 16, None, PS, meta=None) for i in range(3)]
    for p in pages:
        tier.put(p)
    assert dropped == [pages[0]] and tier.tokens == 32 and len(tier) == 2
    taken = tier.take(pages[1].content_hash)
    tier.give_back(taken)                                    # back as the newest
    tier.put(HostPage(b"\x09" * 16, None, PS, meta=None))
    assert dropped == [pages[0], pages[2]]


@pytest.mark.parametrize("host_tokens", [256, 768])
def test_many_offloads_recalls_and_drops_keep_every_pages_values(host_tokens):
    """Offload, recall and drop pages through a small tier for many steps, copies asynchronous as in the
    engine; every recall must bring back exactly the page's values (pinned host arrays shared between
    an alias and its source, or a page taking another's data, would not)."""
    rng = np.random.default_rng(0)
    pool = PagePool(512, host_tokens=host_tokens)
    cache = _cache(512)
    transfers = KvTransfers()                                 # asynchronous, as in the engine
    truth = {}                                                # content hash -> its values when written
    live = []
    for step in range(150):
        while live and rng.random() < 0.6:                    # requests let go of pages
            pool.release(live.pop(rng.integers(len(live))))
        writes = []                                           # what this step's "device step" writes
        for _ in range(rng.integers(1, 4)):                   # new full pages with fresh values
            page = pool.allocate(PS)
            if page is None:
                break
            h = pool.register_full_page(page, None, [step, len(truth)] * 8, depth=0, request_id="r")
            truth[h] = float(len(truth))
            writes.append((page.start_slot, truth[h]))
            live.append(page)
        if len(pool.host) and rng.random() < 0.8:             # a prefix hit on the host tier
            hp = list(pool.host.pages())[rng.integers(len(pool.host))]
            for p in pool._recall_prefix([hp]):                # comes back held once
                if rng.random() < 0.5:
                    live.append(p)
                else:                                         # let go at once: the next allocation of
                    pool.release(p)                           # this pass may evict it again (an alias)
                    page = pool.allocate(PS)
                    if page is not None:
                        h = pool.register_full_page(page, None, [step, len(truth), 1] * 8, depth=0)
                        truth[h] = float(len(truth))
                        writes.append((page.start_slot, truth[h]))
                        live.append(page)
        cache = transfers.run(cache, pool.take_transfers())   # before the step, as in the engine
        for slot, value in writes:
            cache = [(k.at[:, slot:slot + PS].set(value), v.at[:, slot:slot + PS].set(-value)) for k, v in cache]
        for p in live:
            value = np.asarray(cache[0][0])[0, p.start_slot, 0]
            assert value == truth[p.content_hash], f"step {step}: page holds {value}, wants {truth[p.content_hash]}"
    assert transfers.stats.recalled_pages > 20 and pool.host.dropped > 20
    # Kept copies let go for room (both tiers) and, with the larger tier, pages evicted again with the copy
    # kept since their recall (no device -> host copy) were exercised, and every value above still matched.
    assert pool.host.kept_dropped >= 1, pool.host.kept_dropped
    assert host_tokens < 512 or pool.host.reused >= 5, pool.host.reused
    pool.check_invariants()



class _FakeOffload:
    """Stands for kv/transfer.py's _Offload: pinned or numpy, landed or not; records whether it was waited for."""

    def __init__(self, pinned, landed):
        self.pinned, self.landed, self.finished = pinned, landed, False

    def ready(self):
        return self.landed

    def finish(self):
        self.finished = True


def test_a_step_waits_for_no_pinned_offload_still_on_its_way():
    """Only landed pinned offloads and numpy ones (whose data the numpy copy replaces) are finished by
    `run`; pinned ones still copying stay in flight, up to MAX_OFFLOADS_IN_FLIGHT, past which the oldest
    are waited for."""
    from stratum_jax.kv.host_tier import PendingTransfers
    from stratum_jax.kv.transfer import MAX_OFFLOADS_IN_FLIGHT
    transfers = KvTransfers()
    jobs = [_FakeOffload(True, False), _FakeOffload(True, True), _FakeOffload(False, False)]
    transfers._in_flight = list(jobs)
    cache = _cache(256)
    assert transfers.run(cache, PendingTransfers()) is cache
    assert [j.finished for j in jobs] == [False, True, True]
    assert transfers._in_flight == jobs[:1]
    many = [_FakeOffload(True, False) for _ in range(MAX_OFFLOADS_IN_FLIGHT + 2)]
    transfers._in_flight = list(many)
    transfers.run(cache, PendingTransfers())
    assert [j.finished for j in many] == [True, True] + [False] * MAX_OFFLOADS_IN_FLIGHT
    assert transfers._in_flight == many[2:]



def test_a_recalled_page_evicted_again_goes_back_with_its_kept_copy_and_no_copy():
    """Recall, then evict again in a later pass: the page returns to the tier with the host data its recall
    came from (the same array, no device -> host copy booked), and a third recall brings back its values.
    A tier with no room left for the kept copy copies as before."""
    pool = PagePool(256, host_tokens=1024)
    cache = _cache(256)
    a, ha = _fill(pool, list(range(16)))
    want = _page_values(cache, a)
    pool.release(a)
    hogs = [pool.allocate(PS) for _ in range(16)]            # full: a is offloaded
    cache = run_transfers(cache, pool.take_transfers())
    for p in hogs:
        pool.release(p)
    [page] = pool.acquire_prefix(pool.match_prefix(list(range(16)) + [0], PS, 1), 1)
    pending = pool.take_transfers()
    source = pending.recalls[page.start_slot]
    cache = run_transfers(cache, pending)
    assert page.host_copy is source and source.kept and pool.host.kept_tokens == PS
    pool.release(page)
    hogs = [pool.allocate(PS) for _ in range(16)]            # full again: a is evicted a second time
    assert ha in pool.host and pool.host.reused == 1 and pool.host.kept_tokens == 0
    pending = pool.take_transfers()
    assert pending.offloads == [] and pool.host.get(ha).data is source.data   # the same host array, no copy
    cache = run_transfers(cache, pending)
    for p in hogs:
        pool.release(p)
    [again] = pool.acquire_prefix(pool.match_prefix(list(range(16)) + [0], PS, 1), 1)
    cache = run_transfers(cache, pool.take_transfers())
    np.testing.assert_array_equal(_page_values(cache, again), want)
    pool.check_invariants()


def test_kept_copies_make_room_first_and_only_when_their_recall_ran():
    """A kept copy is let go (oldest first) before any tier page when the tier needs room, and a recall
    keeps its source only if the tier has room without letting anything go."""
    tier = HostTier(48)
    pages = [HostPage(bytes([i]) * 16, None, PS, meta=None, data=np.full(1, i)) for i in range(4)]
    tier.put(pages[0])
    tier.put(pages[1])
    taken = tier.take(pages[0].content_hash)
    assert tier.keep(taken) and tier.kept_tokens == PS and tier.tokens == PS
    tier.put(pages[2])                                       # 48 tokens: full, nothing let go
    assert tier.keep(tier.take(pages[1].content_hash)) is True and tier.kept_tokens == 2 * PS
    tier.put(pages[3])                                       # room: the oldest kept copy goes, no tier page
    assert not pages[0].kept and pages[0].data is None and pages[1].kept and tier.kept_dropped == 1
    assert len(tier) == 2 and tier.dropped == 0
    full = HostTier(16)
    full.put(HostPage(b"\x07" * 16, None, PS, meta=None))
    assert full.keep(HostPage(b"\x08" * 16, None, PS, meta=None)) is False and full.kept_tokens == 0
