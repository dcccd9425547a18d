"""The gRPC frontend end to end: the real engine (`tiny` preset) behind a real server on loopback.

One server serves the whole module (start-up compiles the model, so it is paid once). Tests run in file
order and each leaves the server idle again.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import importlib.util
import pathlib
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from serving.background import BackgroundServer
from serving.options import ServerOptions
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from serving.translate import Limits, Translator
from stratum_jax.config import RuntimeConfig
from stratum_jax.metrics import METRICS

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEY = "k-test-0123"
MD = (("x-api-key", KEY),)
# Compiles dominate the run time on CPU: one per (batch rows, chunk, context bucket, greedy or not). So the
# batch is small, prefill chunks are short, and most requests are greedy.
# max_num_batched_tokens = 8 decode rows + 256 prefill tokens: prefill buckets 32-256 (4 packed shapes to
# compile at start, not the default budget's 8); a longer prompt is prefilled over more steps.
CONFIG = RuntimeConfig(model="tiny", max_batch_size=8, max_queue=64, max_context=1024, max_tokens_cap=1000,
                       prefill_chunk=32, max_num_batched_tokens=8 + 256)
MAX_MESSAGE_BYTES = 64 << 10
LONG_TOKENS = 700   # a few seconds of decoding: long enough to outlast every bad request


def user(text: str, **kw) -> pb.MessagesRequest:
    kw.setdefault("max_tokens", 8)
    return pb.MessagesRequest(messages=[pb.Message(role="user", content=text)], **kw)


# Requests whose streamed tokens must equal the engine's own output for the same request and seed.
REFERENCE = {
    "greedy": user("Tell a long story", max_tokens=LONG_TOKENS, temperature=0.0),
    # Sampling options and logprobs in one request: each distinct mix is one more compile.
    "sampled": user("Hey", system="Be brief.", max_tokens=12, temperature=0.9, top_p=0.9, top_k=40, seed=1234,
                    logprobs=3),
}


@dataclasses.dataclass
class Served:
    bg: BackgroundServer
    channel: grpc.Channel
    stub: pb_grpc.StratumStub
    references: dict          # name -> GenerationResult
    translator: Translator

    def new_connection(self) -> pb_grpc.StratumStub:
        """A stub on its own TCP connection (gRPC otherwise shares one between channels)."""
        channel = grpc.insecure_channel(self.bg.target, options=[("grpc.use_local_subchannel_pool", 1)])
        return pb_grpc.StratumStub(channel)

    def snapshot(self) -> pb.MetricsSnapshot:
        return self.stub.GetMetrics(pb.GetMetricsRequest(), metadata=MD, timeout=10)

    def wait_idle(self, timeout: float = 30.0) -> pb.MetricsSnapshot:
        """Waits until no request is in flight and every KV page is free again."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.snapshot()
            if s.in_flight == 0 and s.running == 0 and s.queued == 0 and s.kv_pages_free == s.kv_pages_total:
                return s
            assert time.monotonic() < deadline, f"server not idle after {timeout} s: {s}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from stratum_jax.engine import Engine

    tmp = tmp_path_factory.mktemp("serving")
    engine = Engine(CONFIG)
    translator = Translator(engine.tokenizer, Limits("tiny", CONFIG.max_context, CONFIG.max_tokens_cap))
    # What the engine gives directly, before the server owns it (it is not thread-safe).
    references = {}
    for name, request in REFERENCE.items():
        ids, params = translator.messages_request(request)
        references[name] = engine.generate([ids], params)[0]
    keys = tmp / "keys"
    keys.write_text(f"# test keys\n{KEY}\nk-other\n")
    options = ServerOptions(port=0, metrics_port=0, keys_file=str(keys), max_message_bytes=MAX_MESSAGE_BYTES,
                            profile_dir=str(tmp / "profiles"), drain_grace_s=0.0)
    bg = BackgroundServer(CONFIG, options, engine=engine).start()
    channel = grpc.insecure_channel(bg.target)
    try:
        yield Served(bg, channel, pb_grpc.StratumStub(channel), references, translator)
    finally:
        channel.close()
        bg.stop()


