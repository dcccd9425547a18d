"""Schedulers that decide which requests run in the next engine step: FCFS and HAB, behind one Protocol
(base.py)."""
from __future__ import annotations

from stratum_jax.config import RuntimeConfig
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.phase_times import PhaseTimes
from stratum_jax.scheduler.base import Scheduler


def build_scheduler(config: RuntimeConfig, pool: PagePool, phases: PhaseTimes | None = None) -> Scheduler:
    """The scheduler --scheduler names (hab: the default; fcfs: the ablation and the baseline's). phases:
    where admission's prefix lookups are timed (the engine's), or None for its own."""
    from stratum_jax.scheduler.fcfs import FcfsScheduler
    from stratum_jax.scheduler.hab import HabScheduler
    return (HabScheduler if config.scheduler == "hab" else FcfsScheduler)(config, pool, phases=phases)
