"""Serving under real traffic: replays a window of the Mooncake trace against a server over real gRPC.

    # the GPU run (one server per config, each replaying the window at 1x, 2x, 4x and 8x its recorded rate)
    python benchmarks/serving.py --model llama-1b --window-start 0 --num-requests 500 \\
        --length-scale 0.25 --max-context 8192 --rates 1,2,4,8 \\
        --server-args "--max-context 8192 --max-queue 2048" \\
        --configs "hab=--scheduler hab;fcfs=--scheduler fcfs" --out-prefix serving_llama-1b_h200

    # the CPU smoke run (the tiny preset; two configs with no extra flags; ~5 min on 2 cores)
    JAX_PLATFORMS=cpu python benchmarks/serving.py --model tiny --window-start 25 --num-requests 6 \\
        --length-scale 0.01 --rates 1,2 --configs "a=;b=" --warmup-requests 2 --out-prefix serving_tiny_cpu_smoke

    python benchmarks/serving.py --replot benchmarks/results/serving_tiny_cpu_smoke.json   # PNG only

    # --http: the same replay over the OpenAI-compatible HTTP API (streamed chat completions with
    # stream_options.include_usage, through the `openai` SDK), the servers started with --http-port 0
    python benchmarks/serving.py --http --model tiny ... --out-prefix serving_tiny_http

For each config of `--configs` (NAME=EXTRA SERVER FLAGS, `;`-separated) it starts its own server as a
subprocess (`python -m stratum_jax.serve --model M --host 127.0.0.1 --port 0 --metrics-port 0
<--server-args> <extra flags>`), reads the ports it logs, waits for grpc.health.v1 SERVING, asks Health
for the device, then replays the window once per rate and stops the server (SIGTERM, bounded wait).
With --http the requests go over HTTP instead (CountTokens, Health and GetMetrics stay on gRPC: the same
server answers both); each chunk's tokens are counted through the `return_token_ids` extension, so the
figures mean the same as gRPC's, and the server-side timings (queue_ms, server TTFT) are not available.

The workload. Request i of the window arrives at (timestamp_i - timestamp_first + u_i * slot) / rate. The
shared trace stamps its requests in 3 s slots (1,180 distinct timestamps for 12,031 requests, consecutive ones
2,997-3,003 ms apart; `trace_slot_ms`), so a timestamp says in which slot a request came, not when within it.
`--arrivals slot` (the default) draws u_i uniform in [0, 1) from the rate's salt and the trace line: given each
slot's count, that is where a Poisson process puts its arrivals. `--arrivals burst` (u_i = 0, the replay before
2026-12-01) sends a slot's requests, up to 28 of them, at one instant. Its prompt is
built from its `hash_ids`: each id is one block of text, the same text wherever the id appears (so
requests that share leading ids share a prompt prefix, as in the trace), with the last block cut so the
chat-templated prompt has round(input_length * length_scale) tokens; max_tokens is
round(output_length * length_scale). A block is ceil(512 * length_scale) tokens (the trace's blocks are
512 tokens; `--block-tokens` overrides), so scaling keeps the share of shared prefix. Tokens are
converted to text bytes with a ratio measured once per server through CountTokens (1.0 for the byte-level
tokenizer of the presets, exactly), and the chat template's own tokens are subtracted. Lengths are then
clipped to the context (`--max-context`, default the server's, less `--context-margin`) and to the
server's max_tokens cap; the number clipped is reported. Every rate uses fresh block text (a salt per
rate) so one rate's prefix cache does not serve the next; the sharing within a rate is the trace's.
Sampling is greedy; a model may still end a reply before max_tokens (stop reasons are reported).

Measured per config and rate, client-side, with TTFT counted from the request's scheduled arrival (so a
wait for `--max-concurrency` counts, as it would for a user):
    TTFT, TPOT ((last token - first token) / (tokens - 1)), ITL (gaps between streamed deltas), E2E at
    p50/p95/p99; input and output tokens/s over the rate's duration (first arrival to last reply);
    goodput (requests finished with TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms, per second);
    requests finished / failed (by gRPC status); how late the client sent (send lag: if its p99 is large
    the client, not the server, was the bottleneck).
From the server's Prometheus endpoint: `stratum_jit_compilations_total` before/after (null if the server
has no such metric), the `stratum_gpu_idle_ms` histogram (bucket diff), and `stratum_gpu_idle_fraction`,
`stratum_queue_length` and `stratum_running_requests` sampled every --poll-s during the replay.

Writes benchmarks/results/<out-prefix>.json (per-request rows, columnar), <out-prefix>.tokens.json.gz
(each request's delta arrival times, ms after its scheduled arrival) and <out-prefix>.png (goodput and
P95 TTFT against rate, one line per config; skipped with a message when matplotlib is missing), and
prints a table. Bounds: --request-timeout per request, --run-timeout for the whole invocation (rates not
reached are recorded as skipped), --max-concurrency streams at once. Loopback only.

This file holds the server process, the replay and the command line; beside it: serving_trace.py (the trace,
arrivals and prompts), serving_stats.py (per-request results and their statistics), serving_prometheus.py (the
metrics endpoint and its poller) and serving_report.py (the table, the comparison, the PNG).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime
import functools
import gzip
import json
import math
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

# This file is named serving.py, like the `serving` package it imports: drop its own directory from the
# import path (python puts it first when the file is run as a script) so `serving` means the package.
_HERE = pathlib.Path(__file__).resolve().parent
REPO = _HERE.parent
sys.path[:] = [p for p in sys.path if pathlib.Path(p or os.getcwd()).resolve() != _HERE]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

# The replay's pure parts, one concern a file (this one keeps the server process, the replay and the command line).
from benchmarks.serving_prometheus import Poller, counter_total, histogram, scrape  # noqa: E402
from benchmarks.serving_report import git_commit, compare_at_fcfs_capacity, plot, print_table  # noqa: E402
from benchmarks.serving_stats import RequestResult, histogram_diff, summarize  # noqa: E402
from benchmarks.serving_trace import (Shape, TraceRequest, arrival_offsets, block_text, load_trace,  # noqa: E402
                                      prompt_for, trace_slot_ms)

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
RESULTS = REPO / "benchmarks" / "results"
TRACE_BLOCK_TOKENS = 512          # one hash id per 512-token block in the Mooncake release
SERVICE = "stratum.v1.Stratum"
_LISTENING = re.compile(r"listening on (\S+):(\d+) \(.*?\); metrics (?:on http://(\S+?):(\d+)/metrics|off)")
_HTTP_LISTENING = re.compile(r"HTTP API on (\S+)/v1")
_OWN_FLAGS = ("--host", "--port", "--metrics-port", "--metrics-host", "--model", "--keys-file", "--tls-cert",
              "--tls-key", "--http-port", "--http-host")
_HTTP_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}   # as gRPC names them (no stop sequences sent)


# ---------------------------------------------------------------- the server

class ServerProcess:
    """`python -m stratum_jax.serve` on loopback with free ports; its log goes to log_path."""

    def __init__(self, model: str, flags: list[str], log_path: pathlib.Path, http: bool = False) -> None:
        self.cmd = [sys.executable, "-m", "stratum_jax.serve", "--model", model, "--host", "127.0.0.1",
                    "--port", "0", "--metrics-port", "0", *(["--http-port", "0"] if http else []), *flags]
        self.log_path = log_path
        self.target: str | None = None
        self.http_url: str | None = None      # e.g. http://127.0.0.1:PORT, with --http
        self.metrics_url: str | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self._reader = None
        self._ports = asyncio.Event()
        self.tail: collections.deque[str] = collections.deque(maxlen=40)

    async def _read_log(self) -> None:
        with open(self.log_path, "w") as log:
            async for raw in self.proc.stderr:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                self.tail.append(line.rstrip())
                if (h := _HTTP_LISTENING.search(line)) is not None:
                    self.http_url = h.group(1)      # logged before the gRPC line that sets _ports
                m = _LISTENING.search(line)
                if m and not self._ports.is_set():
                    self.target = f"{m.group(1)}:{m.group(2)}"
                    self.metrics_url = f"http://{m.group(3)}:{m.group(4)}/metrics" if m.group(3) else None
                    self._ports.set()

    async def start(self, timeout_s: float) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        self.proc = await asyncio.create_subprocess_exec(*self.cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._reader = asyncio.create_task(self._read_log())
        deadline = time.monotonic() + timeout_s
        exited = asyncio.create_task(self.proc.wait())
        try:
            ports = asyncio.create_task(self._ports.wait())
            await asyncio.wait({ports, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not self._ports.is_set():
                ports.cancel()
                raise RuntimeError(self._why("did not log its ports"))
            await self._wait_serving(deadline, exited)
        except BaseException:
            await self.stop()
            raise
        finally:
            exited.cancel()

    async def _wait_serving(self, deadline: float, exited) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                if exited.done():
                    raise RuntimeError(self._why("exited while loading"))
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(self._why("was not SERVING before the start timeout"))
                await asyncio.sleep(0.5)

    def _why(self, what: str) -> str:
        code = self.proc.returncode if self.proc else None
        tail = "\n".join(list(self.tail)[-15:])
        return f"the server {what} (exit status {code}; log {self.log_path}):\n{tail}"

    async def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within timeout_s; returns its exit status."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout_s)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        return self.proc.returncode


# ---------------------------------------------------------------- the replay

@dataclasses.dataclass
class Planned:
    result: RequestResult
    text: str


def plan(window: list[TraceRequest], shape: Shape, rate: float, salt: str,
         slot_ms: float = 0.0) -> tuple[list[Planned], int]:
    """The requests of one rate in arrival order, and how many were clipped to the context. slot_ms > 0
    spreads each request over its timestamp's slot (arrival_offsets)."""
    offsets = arrival_offsets([r.timestamp_ms for r in window], rate, slot_ms=slot_ms,
                              keys=[r.index for r in window], salt=salt)
    out, clipped = [], 0
    for r, at in sorted(zip(window, offsets), key=lambda p: (p[1], p[0].index)):
        text, n_in, n_out, c = prompt_for(r, shape, salt)
        clipped += c
        out.append(Planned(RequestResult(r.index, at, n_in, n_out), text))
    return out, clipped


