"""The cache simulator against hit counts worked out by hand."""
import numpy as np
import pytest

from training.history import build_history
from training.simulator import LFU, LRU, Belady, Predicted, replay
from training.traces import AccessStream


def stream(requests, times=None):
    """One AccessStream from a list of requests, each a list of block ids; request i at time i ms."""
    t, b, r, d = [], [], [], []
    for i, req in enumerate(requests):
        for depth, blk in enumerate(req):
            t.append(float(i if times is None else times[i]))
            b.append(blk)
            r.append(i)
            d.append(depth)
    n = len(t)
    nan = np.full(n, np.nan)
    return AccessStream("hand", np.array(t), np.array(b, np.int64), np.array(r, np.int64), np.array(d, float),
                        nan, nan, nan, nan, np.full((n, 5), np.nan), sorted(set(b)), t[-1])


def hits(requests, capacity, make, host=0):
    s = stream(requests)
    res = replay(s, capacity, make(s), host_capacity=host)
    return res.hits, res.host_hits


A, B, C, D = 0, 1, 2, 3
POLICIES = {"lru": lambda s: LRU(), "lfu": lambda s: LFU(),
            "belady": lambda s: Belady(build_history(s).next_event)}


@pytest.mark.parametrize("seq, want", [
    # A A A B C B C B C, capacity 2.
    # LRU: A m, A h, A h, B m, C m (evicts A), then B C B C all hit: 6.
    # LFU: A reaches count 3 and is never evicted; B and C keep evicting each other: 2.
    # Belady: at C, A is never used again, so A goes; then B C B C hit: 6.
    ([A, A, A, B, C, B, C, B, C], {"lru": 6, "lfu": 2, "belady": 6}),
    # A B C A B C, capacity 2.
    # LRU: every access misses (each block is evicted just before it comes back): 0.
    # LFU (all counts 1, ties to the least recent) behaves like LRU here: 0.
    # Belady: at C keep A (next at 4) over B (5): A hits; at B keep C (6) over A (never): C hits: 2.
    ([A, B, C, A, B, C], {"lru": 0, "lfu": 0, "belady": 2}),
    # A B A C A B D A B, capacity 2.
    # LRU: hits at 3 and 5 (A) = 2. LFU: A's count grows, B/C/D churn: hits at 3, 5, 8 = 3.
    # Belady: C evicts B (next 6 vs A 5), B evicts C (never), D evicts B (9 vs A 8): hits 3, 5, 8 = 3.
    ([A, B, A, C, A, B, D, A, B], {"lru": 2, "lfu": 3, "belady": 3}),
])
@pytest.mark.parametrize("policy", ["lru", "lfu", "belady"])
def test_single_block_requests(seq, want, policy):
    assert hits([[x] for x in seq], 2, POLICIES[policy])[0] == want[policy]


def test_multi_block_requests_protect_their_own_blocks():
    # Capacity 3. R0 [1,2]: 2 misses. R1 [1,3]: 1 hits, 3 misses (cache full: 2,1,3 in LRU order).
    # R2 [4,5]: needs 2 slots, evicts 2 then 1 (LRU) -> {3,4,5}. R3 [1,2]: both miss, evicting 3 and 4.
    reqs = [[1, 2], [1, 3], [4, 5], [1, 2]]
    assert hits(reqs, 3, POLICIES["lru"])[0] == 1
    # Belady at R2 evicts 3 (never used again) and one of 1/2 (both next used by R3): R3 gets one hit.
    assert hits(reqs, 3, POLICIES["belady"])[0] == 2
    # A request bigger than the cache keeps what fits and drops the rest without crashing.
    assert hits([[1, 2, 3, 4], [1, 2, 3, 4]], 2, POLICIES["lru"])[0] == 2


def test_host_tier_recalls():
    # Capacity 1, host 1. A m; B m (A -> host); A recalled from host (B -> host); B recalled.
    assert hits([[A], [B], [A], [B]], 1, POLICIES["lru"], host=1) == (0, 2)
    # No host tier: plain misses.
    assert hits([[A], [B], [A], [B]], 1, POLICIES["lru"], host=0) == (0, 0)


def test_count_from_only_scores_later_events():
    s = stream([[A], [B], [A], [B]])
    res = replay(s, 2, LRU(), count_from=2)
    assert (res.accesses, res.hits) == (2, 2)


def test_predicted_policy_uses_the_order_it_is_given():
    # An order function that always evicts the most recently used candidate (MRU) instead of LRU.
    s = stream([[x] for x in [A, B, C, A, B, C]])
    curves = np.zeros((s.num_events, 1))

    def mru(curves, idle, n, now, cached, seq):
        return np.argsort(idle, kind="stable")[:n]

    # MRU on A B C A B C, capacity 2: C evicts B -> {A,C}; A hits; B evicts A -> {C,B}; C hits: 2.
    assert replay(s, 2, Predicted(curves, s.t_ms, mru, 2)).hits == 2
