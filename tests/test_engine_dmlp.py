"""The DMLP cache policy wired into the page pool and the engine: eviction by predicted reuse, page size,
identical outputs to LRU, no leaks, the LRU order unchanged, and clear errors for bad flags."""
import json
import random

import jax
import numpy as np
import pytest

from dmlp_checkpoint import write_checkpoint
from engine_load import run_random_load
from stratum_jax.config import RuntimeConfig, parse_cores
from stratum_jax.dmlp.features import FEATURE_NAMES, Normalizer
from stratum_jax.dmlp.model import DmlpConfig, init_params
from stratum_jax.cache_policy import LruPolicy
from stratum_jax.dmlp.policy import DmlpPolicy
from stratum_jax.dmlp.runtime import build_cache_policy
from stratum_jax.engine import Engine
from stratum_jax.kv.block_meta import RequestFeatures
from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.model.loader import load_model
from stratum_jax.request import SamplingParams
from stratum_jax.dmlp.checkpoint import CheckpointError, save_checkpoint, DmlpCheckpoint

H = (10.0, 50.0, 100.0, 200.0, 500.0)
INPUT = FEATURE_NAMES.index("input_tokens")
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("dmlp") / "ck")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", dtype="float32", seed=0)


class StubPredictor:
    """Reuse curve chosen by the request's prompt length: 100 tokens = hot, 200 = cold, else warm."""
    config = DmlpConfig(num_inputs=2 * len(FEATURE_NAMES), horizons_ms=H)
    normalizer = Normalizer(np.zeros(len(FEATURE_NAMES), np.float32), np.ones(len(FEATURE_NAMES), np.float32))
    CURVES = {100: [0.5, 0.8, 0.9, 0.95, 0.99], 200: [0.0, 0.001, 0.002, 0.003, 0.004]}

    def __init__(self):
        self.rows = 0

    def predict(self, raw):
        self.rows += len(raw)
        warm = [0.1, 0.2, 0.3, 0.4, 0.5]
        return np.array([self.CURVES.get(int(x), warm) if x == x else warm for x in raw[:, INPUT]],
                        np.float32).reshape(len(raw), len(H))


class FakeClock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def pool_with(policy, clock, slots=256):
    pool = PagePool(slots, policy=policy, clock=clock)
    prompt_len = {"hot": 100, "cold": 200, "warm": 50, "run": 100}
    pool.request_features = lambda rid: RequestFeatures(input_tokens=prompt_len.get(rid.split("-")[0]))
    return pool


def cached_table(pool, request_id, first_token, pages=2, page_size=16):
    """A request that computed `pages` full pages of its own tokens, still holding them."""
    t = BlockTable(pool, page_size)
    assert t.ensure_capacity(pages * page_size)
    tokens = list(range(first_token, first_token + pages * page_size))
    t.register_full_pages(tokens, pages * page_size, request_id)
    return t, tokens


def freed_order(pool):
    return [h for ev, _, h, _, _ in pool.events if ev == "freed"]


def fill_and_evict(pool, clock, order, running="run"):
    """Caches 2 pages (16 tokens) for each name in `order` (released in that order), keeps a running
    request's 2 pages held, then allocates until every unowned cached page was evicted.
    Returns {name: its page hashes} and the running table."""
    pool.record_events = True
    hashes = {}
    tables = {}
    for i, name in enumerate(order + [running]):
        clock.t += 1.0
        t, _ = cached_table(pool, name, 1000 * (i + 1))
        hashes[name] = list(t._hashes)
        tables[name] = t
    for name in order:
        clock.t += 1.0
        tables[name].release()
    pool.new_step()
    clock.t += 1.0
    grabbed = []
    while True:
        page = pool.allocate(16)
        if page is None:
            break
        grabbed.append(page)
    pool.check_invariants()
    return hashes, tables[running], grabbed


# ---- (a) the pool evicts by predicted reuse -------------------------------------------------------

def test_pool_evicts_lowest_predicted_reuse_first_and_never_a_running_page():
    clock = FakeClock()
    stub = StubPredictor()
    pool = pool_with(DmlpPolicy(stub), clock)
    hashes, running, grabbed = fill_and_evict(pool, clock, ["hot-a", "cold-b", "warm-c"])
    freed = freed_order(pool)
    # Every unowned page went, the cold request's first, then the warm one's, the hot one's last.
    assert set(freed) == set(hashes["hot-a"] + hashes["cold-b"] + hashes["warm-c"])
    assert set(freed[:2]) == set(hashes["cold-b"]) and set(freed[2:4]) == set(hashes["warm-c"])
    assert set(freed[4:]) == set(hashes["hot-a"])
    # The running request's pages stayed cached and owned.
    assert not set(freed) & set(hashes["run"]) and all(p.ref_count == 1 for p in running.pages)
    assert pool.cached_pages == 2 and stub.rows > 0
    # LRU on the same sequence evicts in release order: the DMLP order differs where predictions say so.
    clock = FakeClock()
    lru = pool_with(LruPolicy(), clock)
    lru_hashes, _, _ = fill_and_evict(lru, clock, ["hot-a", "cold-b", "warm-c"])
    assert freed_order(lru) == lru_hashes["hot-a"] + lru_hashes["cold-b"] + lru_hashes["warm-c"]
    assert [h for h in freed_order(lru)] != [h for h in freed]