@dataclasses.dataclass
class Result:
    events: list
    code: grpc.StatusCode
    details: str

    @property
    def start(self) -> pb.MessageStart:
        assert self.events and self.events[0].WhichOneof("event") == "start", self
        return self.events[0].start

    @property
    def stop(self) -> pb.MessageStop:
        stops = [e.stop for e in self.events if e.WhichOneof("event") == "stop"]
        assert len(stops) == 1 and self.events[-1].WhichOneof("event") == "stop", self
        return stops[0]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events if e.WhichOneof("event") == "delta" for t in e.delta.token_ids]

    @property
    def text(self) -> str:
        return "".join(e.delta.text for e in self.events if e.WhichOneof("event") == "delta")


def call(stub, request, metadata=MD, timeout=120.0) -> Result:
    events = []
    try:
        for event in stub.Messages(request, metadata=metadata, timeout=timeout):
            events.append(event)
    except grpc.RpcError as e:
        return Result(events, e.code(), e.details())
    return Result(events, grpc.StatusCode.OK, "")


# ---- streaming ----

@pytest.mark.parametrize("name", ["greedy", "sampled"])
def test_streamed_tokens_equal_the_engine(served, name):
    ref = served.references[name]
    r = call(served.stub, REFERENCE[name])
    assert r.code == grpc.StatusCode.OK, r.details
    assert r.token_ids == ref.token_ids
    assert r.text == ref.text
    assert r.start.prompt_tokens == ref.prompt_tokens
    assert r.stop.usage.input_tokens == ref.prompt_tokens
    assert r.stop.usage.output_tokens == len(ref.token_ids)
    expected = {"length": pb.MAX_TOKENS, "eos": pb.END_TURN, "stop_token": pb.END_TURN}[ref.finish_reason.value]
    assert r.stop.stop_reason == expected
    t = r.stop.timings
    assert 0 <= t.queue_ms <= t.ttft_ms <= t.total_ms
    if REFERENCE[name].logprobs:
        logprobs = [lp for e in r.events if e.WhichOneof("event") == "delta" for lp in e.delta.logprobs]
        assert [lp.token_id for lp in logprobs] == ref.token_ids
        assert all(len(lp.top) == 3 for lp in logprobs)
        for got, want in zip(logprobs, ref.logprobs):
            assert got.logprob == pytest.approx(want[0].logprob, abs=1e-4)


def test_count_tokens_matches_the_stream(served):
    request = REFERENCE["sampled"]
    counted = served.stub.CountTokens(pb.CountTokensRequest(system=request.system, messages=request.messages),
                                      metadata=MD, timeout=10)
    assert counted.input_tokens == served.references["sampled"].prompt_tokens


def test_stop_sequence_ends_the_stream(served):
    # Stop on the text the greedy reference produces after a few tokens, so the stop is certain to occur.
    ref = served.references["greedy"]
    stop = next((ref.text[i:i + 2] for i in range(2, len(ref.text) - 1) if ref.text[i:i + 2].strip()), None)
    if stop is None:
        pytest.skip("the greedy reference text has no usable stop sequence")
    request = pb.MessagesRequest()
    request.CopyFrom(REFERENCE["greedy"])
    request.stop_sequences.append(stop)
    r = call(served.stub, request)
    assert r.stop.stop_reason == pb.STOP_SEQUENCE
    assert stop not in r.text and ref.text.startswith(r.text)


# ---- concurrency ----

def test_64_concurrent_streams_finish_with_right_usage(served):
    requests = [user(f"Request {i}: " + "abc" * (i % 4), max_tokens=4 + i % 5, temperature=0.0)
                for i in range(64)]
    expected_input = [len(served.translator.prompt_ids(r)) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda r: call(served.stub, r), requests))
    for request, want_input, r in zip(requests, expected_input, results):
        assert r.code == grpc.StatusCode.OK, r.details
        usage = r.stop.usage
        assert r.start.prompt_tokens == usage.input_tokens == want_input
        assert usage.output_tokens == len(r.token_ids) <= request.max_tokens
        assert (usage.output_tokens == request.max_tokens) == (r.stop.stop_reason == pb.MAX_TOKENS)
    served.wait_idle()


# ---- cancellation ----

def test_cancelled_stream_frees_its_pages(served):
    before = served.wait_idle()
    stream = served.stub.Messages(user("Cancel me midway", max_tokens=600, temperature=0.0),
                                  metadata=MD, timeout=120)
    deltas = 0
    for event in stream:
        deltas += event.WhichOneof("event") == "delta"
        if deltas == 3:
            break
    busy = served.snapshot()
    assert busy.kv_tokens_used > 0 and busy.in_flight == 1
    stream.cancel()
    after = served.wait_idle(timeout=10)
    assert after.kv_pages_free == after.kv_pages_total
    # How many engine steps pass between the snapshot and the cancel reaching the engine depends on timing,
    # so it is not asserted here; test_serving_runner.py::test_cancel_frees_at_the_next_step pins down
    # "freed at the next step" deterministically.
    assert after.requests_by_status["cancelled"] == before.requests_by_status["cancelled"] + 1
    assert after.finished == after.accepted


