"""The model runner: a scheduled batch -> device inputs -> one compiled step -> results on the host.

It owns the step executables, one per shape of `step_shapes.all_step_shapes(config)`, compiled ahead of
time (`jit(...).lower(...).compile()`) by `compile_all` before the server reports SERVING. A batch is
packed into fixed-size host arrays (decode.py's layout) and handed to the executable of its bucket, so
after warm-up no batch compiles anything; a shape that is somehow missing is compiled on the spot and
the CompileWatch logs it as a WARNING.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time

import jax
import numpy as np
from tqdm import tqdm

from stratum_jax.attention import RowTables
from stratum_jax.config import RuntimeConfig
from stratum_jax.decode import (ATTN_VAR_LAST_TOKENS, DecodeResult, PackedBatch, StepGeometry, StepResult,
                                decode_steps, packed_step)
from stratum_jax.sampling import SamplingArrays
from stratum_jax.scheduler.base import ScheduledBatch
from stratum_jax.sequence import Sequence
from stratum_jax.step_shapes import StepShape, all_step_shapes, bucket_for, prefill_buckets, prefill_tile

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
    """Host copies of one step's results. decode: DecodeResult [steps, rows]; packed: StepResult [rows]
    (prompt fields only when asked). rows[i] is the row of batch.seqs[i]; offsets[i] is where a prefill
    sequence's chunk starts among the prefill tokens (None for decode rows)."""

    shape: StepShape
    result: DecodeResult | StepResult
    rows: list[int]
    offsets: list[int | None]
    dispatch_s: float        # time.perf_counter() at dispatch
    done_s: float            # results on the host


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model, *, num_slots: int, backend: str, attn_stats: bool):
        self.config = config
        self.model = model
        self.num_slots = num_slots
        self.geo = StepGeometry(rows=config.max_batch_size, table_width=-(-config.max_context // 8),
                                prefill_tile=prefill_tile(config), decode_steps=config.decode_steps,
                                backend=backend, interpret=config.interpret_kernels and backend == "kernel",
                                attn_stats=attn_stats)
        self.buckets = prefill_buckets(config)
        self.shapes = all_step_shapes(config)
        self._executables: dict[StepShape, object] = {}

    # -- compilation --------------------------------------------------------------------------------
    def _lower(self, shape: StepShape, kv_cache):
        cfg, geo = self.model.config, self.geo
        if shape.kind == "decode":
            args = self._decode_inputs(None)
            return decode_steps.lower(self.model.params, kv_cache, *args, cfg=cfg, geo=geo)
        batch, sampling, want = self._packed_inputs(None, shape.prefill_tokens)
        return packed_step.lower(self.model.params, kv_cache, batch, sampling, want, cfg=cfg, geo=geo)

    def _executable(self, shape: StepShape, kv_cache):
        exe = self._executables.get(shape)
        if exe is None:
            exe = self._executables[shape] = self._lower(shape, kv_cache).compile()
        return exe

    def compile_all(self, kv_cache, progress: bool = True) -> float:
        """Compiles every step shape ahead of time; returns the seconds it took. Tracing and lowering run
        one shape at a time (Python); the XLA compiles run in threads, since XLA releases the GIL and a
        GPU host has cores to spare."""
        t0 = time.perf_counter()
        todo = [s for s in self.shapes if s not in self._executables]
        log.info("compiling %d step shapes (rows=%d, table width=%d, prefill buckets=%s, decode steps=%d, "
                 "attention=%s)", len(todo), self.geo.rows, self.geo.table_width, list(self.buckets),
                 self.geo.decode_steps, self.geo.backend)
        workers = max(1, min(len(todo), (os.cpu_count() or 1) // 2))
        with tqdm(total=len(todo), desc="compiling step shapes", unit="shape", disable=not progress) as bar, \
                concurrent.futures.ThreadPoolExecutor(workers) as pool:
            def compile_one(shape, lowered):
                t = time.perf_counter()
                exe = lowered.compile()
                log.info("compiled %s in %.1f s", shape, time.perf_counter() - t)
                return shape, exe

            futures = [pool.submit(compile_one, shape, self._lower(shape, kv_cache)) for shape in todo]
            for future in concurrent.futures.as_completed(futures):
                shape, exe = future.result()
                self._executables[shape] = exe
                bar.update()
        seconds = time.perf_counter() - t0
        log.info("compiled %d step shapes in %.1f s (%d threads)", len(todo), seconds, workers)
        return seconds

    # -- one step -----------------------------------------------------------------------------------
    def run(self, batch: ScheduledBatch, kv_cache):
        """Runs the batch; returns (RunResult, new kv_cache)."""
        if batch.prefill:
            prefill_tokens = sum(self._slots(n) for n in batch.chunk_lens)
            shape = StepShape("packed", bucket_for(prefill_tokens, self.buckets))
            packed, sampling, want = self._packed_inputs(batch, shape.prefill_tokens)
            args = (packed, sampling, want)
        else:
            shape = StepShape("decode")
            args = self._decode_inputs(batch)
            want = None
        exe = self._executable(shape, kv_cache)
        t0 = time.perf_counter()
        result, kv_cache = exe(self.model.params, kv_cache, *args)
        if shape.kind == "packed" and not want:
            # Prompt logprobs were not computed: leave them on the device.
            result = dataclasses.replace(result, prompt_logprob=None, prompt_top_ids=None, prompt_top_logprobs=None)
        result = jax.device_get(result)
        done = time.perf_counter()
        rows = list(range(len(batch.seqs)))
        offsets: list[int | None] = [None] * len(batch.decode)
        off = 0
        for n in batch.chunk_lens:
            offsets.append(off)
            off += self._slots(n)
        return RunResult(shape, result, rows, offsets, t0, done), kv_cache

    def _slots(self, n: int) -> int:
        tile = self.geo.prefill_tile
        return -(-n // tile) * tile

    # -- inputs -------------------------------------------------------------------------------------
    def _tables_and_sampling(self, seqs: list[Sequence]):
        """Block tables [rows, width] and sampling arrays [rows] for seqs (rows 0..len-1; the rest pad)."""
        rows, width = self.geo.rows, self.geo.table_width
        starts = np.zeros((rows, width), np.int32)
        sizes = np.full(rows, 8, np.int32)
        temp = np.zeros(rows, np.float32)
        top_p = np.ones(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        seed_hi = np.zeros(rows, np.uint32)
        seed_lo = np.zeros(rows, np.uint32)
        tok_idx = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            page_starts = seq.blocks.page_starts()
            starts[r, :len(page_starts)] = page_starts
            sizes[r] = seq.blocks.page_size
            p = seq.params
            temp[r], top_p[r], top_k[r] = p.temperature, p.top_p, p.top_k
            seed_hi[r], seed_lo[r] = seq.seed >> 32, seq.seed & 0xFFFFFFFF
            tok_idx[r] = len(seq.output_ids)
        return starts, sizes, SamplingArrays(temp, top_p, top_k, seed_hi, seed_lo, tok_idx)

    def _decode_inputs(self, batch: ScheduledBatch | None):
        rows = self.geo.rows
        seqs = batch.decode if batch is not None else []
        starts, sizes, sampling = self._tables_and_sampling(seqs)
        last = np.zeros(rows, np.int32)
        pos = np.zeros(rows, np.int32)
        allowed = np.zeros(rows, np.int32)
        for r, seq in enumerate(seqs):
            last[r] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
            pos[r] = seq.num_tokens - 1
            allowed[r] = batch.decode_steps[r]
        return last, pos, allowed, RowTables(np.zeros(rows, np.int32), starts, sizes), sampling

    def _packed_inputs(self, batch: ScheduledBatch | None, prefill_tokens: int):
        rows, tile = self.geo.rows, self.geo.prefill_tile
        total = rows + prefill_tokens
        tokens = np.zeros(total, np.int32)
        positions = np.full(total, -1, np.int32)
        slots = np.full(total, self.num_slots, np.int32)          # out of range = dropped write
        weight = np.zeros(total, np.float32)
        prompt_next = np.full(total, -1, np.int32)
        tile_rows = np.full(prefill_tokens // tile, -1, np.int32)
        ctx = np.zeros(rows, np.int32)
        sample_index = np.zeros(rows, np.int32)
        want = False
        seqs = batch.seqs if batch is not None else []
        starts, sizes, sampling = self._tables_and_sampling(seqs)
        if batch is not None:
            for r, seq in enumerate(batch.decode):
                pos = seq.num_tokens - 1
                tokens[r] = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
                positions[r] = pos
                slots[r] = seq.blocks.slots(pos, 1)[0]
                weight[r] = 1.0
                ctx[r] = pos + 1
                sample_index[r] = r
            off = rows
            for i, (seq, n) in enumerate(zip(batch.prefill, batch.chunk_lens)):
                r = len(batch.decode) + i
                start = seq.num_computed
                tokens[off:off + n] = seq.token_slice(start, start + n)
                positions[off:off + n] = np.arange(start, start + n)
                slots[off:off + n] = seq.blocks.slots(start, n)
                last = min(ATTN_VAR_LAST_TOKENS, n)
                weight[off + n - last:off + n] = 1.0 / last
                if seq.wants_prompt_logprobs:
                    want = True
                    nxt = np.arange(start + 1, start + n + 1)
                    ok = nxt < len(seq.prompt_ids)
                    prompt_next[off:off + n][ok] = np.asarray(seq.prompt_ids)[nxt[ok]]
                first_tile = (off - rows) // tile
                tile_rows[first_tile:first_tile + self._slots(n) // tile] = r
                ctx[r] = start + n
                sample_index[r] = off + n - 1
                off += self._slots(n)
        packed = PackedBatch(tokens, positions, slots, weight, prompt_next, tile_rows,
                             RowTables(ctx, starts, sizes), sample_index)
        return packed, sampling, np.asarray(want)
