"""KV copies between HBM and the host tier, run once per engine step before its device work.

The page pool books the moves while it schedules (kv/host_tier.py `PendingTransfers`); `KvTransfers.run`
does them before the step, per copy batch (`copy_batches`): gathers of the offloaded pages' slots (device
-> host, reading the cache as scheduling found it), then scatters of the recalled pages' data into their
new slots (host -> device, donating the cache). Recalls may reuse slots that offloads just vacated, hence
that order.

Host memory is jax's `pinned_host` memory kind (page-locked, so the GPU's copy engines move it by DMA at
PCIe speed) and the copies are direct device <-> pinned transfers, `jax.device_put` with a sharding of that
memory kind, with no numpy copy of a page on either side:
  offload: a batch's gathered slots [n, ...] are cut into pages on the device (`_cut`, one dispatch), and
      the pages go to pinned host memory in one batched, asynchronous `device_put`, which no step waits
      for (a later step books it once it has landed; see `KvTransfers.run`), so the copy overlaps the steps;
  recall: the pages' pinned arrays go to the device in one batched `device_put`, each batch's pages are
      put side by side in a staging array there (`_stage`, one dispatch), and one scatter writes it.
The tier's memory is pinned at start-up (`pin_host_memory`), and warm-up runs every copy shape once
(`KvTransfers.compile_copies`).
A device without `pinned_host` memory (`host_memory_kind`) uses `unpinned_host`, else plain numpy copies
(`jax.device_get`), logged once at start-up with the reason. The CPU backend has `pinned_host` (jax 0.11),
so CI runs the pinned path.

Shapes: cache = per layer (k_pool, v_pool), each [kv_heads, num_slots, head_dim]; in host memory a page
is slot-major, [page_size, layers, 2, kv_heads, head_dim], one contiguous block (the slot axis in the
middle made the host side a strided copy of head_dim-sized pieces, which dominated the copy time on the
H200). A copy batch is padded to one of COPY_BATCH_SLOTS, so a fixed set of shapes compiles; padded
gather slots read slot 0 and are discarded, padded scatter slots point past the pool and are dropped.
A DKVC cache (stratum_jax/kv/delta_cache.py) moves its deltas and scales as rows of bytes (`_gather_deltas`):
half a bf16 page's bytes for fp8, plus 1/(4 * head_dim) for the scales.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from stratum_jax.kv.delta_cache import GRANULE, DeltaKV, num_slots_of
from stratum_jax.kv.host_tier import PendingTransfers
from stratum_jax.phase_times import PhaseTimes

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TransferStats:
    offloaded_pages: int = 0
    offloaded_bytes: int = 0
    recalled_pages: int = 0
    recalled_bytes: int = 0
    seconds: float = 0.0       # wall time spent in run_transfers (host side, copies included)
    device_get_s: float = 0.0  # of which: waiting for the offloaded pages to reach host memory
    upload_s: float = 0.0      # of which: handing the recalled pages to the device (host -> device copy)
    recall_batches: int = 0    # runs that recalled pages
    recall_seconds: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))
                               # the upload time of the latest recall batches


# Slots per copy batch. Every gather and scatter runs at one of these sizes: a batch holds whole pages of
# one size and is padded up to the smallest size that fits, and a longer copy is cut into batches of the
# largest. So the copies compile to a fixed set of executables (per batch size x page size), which
# `compile_copies` builds at warm-up: none compiles on the request path (a quarter-octave bucket per copy
# size compiled there, ~9.5 s for the first 32K-token llama-8b recall on the H200). 512 keeps a one-page
# copy cheap; 8192 moves a long context in few dispatches; 2048 bounds the padding between them (a batch's
# padding is cut and staged like its pages, device copies that are thrown away).
COPY_BATCH_SLOTS = (512, 2048, 8192)
# Pages per copy batch at most: the cut and the staging are one dispatch with a value per page of the
# padded batch, and compiling those for 1,024 pages of 8 tokens took minutes at warm-up.
COPY_BATCH_PAGES = 32


def copy_batches(page_slots: list[int]) -> list[tuple[int, int, int]]:
    """Cuts consecutive pages (each one's size in slots, <= the smallest batch) into copy batches of one
    page size and at most COPY_BATCH_PAGES pages each: -> [(first page, end page, padded slot count)]."""
    out, first, used = [], 0, 0
    for i, n in enumerate(page_slots):
        if used and (used + n > COPY_BATCH_SLOTS[-1] or n != page_slots[first]
                     or i - first == COPY_BATCH_PAGES):
            out.append((first, i, next(b for b in COPY_BATCH_SLOTS if b >= used)))
            first, used = i, 0
        used += n
    if used:
        out.append((first, len(page_slots), next(b for b in COPY_BATCH_SLOTS if b >= used)))
    return out


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
    s = jnp.stack([jnp.moveaxis(c.scales[:, g, :2], -1, 0) for c in cache])                 # [L, 2, H, n]
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
                                scales=c.scales.at[:, g, :2].set(jnp.moveaxis(s[i], 0, -1), mode="drop"))
            for i, c in enumerate(cache)]


def host_memory_kind(device) -> tuple[str | None, str]:
    """The host memory kind the tier keeps pages in on `device` -> (kind or None for numpy, why)."""
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" in kinds:
        return "pinned_host", "direct device <-> pinned_host transfers"
    if "unpinned_host" in kinds:
        return "unpinned_host", (f"{device.platform} device {device.device_kind} has no pinned_host memory "
                                 "(jax reports " + ", ".join(sorted(kinds)) + "): pages in unpinned host memory")
    return None, (f"{device.platform} device {device.device_kind} has no host memory kinds (jax reports "
                  + ", ".join(sorted(kinds)) + "): pages copied through numpy")


def committed(cache):
    """The cache with every leaf committed to the device it is on (a device_put that reuses the buffers,
    no copy); a cache already committed (a tensor-parallel one) is returned as it is.

    Why: jit keys its executables on whether each argument is committed. A recall's scatter returns a
    committed cache (its pages reach the device by a device_put to an explicit sharding), so a cache
    that started uncommitted would make the first offload or recall after the first recall compile every
    copy function (`_gather`, `_page_of`, `_scatter`) a second time, on the request path."""
    leaves = jax.tree_util.tree_leaves(cache)
    if all(x.committed for x in leaves):
        return cache
    devices = {d for x in leaves for d in x.devices()}
    if len(devices) != 1:
        raise ValueError(f"an uncommitted KV cache on {len(devices)} devices ({sorted(map(str, devices))}): "
                         "lay a multi-device cache out with an explicit sharding")
    return jax.device_put(cache, jax.sharding.SingleDeviceSharding(devices.pop()))


@functools.partial(jax.jit, static_argnums=1)
def _cut(gathered, page_size: int):
    """gathered [n, ...] -> its n / page_size pages [page_size, ...], in order, on the device: one
    dispatch per copy batch (a dispatch per page cost ~0.3 ms of host time each on the H200 host: 37.8 ms
    for a 32K-token llama-8b eviction, 11.2 ms batched)."""
    pages = gathered.reshape(gathered.shape[0] // page_size, page_size, *gathered.shape[1:])
    return tuple(pages[i] for i in range(pages.shape[0]))


@jax.jit
def _stage(pages):
    """A copy batch's pages (a tuple, [page_size, ...] each) -> one staging array [n * page_size, ...]."""
    return jnp.concatenate(pages)


# Pinned offload batches whose copy has not landed that `run` leaves in flight; past that it waits for the
# oldest (each holds up to COPY_BATCH_SLOTS[-1] gathered slots of device memory until it lands).
MAX_OFFLOADS_IN_FLIGHT = 8

# Host memory pinned per allocation by `pin_host_memory` (each is staged through a device buffer this big).
PIN_CHUNK_BYTES = 512 << 20


def pin_host_memory(nbytes: int, devices: list, memory_kind: str) -> float:
    """Allocates about `nbytes` of `memory_kind` host memory, split evenly over `devices`, and frees it.
    Returns the seconds it took.

    Why: jax keeps pinned host buffers in a caching allocator that page-locks memory the first time it
    grows. Page-locking is slow (on the H200 host a first 4.2 GB device -> pinned copy took 1.81 s, 2.3
    GB/s, inside the `device_put` call; the same copy into memory pinned before took 0.08 s, 53 GB/s), so
    without this the first offloads of a host tier stall the engine loop, and every stream with it, for
    about half a second per GB. Freed buffers stay pinned in the allocator, so the tier's later pages reuse
    this memory."""
    t = time.perf_counter()
    per_device = -(-nbytes // len(devices))
    if per_device <= 0:
        return 0.0
    held = []
    try:
        for device in devices:
            chunk = jnp.zeros((min(PIN_CHUNK_BYTES, per_device),), jnp.uint8, device=device)
            where = jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)
            held += [jax.device_put(chunk, where) for _ in range(-(-per_device // chunk.size))]
        jax.block_until_ready(held)
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(
            f"could not pin {nbytes / 1e9:.1f} GB of {memory_kind} memory for the KV host tier ({e}); lower "
            "--kv-host-tokens, or raise jax's pinned-memory pool (the XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB "
            "environment variable, 64 GB by default) to hold it") from e
    finally:
        del held
    return time.perf_counter() - t


class _Offload:
    """One copy batch of offloaded pages, gathered and cut into pages on the device, copied to host memory
    in one asynchronous batched transfer while the engine runs its step; `finish` waits for it.

    Started before the step's recalls, not after the step's dispatch: the device -> host copy then runs
    beside the recall's host -> device copy (the link is full duplex) and lands before the step's token
    read-back, which would otherwise queue behind it (deferring it made a 32K-token llama-8b recall 224
    instead of 189 ms on the H200, BENCHMARKS.md)."""

    def __init__(self, pieces: list, pages: list, stats: TransferStats, memory_kind: str | None):
        """pieces: the pages' KV on the device, in the order of `pages`."""
        self.pages, self.stats, self.pinned = pages, stats, memory_kind is not None
        if memory_kind is not None:
            # Each piece keeps its sharding (one device, or a tensor-parallel cache's mesh): only the
            # memory kind changes, so each device's shard goes to that device's host memory.
            self.host = jax.device_put(pieces, [x.sharding.with_memory_kind(memory_kind) for x in pieces])
        else:                                     # no host memory kind: numpy, waited for at `finish`
            for piece in pieces:
                piece.copy_to_host_async()
            self.host = pieces
        for hp, data in zip(pages, self.host):
            hp.src_slot = None
            if not hp.dropped:                    # a page may leave the tier before its copy lands
                hp.data = data
        self.nbytes = sum(x.nbytes for x in self.host)
        stats.offloaded_bytes += self.nbytes
        self.done = False

    def ready(self) -> bool:
        """True once a pinned copy has landed (a numpy one is only read by `finish`)."""
        return self.done or (self.pinned and all(x.is_ready() for x in self.host))

    def finish(self) -> None:
        if self.done:
            return
        t = time.perf_counter()
        if self.pinned:
            jax.block_until_ready(self.host)
        else:
            data = jax.device_get(self.host)
            for hp, piece, d in zip(self.pages, self.host, data):
                if hp.data is piece:              # still in the tier, not recalled (nor dropped) meanwhile
                    hp.data = d
        self.stats.device_get_s += time.perf_counter() - t
        self.done = True


class KvTransfers:
    """Runs the booked copies, once per engine step (`run`). Offloads finish asynchronously: their host
    copy overlaps the step; a later `run` books the pinned ones that have landed and never waits for one
    (up to MAX_OFFLOADS_IN_FLIGHT), and waits for numpy ones (a recall of a page whose copy is still
    under way is ordered after it by jax). `sync=True` finishes everything inside `run` (tests).
    `recall_choice` (kv/recall_choice.py), when set, is told each recall batch's measured copy.
    phases: where `run` adds its parts' host time (transfers.offload_wait / offload_start / upload, of
    which upload.device_put / staging / scatter / wait); the engine passes its own. compile_count: XLA compiles so far (the engine's CompileWatch);
    a recall batch during which something compiled (the first of its shapes) is not told to the choice:
    its upload time is mostly compiling (the first 32K-token recall of llama-8b on the H200 took 16.9 s),
    and a copy rate measured from it would make the choice recompute what it should recall."""

    def __init__(self, sync: bool = False, device=None, phases: PhaseTimes | None = None,
                 compile_count: Callable[[], int] | None = None):
        self.sync = sync
        self.phases = phases if phases is not None else PhaseTimes()
        self.compile_count = compile_count
        self.stats = TransferStats()
        self.recall_choice = None
        self._in_flight: list[_Offload] = []
        self.device = device if device is not None else jax.devices()[0]
        self.memory_kind, self.memory_reason = host_memory_kind(self.device)
        (log.info if self.memory_kind == "pinned_host" else log.warning)("KV host tier memory: %s (%s)",
                                                                         self.memory_kind, self.memory_reason)

    def pin(self, cache, nbytes: int) -> None:
        """Pins the tier's `nbytes` of host memory now (start-up), split over the devices `cache` lives on,
        when pages go to pinned memory: `pin_host_memory`."""
        if self.memory_kind != "pinned_host" or nbytes <= 0:
            return
        devices = sorted({d for x in jax.tree_util.tree_leaves(cache) for d in x.devices()}, key=lambda d: d.id)
        seconds = pin_host_memory(nbytes, devices, self.memory_kind)
        log.info("pinned %.2f GB of host memory for the KV host tier in %.1f s", nbytes / 1e9, seconds)

    def run(self, cache, pending: PendingTransfers):
        """Returns the cache (a new one when something was recalled)."""
        t0 = time.perf_counter()
        stats, phases = self.stats, self.phases
        with phases.span("transfers.offload_wait"):
            # A pinned offload needs no wait: its pages' data are their pinned arrays from the start, and a
            # recall of one still on its way is ordered after the copy by jax. Waiting here held every step
            # after an eviction, and the first token of the request it made room for, until the copy of the
            # evicted pages had landed (a 32K-token llama-8b prompt is 4 GB of KV). Numpy offloads are
            # finished (their data becomes the numpy copy), and so are pinned ones past the cap, oldest first.
            excess = len(self._in_flight) - MAX_OFFLOADS_IN_FLIGHT
            keep = []
            for i, job in enumerate(self._in_flight):
                if job.pinned and i >= excess and not job.ready():
                    keep.append(job)
                else:
                    job.finish()
        self._in_flight = keep
        if not pending:
            stats.seconds += time.perf_counter() - t0
            return cache
        if pending.offloads:
            with phases.span("transfers.offload_start"):
                jobs = self._start_offloads(cache, list(pending.offloads))
            if self.sync:
                with phases.span("transfers.offload_wait"):
                    for job in jobs:
                        job.finish()
            else:
                self._in_flight += jobs
        # Pages evicted again right after their recall: they take their source's data before the recall
        # below lets go of it.
        spent = []
        for hp in pending.aliases:
            if not hp.dropped and hp.data is None:
                spent.append(hp.same_as)
                hp.resolved()
        if pending.recalls:
            starts = list(pending.recalls)
            cache = self._recall(cache, starts, [pending.recalls[s].resolved() for s in starts])
            spent += [pending.recalls[s] for s in starts]
        for hp in spent:     # recalled pages left the tier: their host memory is let go, unless kept as the
            if hp is not None and not hp.kept:   # clean copy of their HBM page (kv/host_tier.py)
                hp.data = None
        stats.seconds += time.perf_counter() - t0
        return cache

    def _start_offloads(self, cache, pages: list) -> list[_Offload]:
        """Gathers the pages' slots (one gather per copy batch) and starts their copies to host memory."""
        jobs = []
        for first, end, padded in copy_batches([hp.page_size for hp in pages]):
            batch = pages[first:end]
            slots = np.zeros(padded, np.int32)              # padding reads slot 0, discarded
            at = 0
            for hp in batch:
                slots[at:at + hp.page_size] = np.arange(hp.src_slot, hp.src_slot + hp.page_size)
                at += hp.page_size
            pieces = _cut(_gather(cache, jnp.asarray(slots)), batch[0].page_size)[:len(batch)]
            jobs.append(_Offload(list(pieces), batch, self.stats, self.memory_kind))
            self.stats.offloaded_pages += len(batch)
        return jobs

    def _recall(self, cache, starts: list[int], datas: list):
        """Copies pages back to the device and writes page i at slots starts[i]...: one batched host ->
        device copy, then per copy batch one staging array (its pages side by side) and one scatter.
        Returns the new cache."""
        stats, phases = self.stats, self.phases
        num_slots = num_slots_of(cache[0])
        compiles = self.compile_count() if self.compile_count is not None else None
        t1 = time.perf_counter()
        with phases.span("transfers.upload.device_put"):
            if isinstance(datas[0], jax.Array):   # one batched host -> device copy, shardings kept
                pages = jax.device_put(datas, [d.sharding.with_memory_kind("device") for d in datas])
            else:                                 # numpy pages (no host memory kind)
                pages = jax.device_put(datas)
        batches = []
        with phases.span("transfers.upload.staging"):
            for first, end, padded in copy_batches([d.shape[0] for d in datas]):
                size = datas[first].shape[0]
                slots = np.full(padded, num_slots, np.int32)          # out of range: dropped
                for i, s in enumerate(starts[first:end]):
                    slots[i * size:(i + 1) * size] = np.arange(s, s + size)
                # The padding repeats the batch's first page: its slots are dropped by the scatter.
                batch = tuple(pages[first:end]) + (pages[first],) * (padded // size - (end - first))
                batches.append((slots, _stage(batch)))
        # The scatters are dispatched before the wait below, while the copy is still in flight: dispatched
        # after it, the device sat idle for their host time (4.6 ms for a 32K-token llama-8b recall). So the
        # measured upload includes their dispatch where that outlasts the copy (a recall of a page or two).
        with phases.span("transfers.upload.scatter"):
            for slots, staging in batches:
                cache = _scatter(cache, jnp.asarray(slots), staging)
        # The wait measures the copy (the recall choice's rate); the scatters queued behind it run meanwhile.
        with phases.span("transfers.upload.wait"):
            jax.block_until_ready([staging for _, staging in batches])
        upload = time.perf_counter() - t1
        phases.add("transfers.upload", upload)
        stats.upload_s += upload
        stats.recall_batches += 1
        stats.recall_seconds.append(upload)
        nbytes = sum(d.nbytes for d in datas)
        if self.recall_choice is not None and (compiles is None or self.compile_count() == compiles):
            self.recall_choice.observe_copy(nbytes, sum(d.shape[0] for d in datas), upload)
        stats.recalled_pages += len(starts)
        stats.recalled_bytes += nbytes
        return cache

    def compile_copies(self, cache, page_sizes):
        """Runs every copy shape once (each copy batch size x page size: gather, cut, copy out, copy
        back, stage, scatter), so that nothing of the tier compiles once the server takes traffic. The
        pages are read from slot 0 and written past the pool (dropped): the cache's contents are kept,
        but it is donated, so use the one returned."""
        t0 = time.perf_counter()
        num_slots = num_slots_of(cache[0])
        stats, choice = self.stats, self.recall_choice
        self.stats, self.recall_choice = TransferStats(), None      # warm-up copies are not traffic
        try:
            shapes = 0
            for size in page_sizes:
                # The fewest pages of this size that reach each batch size they can reach.
                counts = {}
                for n in range(1, COPY_BATCH_PAGES + 1):
                    counts.setdefault(copy_batches([size] * n)[0][2], n)
                for n in counts.values():
                    fake = [_WarmupPage(size) for _ in range(n)]
                    for job in self._start_offloads(cache, fake):
                        job.finish()
                    cache = self._recall(cache, [num_slots] * n, [hp.data for hp in fake])
                    shapes += 1
        finally:
            self.stats, self.recall_choice = stats, choice
        log.info("ran %d host-tier copy shapes (page sizes %s) in %.1f s", shapes, list(page_sizes),
                 time.perf_counter() - t0)
        return cache


@dataclasses.dataclass
class _WarmupPage:
    """A stand-in for a HostPage in `compile_copies`: offloaded from slot 0, never in the tier."""
    page_size: int
    src_slot: int | None = 0
    dropped: bool = False
    data: object = None


def run_transfers(cache, pending: PendingTransfers):
    """Does the booked copies and waits for all of them; returns the cache."""
    return KvTransfers(sync=True).run(cache, pending)
