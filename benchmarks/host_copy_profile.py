"""Host-side cost of the host tier's copies per engine step, without a model or a GPU.

    JAX_PLATFORMS=cpu PYTHONPATH=$PWD python3 benchmarks/host_copy_profile.py --out benchmarks/results/host_copy_profile_cpu.json

A llama-1b-shaped KV cache (16 layers, 8 KV heads, head_dim 64, bf16, 16,384 slots) and `KvTransfers`, fed
the same synthetic stream each time: per step 6 pages of 16 tokens offloaded and, once the tier holds
100 pages, 4 recalled. Two tiers: `growing` (nothing is dropped, as in benchmarks/host_tier.py, whose
tier never fills) and `full` (at most 200 pages; the oldest are dropped). Pages live in jax's host memory
kind (`pinned_host`, kv/transfer.py); the numpy buffer recycling this once compared is gone with it.
Reports ms per step and the transfer time.
On a GPU the device copies overlap the step; here the numbers are the host's share only.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from run_record import provenance, save_json  # noqa: E402  (beside this script)


def run(tier: str, steps: int, warmup: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from stratum_jax.kv.host_tier import HostPage, PendingTransfers
    from stratum_jax.kv.transfer import KvTransfers

    layers, heads, dim, slots, ps = 16, 8, 64, 16384, 16
    cache = [(jnp.zeros((heads, slots, dim), jnp.bfloat16), jnp.zeros((heads, slots, dim), jnp.bfloat16))
             for _ in range(layers)]
    transfers = KvTransfers()
    rng = np.random.default_rng(0)
    held: collections.deque = collections.deque()

    def step(cache):
        pending = PendingTransfers()
        for _ in range(6):
            hp = HostPage(bytes(16), None, ps, None, src_slot=int(rng.integers(0, slots // ps)) * ps)
            pending.offloads.append(hp)
            held.append(hp)
        for _ in range(4):
            if len(held) > 100:
                src = held[int(rng.integers(0, 50))]
                held.remove(src)
                pending.recalls[int(rng.integers(0, slots // ps)) * ps] = src
        while tier == "full" and len(held) > 200:
            gone = held.popleft()
            gone.dropped = True
            gone.data = None
        return transfers.run(cache, pending)

    for _ in range(warmup):
        cache = step(cache)
    jax.block_until_ready(cache)
    s0 = transfers.stats.seconds
    t = time.perf_counter()
    for _ in range(steps):
        cache = step(cache)
    jax.block_until_ready(cache)
    wall = time.perf_counter() - t
    return {"tier": tier, "host_memory": transfers.memory_kind, "ms_per_step": wall / steps * 1e3,
            "transfer_s": transfers.stats.seconds - s0, "steps": steps}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = [run(tier, args.steps, args.warmup) for tier in ("growing", "full")]
    for r in rows:
        print(f"{r['tier']:<8} {r['host_memory']} {r['ms_per_step']:6.2f} ms/step  "
              f"transfer {r['transfer_s']:.2f} s in {r['steps']} steps")
    result = dict(provenance("host_copy_profile"), args=vars(args), rows=rows)
    if args.out:
        save_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
