"""KV copies between HBM and the host tier, run once per engine step before its device work.

The page pool books the moves while it schedules (kv/host_tier.py `PendingTransfers`); `run_transfers`
does them in two batched device calls: one gather of every offloaded page's slots (device -> host,
reading the cache as scheduling found it), then one scatter of every recalled page's data into its new
slots (host -> device, donating the cache). Recalls may reuse slots that offloads just vacated, hence
that order.

Shapes: cache = per layer (k_pool, v_pool), each [kv_heads, num_slots, head_dim]; on the host the
data is slot-major, [n_slots, layers, 2, kv_heads, head_dim], so each page is one contiguous block and
splitting a gather into pages, or joining pages for a scatter, is a plain memcpy per page (the slot axis
in the middle made that a strided copy of head_dim-sized pieces, which dominated the copy time on the
H200). Slot counts are padded to a quarter-octave bucket (>= 64, < 25% waste), so few shapes compile;
padded gather slots read slot 0 and are discarded, padded scatter slots point past the pool and are
dropped. A DKVC cache (stratum_jax/kv/delta_cache.py) moves its deltas and scales as rows of bytes
(`_gather_deltas`): half a bf16 page's bytes for fp8, plus 1/(4 * head_dim) for the scales.

Not done yet (issue #12): the host side is numpy buffers filled by `np.asarray` of the gathered array;
moving it onto jax's `pinned_host` memory kind (direct device <-> pinned copies) is left.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.kv.delta_cache import GRANULE, DeltaKV, num_slots_of
from stratum_jax.kv.host_tier import PageBuffers, PendingTransfers, copy_into


@dataclasses.dataclass
class TransferStats:
    offloaded_pages: int = 0
    offloaded_bytes: int = 0
    recalled_pages: int = 0
    recalled_bytes: int = 0
    seconds: float = 0.0       # wall time spent in run_transfers (host side, copies included)
    device_get_s: float = 0.0  # of which: waiting for the gathered pages to reach host memory
    upload_s: float = 0.0      # of which: handing the recalled pages to the device (host -> device copy)
    recall_batches: int = 0    # runs that recalled pages
    recall_seconds: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))
                               # the upload time of the latest recall batches


def _bucket(n: int) -> int:
    """n rounded up to a multiple of a quarter of its power of two (at least 64)."""
    step = max(64, (1 << max(0, (n - 1).bit_length())) // 4)
    return -(-n // step) * step


@jax.jit
def _gather(cache, slots):
    """slots int32 [n] -> [n, layers, 2, kv_heads, head_dim] (a DKVC cache: `_gather_deltas`)."""
    if isinstance(cache[0], DeltaKV):
        return _gather_deltas(cache, slots)
    kv = jnp.stack([jnp.stack([k[:, slots], v[:, slots]]) for k, v in cache])   # [layers, 2, heads, n, dim]
    return jnp.transpose(kv, (3, 0, 1, 2, 4))


@functools.partial(jax.jit, donate_argnums=0)
def _scatter(cache, slots, data):
    """Writes data [n, layers, 2, kv_heads, head_dim] at slots [n]; slots past the pool are dropped."""
    if isinstance(cache[0], DeltaKV):
        return _scatter_deltas(cache, slots, data)
    kv = jnp.transpose(data, (1, 2, 3, 0, 4))                                    # [layers, 2, heads, n, dim]
    return [(k.at[:, slots].set(kv[i, 0], mode="drop"), v.at[:, slots].set(kv[i, 1], mode="drop"))
            for i, (k, v) in enumerate(cache)]


# A DKVC page moves only its deltas and its granules' scales (the anchor stays resident). On the host
# each slot is one row of bytes, uint8 [n, layers * 2 * kv_heads * head_dim * itemsize + layers *
# kv_heads]: the slot's deltas, then an eighth of its granule's scales (a granule's layers * 2 * kv_heads
# float32 scales are 8 * layers * kv_heads bytes, cut into 8 pieces, one per slot), so a page is still a
# contiguous block of rows and the host tier needs no second array. Pages start on 8-slot boundaries and
# hold whole granules, and the padding adds multiples of 64 rows, so every 8 consecutive rows of a
# scatter are one granule's.
def _gather_deltas(cache, slots):
    n = slots.shape[0]
    d = jnp.stack([jnp.stack([c.k_delta[:, slots], c.v_delta[:, slots]]) for c in cache])  # [L, 2, H, n, D]
    d = jax.lax.bitcast_convert_type(jnp.transpose(d, (3, 0, 1, 2, 4)), jnp.uint8).reshape(n, -1)
    g = slots // GRANULE
    s = jnp.stack([jnp.stack([c.k_scale[:, g], c.v_scale[:, g]]) for c in cache])          # [L, 2, H, n]
    s = jax.lax.bitcast_convert_type(jnp.transpose(s, (3, 0, 1, 2)), jnp.uint8).reshape(n, GRANULE, -1)
    piece = jnp.take_along_axis(s, (slots % GRANULE)[:, None, None], axis=1)[:, 0]          # [n, L * H]
    return jnp.concatenate([d, piece], axis=1)


def _scatter_deltas(cache, slots, data):
    n, layers = data.shape[0], len(cache)
    heads, _, dim = cache[0].k_delta.shape
    dtype = cache[0].k_delta.dtype
    width = jnp.dtype(dtype).itemsize
    raw = data[:, :layers * 2 * heads * dim * width].reshape(n, layers, 2, heads, dim, *((width,) if width > 1 else ()))
    d = jnp.transpose(jax.lax.bitcast_convert_type(raw, dtype), (1, 2, 3, 0, 4))            # [L, 2, H, n, D]
    raw = data[:, layers * 2 * heads * dim * width:].reshape(n // GRANULE, layers, 2, heads, 4)
    s = jnp.transpose(jax.lax.bitcast_convert_type(raw, jnp.float32), (1, 2, 3, 0))        # [L, 2, H, n / 8]
    g = slots[::GRANULE] // GRANULE                         # padding rows point past the pool: dropped
    return [dataclasses.replace(c, k_delta=c.k_delta.at[:, slots].set(d[i, 0], mode="drop"),
                                v_delta=c.v_delta.at[:, slots].set(d[i, 1], mode="drop"),
                                k_scale=c.k_scale.at[:, g].set(s[i, 0], mode="drop"),
                                v_scale=c.v_scale.at[:, g].set(s[i, 1], mode="drop"))
            for i, c in enumerate(cache)]


class _Offload:
    """One gather of offloaded pages, copying to host memory in the background (`copy_to_host_async`)
    while the engine runs its step; `finish` waits for it and copies each page into its own buffer."""

    def __init__(self, gathered: jax.Array, pages: list, stats: TransferStats, buffers: PageBuffers | None):
        self.gathered, self.pages, self.stats, self.buffers = gathered, pages, stats, buffers
        gathered.copy_to_host_async()
        for hp in pages:
            hp.in_flight = self

    def finish(self) -> None:
        if self.gathered is None:
            return
        t = time.perf_counter()
        host = np.asarray(self.gathered)
        self.stats.device_get_s += time.perf_counter() - t
        at = 0
        for hp in self.pages:
            piece = host[at:at + hp.page_size]
            at += hp.page_size
            hp.src_slot = hp.in_flight = None
            if hp.dropped:
                continue                          # left the tier before its copy landed
            buf = self.buffers.get(piece.shape, piece.dtype) if self.buffers is not None else np.empty_like(piece)
            copy_into(buf, piece)
            hp.data = buf
        self.stats.offloaded_bytes += host[:at].nbytes
        self.gathered = None


class KvTransfers:
    """Runs the booked copies, once per engine step (`run`). Offloads finish asynchronously: their host
    copy overlaps the step and is collected at the next `run` (or at once, when a page is recalled
    before that). `sync=True` finishes everything inside `run` (tests). `buffers`: the host tier's
    recycled page buffers (None: fresh arrays)."""

    def __init__(self, sync: bool = False, buffers: PageBuffers | None = None):
        self.sync = sync
        self.buffers = buffers
        self.stats = TransferStats()
        self._in_flight: list[_Offload] = []

    def run(self, cache, pending: PendingTransfers):
        """Returns the cache (a new one when something was recalled)."""
        t0 = time.perf_counter()
        stats, buffers = self.stats, self.buffers
        for job in self._in_flight:              # last step's offloads: done by now, as a rule
            job.finish()
        self._in_flight = []
        if not pending:
            stats.seconds += time.perf_counter() - t0
            return cache
        num_slots = num_slots_of(cache[0])
        if pending.offloads:
            slots = np.concatenate([np.arange(hp.src_slot, hp.src_slot + hp.page_size) for hp in pending.offloads])
            padded = np.zeros(_bucket(len(slots)), np.int32)
            padded[:len(slots)] = slots
            job = _Offload(_gather(cache, jnp.asarray(padded)), list(pending.offloads), stats, buffers)
            stats.offloaded_pages += len(pending.offloads)
            if self.sync:
                job.finish()
            else:
                self._in_flight.append(job)
        # Pages evicted again right after their recall: their own copy first, then the sources' buffers
        # may be recycled below.
        spent = []
        for hp in pending.aliases:
            if not hp.dropped and hp.data is None:
                spent.append(hp.same_as)
                hp.resolved(buffers)
        if pending.recalls:
            starts = list(pending.recalls)
            datas = [pending.recalls[s].resolved(buffers) for s in starts]   # may wait for this step's offload
            n = sum(len(d) for d in datas)
            padded_slots = np.full(_bucket(n), num_slots, np.int32)       # out of range: dropped
            padded = np.zeros((len(padded_slots),) + datas[0].shape[1:], datas[0].dtype)   # tail stays 0
            at = 0
            for s, d in zip(starts, datas):
                padded_slots[at:at + len(d)] = np.arange(s, s + len(d))
                copy_into(padded[at:at + len(d)], d)
                at += len(d)
            t1 = time.perf_counter()
            on_device = jax.device_put(padded)
            on_device.block_until_ready()
            stats.upload_s += time.perf_counter() - t1
            stats.recall_batches += 1
            stats.recall_seconds.append(time.perf_counter() - t1)
            cache = _scatter(cache, jnp.asarray(padded_slots), on_device)
            stats.recalled_pages += len(starts)
            stats.recalled_bytes += padded[:n].nbytes
            spent += [pending.recalls[s] for s in starts]
        if buffers is not None:                  # recalled pages left the tier: their memory is reused
            for hp in spent:
                if hp is not None and hp.data is not None:
                    buffers.give(hp.data)
                    hp.data = None
        stats.seconds += time.perf_counter() - t0
        return cache


def run_transfers(cache, pending: PendingTransfers, buffers: PageBuffers | None = None):
    """Does the booked copies and waits for all of them; returns the cache."""
    return KvTransfers(sync=True, buffers=buffers).run(cache, pending)
