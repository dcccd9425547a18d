"""A random request load for engine tests: arrivals, shared prefixes and cancellations, driven step by step."""
from __future__ import annotations

import random
from typing import Callable

from stratum_jax.request import SamplingParams


def run_random_load(engine, rng: random.Random, *, requests: int, shared_fraction: float,
                    params: Callable[[random.Random], SamplingParams], max_steps: int = 20000) -> dict[str, int]:
    """Submits `requests` random prompts (0-3 per step; `shared_fraction` of them start with the same 24
    tokens), cancels a random live one in 10% of steps, and steps the engine until nothing is left.
    Returns request id -> number of final outputs it got (each should get exactly one)."""
    finals: dict[str, int] = {}
    live: list[str] = []
    submitted = steps = 0
    while submitted < requests or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if submitted < requests:
                prompt = [rng.randrange(3, 250) for _ in range(rng.randrange(1, 70))]
                if rng.random() < shared_fraction:
                    prompt = [11] * 24 + prompt
                live.append(engine.add_request(prompt[:88], params(rng)))
                submitted += 1
        if live and rng.random() < 0.1:
            engine.cancel(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = finals.get(out.request_id, 0) + 1
                if out.request_id in live:
                    live.remove(out.request_id)
        steps += 1
        assert steps < max_steps, "the engine stopped making progress"
    return finals