async def one_request(stub, pb, p: Planned, t0: float, timeout_s: float, sem: asyncio.Semaphore) -> None:
    """Sends one planned request when its turn comes and fills in p.result (also when cancelled)."""
    import grpc
    r = p.result
    request = pb.MessagesRequest(messages=[pb.Message(role="user", content=p.text)], max_tokens=r.target_out,
                                 temperature=0.0)
    call = None
    try:
        async with sem:
            arrival = t0 + r.arrival_s
            r.send_lag_s = time.perf_counter() - arrival
            r.status = "NO_STOP_EVENT"
            call = stub.Messages(request, timeout=timeout_s)
            async for event in call:
                kind = event.WhichOneof("event")
                if kind == "delta" and event.delta.token_ids:
                    r.token_times.append(time.perf_counter() - arrival)
                    r.output_tokens += len(event.delta.token_ids)
                elif kind == "start":
                    r.prompt_tokens = event.start.prompt_tokens
                elif kind == "stop":
                    s = event.stop
                    r.stop_reason = pb.StopReason.Name(s.stop_reason).lower()
                    r.cached_tokens = s.usage.cached_input_tokens
                    r.server_queue_ms, r.server_ttft_ms = s.timings.queue_ms, s.timings.ttft_ms
                    r.stack = s.stack or None
                    r.metered_usd = s.metered.cost_usd if s.HasField("metered") else None
                    r.metered = breakdown_rates(s.metered) if s.HasField("metered") else None
                    r.status = "OK"
    except grpc.aio.AioRpcError as e:
        r.status = e.code().name
    except asyncio.CancelledError:
        # The rate's time bound passed: the script cancels what still runs and records it as such.
        if call is not None:
            call.cancel()
        r.status = "CANCELLED_AT_END" if r.send_lag_s is not None else "NOT_SENT"


