"""The engine's side of the KV block metadata: the request-level features the page pool asks for at each
block access (kv/block_meta.py `RequestFeatures`), and the --trace-out block event log (kv/event_log.py)
those accesses are written to, which `python -m stratum_jax.train_dmlp` trains the DMLP on."""
from __future__ import annotations

from stratum_jax.dmlp.features import FEATURE_NAMES
from stratum_jax.engine_stats import StepRecorder
from stratum_jax.gpu_idle import GpuIdleMeter
from stratum_jax.kv.block_meta import Clock, RequestFeatures, features_of
from stratum_jax.kv.page_pool import PagePool
from stratum_jax.request_table import RequestTable


class BlockEventFeed:
    """Hooks itself into `pool` (its request features; with `trace_out`, its event recording)."""

    def __init__(self, pool: PagePool, requests: RequestTable, recorder: StepRecorder, gpu_idle: GpuIdleMeter,
                 clock: Clock, trace_out: str | None):
        self.pool, self.requests, self.recorder, self.gpu_idle, self.clock = pool, requests, recorder, gpu_idle, clock
        pool.request_features = self.request_features
        self._trace = None
        if trace_out:
            from stratum_jax.kv.event_log import StratumEventLogWriter
            self._trace = StratumEventLogWriter(trace_out)
            pool.record_events = True

    def request_features(self, request_id: str) -> RequestFeatures | None:
        """Request-level features of a block access (the pool asks once per access batch)."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        p = seq.params
        return RequestFeatures(
            gen_frac=len(seq.output_ids) / p.max_tokens, input_tokens=len(seq.prompt_ids), max_tokens=p.max_tokens,
            queue_wait_ms=self.recorder.mean_queue_ms,
            prompt_pages=len(seq.prompt_ids) // seq.blocks.page_size if seq.blocks is not None else None,
            kv_hbm_frac=self.pool.hbm_fraction,   # cached pages in HBM / in HBM and the host tier
            attn_var5=seq.attn_var5,       # from the decode steps' score statistics; None before the first
            gpu_idle_frac=self.gpu_idle.idle_fraction(self.clock()))

    def write(self) -> None:
        """Drains the pool's block events into the --trace-out log (if any), each with its time and the
        block's features at that access (the same `BlockInfo` the cache policy sees).

        Features the engine cannot give are logged as null (missing), never as 0: attn_var5 for a block
        created before its request's first step finished (or when nothing measures it), gpu_idle_frac
        before the first step.
        """
        if self._trace is None:
            return
        for event, t_ms, content_hash, request_id, info in self.pool.events:
            features = features_of(info, FEATURE_NAMES) if info is not None else {}
            self._trace.write(event, t_ms, content_hash.hex(), request_id, features)
        self.pool.events.clear()

    def close(self) -> None:
        if self._trace is not None:
            self._trace.close()