def test_pool_takes_the_oldest_without_asking_past_the_horizons():
    """Idle past the longest horizon every candidate scores 0, so the order is least recently used by
    access (not by release), and the pool does not rank at all."""
    clock = FakeClock()
    stub = StubPredictor()
    pol = DmlpPolicy(stub)
    calls = []
    real = pol.choose_victims
    pol.choose_victims = lambda *a, **k: calls.append(1) or real(*a, **k)
    pool = pool_with(pol, clock)
    pool.record_events = True
    a, _ = cached_table(pool, "hot-a", 1000)      # accessed first (and predicted hot)
    clock.t += 5
    b, _ = cached_table(pool, "cold-b", 2000)
    a_hashes, b_hashes = list(a._hashes), list(b._hashes)
    b.release()                                    # released first
    a.release()
    pool.new_step()
    clock.t += 10_000
    assert pool.allocate(256) is not None
    assert freed_order(pool) == a_hashes + b_hashes
    assert calls == []


def test_pool_lru_order_is_unchanged():
    """(d) The default policy evicts the least recently *released* page first, as before policies."""
    clock = FakeClock()
    pool = PagePool(256, clock=clock)
    assert pool.lru_fast_path
    pool.record_events = True
    tables, hashes = {}, {}
    for i, name in enumerate(["a", "b", "c", "d"]):
        tables[name], _ = cached_table(pool, name, 100 * (i + 1), pages=1)
        hashes[name] = tables[name]._hashes[0]
    for name in ["c", "a", "d", "b"]:
        tables[name].release()
    # Re-use "a" (a prefix hit takes it out of the evictable set; releasing puts it last).
    hit = pool.match_prefix(list(range(100, 116)) + [0], 16, 1)
    pool.acquire_prefix(hit, 1, "e")
    for p in hit:
        pool.release(p)
    big = [pool.allocate(32) for _ in range(8)]
    order = [h for ev, _, h, _, _ in pool.events if ev == "freed"]
    expect = [hashes[n] for n in ["c", "d", "b", "a"]]
    assert order == expect[:len(order)] and len(order) >= 3
    assert all(info is not None for ev, _, _, _, info in pool.events if ev != "freed")
    for p in big:
        if p is not None:
            pool.release(p)
    pool.check_invariants()


def test_engine_with_a_stub_policy_never_evicts_pages_in_use(tiny):
    clock = FakeClock()
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=512, max_batch_size=8,
                                  prefill_chunk=32, max_tokens_cap=64), model=tiny,
                    policy=DmlpPolicy(StubPredictor()), clock=clock)
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(32)]
    for i in range(24):
        engine.add_request(shared + [rng.randrange(3, 250) for _ in range(rng.randrange(1, 40))],
                           SamplingParams(max_tokens=rng.randrange(1, 24), **GREEDY))
    steps = 0
    while engine.has_unfinished():
        clock.t += 3.0
        engine.step()
        held = {p.start_slot for s in engine.scheduler.running for p in s.blocks.pages}
        assert not held & set(engine.pool._evictable), "a page a running request holds is evictable"
        engine.pool.check_invariants()
        steps += 1
        assert steps < 2000
    assert engine.pool.evictions > 0 and engine.pool.free_slots == engine.pool.num_slots


# ---- (b) a real checkpoint through the engine ---------------------------------------------------

def _workload(seed=0, n=40):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.choice((16, 24, 40)))] for _ in range(4)]
    out = []
    for i in range(n):
        body = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 30))]
        out.append((prefixes[i % 4] if i % 5 else []) + body)
    return out


def _run(engine, prompts, waves=4):
    results = []
    per = len(prompts) // waves
    for w in range(waves):
        results += [r.token_ids for r in engine.generate(prompts[w * per:(w + 1) * per],
                                                         SamplingParams(max_tokens=12, **GREEDY))]
    return results


