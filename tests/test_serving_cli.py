"""`python -m stratum_jax.serve` and `python -m stratum_jax.client` as processes: TLS, the CLI, SIGTERM drain
(of gRPC and HTTP streams alike: the server also serves the OpenAI-compatible HTTP API, over TLS too).

One server process for the module. The drain test comes last: it ends the process.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc

GRACE_S = 4.0
LONG_TOKENS = 2000     # the longest reply tiny's 2,048 positions allow a short prompt
START_TIMEOUT_S = 240


@dataclasses.dataclass
class ServerProcess:
    proc: subprocess.Popen
    target: str
    ca: str | None            # the self-signed certificate, when TLS is on
    log: list[str]
    profile_port: int
    http_url: str

    def http_open(self, path: str, body: dict | None = None, timeout: float = 10):
        """urlopen on the HTTP API (verifying the self-signed certificate when TLS is on)."""
        context = ssl.create_default_context(cafile=self.ca) if self.ca else None
        request = urllib.request.Request(self.http_url + path, data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def channel(self) -> grpc.Channel:
        if self.ca:
            with open(self.ca, "rb") as f:
                return grpc.secure_channel(self.target, grpc.ssl_channel_credentials(f.read()))
        return grpc.insecure_channel(self.target)

    def client(self, *args: str) -> subprocess.CompletedProcess:
        tls = ["--tls-ca", self.ca] if self.ca else []
        return subprocess.run([sys.executable, "-m", "stratum_jax.client", "--target", self.target, *tls, *args],
                              capture_output=True, text=True, timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _self_signed(tmp) -> tuple[str, str] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    tls = _self_signed(tmp)
    profile_port = _free_port()
    cmd = [sys.executable, "-m", "stratum_jax.serve", "--model", "tiny", "--port", "0", "--metrics-port", "-1",
           "--max-batch-size", "4", "--prefill-chunk", "32", "--max-tokens-cap", str(LONG_TOKENS),
           "--max-num-batched-tokens", str(4 + 128),          # prefill buckets 32-128: 3 packed shapes to compile
           "--drain-grace-s", str(GRACE_S), "--profile-dir", str(tmp / "profiles"),
           "--profile-port", str(profile_port), "--http-port", "0"]
    if tls:
        cmd += ["--tls-cert", tls[0], "--tls-key", tls[1]]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    log: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stderr:
            log.append(line)
            if " serving " in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(START_TIMEOUT_S), "server did not start:\n" + "".join(log)
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", "".join(log)).group(1))
        http_url = re.search(r"HTTP API on (\S+)/v1", "".join(log)).group(1)
        yield ServerProcess(proc, f"127.0.0.1:{port}", tls[0] if tls else None, log, profile_port, http_url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_client_cli(server):
    r = server.client("Hello there", "--max-tokens", "5", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert re.search(r"\[stop: (max_tokens|end_turn)\] input \d+ tokens .* output [1-5] tokens", r.stderr), r.stderr
    streamed = server.client("Hello there", "--max-tokens", "5", "--temperature", "0", "--stream")
    assert streamed.returncode == 0 and streamed.stdout == r.stdout      # same greedy text either way
    health = json.loads(server.client("--health").stdout)
    assert health["ready"] and health["model"]["name"] == "tiny"
    counted = json.loads(server.client("--count-tokens", "Hello there").stdout)
    assert counted["inputTokens"] > 0
    bad = server.client("Hello", "--max-tokens", "0")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr


def test_profile_from_the_cli(server):
    r = server.client("--profile", "50", "--profile-name", "cli", "--profile-timeout", "1")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["traceDir"].endswith("cli")
    assert any(f.endswith(".xplane.pb") for f in result["files"])


def test_profiler_server_listens(server):
    # --profile-port: jax.profiler.start_server, for TensorBoard/XProf's "capture profile" button.
    with socket.create_connection(("127.0.0.1", server.profile_port), timeout=5):
        pass


def test_tls_is_on(server):
    if server.ca is None:
        pytest.skip("openssl is not installed: the server runs without TLS")
    plain = grpc.insecure_channel(server.target)
    with pytest.raises(grpc.RpcError) as e:
        pb_grpc.StratumStub(plain).Health(pb.HealthRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains(server):
    channel = server.channel()
    stub = pb_grpc.StratumStub(channel)
    results: dict[str, object] = {}

    def run(name: str, request: pb.MessagesRequest, started: threading.Event):
        events = []
        try:
            for event in stub.Messages(request, timeout=120):
                events.append(event)
                if event.WhichOneof("event") == "delta":
                    started.set()
            results[name] = ("OK", events)
        except grpc.RpcError as e:
            results[name] = (e.code().name, e.details())
        started.set()

    def user(text, max_tokens):
        return pb.MessagesRequest(messages=[pb.Message(role="user", content=text)], max_tokens=max_tokens,
                                  temperature=0.0)

    def http_stream(started: threading.Event):
        """A streamed chat completion over HTTP(S): its SSE data lines."""
        lines = []
        body = {"messages": [{"role": "user", "content": "long http"}], "max_tokens": LONG_TOKENS,
                "temperature": 0, "stream": True}
        with server.http_open("/v1/chat/completions", body, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: "):
                    lines.append(line[6:].strip())
                    started.set()
        results["http"] = lines

    long_started, short_started, http_started = threading.Event(), threading.Event(), threading.Event()
    threads = [threading.Thread(target=run, args=("long", user("long", LONG_TOKENS), long_started)),
               threading.Thread(target=http_stream, args=(http_started,))]
    for t in threads:
        t.start()
    assert long_started.wait(60) and http_started.wait(60)
    threads.append(threading.Thread(target=run, args=("short", user("short", 3), short_started)))
    threads[-1].start()
    assert short_started.wait(60)

    server.proc.send_signal(signal.SIGTERM)
    health_stub, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + 30
    while health_stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != \
            health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "health did not turn NOT_SERVING after SIGTERM"
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Messages(user("too late", 3), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in e.value.details()
    for path, body in (("/health", None), ("/v1/completions", {"prompt": "too late", "max_tokens": 3})):
        with pytest.raises(urllib.error.HTTPError) as e:
            server.http_open(path, body)
        assert e.value.code == 503, path
    threads[-1].join(60)
    status, events = results["short"]
    assert status == "OK" and events[-1].WhichOneof("event") == "stop"       # finished within the grace

    # The long requests must still be running when the grace ends, whatever the CPU's speed (the tiny model
    # decodes 2,000 tokens in ~2.4 s on an idle 2-core machine, less than the grace): the server is held stopped
    # past its grace, so on waking its drain's timer is due long before its decoding could finish a request.
    server.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(GRACE_S + 1.0)
    finally:
        server.proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join(60)
    status, details = results["long"]
    assert status == "UNAVAILABLE" and "shut down" in details, (       # cut off after the grace
        status, len(details) if status == "OK" else details)
    last = json.loads(results["http"][-1])                                  # the HTTP stream too: an error event
    assert len(results["http"]) > 2 and "shut down" in last["error"]["message"], results["http"][-3:]
    assert server.proc.wait(60) == 0
    log = "".join(server.log)
    assert "drained" in log
