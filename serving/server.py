"""The gRPC server (and, with --http-port, the OpenAI-compatible HTTP endpoint beside it, on the same event
loop, Frontend and engine runner): builds it, loads and warms the model, and drains it on shutdown.

Start-up order: the ports open first, with grpc.health.v1 answering NOT_SERVING, Messages answering
UNAVAILABLE (HTTP: /health and the completions endpoints answer 503); then the model loads and warms on a worker thread, the memory bandwidth is measured, and only
then does health turn SERVING. Draining reverses it: health turns NOT_SERVING, new requests get
UNAVAILABLE (HTTP 503), in-flight ones of both transports may finish within the grace period, and the
rest end with UNAVAILABLE (an HTTP stream: an error event).

With --stacks stratum,baseline[,long-context] the server runs one engine per pool (serving/stacks.py), all
over the one model the first engine loaded (its weights are not copied), each warmed and calibrated before
SERVING and each on its own EngineRunner thread; they share the device.
"""
from __future__ import annotations

import asyncio
import logging
import pathlib
import time

import grpc
import jax
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from serving import cost
from serving.auth import MESSAGES_METHOD, ApiKeyInterceptor, load_keys
from serving.hardware import device_info, measure_copy_bandwidth_gbps
from stratum_jax.bandwidth import measure_device_peaks
from stratum_jax.step_work import DevicePeaks
from serving.options import ServerOptions
from serving.reflection import enable_reflection
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from serving.runner import EngineRunner
from serving.frontend import DRAINING, Frontend, Pool, Served
from serving.routing import Router
from serving.stacks import BASELINE, LONG_CONTEXT, STRATUM, baseline_config, kv_pool_tokens_for_share, \
    long_context_config
from serving.servicer import StratumServicer
from serving.translate import Limits, Translator
from stratum_jax.config import RuntimeConfig
from stratum_jax.metrics import ServingMetrics
from stratum_jax.request import SamplingParams

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Stratum"].full_name   # "stratum.v1.Stratum"
_TRANSPORT_FACTOR = 4    # gRPC's receive limit, as a multiple of --max-message-bytes
_CALIBRATION_DECODE_TOKENS = 4   # tokens each calibration prompt generates: a few decode steps to time
# Timed calibration prompts at most: a step the engine could not time (it finished before the host looked: 0 s)
# measures nothing, which on a loaded host can happen to all of one prompt's steps, so calibration runs prompts
# until it has both a prefill rate and a decode step time.
_CALIBRATION_PROMPTS = 8
_LAST_STREAMS_S = 10.0   # after the grace period: time for cancelled streams to send their status


