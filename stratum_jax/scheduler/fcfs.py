"""First-come-first-served continuous batching with mixed prefill+decode steps and recompute preemption.

Each call to `schedule` returns one step's work (`ScheduledBatch`): a decode token for every running
sequence that is ready, plus prefill chunks under the step's prompt-token budget (continuing prompts
first, then new admissions in arrival order), so running streams never stall behind a long prompt. A
step with no prefill lets each sequence take up to --decode-steps tokens in one device call. When the KV
pool runs dry, the most recently admitted sequence is preempted: its pages are released and it re-enters
the queue to be recomputed (its prefix pages usually survive in the prefix cache, so little is
recomputed). `HabScheduler` (scheduler/hab.py) changes only the order of admissions.
"""
from __future__ import annotations

import collections
import time

from stratum_jax.config import PAGE_SIZE_CLASSES, RuntimeConfig
from stratum_jax.kv.block_table import BlockTable
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.kv.prefix_hash import token_array
from stratum_jax.page_size import FixedPageSize, PageSizeHints, PageSizeRule, VarianceScale
from stratum_jax.phase_times import PhaseTimes
from stratum_jax.request import RequestState
from stratum_jax.scheduler.base import ScheduledBatch, StepCosts
from stratum_jax.sequence import Sequence
from stratum_jax.step_shapes import prefill_budget, prefill_tile


