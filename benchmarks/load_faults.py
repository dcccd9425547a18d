"""Load with faults over gRPC on loopback: random requests, cancels, disconnects, deadlines and bad input.

    python benchmarks/load_faults.py --clients 16 --requests 300 --max-seconds 120
    python benchmarks/load_faults.py --target 127.0.0.1:50051 --api-key KEY    # against a running server

Without --target it starts its own server (the `tiny` preset) in this process. N client tasks send
`--requests` requests in all; each request is one of:

    complete     read the stream to its end
    cancel       cancel the call after a few events
    disconnect   close the connection (the request has its own channel) after a few events
    deadline     a deadline too short for the generation
    bad          an invalid request (bad field or header): must get INVALID_ARGUMENT and no stream

At `--max-seconds` no new request starts and the ones still running are cancelled. Then, with the server
idle, it checks:

    leaked pages       KV pages not free again (must be 0)
    engine terminals   requests the engine accepted minus final outputs it gave (must be 0)
    status terminals   Messages calls minus terminal statuses the server recorded (must be 0)
    client violations  streams the client read to the end that did not end with exactly one stop event
                       (or one error status), or had events after it (must be 0)

It prints a table and writes benchmarks/results/load_faults.json. Loopback only: it refuses other targets.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime
import ipaddress
import json
import pathlib
import random
import sys
import time

import grpc

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:      # run as a script from anywhere
    sys.path.insert(0, str(REPO))

from serving.proto.stratum.v1 import stratum_pb2 as pb            # noqa: E402
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc  # noqa: E402

KINDS = {"complete": 0.45, "cancel": 0.15, "disconnect": 0.10, "deadline": 0.15, "bad": 0.15}
WORDS = "the quick brown fox jumps over a lazy dog while seven tired engineers watch the pages move".split()
_LOCAL_POOL = [("grpc.use_local_subchannel_pool", 1)]   # its own TCP connection, so closing it disconnects


@dataclasses.dataclass
class Outcome:
    kind: str
    code: str                 # the gRPC status the client saw ("OK" after a stop event; ours for our cancels)
    accepted: bool            # a MessageStart arrived
    output_tokens: int = 0
    ttft_s: float | None = None
    violation: str | None = None


def _check_loopback(target: str) -> None:
    host = target.rsplit(":", 1)[0].strip("[]")
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise SystemExit(f"--target {target}: this script only talks to loopback (127.0.0.1, ::1, localhost)")


def _prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


def _bad_request(rng: random.Random, max_tokens_cap: int) -> tuple[pb.MessagesRequest, tuple]:
    msg = [pb.Message(role="user", content="hi")]
    cases = [
        (pb.MessagesRequest(messages=msg, max_tokens=0), ()),
        (pb.MessagesRequest(messages=msg, max_tokens=max_tokens_cap + 1), ()),
        (pb.MessagesRequest(max_tokens=4), ()),
        (pb.MessagesRequest(messages=[pb.Message(role="wizard", content="hi")], max_tokens=4), ()),
        (pb.MessagesRequest(messages=msg, max_tokens=4, temperature=-1.0), ()),
        (pb.MessagesRequest(messages=msg, max_tokens=4, top_p=2.0), ()),
        (pb.MessagesRequest(messages=msg, max_tokens=4), (("x-stratum-weight", "2"),)),
        (pb.MessagesRequest(messages=msg, max_tokens=4), (("x-stratum-route", "sideways"),)),
    ]
    return rng.choice(cases)


class Load:
    def __init__(self, args, api_key: str | None) -> None:
        self.args = args
        self.md = (("x-api-key", api_key),) if api_key else ()
        self.rng = random.Random(args.seed)
        self.outcomes: list[Outcome] = []
        self.sent = 0
        self.stop_at = time.monotonic() + args.max_seconds

    def _next_kind(self) -> str:
        return self.rng.choices(list(KINDS), weights=list(KINDS.values()))[0]

    async def client(self, shared: grpc.aio.Channel) -> None:
        while self.sent < self.args.requests and time.monotonic() < self.stop_at:
            self.sent += 1
            kind = self._next_kind()
            seed = self.rng.randrange(2**31)
            self.outcomes.append(await self.one(kind, random.Random(seed), shared))

    async def one(self, kind: str, rng: random.Random, shared: grpc.aio.Channel) -> Outcome:
        a = self.args
        md = self.md
        if kind == "bad":
            request, extra = _bad_request(rng, a.max_tokens_cap)
            md = md + extra
        else:
            request = pb.MessagesRequest(messages=[pb.Message(role="user", content=_prompt(rng, a.max_words))],
                                         max_tokens=rng.randint(1, a.max_tokens),
                                         temperature=rng.choice([0.0, 0.0, 0.7, 1.0]), seed=rng.randrange(2**31))
        timeout = rng.uniform(0.02, 0.5) if kind == "deadline" else a.request_timeout
        own = grpc.aio.insecure_channel(a.target, options=_LOCAL_POOL) if kind == "disconnect" else None
        stub = pb_grpc.StratumStub(own or shared)
        call = stub.Messages(request, metadata=md, timeout=timeout)
        quit_after = rng.randint(1, 4) if kind in ("cancel", "disconnect") else None
        out = Outcome(kind, "OK", accepted=False)
        start = time.monotonic()
        stops = after_stop = 0
        events = 0
        try:
            async for event in call:
                events += 1
                which = event.WhichOneof("event")
                if stops:
                    after_stop += 1
                if which == "start":
                    out.accepted = True
                elif which == "delta":
                    out.output_tokens += len(event.delta.token_ids)
                    if out.ttft_s is None and event.delta.token_ids:
                        out.ttft_s = time.monotonic() - start
                elif which == "stop":
                    stops += 1
                    if event.stop.usage.output_tokens != out.output_tokens:
                        out.violation = (f"usage says {event.stop.usage.output_tokens} output tokens, "
                                         f"{out.output_tokens} streamed")
                if quit_after is not None and events > quit_after:
                    break
        except grpc.aio.AioRpcError as e:
            out.code = e.code().name
            # A deadline can expire between the stop event and the OK trailers that follow it (gRPC ends the
            # call on the client's clock, whatever the server sent): for a request sent with a short deadline that
            # is a race, not a server fault. Any other status after the stop event is one.
            if stops and not (kind == "deadline" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
                out.violation = f"an error status ({out.code}) after the stop event"
        except asyncio.CancelledError:
            # Past the time bound: this script cancels what still runs, and records it as such.
            call.cancel()
            out.code = "CANCELLED_AT_END"
            return out
        finally:
            if own is not None:
                await own.close(grace=None)     # drops the TCP connection mid-stream
            elif quit_after is not None:
                call.cancel()
        if quit_after is not None and out.code == "OK" and not stops:
            out.code = "DISCONNECTED" if kind == "disconnect" else "CANCELLED_BY_CLIENT"
        elif out.code == "OK" and out.violation is None:
            if stops != 1:
                out.violation = f"{stops} stop events"
            elif after_stop:
                out.violation = f"{after_stop} events after the stop event"
        if kind == "bad" and (out.code != "INVALID_ARGUMENT" or events):
            out.violation = f"bad request answered {out.code} with {events} events"
        return out


async def _snapshot(target: str, md) -> pb.MetricsSnapshot:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.StratumStub(channel).GetMetrics(pb.GetMetricsRequest(), metadata=md, timeout=10)


async def _wait_idle(target: str, md, timeout: float = 60.0) -> pb.MetricsSnapshot:
    deadline = time.monotonic() + timeout
    while True:
        s = await _snapshot(target, md)
        if (s.in_flight == 0 and s.running == 0 and s.queued == 0) or time.monotonic() > deadline:
            return s
        await asyncio.sleep(0.1)


async def run_load(args, api_key: str | None) -> dict:
    """Runs the load against args.target; returns the report (see the module docstring)."""
    md = (("x-api-key", api_key),) if api_key else ()
    before = await _wait_idle(args.target, md)
    load = Load(args, api_key)
    started = time.monotonic()
    async with grpc.aio.insecure_channel(args.target) as shared:
        clients = [asyncio.create_task(load.client(shared)) for _ in range(args.clients)]
        done, pending = await asyncio.wait(clients, timeout=args.max_seconds + args.request_timeout)
        for task in pending:        # past the time bound: cancel what still runs
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = time.monotonic() - started
    after = await _wait_idle(args.target, md)

    outcomes = load.outcomes
    by_kind = collections.Counter(o.kind for o in outcomes)
    codes = collections.Counter(o.code for o in outcomes)
    violations = [f"{o.kind}: {o.violation}" for o in outcomes if o.violation]
    status_delta = {k: after.requests_by_status.get(k, 0) - before.requests_by_status.get(k, 0)
                    for k in set(after.requests_by_status) | set(before.requests_by_status)}
    status_delta = {k: v for k, v in sorted(status_delta.items()) if v}
    ttfts = sorted(o.ttft_s for o in outcomes if o.ttft_s is not None)
    faults = sum(by_kind[k] for k in ("cancel", "disconnect", "deadline", "bad"))
    return {
        "requests": len(outcomes),
        "clients": args.clients,
        "wall_s": round(wall, 2),
        "faults_injected": faults,
        "by_kind": dict(by_kind),
        "client_codes": dict(codes),
        "accepted": sum(o.accepted for o in outcomes),
        "output_tokens": sum(o.output_tokens for o in outcomes),
        "output_tokens_per_s": round(sum(o.output_tokens for o in outcomes) / wall, 1),
        "ttft_p50_ms": round(1e3 * ttfts[len(ttfts) // 2], 1) if ttfts else None,
        "ttft_p95_ms": round(1e3 * ttfts[int(0.95 * (len(ttfts) - 1))], 1) if ttfts else None,
        "server_status_counts": status_delta,
        "leaked_pages": after.kv_pages_total - after.kv_pages_free,
        "engine_terminal_mismatch": (after.accepted - before.accepted) - (after.finished - before.finished),
        "status_terminal_mismatch": len(outcomes) - sum(status_delta.values()),
        "client_violations": len(violations),
        "violation_examples": violations[:10],
        "server_idle_at_end": after.in_flight == 0 and after.running == 0 and after.queued == 0,
    }


def passed(report: dict) -> bool:
    return (report["leaked_pages"] == 0 and report["engine_terminal_mismatch"] == 0
            and report["status_terminal_mismatch"] == 0 and report["client_violations"] == 0
            and report["server_idle_at_end"])


def print_table(report: dict) -> None:
    rows = [
        ("requests", report["requests"]), ("clients", report["clients"]), ("wall time (s)", report["wall_s"]),
        ("faults injected", report["faults_injected"]),
        ("  by kind", ", ".join(f"{k} {v}" for k, v in sorted(report["by_kind"].items()))),
        ("accepted by the engine", report["accepted"]),
        ("client-side codes", ", ".join(f"{k} {v}" for k, v in sorted(report["client_codes"].items()))),
        ("server terminal statuses", ", ".join(f"{k} {v}" for k, v in report["server_status_counts"].items())),
        ("output tokens (tokens/s)", f"{report['output_tokens']} ({report['output_tokens_per_s']})"),
        ("TTFT p50 / p95 (ms)", f"{report['ttft_p50_ms']} / {report['ttft_p95_ms']}"),
        ("leaked KV pages", report["leaked_pages"]),
        ("engine terminal mismatch", report["engine_terminal_mismatch"]),
        ("status terminal mismatch", report["status_terminal_mismatch"]),
        ("client violations", report["client_violations"]),
        ("result", "PASS" if passed(report) else "FAIL"),
    ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for example in report["violation_examples"]:
        print(f"  violation: {example}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="HOST:PORT of a running server (loopback); default: start one here")
    p.add_argument("--api-key", help="x-api-key for a server with --keys-file")
    p.add_argument("--model", default="tiny", help="preset for the server this script starts")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--max-seconds", type=float, default=120.0, help="no new requests after this long")
    p.add_argument("--request-timeout", type=float, default=60.0, help="deadline of requests that complete")
    p.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a request")
    p.add_argument("--max-words", type=int, default=24, help="longest prompt, in words")
    p.add_argument("--max-tokens-cap", type=int, default=256, help="the server's cap (for the over-cap case)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "load_faults.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (1 <= args.clients <= 256 and 1 <= args.requests <= 100_000 and 0 < args.max_seconds <= 3600):
        raise SystemExit("bounds: --clients in [1, 256], --requests in [1, 100000], --max-seconds in (0, 3600]")
    background = None
    if args.target is None:
        from serving.background import BackgroundServer
        from serving.options import ServerOptions
        from stratum_jax.config import RuntimeConfig

        config = RuntimeConfig(model=args.model, max_tokens_cap=args.max_tokens_cap, max_batch_size=16,
                               max_queue=max(64, 2 * args.clients), prefill_chunk=64)
        print(f"starting a {args.model} server on loopback ...", file=sys.stderr)
        background = BackgroundServer(config, ServerOptions(port=0, metrics_port=-1)).start()
        args.target = background.target
    _check_loopback(args.target)
    try:
        report = asyncio.run(run_load(args, args.api_key))
        health = _health(args.target, args.api_key)
    finally:
        if background is not None:
            background.stop()
    import jax

    report.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  jax_version=jax.__version__, device=health.device, model=health.model.name,
                  max_tokens=args.max_tokens, max_words=args.max_words, seed=args.seed, passed=passed(report))
    print_table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if passed(report) else 1


def _health(target: str, api_key: str | None) -> pb.HealthResponse:
    md = (("x-api-key", api_key),) if api_key else ()
    with grpc.insecure_channel(target) as channel:
        return pb_grpc.StratumStub(channel).Health(pb.HealthRequest(), metadata=md, timeout=10)


if __name__ == "__main__":
    sys.exit(main())
