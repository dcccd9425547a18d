"""Host-tier prefetch: before queued requests are admitted, their cached prefix pages that sit in the host
tier are copied back into HBM (`--kv-prefetch-pages` a step), so the prefix is resident at admission."""
from __future__ import annotations

import itertools
from typing import Iterable

from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.prefix_hash import prompt_chain_hashes
from stratum_jax.sequence import Sequence


def prefetch_queued(pool: PagePool, waiting: Iterable[Sequence], max_requests: int, max_pages: int) -> None:
    """Recalls host-tier pages of the first `max_requests` queued requests (`waiting`, queue order) into
    free HBM, at most `max_pages`, in the cache policy's order (PagePool.prefetch)."""
    if max_pages <= 0 or not pool.host_pages:
        return
    candidates, keep = [], []
    for seq in itertools.islice(waiting, max_requests):
        if seq.wants_prompt_logprobs:
            continue                   # admitted without the prefix cache
        tokens = seq.all_token_ids
        # Chain hashes are kept on the sequence while it waits: it is looked at every step.
        if seq.queued_chain_hashes is None or seq.queued_chain_hashes[0] != len(tokens):
            seq.queued_chain_hashes = (len(tokens), prompt_chain_hashes(tokens))
        host, hbm = pool.host_candidates(seq.queued_chain_hashes[1])
        candidates += host
        keep += hbm
    if candidates:
        pool.prefetch(candidates, max_pages, keep=keep)