# ---- bad input ----

def _bad_cases(served) -> list[tuple[str, pb.MessagesRequest, tuple, grpc.StatusCode, str]]:
    over_context = "x" * (CONFIG.max_context + 10)
    ok = user("fine")
    return [
        ("empty messages", pb.MessagesRequest(max_tokens=8), MD, grpc.StatusCode.INVALID_ARGUMENT, "messages is empty"),
        ("unknown role", pb.MessagesRequest(messages=[pb.Message(role="robot", content="x")], max_tokens=8), MD,
         grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role"),
        ("system role", pb.MessagesRequest(messages=[pb.Message(role="system", content="x")], max_tokens=8), MD,
         grpc.StatusCode.INVALID_ARGUMENT, "'system' field"),
        ("temperature", user("x", temperature=-1.0), MD, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ("temperature nan", user("x", temperature=float("nan")), MD, grpc.StatusCode.INVALID_ARGUMENT,
         "temperature"),
        ("top_p", user("x", top_p=0.0), MD, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ("top_k", user("x", top_k=-3), MD, grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        ("seed", user("x", seed=2**63), MD, grpc.StatusCode.INVALID_ARGUMENT, "seed"),
        ("logprobs", user("x", logprobs=50), MD, grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
        ("empty stop", user("x", stop_sequences=[""]), MD, grpc.StatusCode.INVALID_ARGUMENT, "stop_sequences[0]"),
        ("max_tokens 0", user("x", max_tokens=0), MD, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ("max_tokens -1", user("x", max_tokens=-1), MD, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        ("max_tokens cap", user("x", max_tokens=CONFIG.max_tokens_cap + 1), MD, grpc.StatusCode.INVALID_ARGUMENT,
         "cap of"),
        ("prompt over context", user(over_context), MD, grpc.StatusCode.INVALID_ARGUMENT, "context"),
        ("prompt + max_tokens over context", user("y" * (CONFIG.max_context - 60), max_tokens=100), MD,
         grpc.StatusCode.INVALID_ARGUMENT, "lower max_tokens"),
        ("unknown model", user("x", model="gpt-9"), MD, grpc.StatusCode.INVALID_ARGUMENT, "not served here"),
        ("bad request id", user("x", request_id="has space"), MD, grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
        ("weight not a number", ok, MD + (("x-stratum-weight", "lots"),), grpc.StatusCode.INVALID_ARGUMENT,
         "x-stratum-weight"),
        ("weight over 1", ok, MD + (("x-stratum-weight", "1.5"),), grpc.StatusCode.INVALID_ARGUMENT,
         "x-stratum-weight"),
        ("unknown route", ok, MD + (("x-stratum-route", "fast"),), grpc.StatusCode.INVALID_ARGUMENT,
         "x-stratum-route"),
        ("long-context without the pool", ok, MD + (("x-stratum-route", "long-context"),),
         grpc.StatusCode.INVALID_ARGUMENT, "long-context in --stacks"),
        ("bad session key", ok, MD + (("x-stratum-session", "two words"),), grpc.StatusCode.INVALID_ARGUMENT,
         "x-stratum-session"),
        ("oversized", user("z" * (MAX_MESSAGE_BYTES + 1)), MD, grpc.StatusCode.RESOURCE_EXHAUSTED,
         "--max-message-bytes"),
        ("no key", ok, (), grpc.StatusCode.UNAUTHENTICATED, "missing x-api-key"),
        ("wrong key", ok, (("x-api-key", "nope"),), grpc.StatusCode.UNAUTHENTICATED, "not valid"),
    ]


def test_bad_input_gets_its_status_while_a_long_stream_goes_on(served):
    served.wait_idle()
    long_result: list[Result] = []
    progress = threading.Event()
    long_stub = served.new_connection()

    def long_stream():
        events, code, details = [], grpc.StatusCode.OK, ""
        try:
            for event in long_stub.Messages(REFERENCE["greedy"], metadata=MD, timeout=300):
                events.append(event)
                if len(events) == 4:
                    progress.set()
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
        long_result.append(Result(events, code, details))

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert progress.wait(60), "the long stream did not start"

    failures = []
    for name, request, metadata, code, needle in _bad_cases(served):
        r = call(served.stub, request, metadata=metadata, timeout=30)
        if r.code != code or needle not in r.details or r.events:
            failures.append(f"{name}: got {r.code.name} {r.details!r} ({len(r.events)} events), "
                            f"want {code.name} containing {needle!r}")
    # A deadline that passes mid-generation.
    r = call(served.stub, user("slow", max_tokens=500, temperature=0.0), timeout=0.1)
    if r.code != grpc.StatusCode.DEADLINE_EXCEEDED:
        failures.append(f"deadline: got {r.code.name} {r.details!r}")
    # A full queue: more streams than running slots + queue places. Accepted ones are cancelled at once.
    codes = _flood(served, CONFIG.max_batch_size + CONFIG.max_queue + 8)
    if grpc.StatusCode.RESOURCE_EXHAUSTED not in codes:
        failures.append(f"queue full: no RESOURCE_EXHAUSTED among {set(codes)}")
    assert not failures, "\n".join(failures)
    # Whether the long stream was still running when the last bad request was answered depends on how fast
    # the engine decodes, so it is not asserted (it was flaky); what is asserted is that the bad requests
    # and the flood left it unharmed.

    thread.join(300)
    long = long_result[0]
    assert long.code == grpc.StatusCode.OK, long.details
    assert long.token_ids == served.references["greedy"].token_ids      # unharmed: same tokens as alone
    assert long.stop.usage.output_tokens == len(served.references["greedy"].token_ids)
    snapshot = served.wait_idle()
    assert snapshot.requests_by_status["invalid_argument"] >= 20
    assert snapshot.requests_by_status["unauthenticated"] >= 2
    assert snapshot.requests_by_status["resource_exhausted"] >= 2
    # The deadline case is checked on the client side above. The server's count of it is timing-dependent:
    # a 0.1 s deadline can pass before the handler starts (on a loaded 2-core CI machine it did), and then
    # the server never sees the request at all.


def _flood(served, n: int) -> list[grpc.StatusCode]:
    """Opens n streams at once; returns how each was answered (OK = accepted, then cancelled by us).

    Accepted streams stay open until every stream has its answer, so none frees a place early.
    """
    stub = served.new_connection()
    sent, answered = threading.Barrier(n), threading.Barrier(n)

    def one(i: int) -> grpc.StatusCode:
        stream = stub.Messages(user(f"flood {i}", max_tokens=900, temperature=0.0), metadata=MD, timeout=60)
        sent.wait()
        try:
            next(stream)              # the start event: the engine accepted it
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code = e.code()
        answered.wait()
        stream.cancel()
        return code

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


# ---- load with faults ----

def test_load_with_faults_leaks_nothing(served):
    """A small run of benchmarks/load_faults.py: random requests, cancels, disconnects, deadlines, bad input."""
    spec = importlib.util.spec_from_file_location("load_faults", ROOT / "benchmarks" / "load_faults.py")
    load_faults = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = load_faults      # dataclasses look their module up there
    spec.loader.exec_module(load_faults)
    args = load_faults.build_parser().parse_args([
        "--target", served.bg.target, "--clients", "8", "--requests", "48", "--max-seconds", "600",
        "--max-tokens", "16", "--max-words", "6", "--max-tokens-cap", str(CONFIG.max_tokens_cap), "--seed", "3"])
    # --max-seconds is only a bound: no request may be cut off for time, or "48 requests" below would
    # depend on how loaded the machine is (with 60 s, a loaded 2-core run started only 45 of them).
    report = asyncio.run(load_faults.run_load(args, KEY))
    assert report["requests"] == 48 and report["faults_injected"] > 0
    assert report["leaked_pages"] == 0
    assert report["engine_terminal_mismatch"] == 0 and report["status_terminal_mismatch"] == 0
    assert report["client_violations"] == 0, report["violation_examples"]
    assert load_faults.passed(report)


# ---- the other RPCs ----

def test_health_rpc(served):
    h = served.stub.Health(pb.HealthRequest(), metadata=MD, timeout=10)
    assert h.ready and h.state == "serving"
    assert h.device and h.platform == "cpu" and h.cuda_version == ""
    assert h.hbm_bandwidth_gbps > 0
    assert h.model.name == "tiny" and h.model.num_layers > 0 and h.model.kv_bytes_per_token > 0
    assert h.model.max_context == CONFIG.max_context


def test_cost_estimate(served):
    request = pb.CostEstimateRequest(messages=[pb.Message(role="user", content="What does this cost?")],
                                     max_tokens=100)
    r = served.stub.CostEstimate(request, metadata=MD, timeout=10)
    assert r.input_tokens == len(served.translator.prompt_ids(request))   # no padding billed
    assert r.max_output_tokens == 100
    b = r.breakdown
    assert r.estimated_cost_usd == pytest.approx(b.compute_usd + b.hbm_usd + b.transfer_usd)
    assert b.compute_usd > 0 and b.hbm_usd > 0 and b.transfer_usd > 0
    assert b.decode_step_ms > 0 and b.prefill_tokens_per_s > 0 and b.decode_batch >= 1
    more = served.stub.CostEstimate(pb.CostEstimateRequest(messages=request.messages, max_tokens=200),
                                    metadata=MD, timeout=10)
    assert more.estimated_cost_usd > r.estimated_cost_usd
    with pytest.raises(grpc.RpcError) as e:
        served.stub.CostEstimate(pb.CostEstimateRequest(messages=request.messages, max_tokens=0),
                                 metadata=MD, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_profile_captures_engine_steps(served):
    served.wait_idle()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(served.stub.Profile, pb.ProfileRequest(num_steps=3, name="ci", timeout_s=60),
                              metadata=MD, timeout=90)
        # The capture starts when the engine thread takes the command, at a time the test cannot see: keep
        # the engine stepping until the capture has its 3 steps, rather than sleeping and hoping.
        for _ in range(100):
            r = call(served.stub, user("profile me", max_tokens=6, temperature=0.0))
            assert r.code == grpc.StatusCode.OK
            try:
                profile = pending.result(timeout=1)
                break
            except concurrent.futures.TimeoutError:
                continue
        else:
            profile = pending.result()
    assert profile.steps_captured == 3
    assert any(f.endswith(".xplane.pb") for f in profile.files), profile.files
    with pytest.raises(grpc.RpcError) as e:
        served.stub.Profile(pb.ProfileRequest(name="../escape"), metadata=MD, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- standard services and metrics ----

def test_standard_health_service_is_serving_without_a_key(served):
    health = health_pb2_grpc.HealthStub(served.channel)
    for service in ("", "stratum.v1.Stratum"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_service(served):
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          metadata=MD, timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"stratum.v1.Stratum", "grpc.health.v1.Health"} <= names
    # What grpcurl asks next: the file that defines the service, to build requests without a .proto.
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="stratum.v1.Stratum")]),
        metadata=MD, timeout=10)
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for r in responses for raw in r.file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files for s in f.service if s.name == "Stratum" for m in s.method}
    assert {"Messages", "CountTokens", "CostEstimate", "Health", "GetMetrics", "Profile"} <= methods


def test_metrics_endpoint_scrapes_and_parses(served):
    # Requests of its own, so the counts below do not depend on which tests ran before it.
    for i in range(3):
        assert call(served.stub, user(f"metrics {i}", max_tokens=2)).code == grpc.StatusCode.OK
    text = urllib.request.urlopen(served.bg.metrics_url, timeout=10).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, _) in METRICS.items():
        base = name.removesuffix("_total") if kind == "counter" else name
        assert base in families, f"{name} missing from the exposition"
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "stack"))): s.value
               for f in families.values() for s in f.samples}
    assert samples[("stratum_requests_total", (("status", "ok"),))] >= 3
    assert samples[("stratum_ttft_seconds_count", ())] >= 3
    assert samples[("stratum_kv_pages_free", (("tier", "device"),))] > 0
    assert samples[("stratum_output_tokens_total", ())] > 0
    assert samples[("stratum_prefix_cache_queries_total", ())] > 0
    assert 0 <= samples[("stratum_cache_hit_rate", ())] <= 1
    # Counted step work over device time, against the start-up probes (issue #18's dashboard gauges).
    assert samples[("stratum_read_bandwidth_gbps", ())] > 0 and samples[("stratum_matmul_tflops", ())] > 0
    assert samples[("stratum_hbm_bandwidth_utilization", ())] > 0
    assert samples[("stratum_gpu_compute_utilization", ())] > 0