class FcfsScheduler:
    """page_rule: a fixed rule that overrides the cache policy's page size (None: `pool.policy` picks,
    unless --page-size forces one)."""

    def __init__(self, config: RuntimeConfig, pool: PagePool, page_rule: PageSizeRule | None = None,
                 variance_scale: VarianceScale | None = None, phases: PhaseTimes | None = None):
        self.config = config
        self.pool = pool
        # Judges a request's attention-score variance against recent requests' (the engine feeds it).
        self.variance_scale = variance_scale or VarianceScale()
        if page_rule is None and config.page_size is not None:
            page_rule = FixedPageSize(config.page_size)
        self.page_rule = page_rule
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.triggers = 0            # FCFS never triggers (HAB counts its triggers here)
        self._admitted = 0
        self.tile = prefill_tile(config)
        self.budget = prefill_budget(config)
        self.phases = phases if phases is not None else PhaseTimes()   # admission's prefix lookups, timed

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a sequence out of the queues and gives back its pages (finish or cancel)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.blocks is not None:
            seq.blocks.release()
            seq.blocks = None
        self.pool.end_request(seq.request_id)

    def schedule(self, costs: StepCosts) -> ScheduledBatch | None:
        prefill = self._schedule_prefill(costs)
        decode = self._schedule_decode(multi_step=not prefill)
        # Making room may have preempted a sequence picked earlier.
        prefill = [(s, n) for s, n in prefill if s in self.running]
        decode = [(s, n) for s, n in decode if s in self.running]
        if not prefill and not decode:
            return None
        return ScheduledBatch([s for s, _ in decode], [n for _, n in decode],
                              [s for s, _ in prefill], [n for _, n in prefill])

    # -- prefill ------------------------------------------------------------------------------------
    def _slots(self, n: int) -> int:
        """Budget slots a chunk of n tokens takes: chunks start on a tile boundary."""
        return -(-n // self.tile) * self.tile

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's prompt this step: a non-final chunk is a whole number of tiles."""
        return min(seq.num_tokens - seq.num_computed, self.config.prefill_chunk, budget)

    def _prefill_order(self, costs: StepCosts) -> list[Sequence]:
        """Sequences that may prefill this step, in the order they get the step's prompt-token budget:
        running ones with prompt left (FCFS: in admission order) and queued ones (FCFS: in arrival order,
        after every running one)."""
        running = sorted((s for s in self.running if s.is_prefilling), key=lambda s: s.admit_order)
        return running + list(self.waiting)

    def _keep_trying_after_refusal(self, seq: Sequence) -> bool:
        """FCFS stops at the first request that does not fit, so nothing overtakes it."""
        return False

    def _schedule_prefill(self, costs: StepCosts) -> list[tuple[Sequence, int]]:
        budget = self.budget
        picked: list[tuple[Sequence, int]] = []
        running = {id(s) for s in self.running}
        for seq in self._prefill_order(costs):
            if budget < self.tile:
                break
            if id(seq) in running:
                if seq not in self.running:
                    continue                 # preempted while making room for an earlier one
            elif self.waiting and seq in self.waiting:
                if len(self.running) >= self.config.max_batch_size:
                    continue
                if not self._admit(seq, budget):
                    if self._keep_trying_after_refusal(seq):
                        continue
                    break
                self.waiting.remove(seq)
                self.running.append(seq)
                if not seq.is_prefilling:
                    continue            # the prefix cache covered all but the last token: ready to decode
            else:
                continue                     # preempted back to the queue by this step: not again now
            n = self._chunk(seq, budget)
            if not self._grow(seq, seq.num_computed + n):
                if id(seq) in running:
                    continue
                break                   # it was preempted back to the queue: the pool is full
            picked.append((seq, n))
            budget -= self._slots(n)
        return picked

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Picks the page size, takes cached prefix pages, and checks the first chunk fits."""
        tokens = seq.all_token_ids
        use_cache = not seq.wants_prompt_logprobs      # cached positions would have no prompt logprobs
        max_pages_for = {ps: (len(tokens) - 1) // ps for ps in PAGE_SIZE_CLASSES}
        best_size, best_hit = None, []
        hits: dict[int, list] = {}
        if use_cache:
            # Hashes computed while the request was queued (host-tier prefetch), when they still fit it.
            known = seq.queued_chain_hashes[1] if (seq.queued_chain_hashes is not None
                                                   and seq.queued_chain_hashes[0] == len(tokens)) else {}
            with self.phases.span("schedule.match_prefix"):
                ids = token_array(tokens)       # converted once for every page size's chain
                for ps in PAGE_SIZE_CLASSES:
                    hit = hits[ps] = self.pool.match_prefix(ids, ps, max_pages_for[ps], known.get(ps))
                    if len(hit) * ps > len(best_hit) * (best_size or 1):
                        best_size, best_hit = ps, hit
        expected = len(seq.prompt_ids) + seq.params.max_tokens
        # Known only for a request that already ran (re-admitted after preemption): a new request's
        # scores are measured from its first step on.
        variance = self.variance_scale.relative(seq.attn_var5)
        if self.config.page_size is not None:
            page_size = self.config.page_size
            if best_size != page_size:
                best_hit = []
        elif best_hit:
            page_size = best_size       # prefix caching across page sizes: follow the cached prefix
            if not self.pool.lru_fast_path:
                # The policy may pick another class, if the cache holds as long a prefix there too.
                choice = self.pool.policy.page_size_for(
                    PageSizeHints(expected_tokens=expected, shared_prefix_tokens=len(best_hit) * best_size,
                                  attention_score_variance=variance),
                    [self.pool.block_info(p) for p in best_hit], self.pool.clock())
                if len(hits.get(choice, ())) * choice >= len(best_hit) * best_size:
                    page_size, best_hit = choice, hits[choice]
        elif self.page_rule is not None:
            page_size = self.page_rule(PageSizeHints(expected_tokens=expected, attention_score_variance=variance))
        else:
            page_size = self.pool.policy.page_size_for(
                PageSizeHints(expected_tokens=expected, attention_score_variance=variance), (), self.pool.clock())
        first_chunk = min(len(tokens) - len(best_hit) * page_size, self.config.prefill_chunk, budget)
        if not self.pool.can_admit(best_hit, page_size, -(-first_chunk // page_size) + 1):
            return False
        blocks = BlockTable(self.pool, page_size)
        seq.blocks = blocks              # before the access: its features read the page size
        if use_cache:
            # Host-tier pages are recalled here; with too little room left the prefix may come back shorter.
            with self.phases.span("schedule.acquire_prefix"):
                best_hit = self.pool.acquire_prefix(best_hit, queried_pages=max(1, max_pages_for[page_size]),
                                                    request_id=seq.request_id)
        seq.queued_chain_hashes = None
        blocks.adopt_prefix(best_hit)
        seq.num_computed = len(best_hit) * page_size
        if seq.preemptions == 0:
            seq.cached_prompt_tokens = seq.num_computed
        seq.state = RequestState.PREFILLING
        if seq.admit_time is None:
            seq.admit_time = time.monotonic()
        self._admitted += 1
        seq.admit_order = self._admitted
        return True

    # -- decode -------------------------------------------------------------------------------------
    def _schedule_decode(self, multi_step: bool) -> list[tuple[Sequence, int]]:
        """Every ready sequence, each with the decode steps it may take (1 in a step that prefills)."""
        most = self.config.decode_steps if multi_step else 1
        picked = []
        for seq in sorted((s for s in self.running if not s.is_prefilling), key=lambda s: s.admit_order):
            if seq not in self.running:
                continue                     # preempted while making room for an earlier one
            n = min(most, seq.params.max_tokens - seq.num_output_tokens)
            if n <= 0:
                continue                     # its last token is pending: it finishes when that is read
            if self._grow(seq, seq.num_tokens + n - 1):
                picked.append((seq, n))
        return picked

    # -- memory -------------------------------------------------------------------------------------
    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Makes room for `num_tokens` in seq's table, preempting later-admitted sequences if needed.

        Returns False if seq itself had to be preempted.
        """
        while not seq.blocks.ensure_capacity(num_tokens):
            victim = max(self.running, key=lambda s: s.admit_order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.blocks.release()
        seq.blocks = None
        seq.num_computed = 0
        seq.num_pending = 0                  # an in-flight step's tokens for it are dropped (epoch)
        seq.epoch += 1
        seq.state = RequestState.QUEUED
        seq.preemptions += 1
        if not seq.prompt_logprobs_sent:
            seq.prompt_logprobs = None
        self.preemptions += 1
        self.waiting.appendleft(seq)