async def one_request_http(client, p: Planned, t0: float, timeout_s: float, sem: asyncio.Semaphore) -> None:
    """one_request over the OpenAI-compatible HTTP API: a streamed chat completion with the usage chunk."""
    import openai
    r = p.result
    try:
        async with sem:
            arrival = t0 + r.arrival_s
            r.send_lag_s = time.perf_counter() - arrival
            r.status = "NO_STOP_EVENT"
            stream = await client.chat.completions.create(
                model="", messages=[{"role": "user", "content": p.text}], max_tokens=r.target_out, temperature=0,
                stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
                timeout=timeout_s)
            async with stream:      # closes the connection (the server cancels) on any exit
                async for chunk in stream:
                    for choice in chunk.choices:
                        ids = (choice.model_extra or {}).get("token_ids") or ()
                        if ids:
                            r.token_times.append(time.perf_counter() - arrival)
                            r.output_tokens += len(ids)
                        if choice.finish_reason:
                            r.stop_reason = _HTTP_STOP_REASONS.get(choice.finish_reason, choice.finish_reason)
                    if chunk.usage is not None:
                        r.prompt_tokens = chunk.usage.prompt_tokens
                        details = chunk.usage.prompt_tokens_details
                        r.cached_tokens = details.cached_tokens if details is not None else None
                        r.status = "OK"
    except openai.APIStatusError as e:
        r.status = f"HTTP_{e.status_code}"
    except openai.APIError as e:            # a connection error, or an error event mid-stream
        r.status = type(e).__name__
    except asyncio.CancelledError:
        r.status = "CANCELLED_AT_END" if r.send_lag_s is not None else "NOT_SENT"


