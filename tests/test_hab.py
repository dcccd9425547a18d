"""HAB admits on idle: a stub clock drives the device idle gaps the scheduler sees; above the threshold it
picks by CPM fit, below it gives the budget to the shortest remaining prompt, and it respects the
starvation bound."""
import pytest

from stratum_jax.config import RuntimeConfig
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.request import SamplingParams
from stratum_jax.scheduler import build_scheduler
from stratum_jax.scheduler.base import StepCosts
from stratum_jax.scheduler.fcfs import FcfsScheduler
from stratum_jax.scheduler.hab import HabScheduler, cpm, fill_score
from stratum_jax.sequence import Sequence

PREFILL_MS_PER_TOKEN = 0.05       # measured costs the stub feeds in: 20 tokens per ms of prefill
DECODE_MS_PER_STEP = 2.0


def _scheduler(kind="hab", **kw):
    config = RuntimeConfig(model="tiny", max_context=1024, kv_pool_tokens=8192, max_batch_size=1, prefill_chunk=512,
                           max_num_batched_tokens=1 + 512, scheduler=kind, hab_threshold_ms=8.0,
                           hab_max_wait_ms=kw.pop("max_wait_ms", 5000.0), **kw)
    return build_scheduler(config, PagePool(config.kv_pool_slots, enable_prefix_caching=False))


def _seq(name, prompt_tokens, arrival_s, max_tokens=1):
    return Sequence(request_id=name, prompt_ids=list(range(3, 3 + prompt_tokens)),
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0), seed=0, detokenizer=None,
                    arrival_time=arrival_s)


def _costs(now_s, idle_ms):
    return StepCosts(now_s=now_s, idle_gap_ms=idle_ms, prefill_ms_per_token=PREFILL_MS_PER_TOKEN,
                     decode_ms_per_step=DECODE_MS_PER_STEP)


def _admitted(batch):
    return [s.request_id for s in batch.prefill]


def test_cpm_score():
    assert cpm(4.0, 4.0) == 2.0 and cpm(0.0, 5.0) == 0.0
    # CPM alone grows with the request; the fit score peaks where the request's compute equals the idle time.
    assert cpm(100.0, 8.0) > cpm(8.0, 8.0)
    assert fill_score(8.0, 8.0) == 0.5 > fill_score(4.0, 8.0) == fill_score(16.0, 8.0)


def _queue(sched):
    # Arrival order: a 400-token prompt (20 ms of prefill), then 200 (10 ms), then 160 (8 ms), then 40 (2 ms).
    for i, (name, n) in enumerate([("big", 400), ("mid", 200), ("fit", 160), ("small", 40)]):
        sched.add(_seq(name, n, arrival_s=100.0 + i * 0.001))


def test_below_threshold_hab_admits_the_shortest_prompt_first():
    sched = _scheduler()
    _queue(sched)
    batch = sched.schedule(_costs(now_s=100.5, idle_ms=3.0))        # 3 ms idle < 8 ms
    assert _admitted(batch) == ["small"] and sched.triggers == 0
    assert isinstance(sched, HabScheduler)
    fcfs = _scheduler("fcfs")
    _queue(fcfs)
    assert _admitted(fcfs.schedule(_costs(now_s=100.5, idle_ms=3.0))) == ["big"]


@pytest.mark.parametrize("kind, want", [("hab", ["short", "long"]), ("fcfs", ["long"])])
def test_a_short_prompt_overtakes_a_long_one_mid_prefill(kind, want):
    """A 100-token prompt arrives while a 1000-token one is prefilling: HAB gives it the budget first and
    the long prompt the rest; FCFS keeps the budget on the long prompt."""
    config = RuntimeConfig(model="tiny", max_context=2048, kv_pool_tokens=8192, max_batch_size=2, prefill_chunk=512,
                           max_num_batched_tokens=2 + 512, scheduler=kind, hab_threshold_ms=8.0,
                           hab_max_wait_ms=5000.0)
    sched = build_scheduler(config, PagePool(config.kv_pool_slots, enable_prefix_caching=False))
    sched.add(_seq("long", 1000, arrival_s=100.0))
    (long,) = sched.schedule(_costs(100.0, 0.0)).prefill
    long.num_computed += 512                    # what the engine accounts when it dispatches the chunk
    sched.add(_seq("short", 100, arrival_s=100.1))
    batch = sched.schedule(_costs(100.2, 0.0))
    assert _admitted(batch) == want
    assert sum(batch.chunk_lens) <= 512


