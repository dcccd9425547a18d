"""The work an engine step must do, counted from what it computes: the bytes it must move through device
memory and its FLOPs. They feed `stratum_hbm_bandwidth_utilization` and `stratum_gpu_compute_utilization`
(counted work over the step's time, against peaks measured at start-up: stratum_jax/bandwidth.py) and the
byte floor of benchmarks/profile_decode.py.

Bytes, per decode step (a call of k decode steps counts k) or packed step:
    weights     every parameter read once, except the input embedding of an untied model, of which only
                the looked-up rows are read (a tied table is read whole by the LM head)
    KV read     each decode token reads the K/V of its context once; each prefill chunk reads the context
                before it and its own K/V once (a lower bound: attention kernels re-read per query tile)
    KV written  one slot per token computed
FLOPs, 2 per multiply-add:
    linear      q, k, v, o, gate, up and down projections: 2 x their parameters per token, every layer
    LM head     2 x vocab x hidden per sampled row
    attention   QKᵀ and PV: 4 x num_heads x head_dim per (query token, visible key), every layer
Norms, RoPE, activations and sampling are left out of the FLOPs: they are elementwise, far below the GEMMs.
With tensor parallelism the counts are the whole model's; the peaks are then the sum over its devices.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from stratum_jax.model.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class StepWork:
    bytes_moved: int     # weights read + KV read + KV written
    flops: int

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(self.bytes_moved + other.bytes_moved, self.flops + other.flops)


@dataclasses.dataclass(frozen=True)
class ModelWork:
    """Per-model constants of the counting. weight_bytes: all parameters as loaded (the quantity the
    device holds); kv_bytes_per_token: one token slot over all layers (DKVC: its deltas and scales)."""

    cfg: ModelConfig
    weight_bytes: int
    kv_bytes_per_token: int
    dtype_bytes: int

    @classmethod
    def of(cls, cfg: ModelConfig, weight_bytes: int, kv_bytes_per_token: int, dtype_bytes: int) -> ModelWork:
        return cls(cfg, int(weight_bytes), int(kv_bytes_per_token), int(dtype_bytes))

    @property
    def _embedding_bytes(self) -> int:
        return self.cfg.vocab_size * self.cfg.hidden_size * self.dtype_bytes

    def _weights_read(self, tokens: int) -> int:
        if self.cfg.tie_word_embeddings:
            return self.weight_bytes
        rows = min(tokens, self.cfg.vocab_size) * self.cfg.hidden_size * self.dtype_bytes
        return self.weight_bytes - self._embedding_bytes + rows

    @property
    def linear_flops_per_token(self) -> int:
        c = self.cfg
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        return 2 * c.num_layers * per_layer

    @property
    def lm_head_flops_per_row(self) -> int:
        return 2 * self.cfg.vocab_size * self.cfg.hidden_size

    @property
    def attention_flops_per_key(self) -> int:
        return 4 * self.cfg.num_layers * self.cfg.num_heads * self.cfg.head_dim

    def step(self, decode_contexts: Sequence[int] = (), chunks: Sequence[tuple[int, int]] = ()) -> StepWork:
        """One step: decode rows whose new token sees `decode_contexts[i]` keys (its own included), and
        prefill chunks (start, length): `length` prompt tokens after `start` cached ones, each sampling
        one row at most (the chunk that ends a prompt samples its first token; counted for every chunk, an
        upper bound of one row each)."""
        tokens = len(decode_contexts) + sum(n for _, n in chunks)
        if tokens == 0:
            return StepWork(0, 0)
        kv_read_tokens = sum(decode_contexts) + sum(start + n for start, n in chunks)
        kv = self.kv_bytes_per_token * (kv_read_tokens + tokens)
        # Chunk token j (0-based) sees start + j + 1 keys: sum over the chunk = n * start + n (n + 1) / 2.
        keys = sum(decode_contexts) + sum(n * start + n * (n + 1) // 2 for start, n in chunks)
        rows = len(decode_contexts) + len(chunks)
        flops = (self.linear_flops_per_token * tokens + self.lm_head_flops_per_row * rows
                 + self.attention_flops_per_key * keys)
        return StepWork(self._weights_read(tokens) + kv, flops)

    def scheduled(self, decode_contexts: Sequence[int], decode_steps: Sequence[int],
                  chunks: Sequence[tuple[int, int]]) -> StepWork:
        """An engine step as scheduled: with prefill chunks one packed step (each decode row one token),
        else a decode call (decode_call)."""
        if chunks:
            return self.step(decode_contexts, chunks)
        return self.decode_call(decode_contexts, decode_steps)

    def decode_call(self, contexts: Sequence[int], steps: Sequence[int]) -> StepWork:
        """A call of decode steps: row i takes steps[i] tokens, the first seeing contexts[i] keys."""
        total = StepWork(0, 0)
        for k in range(max(steps, default=0)):
            total = total + self.step([c + k for c, s in zip(contexts, steps) if k < s])
        return total


@dataclasses.dataclass(frozen=True)
class DevicePeaks:
    """What the device(s) can do, measured at start-up (stratum_jax/bandwidth.py): read bandwidth (a large
    bf16 sum) and the bf16 matmul rate, summed over the engine's devices."""

    read_bytes_per_s: float
    matmul_flops_per_s: float

    def utilization(self, work: StepWork, seconds: float) -> tuple[float, float]:
        """(share of the read bandwidth, share of the matmul rate) that `work` done in `seconds` uses."""
        if seconds <= 0:
            return 0.0, 0.0
        return self.of_rates(work.bytes_moved / seconds, work.flops / seconds)

    def of_rates(self, bytes_per_s: float, flops_per_s: float) -> tuple[float, float]:
        """The same for work already expressed per second (EngineStats.step_bytes_per_s / step_flops_per_s)."""
        return bytes_per_s / self.read_bytes_per_s, flops_per_s / self.matmul_flops_per_s