async def replay(send, planned: list[Planned], args, deadline: float) -> float:
    """Sends every planned request at its arrival time; returns the rate's start (perf_counter)."""
    sem = asyncio.Semaphore(args.max_concurrency)
    t0 = time.perf_counter() + 0.1
    tasks = []
    for p in planned:
        delay = t0 + p.result.arrival_s - time.perf_counter()
        if t0 + p.result.arrival_s > deadline:
            break                                   # the rest stay NOT_SENT
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(p, t0, args.request_timeout, sem)))
    if tasks:
        bound = min(deadline, t0 + planned[-1].result.arrival_s + args.request_timeout + 5.0)
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, bound - time.perf_counter()))
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return t0


async def wait_idle(stub, pb, timeout_s: float) -> bool:
    """Waits until the server has nothing queued, running or in flight; False if it did not within timeout_s."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        s = await stub.GetMetrics(pb.GetMetricsRequest(), timeout=10)
        stacks = list(s.stacks) or [s]      # every stack's engine (a server from before `stacks`: the one)
        if s.in_flight == 0 and all(x.running == 0 and x.queued == 0 for x in stacks):
            return True
        await asyncio.sleep(0.2)
    return False


async def calibrate(stub, pb) -> dict:
    """Template tokens and text bytes per token, from CountTokens on an empty and a long message."""
    async def count(text: str) -> int:
        r = await stub.CountTokens(pb.CountTokensRequest(messages=[pb.Message(role="user", content=text)]),
                                   timeout=30)
        return r.input_tokens
    sample = "".join(block_text("calibration", h, 512) for h in range(8))
    empty, full = await count(""), await count(sample)
    if full <= empty:
        raise RuntimeError(f"CountTokens gave {full} tokens for {len(sample)} bytes and {empty} for none")
    return {"template_tokens": empty, "sample_bytes": len(sample), "sample_tokens": full - empty,
            "bytes_per_token": len(sample) / (full - empty)}


# ---------------------------------------------------------------- one config

async def run_config(name: str, flags: list[str], window, args, deadline: float, out: dict) -> None:
    """Starts the config's server, replays every rate, stops it; fills out (the config's JSON entry)."""
    import grpc

    from serving.proto.stratum.v1 import stratum_pb2 as pb
    from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc

    log_dir = pathlib.Path(args.server_log_dir or tempfile.mkdtemp(prefix="serving-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.model, flags, log_dir / f"{args.out_prefix}_{name}.server.log", http=args.http)
    out.update(name=name, server_flags=flags, server_command=shlex.join(server.cmd), server_log=str(server.log_path),
               transport="http" if args.http else "grpc", rates={})
    started = time.monotonic()
    try:
        await server.start(min(args.start_timeout, max(1.0, deadline - time.perf_counter())))
    except RuntimeError as e:
        out["error"] = str(e)
        print(f"[{name}] {e}", file=sys.stderr)
        return
    out["server_start_s"] = round(time.monotonic() - started, 1)
    try:
        async with grpc.aio.insecure_channel(server.target) as channel, _http_client(server, args) as client:
            stub = pb_grpc.StratumStub(channel)
            if args.http:
                if server.http_url is None:
                    raise RuntimeError("the server did not log its HTTP address")
                send = functools.partial(one_request_http, client)
            else:
                send = functools.partial(one_request, stub, pb)
            h = await stub.Health(pb.HealthRequest(), timeout=30)
            out["health"] = {"device": h.device, "platform": h.platform, "cuda_version": h.cuda_version,
                             "jax_version": h.jax_version, "version": h.version,
                             "hbm_bandwidth_gbps": round(h.hbm_bandwidth_gbps, 1), "model": h.model.name,
                             "dtype": h.model.dtype, "max_context": h.model.max_context,
                             "max_tokens_cap": h.model.max_tokens_cap}
            cal = await calibrate(stub, pb)
            out["calibration"] = cal
            context = min(args.max_context or h.model.max_context, h.model.max_context) - args.context_margin
            shape = Shape(args.length_scale, args.block_tokens or math.ceil(TRACE_BLOCK_TOKENS * args.length_scale),
                          cal["bytes_per_token"], cal["template_tokens"], context, h.model.max_tokens_cap)
            if context <= shape.template_tokens + 1:
                raise RuntimeError(f"a context of {context} tokens leaves no room for a prompt: raise --max-context")
            out["shape"] = dataclasses.asdict(shape)
            print(f"[{name}] serving on {server.target} ({h.device}, {h.platform}); started in "
                  f"{out['server_start_s']} s", file=sys.stderr)
            if args.warmup_requests:
                out["warmup"] = await warmup(send, stub, pb, window, shape, args, server.metrics_url, deadline)
            for i, rate in enumerate(args.rates):
                if time.perf_counter() >= deadline:
                    out["rates"][str(rate)] = {"skipped": "the --run-timeout passed"}
                    continue
                out["rates"][str(rate)] = await run_rate(send, stub, pb, window, shape, rate, f"rate{i}", args,
                                                         server.metrics_url, deadline)
    except (RuntimeError, grpc.aio.AioRpcError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        print(f"[{name}] {out['error']}", file=sys.stderr)
    finally:
        out["server_exit_status"] = await server.stop(args.stop_timeout)


@contextlib.asynccontextmanager
async def _http_client(server: ServerProcess, args):
    """An AsyncOpenAI client on the server's HTTP API with --http (else None). No retries: a refused
    request is a result. The connection pool is as large as the concurrency, so none waits for a socket."""
    if not args.http:
        yield None
        return
    import httpx2 as httpx
    import openai
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)
    client = openai.AsyncOpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                                http_client=openai.DefaultAsyncHttpxClient(limits=limits))
    try:
        yield client
    finally:
        await client.close()


async def warmup(send, stub, pb, window, shape, args, metrics_url, deadline) -> dict:
    """The first --warmup-requests of the window, all at once, with their own text; not measured."""
    planned, _ = plan(window[: args.warmup_requests], shape, 1e9, "warmup")
    before = await scrape(metrics_url)
    t = time.perf_counter()
    await replay(send, planned, args, deadline)
    await wait_idle(stub, pb, args.request_timeout)
    after = await scrape(metrics_url)
    return {"requests": len(planned), "finished": sum(p.result.ok for p in planned),
            "seconds": round(time.perf_counter() - t, 2),
            "jit_compilations": _delta(counter_total(before, "stratum_jit_compilations_total"),
                                       counter_total(after, "stratum_jit_compilations_total"))}


def _delta(a, b):
    return None if a is None or b is None else b - a


async def run_rate(send, stub, pb, window, shape, rate, salt, args, metrics_url, deadline) -> dict:
    planned, clipped = plan(window, shape, rate, salt, args.arrival_slot_ms)
    idle_before = await wait_idle(stub, pb, args.request_timeout)
    before = await scrape(metrics_url)
    poller = Poller(metrics_url, args.poll_s)
    poller.start(time.perf_counter())
    await replay(send, planned, args, deadline)
    samples = await poller.stop()
    idle_after = await wait_idle(stub, pb, args.request_timeout)
    after = await scrape(metrics_url)
    results = [p.result for p in planned]
    ends = [r.arrival_s + r.e2e_s for r in results if r.e2e_s is not None]
    duration = max([planned[-1].result.arrival_s, *ends, 1e-3])
    s = summarize(results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
    ttft, tpot = s["ttft_ms"] or {}, s["tpot_ms"] or {}
    print(f"  rate {rate}x: {s['finished']}/{s['requests']} finished, TTFT p95 {ttft.get('p95')} ms, "
          f"TPOT p95 {tpot.get('p95')} ms, goodput {s['goodput_rps']} req/s", file=sys.stderr)
    s.update(
        rate=rate, salt=salt, arrival_slot_ms=args.arrival_slot_ms, offered_rps=round(len(planned) / max(planned[-1].result.arrival_s, 1e-3), 4),
        window_span_s=round(planned[-1].result.arrival_s, 3), clipped_to_context=clipped,
        server_idle_before=idle_before, server_idle_after=idle_after,
        jit_compilations=_delta(counter_total(before, "stratum_jit_compilations_total"),
                                counter_total(after, "stratum_jit_compilations_total")),
        # Every compile since the server reported SERVING (absolute; should stay 0).
        jit_compilations_after_serving=counter_total(after, "stratum_jit_compilations_after_serving_total"),
        hab_triggers=_delta(counter_total(before, "stratum_hab_triggers_total"),
                            counter_total(after, "stratum_hab_triggers_total")),
        gpu_idle_ms_histogram=histogram_diff(histogram(before, "stratum_gpu_idle_ms"),
                                             histogram(after, "stratum_gpu_idle_ms")),
        preemptions=_delta(counter_total(before, "stratum_preemptions_total"),
                           counter_total(after, "stratum_preemptions_total")),
        metric_samples=samples, per_request=per_request_table(results))
    s["cost"] = await cost_figures(stub, pb, planned, args.cost_samples)
    s["_token_times"] = [[round(t * 1e3, 2) for t in r.token_times] for r in results]
    return s


BREAKDOWN_RATES = ("cost_usd", "compute_seconds", "estimated_compute_seconds", "decode_step_ms",
                   "prefill_tokens_per_s", "decode_batch", "prefill_batch", "billed_input_tokens",
                   "billed_output_tokens")


def breakdown_rates(b) -> dict:
    """A CostBreakdown's cost, device seconds, the rates it was priced at and the tokens it billed."""
    return {k: round(float(getattr(b, k)), 9) for k in BREAKDOWN_RATES}