def test_dmlp_engine_matches_lru_and_leaks_nothing(tiny, ckpt, tmp_path):
    kw = dict(model="tiny", max_context=128, kv_pool_tokens=512, max_batch_size=8, prefill_chunk=32,
              max_tokens_cap=64)
    prompts = _workload()
    lru = Engine(RuntimeConfig(**kw), model=tiny)
    want = _run(lru, prompts)
    trace = tmp_path / "events.jsonl"
    dm = Engine(RuntimeConfig(**kw, cache_policy="dmlp", dmlp_checkpoint=ckpt, trace_out=str(trace)), model=tiny)
    assert isinstance(dm.cache_policy, DmlpPolicy) and dm.dmlp_tuner is None
    got = _run(dm, prompts)
    dm.close()
    assert got == want, "eviction policy changed generated tokens"
    for e in (lru, dm):
        st = e.stats()
        assert e.pool.evictions > 0, "the pool was meant to be small enough to force evictions"
        assert st.prefix_cache_hits > 0 and st.kv_pages_free == st.kv_pages_total
        assert e.pool.free_slots == e.pool.num_slots and not e.scheduler.running
        e.pool.check_invariants()
    # The trace carries the metadata's features (history included) and reads back.
    from training.traces import read_stratum_log
    events = [json.loads(line) for line in trace.read_text().splitlines()]
    accessed = [e for e in events if e["event"] == "accessed"]
    assert accessed and all(e["features"]["access_count"] >= 2 for e in accessed)
    assert all(e["features"]["recency_ms"] is not None and e["features"]["attn_var5"] is None for e in accessed)
    assert all(e["features"]["kv_hbm_frac"] == 1.0 for e in accessed)
    times = [e["timestamp_ms"] for e in events]
    assert times == sorted(times)
    assert read_stratum_log(str(trace)).num_events == sum(e["event"] in ("created", "accessed") for e in events)


def test_dmlp_no_leaks_with_preemption_and_cancellation(tiny, ckpt):
    engine = Engine(RuntimeConfig(model="tiny", kv_pool_tokens=512, max_context=128, max_batch_size=16,
                                  max_queue=400, prefill_chunk=32, max_tokens_cap=64,
                                  cache_policy="dmlp", dmlp_checkpoint=ckpt), model=tiny)
    finals = run_random_load(engine, random.Random(11), requests=80, shared_fraction=0.5,
                             params=lambda rng: SamplingParams(max_tokens=rng.randrange(1, 40), **GREEDY))
    assert len(finals) == 80 and set(finals.values()) == {1}
    st = engine.stats()
    assert engine.pool.evictions > 0 and st.prefix_cache_hits > 0
    assert engine.pool.free_slots == engine.pool.num_slots and not engine.pool._request_prefix
    engine.pool.check_invariants()


def test_page_size_follows_the_policy_without_a_hit(tiny):
    class Fixed(LruPolicy):
        pool_lru = False

        def observe_access(self, infos):
            return None

        def choose_victims(self, candidates, n, now_ms):
            return [b.block_id for b in candidates[:n]]

        def page_size_for(self, hints, prefix_blocks=(), now_ms=0.0):
            return 64

    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, max_tokens_cap=64),
                    model=tiny, policy=Fixed())
    engine.add_request(list(range(3, 30)), SamplingParams(max_tokens=2, **GREEDY))
    engine.step()
    (seq,) = engine.scheduler.running
    assert seq.blocks.page_size == 64
    forced = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, max_tokens_cap=64,
                                  page_size=16), model=tiny, policy=Fixed())
    forced.add_request(list(range(3, 30)), SamplingParams(max_tokens=2, **GREEDY))
    forced.step()
    assert forced.scheduler.running[0].blocks.page_size == 16          # --page-size wins


# ---- (c) bad flags and checkpoints --------------------------------------------------------------

def test_bad_flags_say_what_to_fix(ckpt, tmp_path):
    with pytest.raises(ValueError, match="--dmlp-checkpoint"):
        RuntimeConfig(cache_policy="dmlp")
    with pytest.raises(ValueError, match=f"{tmp_path}/nope"):
        RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="--dmlp-confidence"):
        RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_confidence=0.99)
    with pytest.raises(ValueError, match="--dmlp-online-dir"):
        RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_online=True)
    with pytest.raises(ValueError, match="only applies with --cache-policy dmlp"):
        RuntimeConfig(dmlp_checkpoint=ckpt)
    with pytest.raises(ValueError, match="--cache-policy must be one of"):
        RuntimeConfig(cache_policy="lfu")
    with pytest.raises(ValueError, match="--dmlp-online-track"):
        RuntimeConfig(cache_policy="dmlp", dmlp_checkpoint=ckpt, dmlp_online_track=1.5)
    with pytest.raises(ValueError, match="--dmlp-online-cores"):
        parse_cores("3-1")
    assert parse_cores("0,2-3") == (0, 2, 3) and parse_cores("") is None
    # Through the server's parser: flags land in the config.
    from stratum_jax.serve import build_parser
    args = build_parser().parse_args(["--cache-policy", "dmlp", "--dmlp-checkpoint", ckpt, "--dmlp-online",
                                      "--dmlp-online-dir", str(tmp_path / "on"), "--dmlp-online-cores", "0",
                                      "--dmlp-online-track", "0.5"])
    cfg = RuntimeConfig.from_cli_args(args)
    assert cfg.dmlp_online and cfg.dmlp_online_cores == (0,) and cfg.dmlp_confidence == 0.75
    assert cfg.dmlp_online_track == 0.5 and cfg.dmlp_device == "default"