def test_idle_above_threshold_admits_by_cpm_fit():
    sched = _scheduler()
    _queue(sched)
    # Idle accumulates across calls while requests wait: 5 ms, then 4 more ms = 9 ms >= 8 ms.
    assert sched._prefill_order(_costs(100.5, 5.0)) and sched.triggers == 0
    batch = sched.schedule(_costs(now_s=100.5, idle_ms=4.0))
    # c_idle = 9 ms; c_req = tokens x 0.05 ms + max_tokens x 2 ms / 1 row: fit (8 + 2 = 10 ms) fits best.
    assert _admitted(batch) == ["fit"]
    assert sched.triggers == 1 and sched.hungry_ms == 0.0
    # FCFS, same queue and idle time: the head of the queue.
    fcfs = _scheduler("fcfs")
    _queue(fcfs)
    assert isinstance(fcfs, FcfsScheduler) and not isinstance(fcfs, HabScheduler)
    assert _admitted(fcfs.schedule(_costs(now_s=100.5, idle_ms=50.0))) == ["big"]


def test_starvation_bound_goes_first():
    sched = _scheduler(max_wait_ms=300.0)
    _queue(sched)
    # 0.4 s after arrival every request has waited past the 300 ms bound: arrival order wins over the fit.
    batch = sched.schedule(_costs(now_s=100.4, idle_ms=50.0))
    assert _admitted(batch) == ["big"]


def test_idle_with_an_empty_queue_is_not_owed():
    sched = _scheduler()
    sched.schedule(_costs(100.0, 100.0))                   # nothing queued: the idle time is forgotten
    _queue(sched)
    assert _admitted(sched.schedule(_costs(100.5, 1.0))) == ["small"] and sched.triggers == 0


@pytest.mark.parametrize("value, want", [("4", 4.0), ("low-latency", 2.0)])
def test_threshold_from_environment(monkeypatch, value, want):
    monkeypatch.setenv("STRATUM_HAB_THRESHOLD_MS", value)
    assert RuntimeConfig(model="tiny").hab_threshold_ms == want
    monkeypatch.setenv("STRATUM_HAB_THRESHOLD_MS", "soon")
    with pytest.raises(ValueError, match="STRATUM_HAB_THRESHOLD_MS"):
        RuntimeConfig(model="tiny")


def test_a_starving_request_goes_before_the_cpm_pick():
    """Only the oldest request has waited past the bound: it is admitted first even though the idle time
    would pick another one; with room for two, the CPM pick comes next."""
    config = RuntimeConfig(model="tiny", max_context=1024, kv_pool_tokens=8192, max_batch_size=2, prefill_chunk=512,
                           max_num_batched_tokens=2 + 1024, scheduler="hab", hab_threshold_ms=8.0,
                           hab_max_wait_ms=300.0)
    sched = build_scheduler(config, PagePool(config.kv_pool_slots, enable_prefix_caching=False))
    sched.add(_seq("old-big", 400, arrival_s=99.0))                     # waited 1.5 s at now = 100.5
    for i, (name, n) in enumerate([("mid", 200), ("fit", 160), ("small", 40)]):
        sched.add(_seq(name, n, arrival_s=100.4 + i * 0.001))
    batch = sched.schedule(_costs(now_s=100.5, idle_ms=9.0))
    assert _admitted(batch) == ["old-big", "fit"] and sched.triggers == 1