async def cost_figures(stub, pb, planned: list[Planned], samples: int) -> dict | None:
    """CostEstimate after the rate, for the first `samples` finished requests (their own prompts and
    max_tokens, with each stack's step times as measured at the end of the rate): per stack, the estimated
    USD per 1,000 output tokens; and for each request against its own stack's estimate, the metered usage's
    error (metered - estimated) / estimated, with both breakdowns' rates side by side (`per_request`: which
    term makes a gap). None when the server has no per-stack CostEstimate."""
    import grpc
    done = [p for p in planned if p.result.ok and p.result.metered_usd is not None][:samples]
    if not done:
        return None
    usd, tokens, errors, pairs = collections.defaultdict(float), 0, [], []
    for p in done:
        request = pb.CostEstimateRequest(messages=[pb.Message(role="user", content=p.text)],
                                         max_tokens=p.result.target_out)
        try:
            r = await stub.CostEstimate(request, timeout=30)
        except grpc.aio.AioRpcError as e:
            return {"error": f"{e.code().name}: {e.details()}"}
        tokens += request.max_tokens
        for b in r.stacks:
            usd[b.stack] += b.cost_usd
            if b.stack == p.result.stack:
                errors.append((p.result.metered_usd - b.cost_usd) / b.cost_usd)
                pairs.append({"index": p.result.index, "stack": b.stack, "metered": p.result.metered,
                              "estimated": breakdown_rates(b)})
    return {"requests": len(done),
            "estimated_usd_per_1k_output_tokens": {k: round(1e3 * v / tokens, 9) for k, v in usd.items()},
            "metered_vs_estimated": {"mean": round(float(np.mean(errors)), 5),
                                     "mean_abs": round(float(np.mean(np.abs(errors))), 5)} if errors else None,
            "per_request": pairs}