class StratumServer:
    """One served model behind one gRPC server (plus its Prometheus endpoint)."""

    def __init__(self, config: RuntimeConfig, options: ServerOptions, engine=None) -> None:
        self.config = config
        self.options = options
        self._engine = engine            # None: built from config at start-up
        self._device_peaks: DevicePeaks | None = None   # measured at start-up (_load_blocking)
        self.metrics = ServingMetrics()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self.http_port: int | None = None
        self.frontend = Frontend(self.metrics, max_message_bytes=options.max_message_bytes, prices=options.prices)
        self.servicer: StratumServicer | None = None
        self.runner: EngineRunner | None = None     # the Stratum stack's
        self.runners: list[EngineRunner] = []       # every pool's, the Stratum stack's first
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._metrics_httpd = None
        self._http = None                # serving.http.HttpServer, with --http-port
        self._profiler_started = False
        self._drained: asyncio.Event | None = None
        self._dmlp_tuner = None          # the online DMLP fine-tuner, while it runs

    # ---- start-up ----

    async def start(self, load: bool = True) -> None:
        """Opens the port, then (when `load`) loads and warms the model; returns once it is SERVING."""
        opts = self.options
        if not opts.is_loopback and opts.keys_file is None:
            log.warning("binding %s without --keys-file: anyone who can reach it can use it",
                        opts.host if opts.http_port < 0 else f"{opts.host} / {opts.http_address}")
        keys = None if opts.keys_file is None else load_keys(opts.keys_file)
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.servicer = StratumServicer(self.frontend, device_info(), opts.prices, opts.profile_dir)
        interceptors = []
        if keys is not None:
            interceptors.append(ApiKeyInterceptor(keys, on_reject=self._on_auth_reject))
        self._server = grpc.aio.server(interceptors=interceptors, options=[
            # The transport takes up to 4x --max-message-bytes so the servicer can enforce the limit
            # itself: count the request and say which flag raises it (gRPC's own refusal is neither
            # counted nor worded). Beyond 4x, gRPC refuses it before any handler runs.
            ("grpc.max_receive_message_length", transport_receive_limit(opts.max_message_bytes)),
            ("grpc.so_reuseport", 0),   # a port in use is an error, not a silent second server
        ])
        pb_grpc.add_StratumServicer_to_server(self.servicer, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                          self._server)
        address = f"[{opts.host}]:{opts.port}" if ":" in opts.host else f"{opts.host}:{opts.port}"
        if opts.tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(pathlib.Path(opts.tls_key).read_bytes(), pathlib.Path(opts.tls_cert).read_bytes())])
            self.port = self._server.add_secure_port(address, credentials)
        else:
            self.port = self._server.add_insecure_port(address)
        await self._server.start()
        if opts.metrics_port >= 0:
            self._metrics_httpd, self.metrics_port = self.metrics.start_http_server(opts.metrics_host,
                                                                                    opts.metrics_port)
        if opts.http_port >= 0:
            self._start_http(keys)
        if opts.profile_port > 0:
            log.warning("profiler server on port %d: jax binds it on every interface", opts.profile_port)
            jax.profiler.start_server(opts.profile_port)
            self._profiler_started = True
        log.info("listening on %s:%d (%s); metrics %s", opts.host, self.port,
                 "TLS" if opts.tls_cert else "plaintext",
                 f"on http://{opts.metrics_host}:{self.metrics_port}/metrics" if self.metrics_port else "off")
        if load:
            await self.load()

    def _start_http(self, keys: tuple[str, ...] | None) -> None:
        from serving.http import HttpServer, OpenAIApp   # starlette and uvicorn only when asked for
        opts = self.options
        tls = (opts.tls_cert, opts.tls_key) if opts.tls_cert else None
        self._http = HttpServer(OpenAIApp(self.frontend, keys, self.metrics.registry), opts.http_address,
                                opts.http_port, tls=tls, shutdown_timeout_s=_LAST_STREAMS_S)
        self._http.start()
        self.http_port = self._http.port
        log.info("OpenAI-compatible HTTP API on %s/v1", self._http.url)

    async def load(self) -> None:
        """Loads and warms the model off the event loop, then turns the server SERVING."""
        served, bandwidth = await asyncio.to_thread(self._load_blocking)
        if self._drained is not None:        # told to stop while loading: never turn SERVING
            await asyncio.to_thread(self._stop_dmlp)
            return
        self.runner = served.runner
        self.runners = [pool.runner for pool in served.pools.values()]
        self.servicer.set_served(served, bandwidth)
        for pool in served.pools.values():
            pool.metrics.hbm_bandwidth.set(bandwidth)
            pool.metrics.set_device_peaks(self._device_peaks)
            pool.runner.engine.mark_serving()       # a compile from here on is on the request path
        for service in ("", SERVICE_NAME):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        for runner in self.runners:
            runner.start()
        log.info("serving %s on %s (%s), memory bandwidth %.1f GB/s, stacks %s", served.model_info.name,
                 self.servicer.device.device, self.servicer.device.platform, bandwidth, ",".join(served.pools))

    def _load_blocking(self) -> tuple[Served, float]:
        engine = self._engine
        if engine is None:
            start = time.perf_counter()
            from stratum_jax.engine import Engine   # the heavy import only when a real model is served
            log.info("loading model %s", self.config.model)
            engine = Engine(self.config)
            log.info("engine ready in %.2f s (engine import, model load, KV cache, set-up; phases above)",
                     time.perf_counter() - start)
        start = time.perf_counter()
        log.info("warming up (compiling the step functions)")
        engine.warmup()
        prefill_rate = cost.PrefillRate(_representative_prefill_tokens(engine.config))
        _calibrate(engine, prefill_rate)
        log.info("warm-up and calibration took %.2f s", time.perf_counter() - start)
        engines = {STRATUM: (engine, prefill_rate)}
        for name, config in self._pool_configs(engine).items():
            from stratum_jax.engine import Engine
            start = time.perf_counter()
            other = Engine(config, model=engine.model)     # the same weights and tokenizer: no second copy
            other.warmup()
            rate = cost.PrefillRate(_representative_prefill_tokens(other.config))
            _calibrate(other, rate)
            log.info("%s pool: scheduler %s, page size %s, cache policy %s, KV %s, %d KV token slots, context %d; "
                     "built, warmed and calibrated in %.2f s", name, other.config.scheduler,
                     other.config.page_size or "adaptive", other.config.cache_policy, other.kv_precision,
                     other.num_slots, other.config.max_context, time.perf_counter() - start)
            engines[name] = (other, rate)
        self._start_dmlp(engine)
        start = time.perf_counter()
        bandwidth = measure_copy_bandwidth_gbps()
        self._device_peaks = peaks = measure_device_peaks(self.config.tensor_parallel)
        log.info("memory bandwidth (copy %.1f GB/s, read %.1f GB/s) and bf16 matmul rate (%.1f TFLOP/s) measured "
                 "in %.2f s", bandwidth, peaks.read_bytes_per_s / 1e9, peaks.matmul_flops_per_s / 1e12,
                 time.perf_counter() - start)
        name = _model_name(self.config.model)
        mc = engine.model_config
        kv_bytes = cost.kv_bytes_per_token(mc)
        resolved = engine.config     # max_context resolved against the model (RuntimeConfig.for_model)
        info = pb.ModelInfo(name=name, dtype=str(self.config.dtype or getattr(mc, "dtype", "")),
                            num_layers=mc.num_layers, hidden_size=mc.hidden_size, num_heads=mc.num_heads,
                            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, vocab_size=mc.vocab_size,
                            max_context=resolved.max_context, max_tokens_cap=resolved.max_tokens_cap,
                            kv_bytes_per_token=kv_bytes)
        pools = {}
        for pool_name, (pool_engine, rate) in engines.items():
            metrics = self.metrics if pool_name == STRATUM else self.metrics.for_stack(pool_name)
            pc = pool_engine.config
            pools[pool_name] = Pool(
                pool_name, EngineRunner(pool_engine, metrics, name=f"stratum-engine-{pool_name}", prefill_rate=rate),
                Translator(pool_engine.tokenizer, Limits(name, pc.max_context, pc.max_tokens_cap)),
                # The pool's own bytes per token: DKVC's deltas and scales on the Stratum stack, bf16 elsewhere.
                pool_engine.stats().kv_bytes_per_token or kv_bytes, metrics)
        opts = self.options
        router = Router(long_context=LONG_CONTEXT in pools, entropy_threshold_bits=opts.route_entropy_bits,
                        long_prompt_tokens=opts.route_long_prompt_tokens, prompt_regex=opts.route_regex,
                        window=opts.route_entropy_window)
        primary = pools[STRATUM]
        return Served(primary.runner, primary.translator, info, kv_bytes, pools=pools, router=router,
                      stratum_weight=opts.stratum_weight), bandwidth

    def _pool_configs(self, engine) -> dict:
        """The RuntimeConfig of each pool besides the Stratum stack's (serving/stacks.py), from the Stratum
        engine's resolved config; the baseline's pool sized by --baseline-kv-pool-tokens or -memory-share."""
        opts, base = self.options, engine.config
        configs = {}
        if BASELINE in opts.stacks:
            tokens = opts.baseline_kv_pool_tokens
            if opts.baseline_kv_memory_share is not None:
                tokens = kv_pool_tokens_for_share(opts.baseline_kv_memory_share, _device_memory_bytes(),
                                                  cost.kv_bytes_per_token(engine.model_config))
            configs[BASELINE] = baseline_config(base, tokens)
        if LONG_CONTEXT in opts.stacks:
            configs[LONG_CONTEXT] = long_context_config(
                base, page_size=opts.long_context_page_size,
                max_context=opts.long_context_max_context or engine.model_config.max_position_embeddings,
                kv_pool_tokens=opts.long_context_kv_pool_tokens)
        return configs

    def _start_dmlp(self, engine) -> None:
        """With --cache-policy dmlp: exports stratum_dmlp_* and starts online fine-tuning (after warm-up,
        so its worker process does not compete with the compiles)."""
        from stratum_jax.dmlp.runtime import export_dmlp_metrics
        policy, tuner = engine.cache_policy, engine.dmlp_tuner
        export_dmlp_metrics(policy, tuner, self.metrics.registry)
        if tuner is not None:
            log.info("starting online DMLP fine-tuning (checkpoints in %s)", tuner.checkpoint_dir)
            tuner.start()
            self._dmlp_tuner = tuner

    def _stop_dmlp(self) -> None:
        """Stops online fine-tuning after its final checkpoint (the engine thread has stopped)."""
        tuner, self._dmlp_tuner = self._dmlp_tuner, None
        if tuner is not None:
            path = tuner.stop()
            log.info("online DMLP fine-tuning stopped (%d updates); final checkpoint %s", tuner.updates, path)

    def _on_auth_reject(self, method: str) -> None:
        if method == MESSAGES_METHOD:     # refused before any routing: the router's series
            self.frontend.router_metrics.request_ended("unauthenticated")

    # ---- shutdown ----

    async def drain(self, grace_s: float | None = None) -> None:
        """Stops taking requests, lets in-flight ones finish within the grace period, then shuts down."""
        if self._drained is not None:        # a second SIGTERM (or stop) waits for the first drain
            await self._drained.wait()
            return
        self._drained = asyncio.Event()
        grace = self.options.drain_grace_s if grace_s is None else grace_s
        frontend = self.frontend
        log.info("draining: %d requests in flight, grace %.1f s", len(frontend.active), grace)
        frontend.state = DRAINING
        await self._health.enter_graceful_shutdown()
        for runner in self.runners:
            runner.close("the server is draining")
        try:
            await asyncio.wait_for(frontend.idle.wait(), grace)
        except TimeoutError:
            log.info("grace period over: cancelling %d requests", len(frontend.active))
            frontend.shutdown_streams()
            try:
                await asyncio.wait_for(frontend.idle.wait(), _LAST_STREAMS_S)
            except TimeoutError:
                log.warning("%d streams did not end after cancellation", len(frontend.active))
        await self._server.stop(grace=1.0)
        if self._http is not None:
            await self._http.stop()
            self._http = None
        for runner in self.runners:
            await asyncio.to_thread(runner.stop)
        await asyncio.to_thread(self._stop_dmlp)
        self._stop_side_servers()
        self._drained.set()
        log.info("drained")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()

    def _stop_side_servers(self) -> None:
        if self._metrics_httpd is not None:
            self._metrics_httpd.shutdown()
            self._metrics_httpd.server_close()
            self._metrics_httpd = None
        if self._profiler_started:
            jax.profiler.stop_server()
            self._profiler_started = False