def test_dmlp_device_cpu_puts_the_predictor_on_the_host(ckpt):
    import jax
    from stratum_jax.dmlp.runtime import build_dmlp
    from stratum_jax.serve import build_parser
    args = build_parser().parse_args(["--cache-policy", "dmlp", "--dmlp-checkpoint", ckpt, "--dmlp-device", "cpu"])
    wired, _ = build_dmlp(RuntimeConfig.from_cli_args(args))
    predictor = wired.policy.predictor
    assert predictor.device == jax.devices("cpu")[0]
    assert {d for leaf in jax.tree_util.tree_leaves(predictor.params) for d in leaf.devices()} == {predictor.device}


def test_corrupt_checkpoint_fails_at_start_up_naming_the_file(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{ not json")
    cfg = RuntimeConfig(model="tiny", cache_policy="dmlp", dmlp_checkpoint=str(bad))
    with pytest.raises(CheckpointError, match="meta.json"):
        build_cache_policy(cfg)
    f = len(FEATURE_NAMES)
    (bad / "meta.json").write_text(json.dumps({"format": "stratum-dmlp", "version": 1,
                                               "feature_names": list(FEATURE_NAMES), "num_inputs": 2 * f,
                                               "horizons_ms": list(H), "hidden": [8],
                                               "normalizer": {"mean": [0.0] * f, "std": [1.0] * f}}))
    with pytest.raises(CheckpointError, match="params"):
        build_cache_policy(cfg)


def test_idle_engine_still_labels_accesses_for_online_fine_tuning(tiny):
    """With no traffic, the engine's idle tick closes accesses whose horizons passed (labels all 0), so
    online fine-tuning keeps learning when a server goes quiet."""
    from stratum_jax.dmlp.outcomes import OutcomeTracker
    got = []
    tracker = OutcomeTracker(H, lambda raw, labels, known: got.append((raw, labels * known)))
    policy = DmlpPolicy(StubPredictor(), on_access=tracker.accessed, on_idle=tracker.idle, score_on_access=False)
    clock = FakeClock()
    engine = Engine(RuntimeConfig(model="tiny", max_context=128, kv_pool_tokens=1024, page_size=8), model=tiny,
                    policy=policy, clock=clock)
    assert engine.idle_tick_s == H[-1] / 1e3
    engine.generate([list(range(3, 43))], SamplingParams(max_tokens=4, **GREEDY))    # 5 full prompt pages
    engine.tick()
    assert not got                                   # nothing has expired yet
    clock.t += H[-1] + 1.0
    engine.tick()
    raw = np.concatenate([r for r, _ in got])
    labels = np.concatenate([lab for _, lab in got])
    # Each of the 5 pages' horizons is decided on its own deadline: one row per (page, horizon), all 0.
    assert len(raw) == 5 * len(H) and labels.shape == (5 * len(H), len(H)) and not labels.any()
    assert Engine(RuntimeConfig(model="tiny", max_context=128), model=tiny).idle_tick_s is None   # lru


def test_residency_estimate_counts_each_eviction_once():
    """The pool asks for rankings of up to 16 victims but may use them in part: the policy's residency
    estimate must see exactly the evictions made, not the batch sizes asked for."""
    counted = []

    class Spy(DmlpPolicy):
        def __init__(self):
            super().__init__(StubPredictor())
            real = self.residency.update
            self.residency.update = lambda now, evicted, cached: counted.append(evicted) or real(now, evicted, cached)

    clock = FakeClock()
    pool = pool_with(Spy(), clock)
    tables = []
    for i, name in enumerate(["hot-a", "cold-b", "warm-c"]):
        clock.t += 1.0
        tables.append(cached_table(pool, name, 1000 * (i + 1))[0])
    for t in tables:
        t.release()                                   # 6 unowned cached pages
    pool.new_step()
    while pool.evictions < 2:                         # room for two more pages only: a partial ranking
        assert pool.allocate(16) is not None
    assert pool.evictions == 2 and sum(counted) == 2