REQUEST_FIELDS = ("index", "arrival_s", "status", "send_lag_ms", "target_in", "target_out", "prompt_tokens",
                  "cached_tokens", "output_tokens", "stop_reason", "ttft_ms", "tpot_ms", "e2e_ms",
                  "server_queue_ms", "server_ttft_ms", "stack", "metered_usd", "metered_compute_s",
                  "metered_decode_batch", "metered_prefill_batch")


def per_request_table(results: list[RequestResult]) -> dict:
    def ms(x):
        return None if x is None else round(x * 1e3, 2)
    rows = [[r.index, round(r.arrival_s, 4), r.status, ms(r.send_lag_s), r.target_in, r.target_out,
             r.prompt_tokens, r.cached_tokens, r.output_tokens, r.stop_reason, ms(r.ttft_s), ms(r.tpot_s),
             ms(r.e2e_s), None if r.server_queue_ms is None else round(r.server_queue_ms, 2),
             None if r.server_ttft_ms is None else round(r.server_ttft_ms, 2), r.stack, r.metered_usd,
             *((r.metered["compute_seconds"], r.metered["decode_batch"], r.metered["prefill_batch"]) if r.metered
               else (None, None, None))] for r in results]
    return {"fields": list(REQUEST_FIELDS), "rows": rows}


# ---------------------------------------------------------------- command line