def _device_memory_bytes() -> int:
    """The first device's memory (bytes), for --baseline-kv-memory-share; ValueError where it is unknown."""
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ValueError("--baseline-kv-memory-share needs a device that reports its memory (a GPU); this one "
                         "does not: size the baseline's pool with --baseline-kv-pool-tokens instead")
    return int(limit)


def transport_receive_limit(max_message_bytes: int) -> int:
    """gRPC's receive limit for a server whose servicer enforces `max_message_bytes` (see start())."""
    return min(_TRANSPORT_FACTOR * max_message_bytes, 2**31 - 1)


def _model_name(model: str) -> str:
    """The name clients send in `model`: the preset, or the checkpoint directory's name."""
    return pathlib.Path(model).name if ("/" in model or pathlib.Path(model).is_dir()) else model


def _representative_prefill_tokens(config: RuntimeConfig) -> int:
    """The smallest prefill step the cost model learns its rate from: 64 tokens, or less when the prefill
    chunk or half the context is smaller (a step never holds more)."""
    return min(cost.REPRESENTATIVE_PREFILL_TOKENS, config.prefill_chunk, config.max_context // 2)


def _calibrate(engine, rate: cost.PrefillRate) -> None:
    """Gives the cost model a representative prefill rate (and a decode step time) before serving.

    Warm-up only compiles, so nothing says yet how fast prompts prefill. Prompts of one representative
    length run here: the first warms the device, the next are timed (their steps are fed to `rate`) until
    both a prefill rate and a decode step time are measured (_CALIBRATION_PROMPTS at most). They differ, so
    the prefix cache does not skip a later one's prefill. Each also decodes a few tokens, so
    the engine has a decode step time too: a stack that takes no traffic yet (the Stratum stack at
    --stratum-weight 0) can still be priced by CostEstimate.
    """
    config = engine.config
    length = max(rate.min_tokens, min(config.prefill_chunk, config.max_context // 2))
    vocab = min(engine.tokenizer.vocab_size, engine.model_config.vocab_size)
    for offset in range(1 + _CALIBRATION_PROMPTS):
        observe = offset > 0
        if observe and rate.tokens_per_s > 0 and engine.stats().decode_step_ms > 0:
            break
        ids = [(offset + 7 * i) % vocab for i in range(length)]
        engine.add_request(ids, SamplingParams(max_tokens=_CALIBRATION_DECODE_TOKENS, temperature=0.0,
                                               ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            if observe:
                rate.observe(engine.last_step)
    if rate.tokens_per_s <= 0:
        log.warning("calibration saw no prefill step of >= %d tokens: CostEstimate answers FAILED_PRECONDITION "
                    "until a request brings one", rate.min_tokens)
