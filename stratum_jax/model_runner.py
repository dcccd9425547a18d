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
import threading
import time
from typing import Callable

import jax
import numpy as np
from tqdm import tqdm

from stratum_jax.attention import RowTables
from stratum_jax.config import RuntimeConfig
from stratum_jax.decode import (PROMPT_LOGPROB_PIECE, DecodeResult, PackedBatch,
                                SamplerVariant, StepGeometry, StepResult, TokenFeed, decode_steps, packed_step,
                                packed_step_compiler_options, prompt_logprobs_piece, sample_step)
from stratum_jax.executable_cache import ExportedSteps
from stratum_jax.kv.slot_write import padding_slots
from stratum_jax.model.llama import fused_shards_of
from stratum_jax.sampling import MAX_TOP_LOGPROBS
from stratum_jax.sampling import SamplingArrays
from stratum_jax.scheduler.base import ScheduledBatch
from stratum_jax.sequence import Sequence
from stratum_jax.step_work import StepWork
from stratum_jax.step_shapes import StepShape, all_step_shapes, bucket_for, prefill_buckets, prefill_tile

log = logging.getLogger(__name__)

# Compiled step executables of this process, shared by every runner whose key matches (as jax's own jit
# cache is shared): (StepShape, StepGeometry, ModelConfig, num_slots, kv_layout) -> executable. An executable
# depends on nothing else (the params and KV pools are arguments, their shapes follow from the key).
_EXECUTABLES: dict[tuple, object] = {}
_EXECUTABLES_LOCK = threading.Lock()


@dataclasses.dataclass
class PackedOutput:
    """Host copies of a packed step's results: tokens / logprob [rows], top_ids / top_logprobs [rows, K]
    (K = 0 without logprobs), attn_score_var [rows]; prompt_* [P, ...] over the prefill tokens, or None
    when no chunk asked for prompt logprobs."""

    tokens: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    attn_score_var: np.ndarray
    prompt_logprob: np.ndarray | None = None
    prompt_top_ids: np.ndarray | None = None
    prompt_top_logprobs: np.ndarray | None = None


@dataclasses.dataclass
class RunResult:
    """One step's results on the host. decode: DecodeResult [steps, rows]; packed: PackedOutput. Row r is
    batch.seqs[r]; offsets[r] is where prefill row r's chunk starts among the prefill tokens (None for
    decode rows)."""

    shape: StepShape
    result: DecodeResult | PackedOutput
    offsets: list[int | None]
    dispatch_s: float        # time.perf_counter() at dispatch
    done_s: float            # results on the host


@dataclasses.dataclass
class _PackedOnDevice:
    """A packed step's outputs, still on the device: the step's, the sampler's (tokens, logprob, top_ids,
    top_logprobs) when the batch needed it, and the host's prompt_next [P] when a chunk wants prompt
    logprobs (wants_prompt_logprobs[i]: prefill row i does)."""

    step: StepResult
    sampled: tuple | None
    prompt_next: np.ndarray | None
    wants_prompt_logprobs: list[bool]


@dataclasses.dataclass
class InFlightStep:
    """A dispatched step whose results the host has not read. epochs[r]: batch.seqs[r].epoch at dispatch
    (a preempted sequence's results are stale); chunk_starts[i]: where prefill row i's chunk began;
    device: DecodeResult or _PackedOnDevice; next_tokens [rows] on the device: each row's last sampled
    token (what the next step's TokenFeed reads); dispatch_s: time.perf_counter() when its inputs were
    packed and the executable called."""

    batch: ScheduledBatch
    shape: StepShape
    epochs: list[int]
    chunk_starts: list[int]
    device: object
    next_tokens: jax.Array
    dispatch_s: float
    work: StepWork | None = None      # what the step must move and compute (step_work.py), set by the engine

    def is_ready(self) -> bool:
        """True once the device has finished the step (its last output is computed)."""
        return self.next_tokens.is_ready()


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """One step shape's program: `jitted.lower(*args, **static)` (static: its static keyword arguments), with
    `donate_argnums` donated. name: a file-name-safe label; key: what tells it apart from every other program
    (the executable cache's key)."""

    name: str
    key: tuple
    jitted: Callable
    args: tuple
    static: dict
    donate_argnums: tuple[int, ...] = ()