def parse_configs(text: str) -> list[tuple[str, list[str]]]:
    """'hab=--scheduler hab;fcfs=--scheduler fcfs' -> [("hab", ["--scheduler", "hab"]), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, flags = part.partition("=")
        name = name.strip()
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise ValueError(f"--configs: {part!r} is not NAME=FLAGS (a name of letters, digits, _ . -)")
        out.append((name, shlex.split(flags)))
    names = [n for n, _ in out]
    if not out or len(set(names)) != len(names):
        raise ValueError(f"--configs needs at least one NAME=FLAGS and distinct names, got {names}")
    return out


def check_server_flags(flags: list[str]) -> None:
    for f in flags:
        if f.split("=", 1)[0] in _OWN_FLAGS:
            raise ValueError(f"server flag {f}: this script sets the model, loopback host and free ports itself "
                             f"(and sends no API key or TLS); leave {', '.join(_OWN_FLAGS)} out")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--model", default="tiny", help="--model of the servers (a preset or a checkpoint directory)")
    p.add_argument("--trace", type=pathlib.Path, default=TRACE)
    p.add_argument("--window-start", type=int, default=0, help="first trace line replayed (0-based)")
    p.add_argument("--num-requests", type=int, default=200)
    p.add_argument("--rates", default="1,2,4,8", help="time compressions of the recorded arrivals")
    p.add_argument("--arrivals", choices=("slot", "burst"), default="slot",
                   help="slot: each request at a uniform offset within the trace's timestamp slot (a Poisson "
                        "process given each slot's count; seeded per rate); burst: every request of a timestamp "
                        "at the same instant (the replay before 2026-12-01)")
    p.add_argument("--arrival-slot-ms", type=float, default=0.0,
                   help="with --arrivals slot: the slot width (default: the window's median gap between distinct "
                        "timestamps, 3000 for the shared trace)")
    p.add_argument("--length-scale", type=float, default=1.0, help="multiplies input and output lengths")
    p.add_argument("--block-tokens", type=int, default=0,
                   help="tokens per hash-id block (default ceil(512 * --length-scale))")
    p.add_argument("--max-context", type=int, default=0,
                   help="clip prompt + max_tokens to this (default, and at most, the server's --max-context)")
    p.add_argument("--context-margin", type=int, default=0,
                   help="tokens kept free below the context, for tokenizers where text and tokens do not add up")
    p.add_argument("--configs", default="default=", help="NAME=EXTRA SERVER FLAGS;... one server each, in order")
    p.add_argument("--server-args", default="", help="flags every server gets (before the config's)")
    p.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=50.0)
    p.add_argument("--http", action="store_true",
                   help="replay over the OpenAI-compatible HTTP API (--http-port 0) instead of gRPC Messages")
    p.add_argument("--max-concurrency", type=int, default=512, help="streams open at once (later arrivals wait)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline of each request (s)")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="bound on the whole invocation (s)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="bound on a server's load + warm-up (s)")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="after SIGTERM, SIGKILL past this (s)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="send this many requests (own text, all at once) before the first rate, unmeasured")
    p.add_argument("--poll-s", type=float, default=0.5, help="period of the /metrics samples")
    p.add_argument("--out-prefix", default="serving", help="file names under benchmarks/results/")
    p.add_argument("--compare-baseline", default="fcfs",
                   help="the config the others' goodput is compared with, at its capacity (e.g. w0 for a "
                        "--stratum-weight 0 config of a two-stack server)")
    p.add_argument("--cost-samples", type=int, default=16,
                   help="finished requests per rate priced with CostEstimate after the rate (0 = none)")
    p.add_argument("--server-log-dir", default=None, help="where server logs go (default: a temporary directory)")
    p.add_argument("--replot", type=pathlib.Path, metavar="JSON", help="only redraw the PNG of a result file")
    return p


def validate(args, parser) -> None:
    try:
        args.rates = [float(r) for r in args.rates.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rates: give numbers separated by commas, e.g. 1,2,4,8; got {args.rates!r}")
    if not args.rates or any(r <= 0 for r in args.rates):
        parser.error("--rates must be positive numbers")
    args.rates = [int(r) if r.is_integer() else r for r in args.rates]
    bounds = [("length_scale", 0 < args.length_scale <= 4), ("num_requests", 1 <= args.num_requests <= 100_000),
              ("window_start", args.window_start >= 0), ("block_tokens", args.block_tokens >= 0),
              ("max_context", args.max_context >= 0), ("context_margin", args.context_margin >= 0),
              ("max_concurrency", 1 <= args.max_concurrency <= 10_000),
              ("request_timeout", 0 < args.request_timeout <= 3600), ("run_timeout", 0 < args.run_timeout <= 86_400),
              ("start_timeout", args.start_timeout > 0), ("stop_timeout", args.stop_timeout > 0),
              ("poll_s", 0.05 <= args.poll_s <= 60), ("slo_ttft_ms", args.slo_ttft_ms > 0),
              ("slo_tpot_ms", args.slo_tpot_ms > 0),
              ("warmup_requests", 0 <= args.warmup_requests <= args.num_requests),
              ("arrival_slot_ms", 0 <= args.arrival_slot_ms <= 3_600_000)]
    for name, ok in bounds:
        if not ok:
            parser.error(f"--{name.replace('_', '-')} is out of range: {getattr(args, name)} (see --help)")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", args.out_prefix):
        parser.error(f"--out-prefix {args.out_prefix!r}: use letters, digits, _ . - (it names files)")
    try:
        args.config_list = parse_configs(args.configs)
        args.common_flags = shlex.split(args.server_args)
        for flags in [args.common_flags] + [f for _, f in args.config_list]:
            check_server_flags(flags)
    except ValueError as e:
        parser.error(str(e))


async def run_all(args, window) -> list[dict]:
    deadline = time.perf_counter() + args.run_timeout
    configs = []
    for name, flags in args.config_list:
        entry: dict = {}
        configs.append(entry)
        if time.perf_counter() >= deadline:
            entry.update(name=name, rates={}, error="skipped: the --run-timeout passed")
            continue
        print(f"[{name}] starting a server: {args.model} {shlex.join(args.common_flags + flags)}", file=sys.stderr)
        await run_config(name, args.common_flags + flags, window, args, deadline, entry)
    return configs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return 0
    validate(args, parser)
    try:
        window = load_trace(args.trace, args.window_start, args.num_requests)
    except (OSError, ValueError) as e:
        parser.error(str(e))
    if args.arrivals == "burst":
        args.arrival_slot_ms = 0.0
    elif not args.arrival_slot_ms:
        args.arrival_slot_ms = trace_slot_ms([r.timestamp_ms for r in window])
        if args.arrival_slot_ms is None:
            parser.error("--arrivals slot: every request of the window has the same timestamp, so its slot width "
                         "is unknown; pass --arrival-slot-ms, or --arrivals burst")
    print(f"arrivals: {args.arrivals}" + (f" (uniform within {args.arrival_slot_ms:g} ms slots)"
                                          if args.arrival_slot_ms else ""), file=sys.stderr)
    started = datetime.datetime.now(datetime.timezone.utc)
    configs = asyncio.run(run_all(args, window))
    token_times = {c["name"]: {rate: s.pop("_token_times") for rate, s in c.get("rates", {}).items()
                               if "_token_times" in s} for c in configs}
    health = next((c["health"] for c in configs if "health" in c), {})
    report = {
        "benchmark": "serving (issue #10): Mooncake conversation trace replayed over "
                     + ("HTTP (OpenAI API, issue #17)" if args.http else "gRPC"),
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["serving.py", *argv]),
        "git_commit": git_commit(),
        "device": health.get("device"), "platform": health.get("platform"),
        "jax_version": health.get("jax_version"), "cuda_version": health.get("cuda_version"),
        "trace": str(args.trace), "window": [args.window_start, args.window_start + args.num_requests],
        "length_scale": args.length_scale,
        "notes": ("TTFT/E2E from each request's scheduled arrival; TPOT = (last - first token) / (tokens - 1); "
                  "ITL = gaps between streamed deltas; throughput and goodput over first arrival to last reply; "
                  f"arrivals: {args.arrivals}"
                  + (f" (uniform within {args.arrival_slot_ms:g} ms timestamp slots)" if args.arrival_slot_ms else "")
                  + "; lengths x length_scale, then clipped to the context (clipped_to_context); fresh block text "
                  "per rate (salt), so rates do not share prefix cache; temperature 0"),
        "args": {k: v for k, v in vars(args).items() if k not in ("config_list", "common_flags", "replot")},
        "configs": configs,
    }
    report["args"]["trace"] = str(args.trace)
    report["comparison"] = compare_at_fcfs_capacity(report, args.compare_baseline)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out_prefix}.json"
    path.write_text(json.dumps(report, separators=(",", ":")) + "\n")
    tokens_path = RESULTS / f"{args.out_prefix}.tokens.json.gz"
    with gzip.open(tokens_path, "wt") as f:
        json.dump({"fields": "per config, per rate: each request's delta times (ms after its scheduled arrival), "
                             "in the order of per_request.rows", "configs": token_times}, f, separators=(",", ":"))
    print_table(report)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and {tokens_path.name}", file=sys.stderr)
    if path.stat().st_size > 5e6:
        print("note: the JSON is over 5 MB: keep it out of git (or run fewer requests)", file=sys.stderr)
    if plot(report, path.with_suffix(".png")):
        print(f"wrote {path.with_suffix('.png')}", file=sys.stderr)
    failed = any("error" in c for c in configs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
