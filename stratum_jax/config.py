"""One frozen dataclass of every runtime tunable, built from CLI flags, validated once at construction."""
from __future__ import annotations

import argparse
import dataclasses
import os

PAGE_SIZE_CLASSES = (8, 16, 32, 64, 128, 256)   # tokens per page: 8 * 2^k
ATTENTION_BACKENDS = ("auto", "reference", "kernel")
PROJECTION_BACKENDS = ("auto", "kernel", "xla")
DECODE_KERNELS = ("swapped", "paged")          # --decode-kernel: stratum_jax/attention.py decode_attention
L2_PREFETCH_MAX_MB = 50.0                       # --l2-prefetch-mb: the H200's L2; more could only evict itself
DMLP_DEVICES = ("default", "cpu")
TP_EMBEDDINGS = ("auto", "vocab-parallel", "replicated")   # --tp-embedding (stratum_jax/tensor_parallel.py)
CACHE_POLICIES = ("lru", "dmlp")
SCHEDULERS = ("hab", "fcfs")
# Where the entry points (serve, generate) keep jax's persistent compilation cache unless told otherwise.
DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/stratum-jax/xla"
# HAB's idle threshold: the design's default, and its profiles for high QPS and for low latency.
HAB_PROFILES = {"default": 8.0, "high-qps": 4.0, "low-latency": 2.0}
HAB_THRESHOLD_ENV = "STRATUM_HAB_THRESHOLD_MS"
KV_PRECISIONS = ("bf16", "fp16-delta", "fp8-delta")   # --kv-precision (DKVC: stratum_jax/kv/delta_cache.py)
FP8_SCALES = ("granule", "head")   # --fp8-scale: fp8 deltas' scale rule (stratum_jax/kv/delta_cache.py)
KV_PRECISION_ENV = "STRATUM_DKVC_PRECISION"


def _kv_precision_default() -> str:
    """--kv-precision's default: $STRATUM_DKVC_PRECISION (the design's stratum_dkvc_precision), else bf16.
    Checked with the other fields in __post_init__."""
    return os.environ.get(KV_PRECISION_ENV, "").strip() or "bf16"


def _hab_threshold_default() -> float:
    """--hab-threshold-ms's default: $STRATUM_HAB_THRESHOLD_MS (a number of ms or a profile name), else 8."""
    text = os.environ.get(HAB_THRESHOLD_ENV, "").strip()
    if not text:
        return HAB_PROFILES["default"]
    if text in HAB_PROFILES:
        return HAB_PROFILES[text]
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"${HAB_THRESHOLD_ENV} must be a number of ms or one of {sorted(HAB_PROFILES)}, "
                         f"got {text!r}") from None
DMLP_CONFIDENCE_RANGE = (0.5, 0.95)    # the bounds of ConfidenceThreshold (stratum_jax/dmlp/policy.py)
DEFAULT_MAX_CONTEXT = 2048             # --max-context when none is given, capped by the model's own limit


def parse_cores(text: str | None) -> tuple[int, ...] | None:
    """"2,3" or "4-7" or "0,2-3" -> sorted core ids; "" or None -> None. ValueError names the flag."""
    if text is None or str(text).strip() == "":
        return None
    cores: set[int] = set()
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            a, b = int(lo), int(hi) if hi else int(lo)
            if a < 0 or b < a:
                raise ValueError
            cores.update(range(a, b + 1))
    except ValueError:
        raise ValueError(f"--dmlp-online-cores must list CPU cores like 2,3 or 4-7, got {text!r}") from None
    return tuple(sorted(cores))


def parse_prefill_splits(value) -> int | str | None:
    """--prefill-splits as `prefill_attention(prefill_splits=...)` takes it: "off" -> None, "auto", or a count
    from 1 to 16; anything else raises ValueError."""
    text = str(value).strip().lower()
    if text in ("auto", "off"):
        return None if text == "off" else text
    if text.isdigit() and 1 <= int(text) <= 16:
        return int(text)
    raise ValueError(f"--prefill-splits must be 'auto', 'off' or a count from 1 to 16, got {value!r}")