def kv_layout_of(kv_cache) -> tuple:
    """(the pytree structure, then (shape, dtype) of every leaf) of one layer's cache: () for the bf16 pools,
    whose shapes the rest of the key already fixes (so their key is as before). The structure's text holds
    the static fields too (DeltaKV.fixed_scales), which change the program as much as a shape does."""
    layer = kv_cache[0]
    if isinstance(layer, tuple):
        return ()
    return (repr(jax.tree_util.tree_structure(layer)),) + tuple(
        (x.shape, str(x.dtype)) for x in jax.tree_util.tree_leaves(layer))


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model, *, num_slots: int, backend: str, attn_stats: bool,
                 kv_layout: tuple = (), projections: str = "xla"):
        """kv_layout: what tells this engine's KV cache pytree apart from another's with the same slots (DKVC's
        precision and anchor length: `kv_layout_of`); part of the executables' key."""
        self.config = config
        self.model = model
        self.num_slots = num_slots
        self.kv_layout = kv_layout
        self.geo = StepGeometry(rows=config.max_batch_size, table_width=-(-config.max_context // 8),
                                prefill_tile=prefill_tile(config), decode_steps=config.decode_steps,
                                backend=backend, projections=projections,
                                interpret=config.interpret_kernels and "kernel" in (backend, projections),
                                l2_prefetch_mb=config.l2_prefetch_mb,
                                norms_folded=model is not None and model.norms_folded and projections == "kernel",
                                prefill_kernel="single" if config.interpret_kernels else "ws",
                                decode_kernel=config.decode_kernel, prefill_splits=config.prefill_split_setting,
                                attn_stats=attn_stats, tp=None if model is None else model.tp)
        self.buckets = prefill_buckets(config)
        self.shapes = all_step_shapes(config)
        self.exports = ExportedSteps(config.compilation_cache_dir)
        self._zero_tokens = None

    # -- compilation --------------------------------------------------------------------------------
    def program(self, shape: StepShape, kv_cache) -> StepProgram:
        """`shape`'s step program: what `_lower` lowers (and `benchmarks/gpu_preflight.py` exports for CUDA on a
        host without a GPU). kv_cache may be abstract (jax.ShapeDtypeStruct leaves), and so may the params."""
        cfg, geo, params = self.model.config, self.geo, self.model.params
        feed = TokenFeed(self._no_tokens(), np.full(geo.rows, -1, np.int32))
        name, key = shape.file_label(), self._key(shape)
        if shape.kind == "decode":
            args = self._decode_inputs(None)
            return StepProgram(name, key, decode_steps, (params, kv_cache, *args, feed),
                               dict(cfg=cfg, geo=geo, variant=shape.variant), donate_argnums=(1,))
        if shape.kind == "packed":
            batch, _ = self._packed_inputs(None, shape.prefill_tokens)
            return StepProgram(name, key, packed_step, (params, kv_cache, batch, feed), dict(cfg=cfg, geo=geo),
                               donate_argnums=(1,))
        if shape.kind == "sample":
            logits = jax.ShapeDtypeStruct((geo.rows, cfg.vocab_size), np.float32,
                                          sharding=geo.tp.replicated if geo.tp else None)   # as packed_step's
            return StepProgram(name, key, sample_step, (logits, self._tables_and_sampling([])[2]),
                               dict(variant=shape.variant))
        hidden = jax.ShapeDtypeStruct((PROMPT_LOGPROB_PIECE, cfg.hidden_size), np.dtype(cfg.dtype))
        return StepProgram(name, key, prompt_logprobs_piece,
                           (params, hidden, np.zeros(PROMPT_LOGPROB_PIECE, np.int32)), dict(cfg=cfg))

    def _lower(self, shape: StepShape, kv_cache):
        """The lowering of `shape`'s program, through the export cache (executable_cache.py)."""
        prog = self.program(shape, kv_cache)
        return self.exports.lower(prog.name, prog.key, prog.jitted, prog.args, prog.static, prog.donate_argnums)

    @staticmethod
    def _compiler_options(shape: StepShape) -> dict:
        return packed_step_compiler_options(jax.default_backend()) if shape.kind == "packed" else {}

    def _key(self, shape: StepShape) -> tuple:
        # The params' layout (HF's or fused, model/fused.py) changes the program's argument tree.
        return shape, self.geo, self.model.config, self.num_slots, self.kv_layout, fused_shards_of(self.model.params)

    def missing_shapes(self) -> list[StepShape]:
        """The shapes of this config with no executable yet (empty after `compile_all`)."""
        return [s for s in self.shapes if self._key(s) not in _EXECUTABLES]

    def _executable(self, shape: StepShape, kv_cache):
        exe = _EXECUTABLES.get(self._key(shape))
        if exe is None:
            exe = self._lower(shape, kv_cache).compile(self._compiler_options(shape))
            with _EXECUTABLES_LOCK:
                exe = _EXECUTABLES.setdefault(self._key(shape), exe)
        return exe

    def compiled_text(self, kv_cache, variant: SamplerVariant = SamplerVariant()) -> str:
        """The decode program's optimized HLO (compiling it if need be). Its op metadata (op_name, with the
        model's named scopes) says which part of the model each kernel of a profile belongs to."""
        return self._executable(StepShape("decode", variant=variant), kv_cache).as_text()

    def compile_all(self, kv_cache, progress: bool = True) -> float:
        """Compiles every step shape ahead of time; returns the seconds it took. Tracing and lowering run
        one shape at a time (Python); the XLA compiles run in threads, since XLA releases the GIL and a
        GPU host has cores to spare."""
        t0 = time.perf_counter()
        todo = self.missing_shapes()
        log.info("compiling %d step shapes (rows=%d, table width=%d, prefill buckets=%s, decode steps=%d, "
                 "attention=%s)", len(todo), self.geo.rows, self.geo.table_width, list(self.buckets),
                 self.geo.decode_steps, self.geo.backend)
        workers = max(1, min(len(todo), (os.cpu_count() or 1) // 2))
        with tqdm(total=len(todo), desc="compiling step shapes", unit="shape", disable=not progress) as bar, \
                concurrent.futures.ThreadPoolExecutor(workers) as pool:
            def compile_one(shape, lowered):
                t = time.perf_counter()
                exe = lowered.compile(self._compiler_options(shape))
                log.info("compiled %s in %.1f s", shape, time.perf_counter() - t)
                return shape, exe

            futures = []
            for shape in todo:
                t = time.perf_counter()
                lowered = self._lower(shape, kv_cache)
                log.info("traced and lowered %s in %.1f s", shape, time.perf_counter() - t)
                futures.append(pool.submit(compile_one, shape, lowered))
            for future in concurrent.futures.as_completed(futures):
                shape, exe = future.result()
                with _EXECUTABLES_LOCK:
                    _EXECUTABLES.setdefault(self._key(shape), exe)
                bar.update()
        seconds = time.perf_counter() - t0
        log.info("compiled %d step shapes in %.1f s (%d threads; export cache: %d read, %d exported)", len(todo),
                 seconds, workers, self.exports.hits, self.exports.exports)
        return seconds

    # -- one step -----------------------------------------------------------------------------------
    def dispatch(self, batch: ScheduledBatch, kv_cache, previous: InFlightStep | None = None):
        """Packs the batch and launches its step on the device without waiting for it; returns
        (InFlightStep, new kv_cache). previous: the step still in flight, whose sampled tokens this one's
        decode rows may take on the device (Sequence.num_pending > 0; async scheduling)."""
        params = self.model.params
        variant = SamplerVariant(sampled=any(s.params.temperature > 0 for s in batch.seqs),
                                 logprobs=any(s.params.logprobs > 0 for s in batch.seqs))
        feed = self._feed(batch, previous)
        epochs = [s.epoch for s in batch.seqs]
        starts = [s.num_computed for s in batch.prefill]
        if not batch.prefill:
            shape = StepShape("decode", variant=variant)
            exe = self._executable(shape, kv_cache)
            inputs = self._decode_inputs(batch)
            t0 = time.perf_counter()          # the device can start the step from here
            result, kv_cache = exe(params, kv_cache, *inputs, feed)
            return InFlightStep(batch, shape, epochs, starts, result, result.next_tokens, t0), kv_cache
        prefill_tokens = sum(self._slots(n) for n in batch.chunk_lens)
        shape = StepShape("packed", bucket_for(prefill_tokens, self.buckets))
        packed, sampling = self._packed_inputs(batch, shape.prefill_tokens)
        exe = self._executable(shape, kv_cache)
        t0 = time.perf_counter()
        step, kv_cache = exe(params, kv_cache, packed, feed)
        if variant.sampled or variant.logprobs:
            sampler = self._executable(StepShape("sample", variant=variant), kv_cache)
            sampled = sampler(step.logits, sampling)
        else:
            sampled = None
        wants = [s.wants_prompt_logprobs for s in batch.prefill]
        device = _PackedOnDevice(step, sampled, packed.prompt_next[self.geo.rows:] if any(wants) else None, wants)
        next_tokens = sampled[0] if sampled is not None else step.tokens
        return InFlightStep(batch, shape, epochs, starts, device, next_tokens, t0), kv_cache

    def collect(self, step: InFlightStep, kv_cache) -> RunResult:
        """Waits for an in-flight step and brings its results to the host (prompt logprobs, if a chunk
        asked for them, run here: they need the step's hidden states). kv_cache: the current cache, for
        the prompt-logprob executable's key only."""
        if step.shape.kind == "decode":
            result = jax.device_get(step.device)
            return RunResult(step.shape, result, [None] * len(step.batch.decode), step.dispatch_s,
                             time.perf_counter())
        batch, dev, rows = step.batch, step.device, self.geo.rows
        offsets: list[int | None] = [None] * len(batch.decode)
        if dev.sampled is not None:
            tokens, logprob, top_ids, top_lp = dev.sampled
        else:
            empty = np.zeros((rows, 0), np.float32)
            tokens, logprob, top_ids, top_lp = dev.step.tokens, np.zeros(rows, np.float32), empty.astype(np.int32), empty
        out = PackedOutput(*jax.device_get((tokens, logprob, top_ids, top_lp, dev.step.attn_score_var)))
        off, hidden = 0, None
        for n, wants in zip(batch.chunk_lens, dev.wants_prompt_logprobs):
            offsets.append(off)
            if wants:
                if hidden is None:       # on the host: slicing it on the device would compile per slice
                    hidden = np.asarray(jax.device_get(dev.step.prefill_hidden))
                self._prompt_logprobs(out, hidden, dev.prompt_next, off, n, kv_cache)
            off += self._slots(n)
        return RunResult(step.shape, out, offsets, step.dispatch_s, time.perf_counter())

    def _feed(self, batch: ScheduledBatch, previous: InFlightStep | None) -> TokenFeed:
        """The TokenFeed of a batch: decode rows with a pending token take it from `previous`'s row."""
        rows = self.geo.rows
        source = np.full(rows, -1, np.int32)
        if previous is not None:
            row_of = {id(s): r for r, (s, e) in enumerate(zip(previous.batch.seqs, previous.epochs)) if s.epoch == e}
            for r, seq in enumerate(batch.decode):
                if seq.num_pending:
                    source[r] = row_of[id(seq)]   # a pending token comes from the one step in flight
            tokens = previous.next_tokens
        else:
            tokens = self._no_tokens()
        return TokenFeed(tokens, source)

    def _no_tokens(self):
        """A [rows] int32 device array laid out as steps' next_tokens are (for steps with nothing to feed)."""
        if self._zero_tokens is None:
            zeros = np.zeros(self.geo.rows, np.int32)
            self._zero_tokens = jax.device_put(zeros, self.geo.tp.replicated if self.geo.tp else None)
        return self._zero_tokens

    def _prompt_logprobs(self, out: PackedOutput, hidden: np.ndarray, prompt_next: np.ndarray, off: int, n: int,
                         kv_cache):
        """Fills out.prompt_* [P, ...] for the prefill tokens [off, off + n), in pieces.
        hidden [P, hidden_size], prompt_next [P]: the packed step's prefill hidden states and next tokens."""
        if out.prompt_logprob is None:
            p = prompt_next.shape[0]
            out.prompt_logprob = np.zeros(p, np.float32)
            out.prompt_top_ids = np.zeros((p, MAX_TOP_LOGPROBS), np.int32)
            out.prompt_top_logprobs = np.zeros((p, MAX_TOP_LOGPROBS), np.float32)
        exe = self._executable(StepShape("prompt_logprobs"), kv_cache)
        piece = PROMPT_LOGPROB_PIECE
        for start in range(off, off + n, piece):
            # The last piece may reach past the prefill tokens: pad it (its extra rows are discarded).
            nxt = np.full(piece, -1, np.int32)
            stop = min(start + piece, prompt_next.shape[0])
            nxt[:stop - start] = prompt_next[start:stop]
            h = np.zeros((piece, hidden.shape[1]), hidden.dtype)
            h[:stop - start] = hidden[start:stop]
            lp, ids, top = jax.device_get(exe(self.model.params, h, nxt))
            take = min(off + n, stop) - start
            out.prompt_logprob[start:start + take] = lp[:take]
            out.prompt_top_ids[start:start + take] = ids[:take]
            out.prompt_top_logprobs[start:start + take] = top[:take]

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
            tok_idx[r] = seq.num_output_tokens        # its next token's index (seeds per token)
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
        slots = padding_slots(self.num_slots, np.arange(total, dtype=np.int32))   # out of range = dropped write
        weight = np.zeros(total, np.float32)
        prompt_next = np.full(total, -1, np.int32)
        tile_rows = np.full(prefill_tokens // tile, -1, np.int32)
        ctx = np.zeros(rows, np.int32)
        sample_index = np.zeros(rows, np.int32)
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
                if seq.wants_prompt_logprobs:
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
        return packed, sampling
