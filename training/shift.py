"""Shifted workloads derived from one Mooncake trace: other arrival rates, another sharing structure, and
a mix with the synthetic generator. Deterministic: the same records, spec and seed give the same output.

    python -m training.shift --trace ../shared/traces/mooncake_conversation.jsonl --out shifted.jsonl \\
        --rate 3 --system-prompts 8 --system-blocks 4 --mix 0.3 --seed 0

The three transformations, applied in this order:

- sharing (`system_prompts` K > 0): the trace's one shared block (hash id 0, the system prompt every
  request starts with) is replaced by one of K system prompts of `system_blocks` blocks each, drawn per
  conversation with Zipf(`zipf`) popularity; a conversation keeps its prompt across turns (a
  conversation is the chain that shares its first private block). Inputs grow by the added blocks.
  Private ids are moved past the new shared ones, so nothing collides.
- rate (`rate` r): arrivals r times as dense (timestamps t0 + (t - t0) / r): think times and
  inter-arrival gaps shrink together, as when the same users are served r times faster or r times
  as many are multiplexed.
- mix (`mix` f > 0): a synthetic conversation workload (`training/synthetic.py`) with f x as many
  requests as the trace, spread over the same time span, merged in by timestamp; its ids are moved past
  every id of the trace.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import numpy as np

from training.synthetic import BLOCK, conversation_trace, write_jsonl
from training.traces import mooncake_records


@dataclasses.dataclass(frozen=True)
class ShiftSpec:
    rate: float = 1.0
    system_prompts: int = 0
    system_blocks: int = 4
    zipf: float = 1.2
    mix: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.system_prompts < 0 or self.system_blocks < 1:
            raise ValueError(f"system_prompts must be >= 0 and system_blocks >= 1, got "
                             f"{self.system_prompts}, {self.system_blocks}")
        if not self.zipf > 1.0:
            raise ValueError(f"zipf must be > 1, got {self.zipf}")
        if self.mix < 0:
            raise ValueError(f"mix must be >= 0, got {self.mix}")


def read_records(path: str) -> list[dict]:
    """Mooncake records, one JSON object a line, each line checked as `read_mooncake` checks it
    (TraceFormatError, a ValueError, names the file and line)."""
    return [obj for _, obj in mooncake_records(path)]


def _max_id(records: list[dict]) -> int:
    return max(max(r["hash_ids"]) for r in records)


def remap_sharing(records: list[dict], prompts: int, blocks: int, zipf: float, seed: int) -> list[dict]:
    """See the module docstring (sharing). Conversations are keyed by their first private block."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, prompts + 1) ** zipf
    weights /= weights.sum()
    shared = [[1 + k * blocks + j for j in range(blocks)] for k in range(prompts)]
    offset = 1 + prompts * blocks
    choice: dict[int, int] = {}
    out = []
    for r in records:
        ids = r["hash_ids"]
        key = ids[1] if len(ids) > 1 else None
        if key is None or key not in choice:
            k = int(rng.choice(prompts, p=weights))
            if key is not None:
                choice[key] = k
        else:
            k = choice[key]
        head = shared[k] if ids[0] == 0 else [offset + ids[0]]
        new = head + [offset + h for h in ids[1:]]
        grown = BLOCK * (len(new) - len(ids))
        out.append({**r, "input_length": r["input_length"] + grown, "hash_ids": new})
    return out


def scale_rate(records: list[dict], rate: float) -> list[dict]:
    """Arrivals `rate` times as dense, from the first timestamp."""
    t0 = records[0]["timestamp"]
    return [{**r, "timestamp": int(round(t0 + (r["timestamp"] - t0) / rate))} for r in records]


def mix_synthetic(records: list[dict], share: float, seed: int) -> list[dict]:
    """Merges in round(share x len(records)) synthetic requests over the same time span."""
    n = int(round(share * len(records)))
    if n == 0:
        return list(records)
    t0, t1 = records[0]["timestamp"], records[-1]["timestamp"]
    span_s = max(1.0, (t1 - t0) / 1000.0)
    syn = conversation_trace(n, seed=seed, rate_per_s=n / span_s * 0.6)   # turns add ~2/3 more requests
    offset = _max_id(records) + 1
    syn_t1 = max(1, syn[-1]["timestamp"])
    syn = [{**r, "timestamp": int(t0 + r["timestamp"] * (t1 - t0) / syn_t1),
            "hash_ids": [offset + h for h in r["hash_ids"]]} for r in syn]
    both = [(r["timestamp"], 0, i, r) for i, r in enumerate(records)] + \
           [(r["timestamp"], 1, i, r) for i, r in enumerate(syn)]
    both.sort(key=lambda x: x[:3])
    return [r for *_, r in both]


def derive(records: list[dict], spec: ShiftSpec) -> list[dict]:
    """The shifted workload of `records` (time-ordered Mooncake records) under `spec`."""
    if not records:
        raise ValueError("no records to shift")
    out = list(records)
    if spec.system_prompts:
        out = remap_sharing(out, spec.system_prompts, spec.system_blocks, spec.zipf, spec.seed)
    if spec.rate != 1.0:
        out = scale_rate(out, spec.rate)
    if spec.mix:
        out = mix_synthetic(out, spec.mix, spec.seed + 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m training.shift", description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True, help="a Mooncake trace (JSON lines)")
    p.add_argument("--out", required=True)
    p.add_argument("--rate", type=float, default=1.0, help="arrival density factor (2 = twice as dense)")
    p.add_argument("--system-prompts", type=int, default=0, help="K shared system prompts (0 = keep the trace's)")
    p.add_argument("--system-blocks", type=int, default=4, help="blocks per system prompt")
    p.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the system prompts' popularity")
    p.add_argument("--mix", type=float, default=0.0, help="synthetic requests per trace request to merge in")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if os.path.exists(a.out) and os.path.exists(a.trace) and os.path.samefile(a.out, a.trace):
        p.error(f"--out {a.out} is the --trace file: writing it would replace the trace; give another path")
    try:
        spec = ShiftSpec(a.rate, a.system_prompts, a.system_blocks, a.zipf, a.mix, a.seed)
        out = derive(read_records(a.trace), spec)
    except (ValueError, OSError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_jsonl(a.out, out)
    print(f"wrote {len(out)} requests to {a.out} ({dataclasses.asdict(spec)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