def _parses(parse, value) -> bool:
    try:
        parse(value)
    except ValueError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Everything the engine can be tuned by. Invalid values raise ValueError naming the flag to fix."""

    model: str = "pydoc-2m"          # preset name (random tiny/llama-1b/llama-8b, trained pydoc-2m) or HF dir
    dtype: str | None = None         # override the model's dtype: "float32" or "bfloat16"
    max_batch_size: int = 32         # running sequences per decode step
    max_context: int | None = None   # prompt + generated tokens per request; None = the model's
                                     # max_position_embeddings capped at DEFAULT_MAX_CONTEXT (for_model)
    max_tokens_cap: int = 1024       # the largest max_tokens a request may ask for
    max_queue: int = 256             # waiting requests before add_request raises QueueFullError
    kv_pool_tokens: int = 65536      # KV capacity in token slots (rounded up to a multiple of 256)
    kv_host_tokens: int = 0          # host-memory tier for evicted prefix pages, in tokens (0 = none)
    kv_prefetch_pages: int = 64      # host-tier pages of queued requests recalled ahead, per step (0 = off)
    kv_host_pin_at_start: bool = True  # pin the host tier's memory at start-up (kv/transfer.py pin_host_memory):
                                     # pinning on first use stalled the engine loop ~0.45 s per GB offloaded
    prefill_chunk: int = 4096        # most prompt tokens one request prefills per step (long prompts are split);
                                     # as large as the step's budget: the scheduler decides who gets it
    max_num_batched_tokens: int = 4096   # tokens per step: one decode token per row + prefill chunks (the
                                     # Mooncake replay in BENCHMARKS.md: 4096 beat 2048 on TTFT at equal TPOT)
    decode_steps: int = 2            # decode steps per device call in steps with no prefill (tokens reach
                                     # the host in bursts of this). A prompt that arrives waits for the call
                                     # in flight and the one queued behind it: on the Mooncake replay 2 beat 4
                                     # on TTFT p50 at equal TPOT and goodput (BENCHMARKS.md, session 9)
    async_scheduling: bool = True    # dispatch step N+1 before reading step N's results (engine.step)
    scheduler: str = "hab"           # "hab" (hunger-aware) or "fcfs" (the ablation / baseline)
    hab_threshold_ms: float = dataclasses.field(default_factory=_hab_threshold_default)
    hab_max_wait_ms: float = 2000.0  # HAB's starvation bound: a request waiting this long goes first
    compilation_cache_dir: str | None = None   # jax's persistent compilation cache (None: off)
    page_size: int | None = None     # force one page size for every request; None = adaptive rule
    attention: str = "auto"          # "kernel" (Pallas Mosaic GPU), "reference" (pure jnp), or "auto": the
                                     # kernel on a Hopper GPU when the model fits it, else the reference
    projections: str = "auto"        # a decode step's q/k/v, o and down projections: "kernel" (the Pallas
                                     # weight-streaming GEMM), "xla", or "auto": the kernel on a Hopper GPU for
                                     # a bf16 model on one device (stratum_jax/model/projection.py)
    l2_prefetch_mb: float = 0.0      # with the Pallas projections: the kernel before each decode GEMM (the norms,
                                     # attention, gate/up) also prefetches into L2 up to this many MB of that GEMM's
                                     # weight, the tiles it reads first, and the fused q/k/v write each decode row's
                                     # first K/V tile (projection.DecodeKernelMatmul); 0 = off: on the H200 the
                                     # issuing kernels lose what the fed ones gain (BENCHMARKS.md #18, session 30)
    fold_norms: bool = False         # with the Pallas projections: fold each layer's RMSNorm weights into q/k/v's and
                                     # gate/up's weights at load and run a decode layer in 6 kernels instead of 8 (the
                                     # residual adds inside o's and down's GEMMs, the norms' row scales inside q/k/v's
                                     # and gate/up's: pallas_kernels/norm_fold.py); the prefill runs the same function
    decode_kernel: str = "swapped"   # the bf16 decode kernel with --attention kernel: "swapped" (keys on WGMMA's M,
                                     # the GQA group on N: fewer registers, 2-4 CTAs an SM) or "paged" (64-row q
                                     # blocks); benchmarks/KERNEL_NOTES.md has their timings
    prefill_splits: str = "auto"     # split-K over the context in the WS prefill kernel: "auto" (ws_prefill_splits:
                                     # only when a chunk's blocks x kv heads leave SMs idle, e.g. a recomputed tail
                                     # over a long prefix), "off", or a count N >= 1
    interpret_kernels: bool = False  # run Pallas kernels in the Mosaic GPU interpreter (CPU tests)
    cache_policy: str = "lru"        # eviction/page-size policy for cached prefix pages: lru or dmlp
    dmlp_checkpoint: str | None = None   # DMLP checkpoint directory (train_dmlp --out); needed by dmlp
    dmlp_confidence: float = 0.75    # initial stratum_dmlp_confidence (hot/cold threshold), in [0.5, 0.95]
    dmlp_online: bool = False        # fine-tune the DMLP online from live traffic (the server starts it)
    dmlp_online_dir: str | None = None   # where the online fine-tuner writes its orbax checkpoints
    dmlp_online_cores: tuple[int, ...] | None = None   # CPU cores to pin the fine-tuning worker to
    dmlp_online_track: float = 0.25  # share of KV blocks (by id) whose accesses become online examples
    dmlp_device: str = "default"     # where the DMLP runs its predictions: "default" (jax's default device, the
                                     # GPU on a server) or "cpu" (overlaps the step in flight instead of queueing
                                     # behind it on the GPU; slower per call: BENCHMARKS.md, #13 session 13)
    dmlp_guard: bool = True          # shadow-LRU guard: evict in LRU order while the DMLP trails LRU
    dmlp_score_ahead: bool = True    # dispatch each step's block accesses to the predictor without waiting and read
                                     # the curves when a decision needs them (else: scored, waiting, at each
                                     # decision; the engine thread then waits behind the step in flight)
    kv_precision: str = dataclasses.field(default_factory=_kv_precision_default)   # KV pages: bf16, or
                                     # deltas from a resident anchor (fp16/fp8); the engine may fall back
    fp8_scale: str = "granule"       # fp8 deltas' scales: set per 8-slot granule at its first write, or one
                                     # fixed scale per layer and KV head from the warm-up run ("head")
    dmlp_guard_window: int = 2048    # block accesses per guard judgement (ShadowLruGuard's window)
    enable_prefix_caching: bool = True
    seed: int = 0                    # seeds requests that bring no seed of their own
    trace_out: str | None = None     # write the block event log (JSONL, see stratum_jax/kv/event_log.py) here
    tensor_parallel: int = 1         # devices the model is split over (stratum_jax/tensor_parallel.py)
    tp_embedding: str = "auto"       # with tensor_parallel > 1: embedding + LM head split, replicated, or
                                     # chosen per model (tensor_parallel.choose_embedding)
    coordinator: str | None = None   # jax.distributed: HOST:PORT of process 0 (stratum_jax/distributed.py)
    num_processes: int = 1           # jax.distributed: processes (hosts) in the job
    process_id: int = 0              # jax.distributed: this process's rank in [0, num_processes)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.dtype in (None, "float32", "bfloat16"),
             f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        for name in ("max_batch_size", "max_context", "max_tokens_cap", "max_queue", "kv_pool_tokens",
                     "prefill_chunk", "decode_steps"):
            value = getattr(self, name)
            if name == "max_context" and value is None:
                continue             # resolved against the model by for_model()
            need(isinstance(value, int) and value > 0,
                 f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        need(self.max_batch_size <= 1024, f"--max-batch-size must be <= 1024, got {self.max_batch_size}")
        need(self.prefill_chunk >= 8 and self.prefill_chunk & (self.prefill_chunk - 1) == 0,
             f"--prefill-chunk must be a power of two >= 8, got {self.prefill_chunk}")
        need(self.decode_steps <= 64, f"--decode-steps must be <= 64, got {self.decode_steps}")
        need(isinstance(self.max_num_batched_tokens, int)
             and self.max_num_batched_tokens >= self.max_batch_size + min(64, self.prefill_chunk),
             f"--max-num-batched-tokens ({self.max_num_batched_tokens!r}) must hold one decode token per row "
             f"(--max-batch-size {self.max_batch_size}) plus at least one prefill tile of "
             f"{min(64, self.prefill_chunk)} tokens: raise it or lower --max-batch-size")
        need(self.scheduler in SCHEDULERS, f"--scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        for name in ("hab_threshold_ms", "hab_max_wait_ms"):
            value = getattr(self, name)
            env = f" (or ${HAB_THRESHOLD_ENV})" if name == "hab_threshold_ms" else ""
            need(isinstance(value, (int, float)) and 0 <= value < float("inf"),
                 f"--{name.replace('_', '-')}{env} must be a finite number of ms >= 0, got {value!r}")
        need(self.page_size is None or self.page_size in PAGE_SIZE_CLASSES,
             f"--page-size must be one of {PAGE_SIZE_CLASSES}, got {self.page_size!r}")
        need(self.attention in ATTENTION_BACKENDS,
             f"--attention must be one of {ATTENTION_BACKENDS}, got {self.attention!r}")
        need(self.projections in PROJECTION_BACKENDS,
             f"--projections must be one of {PROJECTION_BACKENDS}, got {self.projections!r}")
        need(isinstance(self.l2_prefetch_mb, (int, float)) and 0 <= self.l2_prefetch_mb <= L2_PREFETCH_MAX_MB,
             f"--l2-prefetch-mb must be a number of MB in [0, {L2_PREFETCH_MAX_MB}] (the H200's L2 holds 50 MB), "
             f"got {self.l2_prefetch_mb!r}")
        need(isinstance(self.fold_norms, bool), f"--fold-norms is a flag (true or false), got {self.fold_norms!r}")
        need(self.decode_kernel in DECODE_KERNELS,
             f"--decode-kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")
        need(_parses(parse_prefill_splits, self.prefill_splits),
             f"--prefill-splits must be 'auto', 'off' or a count from 1 to 16, got {self.prefill_splits!r}")
        need(self.cache_policy in CACHE_POLICIES,
             f"--cache-policy must be one of {CACHE_POLICIES}, got {self.cache_policy!r}")
        need(self.kv_precision in KV_PRECISIONS,
             f"--kv-precision (or ${KV_PRECISION_ENV}) must be one of {KV_PRECISIONS}, got {self.kv_precision!r}")
        need(self.fp8_scale in FP8_SCALES, f"--fp8-scale must be one of {FP8_SCALES}, got {self.fp8_scale!r}")
        need(self.fp8_scale == "granule" or self.kv_precision == "fp8-delta",
             f"--fp8-scale {self.fp8_scale} is a rule for fp8 deltas; it needs --kv-precision fp8-delta "
             f"(got {self.kv_precision})")
        self._check_dmlp(need)
        self._check_parallel(need)
        need(isinstance(self.seed, int) and self.seed >= 0,
             f"--engine-seed must be an integer >= 0, got {self.seed!r}")
        self._check_paths(need)
        for name in ("kv_host_tokens", "kv_prefetch_pages"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 0,
                 f"--{name.replace('_', '-')} must be an integer >= 0, got {value!r}")
        need(not self.kv_host_tokens or self.enable_prefix_caching,
             "--kv-host-tokens keeps evicted prefix-cache pages: it needs prefix caching "
             "(drop --no-prefix-caching or --kv-host-tokens)")
        # With max_context None the pool is checked again once the model fixes it (for_model).
        need(self.max_context is None or self.kv_pool_tokens >= self.max_context,
             f"--kv-pool-tokens ({self.kv_pool_tokens}) must hold at least one full context "
             f"(--max-context {self.max_context})")

    def for_model(self, max_position_embeddings: int) -> "RuntimeConfig":
        """This config with max_context fixed for a model that allows `max_position_embeddings` positions.

        Still one config validated once per value: the engine calls this when it knows the model, and the
        resolved copy is validated like any other. No --max-context: the model's limit capped at
        DEFAULT_MAX_CONTEXT (a 512-position model gets 512, not an error). An explicit --max-context above
        the model's limit is an error, as is a --kv-pool-tokens too small for the resolved context.
        """
        if self.max_context is None:
            return dataclasses.replace(self, max_context=min(DEFAULT_MAX_CONTEXT, max_position_embeddings))
        if self.max_context > max_position_embeddings:
            raise ValueError(f"--max-context {self.max_context} exceeds the model's max_position_embeddings "
                             f"{max_position_embeddings}: lower it, or leave it out to use the model's limit")
        return self

    def _check_paths(self, need) -> None:
        """Paths the engine writes, checked now rather than after the model has loaded."""
        if self.trace_out is not None:
            path = self.trace_out
            parent = os.path.dirname(os.path.abspath(path))
            need(not os.path.isdir(path), f"--trace-out {self.trace_out}: is a directory; give a file path "
                                          f"(the event log is appended to it)")
            need(os.path.isdir(parent), f"--trace-out {self.trace_out}: its directory {parent} does not exist; "
                                        f"create it or give another path")
        if self.compilation_cache_dir is not None:
            path = os.path.expanduser(self.compilation_cache_dir)
            need(not os.path.exists(path) or os.path.isdir(path),
                 f"--compilation-cache-dir {self.compilation_cache_dir}: is a file, not a directory; give a "
                 f"directory (created if missing) or 'none'")

    def _check_parallel(self, need) -> None:
        need(isinstance(self.tensor_parallel, int) and self.tensor_parallel >= 1,
             f"--tensor-parallel must be a positive integer, got {self.tensor_parallel!r}")
        need(self.tp_embedding in TP_EMBEDDINGS,
             f"--tp-embedding must be one of {TP_EMBEDDINGS}, got {self.tp_embedding!r}")
        need(isinstance(self.num_processes, int) and self.num_processes >= 1,
             f"--num-processes must be a positive integer, got {self.num_processes!r}")
        need(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
             f"--process-id must lie in [0, --num-processes {self.num_processes}), got {self.process_id!r}")
        if self.num_processes == 1:
            need(self.coordinator is None, "--coordinator needs --num-processes > 1 (and --process-id)")
            return
        host, _, port = (self.coordinator or "").rpartition(":")
        need(bool(host) and port.isdigit() and 0 < int(port) < 65536,
             f"--num-processes {self.num_processes} needs --coordinator HOST:PORT (process 0's address), "
             f"got {self.coordinator!r}")
        # Every process runs the host side (scheduler, page pool, cache policy) on the same requests and
        # must make the same choices, or the processes' device programs diverge and the collectives hang.
        # HAB admits by measured idle time and the DMLP reads it too: both differ between processes.
        need(self.scheduler == "fcfs", "--num-processes > 1 needs --scheduler fcfs (HAB's admissions follow "
                                       "each process's own measured idle time, so processes would diverge)")
        need(self.cache_policy == "lru", "--num-processes > 1 needs --cache-policy lru (the DMLP's features "
                                         "include measured times, so processes would diverge)")
        need(not self.kv_host_tokens, "--num-processes > 1 does not support --kv-host-tokens")

    @property
    def prefill_split_setting(self) -> int | str | None:
        """--prefill-splits as `prefill_attention(prefill_splits=...)` takes it: None (off), "auto" or a count."""
        return parse_prefill_splits(self.prefill_splits)

    def _check_dmlp(self, need) -> None:
        need(self.dmlp_device in DMLP_DEVICES, f"--dmlp-device must be one of {DMLP_DEVICES}, got {self.dmlp_device!r}")
        dmlp = self.cache_policy == "dmlp"
        if not dmlp:
            for flag, value in (("--dmlp-checkpoint", self.dmlp_checkpoint), ("--dmlp-online", self.dmlp_online or None),
                                ("--dmlp-online-dir", self.dmlp_online_dir),
                                ("--dmlp-online-cores", self.dmlp_online_cores),
                                ("--dmlp-device", None if self.dmlp_device == "default" else self.dmlp_device),
                                ("--no-dmlp-score-ahead", None if self.dmlp_score_ahead else False)):
                need(value is None, f"{flag} only applies with --cache-policy dmlp (the policy is "
                                    f"{self.cache_policy!r}): add --cache-policy dmlp or drop {flag}")
            return
        need(self.dmlp_checkpoint is not None,
             "--cache-policy dmlp needs --dmlp-checkpoint DIR: a DMLP checkpoint directory written by "
             "python -m stratum_jax.train_dmlp --out DIR")
        need(os.path.isfile(os.path.join(self.dmlp_checkpoint, "meta.json")),
             f"--dmlp-checkpoint {self.dmlp_checkpoint}: not a DMLP checkpoint directory (no meta.json in it)")
        lo, hi = DMLP_CONFIDENCE_RANGE
        need(isinstance(self.dmlp_confidence, (int, float)) and lo <= self.dmlp_confidence <= hi,
             f"--dmlp-confidence must lie in [{lo}, {hi}], got {self.dmlp_confidence!r}")
        need(isinstance(self.dmlp_online_track, (int, float)) and 0.0 < self.dmlp_online_track <= 1.0,
             f"--dmlp-online-track must lie in (0, 1], got {self.dmlp_online_track!r}")
        need(isinstance(self.dmlp_guard_window, int) and self.dmlp_guard_window >= 1,
             f"--dmlp-guard-window must be an integer >= 1 (block accesses), got {self.dmlp_guard_window!r}")
        if self.dmlp_online:
            need(self.dmlp_online_dir is not None,
                 "--dmlp-online needs --dmlp-online-dir DIR, where its checkpoints go")
            need(os.path.abspath(self.dmlp_online_dir) != os.path.abspath(self.dmlp_checkpoint),
                 "--dmlp-online-dir must differ from --dmlp-checkpoint (it keeps only its newest step-N "
                 "checkpoints)")
        else:
            need(self.dmlp_online_dir is None and self.dmlp_online_cores is None,
                 "--dmlp-online-dir and --dmlp-online-cores need --dmlp-online")
        if self.dmlp_online_cores is not None:
            cores = self.dmlp_online_cores
            need(isinstance(cores, tuple) and cores and all(isinstance(c, int) and c >= 0 for c in cores),
                 f"--dmlp-online-cores must be a non-empty list of CPU core ids, got {cores!r}")
            available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
            need(available is None or set(cores) <= available,
                 f"--dmlp-online-cores {','.join(map(str, cores))}: this process may only run on cores "
                 f"{','.join(map(str, sorted(available or ())))}")

    @property
    def kv_pool_slots(self) -> int:
        """Token slots in each layer's pool: a multiple of the largest page so the buddy tree is whole."""
        top = PAGE_SIZE_CLASSES[-1]
        return -(-self.kv_pool_tokens // top) * top

    @property
    def measures_attention_stats(self) -> bool:
        """Whether the steps measure attention-score variance (attn_var5): only when something reads it, the
        DMLP's features or the block event log (its cost is in BENCHMARKS.md); the page-size rule uses it
        when it is there."""
        return self.cache_policy == "dmlp" or self.trace_out is not None

    @property
    def page_sizes(self) -> tuple[int, ...]:
        """The page sizes requests can get: the forced --page-size, else every class the adaptive rule and
        the DMLP choose from."""
        return (self.page_size,) if self.page_size is not None else PAGE_SIZE_CLASSES

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        # The defaults that read the environment are not read here: a bad $STRATUM_* value is an error of
        # from_cli_args (a usage message), not a traceback while the parser is being built.
        d = RuntimeConfig(hab_threshold_ms=HAB_PROFILES["default"], kv_precision="bf16")
        g = parser.add_argument_group("runtime")
        g.add_argument("--model", default=d.model, help="preset name (pydoc-2m: trained; tiny, llama-1b, llama-8b, llama-70b: random) or HF dir")
        g.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"])
        g.add_argument("--max-batch-size", type=int, default=d.max_batch_size)
        g.add_argument("--max-context", type=int, default=d.max_context,
                       help=f"prompt + generated tokens per request (default: the model's "
                            f"max_position_embeddings, at most {DEFAULT_MAX_CONTEXT})")
        g.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap)
        g.add_argument("--max-queue", type=int, default=d.max_queue)
        g.add_argument("--kv-pool-tokens", type=int, default=d.kv_pool_tokens)
        g.add_argument("--kv-host-tokens", type=int, default=d.kv_host_tokens, metavar="TOKENS",
                       help="host-memory tier: evicted prefix pages move there and are copied back on a "
                            "prefix hit instead of recomputed (0 = no host tier)")
        g.add_argument("--kv-host-pin-at-start", action=argparse.BooleanOptionalAction,
                       default=d.kv_host_pin_at_start,
                       help="with --kv-host-tokens: page-lock the tier's host memory at start-up (up to ~1 s per "
                            "GB, logged) instead of on the first offloads, where it stalls every stream")
        g.add_argument("--kv-prefetch-pages", type=int, default=d.kv_prefetch_pages, metavar="N",
                       help="with --kv-host-tokens: host-tier pages of queued requests copied back into free "
                            "HBM per step, in the cache policy's order (0 = no prefetch)")
        g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, metavar="N",
                       help="tokens per engine step: one decode token per running request plus prefill chunks "
                            "of waiting prompts; the step shapes compiled at warm-up follow from it")
        g.add_argument("--decode-steps", type=int, default=d.decode_steps,
                       help="decode steps per device call when no prompt is prefilling: more = less host "
                            "overhead, burstier streams (tokens reach clients N at a time)")
        g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                       help="dispatch each engine step before reading the previous one's results, so host "
                            "work (post-processing, scheduling, packing) overlaps the device's; on by default")
        g.add_argument("--scheduler", default=d.scheduler, choices=SCHEDULERS,
                       help="hab: hunger-aware batching (admits by compute fit when the device idles); "
                            "fcfs: first come, first served")
        g.add_argument("--hab-threshold-ms", type=_threshold_arg, default=None, metavar="MS",
                       help=f"HAB: device idle time that triggers CPM admission, ms or a profile "
                            f"{HAB_PROFILES} (default: ${HAB_THRESHOLD_ENV}, else 8)")
        g.add_argument("--hab-max-wait-ms", type=float, default=d.hab_max_wait_ms, metavar="MS",
                       help="HAB's starvation bound: a request that waited this long is admitted first")
        g.add_argument("--compilation-cache-dir", default=d.compilation_cache_dir, metavar="DIR",
                       help="jax's persistent compilation cache, so a restart loads compiled step shapes "
                            f"instead of compiling them (serve/generate default: {DEFAULT_COMPILATION_CACHE_DIR}; "
                            "'none' turns it off)")
        g.add_argument("--page-size", type=int, default=d.page_size,
                       help=f"force one page size {PAGE_SIZE_CLASSES}; default: adaptive per request")
        g.add_argument("--attention", default=d.attention, choices=ATTENTION_BACKENDS,
                       help="decode attention: the Pallas kernel, the jnp reference, or auto (the kernel on a "
                            "Hopper GPU for bf16 models with head_dim 64/128, else the reference)")
        g.add_argument("--projections", default=d.projections, choices=PROJECTION_BACKENDS,
                       help="a decode step's q/k/v, o and down projections: the Pallas weight-streaming GEMM, XLA's "
                            "dot, or auto (the kernel on a Hopper GPU for a bf16 model on one device)")
        g.add_argument("--l2-prefetch-mb", type=float, default=d.l2_prefetch_mb, metavar="MB",
                       help="with the Pallas projections, the kernel before each decode GEMM also prefetches into "
                            "L2 up to this many MB of that GEMM's weight, and the fused q/k/v write each decode row's "
                            "first K/V tile (0: off)")
        g.add_argument("--fold-norms", action=argparse.BooleanOptionalAction, default=d.fold_norms,
                       help="with the Pallas projections, fold the layers' RMSNorm weights into the next projection's "
                            "weight at load and run each decode layer in 6 kernels instead of 8 (the residual adds "
                            "and the norms inside the GEMMs)")
        g.add_argument("--decode-kernel", default=d.decode_kernel, choices=DECODE_KERNELS,
                       help="the bf16 decode attention kernel with --attention kernel: swapped (keys on the MMA's "
                            "rows, the GQA group on its columns) or paged (64-row query blocks)")
        g.add_argument("--prefill-splits", default=d.prefill_splits, metavar="{auto,off,N}",
                       help="split-K over the context in the warp-specialised prefill kernel: auto (only when a "
                            "chunk's blocks x kv heads leave SMs idle, as for a short tail over a long prefix), "
                            "off, or N CTAs per block")
        g.add_argument("--kv-precision", default=None, choices=KV_PRECISIONS,
                       help="KV pages: bf16, or DKVC deltas from a resident anchor built at start-up, as fp16 or "
                            f"fp8 e4m3 with per-granule scales (default: ${KV_PRECISION_ENV}, else bf16). fp8 "
                            "falls back to fp16-delta on GPUs without fp8, and deltas to bf16 when the measured "
                            "memory bandwidth is HBM2-class; the log says which ran")
        g.add_argument("--fp8-scale", default=d.fp8_scale, choices=FP8_SCALES,
                       help="fp8-delta's scales: 'granule' (one per 8 slots and KV head, set at the granule's first "
                            "write) or 'head' (one per layer and KV head, fixed from the warm-up run's largest "
                            "delta: no scale work per step; a delta beyond it saturates)")
        g.add_argument("--interpret-kernels", action="store_true",
                       help="run Pallas kernels in the Mosaic GPU interpreter (for CPU)")
        g.add_argument("--cache-policy", default=d.cache_policy, choices=CACHE_POLICIES,
                       help="which cached KV pages to evict and which page size to use: lru, or dmlp "
                            "(the reuse predictor; needs --dmlp-checkpoint)")
        g.add_argument("--dmlp-checkpoint", default=None, metavar="DIR",
                       help="DMLP checkpoint directory (python -m stratum_jax.train_dmlp --out DIR)")
        g.add_argument("--dmlp-confidence", type=float, default=d.dmlp_confidence,
                       help="initial hot/cold threshold on P(reuse) (stratum_dmlp_confidence), in [0.5, 0.95]")
        g.add_argument("--dmlp-online", action=argparse.BooleanOptionalAction, default=d.dmlp_online,
                       help="fine-tune the DMLP from live traffic in a background worker (server only)")
        g.add_argument("--dmlp-online-dir", default=None, metavar="DIR",
                       help="where online fine-tuning writes its orbax checkpoints (step-N)")
        g.add_argument("--dmlp-online-cores", type=parse_cores, default=None, metavar="CORES",
                       help="pin the fine-tuning worker to these CPU cores, e.g. 14,15 or 12-15")
        g.add_argument("--dmlp-online-track", type=float, default=d.dmlp_online_track, metavar="FRACTION",
                       help="share of KV blocks, sampled by block id, whose accesses become online training "
                            "examples (each costs the engine thread a little), in (0, 1]")
        g.add_argument("--dmlp-device", default=d.dmlp_device, choices=DMLP_DEVICES,
                       help="where the DMLP's predictions run: jax's default device (the GPU on a server, where a "
                            "call queues behind the step in flight) or the host CPU (overlaps it, slower per call)")
        g.add_argument("--dmlp-guard", action=argparse.BooleanOptionalAction, default=d.dmlp_guard,
                       help="shadow-LRU guard: evict in LRU order while the DMLP's recent hit rate trails "
                            "what LRU would have had (stratum_dmlp_guard_active); on by default")
        g.add_argument("--dmlp-score-ahead", action=argparse.BooleanOptionalAction, default=d.dmlp_score_ahead,
                       help="launch the DMLP on each step's block accesses without waiting and read its curves "
                            "when an eviction needs them (the same decisions; the engine thread does not wait "
                            "behind the step in flight); --no-dmlp-score-ahead scores at each decision instead")
        g.add_argument("--dmlp-guard-window", type=int, default=d.dmlp_guard_window, metavar="ACCESSES",
                       help="block accesses per guard judgement: a shorter window reacts sooner, a longer one "
                            "trips less on noise")
        g.add_argument("--trace-out", default=None, metavar="PATH",
                       help="append the KV block event log (JSONL) to PATH, for DMLP training")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
        g.add_argument("--engine-seed", dest="seed", type=int, default=d.seed,
                       help="seeds preset weights and requests that bring no seed")
        g = parser.add_argument_group("parallelism")
        g.add_argument("--tensor-parallel", type=int, default=d.tensor_parallel, metavar="N",
                       help="split the model over N devices (Megatron-style: heads and FFN columns; "
                            "all devices of all processes with --num-processes)")
        g.add_argument("--tp-embedding", default=d.tp_embedding, choices=TP_EMBEDDINGS,
                       help="with --tensor-parallel: split the embedding and LM head over the vocabulary, "
                            "replicate them on every device, or auto: replicated unless that adds over 2 GiB "
                            "of LM head per device (faster at batch 1 on two H200s)")
        g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="multi-host: address of process 0 (jax.distributed.initialize)")
        g.add_argument("--num-processes", type=int, default=d.num_processes, metavar="P",
                       help="multi-host: processes in the job, one per host")
        g.add_argument("--process-id", type=int, default=d.process_id, metavar="I",
                       help="multi-host: this process's rank, 0 .. P-1 (0 runs the coordinator)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "RuntimeConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        if str(values.get("compilation_cache_dir", "")).lower() in ("none", ""):
            values["compilation_cache_dir"] = None
        if values.get("hab_threshold_ms") is None:
            values.pop("hab_threshold_ms", None)       # the field's default reads the environment
        if values.get("kv_precision") is None:
            values.pop("kv_precision", None)           # likewise ($STRATUM_DKVC_PRECISION)
        return cls(**values)


def _threshold_arg(text: str) -> float:
    """--hab-threshold-ms: a number of ms or a profile name."""
    if text in HAB_PROFILES:
        return HAB_PROFILES[text]
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ms or one of {sorted(HAB_PROFILES)}, got {text!r}") from None
