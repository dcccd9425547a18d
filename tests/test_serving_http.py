"""The OpenAI-compatible HTTP endpoint end to end: the official `openai` SDK against a real server on loopback
(uvicorn and gRPC in one process, the real engine with the `tiny` preset).

One server for the module (start-up compiles the model, so it is paid once); a small batch, queue and
token budget keep its compiles few. Tests run in file order and each leaves the server idle again; the
drain test comes last, as it ends the server.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.background import BackgroundServer
from serving.options import ServerOptions
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from stratum_jax.config import RuntimeConfig

KEY = "k-http-0123"
MD = (("x-api-key", KEY),)
# max_num_batched_tokens = 4 decode rows + 2 prefill tiles of 32: two prefill buckets, so few compiles.
CONFIG = RuntimeConfig(model="tiny", max_batch_size=4, max_queue=4, max_context=512, max_tokens_cap=500,
                       prefill_chunk=32, max_num_batched_tokens=68)
MAX_MESSAGE_BYTES = 16 << 10
LONG = 400            # tokens that take seconds to decode: a request that is still running when the test acts


class Http:
    def __init__(self, bg: BackgroundServer) -> None:
        self.bg = bg
        self.url = bg.http_url
        self.client = self.sdk(KEY)
        self.stub = pb_grpc.StratumStub(grpc.insecure_channel(bg.target))

    def sdk(self, key: str) -> openai.OpenAI:
        # No retries: the SDK retries 429 and 5xx by default, and the tests want to see them.
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        return raw(self.url + path, headers=headers)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """The samples by name and labels other than `stack`, summed over stacks (a call refused before
        routing is counted under stack="router", one refused by the engine under its stack's)."""
        status, text = self.get("/metrics")
        assert status == 200
        samples = collections.defaultdict(float)
        for f in text_string_to_metric_families(text.decode()):
            for s in f.samples:
                samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "stack")))] += s.value
        return dict(samples)

    def status_count(self, status: str) -> float:
        return self.metrics().get(("stratum_requests_total", (("status", status),)), 0.0)

    def wait(self, condition, what: str, timeout: float = 30.0) -> dict:
        """Polls /metrics until condition(samples) holds."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if condition(m):
                return m
            assert time.monotonic() < deadline, f"{what} not reached after {timeout} s"
            time.sleep(0.05)

    def wait_idle(self) -> dict:
        return self.wait(lambda m: in_flight(m) == 0 and pages_used(m) == 0
                         and m[("stratum_running_requests", ())] == 0 and m[("stratum_queue_length", ())] == 0,
                         "an idle server with every KV page free")


def in_flight(m: dict) -> float:
    return m[("stratum_in_flight_requests", ())]


def pages_used(m: dict) -> float:
    return m[("stratum_kv_pages_used", (("tier", "device"),))]


def raw(url: str, body: bytes | None = None, headers: dict | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    keys = tmp / "keys"
    keys.write_text(f"{KEY}\n")
    options = ServerOptions(port=0, metrics_port=-1, http_port=0, keys_file=str(keys),
                            max_message_bytes=MAX_MESSAGE_BYTES, profile_dir=str(tmp / "profiles"), drain_grace_s=0.0)
    bg = BackgroundServer(CONFIG, options).start()
    try:
        yield Http(bg)
    finally:
        bg.stop()


def chat(text: str, **kw) -> dict:
    return dict(model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}],
                **kw)


def grpc_call(http: Http, request: pb.MessagesRequest) -> tuple[list[int], str, pb.MessageStop, list]:
    """(token ids, text, stop event, per-token logprobs) of one Messages call."""
    ids, text, stop, logprobs = [], "", None, []
    for event in http.stub.Messages(request, metadata=MD, timeout=60):
        if event.WhichOneof("event") == "delta":
            ids += event.delta.token_ids
            text += event.delta.text
            logprobs += event.delta.logprobs
        elif event.WhichOneof("event") == "stop":
            stop = event.stop
    return ids, text, stop, logprobs


# ---- the same request over gRPC and over HTTP ----

def test_greedy_chat_over_http_equals_grpc(http):
    """Same tokens, text, usage and cached prompt tokens, streamed or not, as stratum.v1 Messages."""
    request = pb.MessagesRequest(system="Be brief.", messages=[pb.Message(role="user", content="Compare us")],
                                 max_tokens=24, temperature=0.0)
    ids, text, stop, _ = grpc_call(http, request)
    kw = chat("Compare us", max_tokens=24, temperature=0, extra_body={"return_token_ids": True})
    whole = http.client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.model_extra["token_ids"] == ids and choice.message.content == text
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == stop.usage.input_tokens and whole.usage.completion_tokens == len(ids)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.model == "tiny" and whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    # The prompt was seen twice before this one, so its full pages come from the prefix cache here as they
    # would over gRPC: cached counts equal, and are more than zero.
    again = http.client.chat.completions.create(**kw)
    _, _, stop_again, _ = grpc_call(http, request)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == stop_again.usage.cached_input_tokens > 0

    chunks = list(http.client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed_ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", ())]
    assert streamed_ids == ids
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == text
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    usage = chunks[-1].usage      # the last chunk: no choices, the usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ids)
    assert usage.prompt_tokens == stop.usage.input_tokens and usage.prompt_tokens_details.cached_tokens > 0
    http.wait_idle()


def test_completions_streamed_and_not(http):
    """A text prompt and the same prompt as token ids (BOS + bytes: the byte tokenizer's encoding) give
    the same greedy tokens, streamed or not; usage counts them."""
    kw = dict(model="tiny", max_tokens=16, temperature=0, extra_body={"return_token_ids": True})
    text = http.client.completions.create(prompt="Once upon a time", **kw)
    as_ids = http.client.completions.create(prompt=[256] + list(b"Once upon a time"), **kw)
    ids = text.choices[0].model_extra["token_ids"]
    assert len(ids) == 16 and as_ids.choices[0].model_extra["token_ids"] == ids
    assert text.usage.prompt_tokens == len("Once upon a time") + 1 and text.usage.completion_tokens == 16
    assert text.object == "text_completion" and text.choices[0].finish_reason == "length"
    chunks = list(http.client.completions.create(prompt="Once upon a time", stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == text.choices[0].text
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    assert all(c.usage is None for c in chunks)       # no usage chunk without stream_options.include_usage
    raw = http.client.completions.with_raw_response.create(prompt="Once upon a time", **kw)
    assert raw.headers["x-stratum-stack"] == "stratum"          # the stack that served it
    http.wait_idle()


# ---- logprobs and stop ----

def test_logprobs_match_grpc(http):
    ids, _, _, grpc_logprobs = grpc_call(http, pb.MessagesRequest(
        system="Be brief.", messages=[pb.Message(role="user", content="Logprobs please")], max_tokens=6,
        temperature=0.0, logprobs=3))
    r = http.client.chat.completions.create(**chat("Logprobs please", max_tokens=6, temperature=0, logprobs=True,
                                                   top_logprobs=3))
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    for entry, want in zip(content, grpc_logprobs):
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([t.logprob for t in want.top], abs=1e-5)
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)   # greedy: the top one
    # logprobs without top_logprobs: the chosen token's only.
    r = http.client.chat.completions.create(**chat("Logprobs please", max_tokens=6, temperature=0, logprobs=True))
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx([e.logprob for e in content])
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)
    # The legacy completions shape.
    c = http.client.completions.create(model="tiny", prompt="Logprobs", max_tokens=5, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset == sorted(lp.text_offset)
    assert http.client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].logprobs is None
    http.wait_idle()


def test_stop_ends_the_reply(http):
    # Stop on a character the greedy reply produces after its start (the tiny preset's replies are byte
    # noise; this prompt's has several distinct characters): the reply must end just before it.
    kw = dict(model="tiny", prompt="abc", max_tokens=60, temperature=0)
    reference = http.client.completions.create(**kw).choices[0].text
    at = next((i for i in range(1, len(reference)) if reference[i] not in reference[:i] + "\ufffd"), None)
    assert at is not None, f"no usable stop character in {reference!r}"
    stop = reference[at]
    for stream in (False, True):
        if stream:
            chunks = list(http.client.completions.create(**kw, stop=[stop, "never there"], stream=True))
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            r = http.client.completions.create(**kw, stop=stop)
            text, finish = r.choices[0].text, [r.choices[0].finish_reason]
        assert finish == ["stop"] and text == reference[:at], (stop, text, reference)
    http.wait_idle()


# ---- errors ----

def _bad_cases():
    over = "x" * (CONFIG.max_context + 10)
    user = [{"role": "user", "content": "hi"}]
    sdk = [  # (name, kwargs of chat.completions.create, status, needle)
        ("n=2", dict(messages=user, n=2), 400, "n must be 1"),
        ("temperature", dict(messages=user, temperature=-1), 400, "temperature"),
        ("temperature type", dict(messages=user, extra_body={"temperature": "hot"}), 400, "temperature must be a number"),
        ("max_tokens 0", dict(messages=user, max_tokens=0), 400, "max_tokens must be a positive integer"),
        ("over the cap", dict(messages=user, max_completion_tokens=CONFIG.max_tokens_cap + 1), 400,
         "max_completion_tokens=501 is over this server's cap"),
        ("prompt over context", dict(messages=[{"role": "user", "content": over}]), 400, "context"),
        ("empty messages", dict(messages=[]), 400, "messages is empty"),
        ("unknown role", dict(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role is 'robot'"),
        ("late system", dict(messages=user + [{"role": "system", "content": "x"}]), 400,
         "messages[1].role is 'system': it must be 'user' or 'assistant' (system messages must come first)"),
        ("image part", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         400, "messages[0].content[0] must be a text part"),
        ("too many stops", dict(messages=user, stop=["a"] * 17), 400, "stop has 17 entries"),
        ("penalty", dict(messages=user, presence_penalty=0.5), 400, "presence_penalty is not supported"),
        ("top_logprobs alone", dict(messages=user, top_logprobs=2), 400, "top_logprobs needs logprobs"),
        ("stream_options alone", dict(messages=user, stream_options={"include_usage": True}), 400,
         "stream_options is only allowed with stream"),
        ("weight header", dict(messages=user, extra_headers={"x-stratum-weight": "lots"}), 400, "x-stratum-weight"),
        ("route header", dict(messages=user, extra_headers={"x-stratum-route": "fast"}), 400, "x-stratum-route"),
        ("unknown model", dict(messages=user, model="gpt-9"), 404, "model 'gpt-9' is not served here"),
        ("too large", dict(messages=[{"role": "user", "content": "z" * (MAX_MESSAGE_BYTES + 1)}]), 413,
         "--max-message-bytes"),
    ]
    return sdk


def test_bad_requests_get_openai_errors_with_their_status(http):
    before = {s: http.status_count(s) for s in ("invalid_argument", "resource_exhausted")}
    failures = []
    for name, kw, status, needle in _bad_cases():
        kw = {"model": "tiny", **({} if "max_completion_tokens" in kw else {"max_tokens": 4}), **kw}
        try:
            http.client.chat.completions.create(**kw)
            failures.append(f"{name}: accepted")
            continue
        except openai.APIStatusError as e:
            got, body = e.status_code, e.body
        if got != status or needle not in body.get("message", "") or not {"type", "code", "param"} <= body.keys():
            failures.append(f"{name}: got {got} {body!r}, want {status} with {needle!r}")
    # What the SDK cannot send: a body that is not JSON, a prompt of the wrong type, an unknown path.
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for name, path, body, status, needle in [
            ("not json", "/v1/chat/completions", b"{nope", 400, "not valid JSON"),
            ("prompt type", "/v1/completions", json.dumps({"prompt": {"a": 1}}).encode(), 400, "prompt must be"),
            ("two prompts", "/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400, "one prompt"),
            # JSON's escapes can name half a surrogate pair: not text, so not the tokenizer's (it was a 500).
            ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud83db", "max_tokens": 2}', 400,
             "prompt holds a lone UTF-16 surrogate (\\ud83d)"),
            ("unknown path", "/v1/embeddings", b"{}", 404, "no endpoint /v1/embeddings")]:
        got, raw_body = raw(http.url + path, body, headers)
        message = json.loads(raw_body)["error"]["message"]
        if got != status or needle not in message:
            failures.append(f"{name}: got {got} {message!r}, want {status} with {needle!r}")
    assert not failures, "\n".join(failures)
    after = {s: http.status_count(s) for s in ("invalid_argument", "resource_exhausted")}
    # Counted as gRPC's are: 17 SDK cases + 4 raw ones are invalid_argument (the unknown model too; the
    # unknown path is no completion call), the oversized one resource_exhausted.
    assert after["invalid_argument"] - before["invalid_argument"] == 21
    assert after["resource_exhausted"] - before["resource_exhausted"] == 1


def test_api_key_is_required_on_v1_only(http):
    before = http.status_count("unauthenticated")
    with pytest.raises(openai.AuthenticationError) as e:
        http.sdk("wrong").chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert "the API key is not valid" in e.value.body["message"] and e.value.body["code"] == "invalid_api_key"
    # The SDK refuses to send no key at all; a bare client can.
    status, body = raw(http.url + "/v1/completions", json.dumps({"prompt": "hi"}).encode(),
                       {"Content-Type": "application/json"})
    assert status == 401 and "no API key: send 'Authorization: Bearer KEY'" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        http.sdk("wrong").models.list()
    assert http.status_count("unauthenticated") == before + 2     # the completion calls only
    assert [m.id for m in http.client.models.list()] == ["tiny"]
    assert http.client.models.retrieve("tiny").owned_by == "stratum"
    with pytest.raises(openai.NotFoundError):
        http.client.models.retrieve("gpt-9")
    # Probes and scrapers need no key.
    status, body = http.get("/health")
    assert status == 200 and json.loads(body) == {"status": "serving"}
    assert http.get("/metrics")[0] == 200


# ---- capacity and disconnects ----

def test_full_queue_is_429(http):
    """More streams at once than running slots + queue places: the rest get 429. Accepted streams stay
    open (and undrained) until every stream has its answer, so none frees a place early."""
    n = CONFIG.max_batch_size + CONFIG.max_queue + 3
    answered = threading.Barrier(n)

    def one(i: int):
        try:
            stream = http.client.chat.completions.create(**chat(f"flood {i}", max_tokens=LONG, temperature=0,
                                                                stream=True, extra_body={"ignore_eos": True}))
            outcome = 200
        except openai.RateLimitError as e:
            stream, outcome = None, (429, e.body["message"], e.response.headers.get("retry-after"))
        answered.wait()
        if stream is not None:
            stream.close()
        return outcome

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        outcomes = list(pool.map(one, range(n)))
    refused = [o for o in outcomes if o != 200]
    assert len(refused) >= 3 and outcomes.count(200) <= CONFIG.max_batch_size + CONFIG.max_queue, outcomes
    assert all(status == 429 and "retry with backoff" in message and retry == "1"
               for status, message, retry in refused), refused
    http.wait_idle()


def test_disconnect_frees_kv_pages(http):
    """A stream the client closes, and a non-streamed call whose connection drops, are cancelled: /metrics
    shows their pages freed and the calls counted as cancelled."""
    http.wait_idle()
    before = http.status_count("cancelled")
    stream = http.client.chat.completions.create(**chat("Disconnect me", max_tokens=LONG, temperature=0,
                                                        stream=True, extra_body={"ignore_eos": True}))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    busy = http.metrics()
    assert in_flight(busy) == 1 and pages_used(busy) > 0
    stream.close()
    http.wait_idle()
    assert http.status_count("cancelled") == before + 1

    body = json.dumps(chat("Disconnect me too", max_tokens=LONG, temperature=0, ignore_eos=True)).encode()
    host, port = http.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        http.wait(lambda m: in_flight(m) == 1 and pages_used(m) > 0, "the call running")
    http.wait_idle()
    assert http.status_count("cancelled") == before + 2


# ---- draining (last: it ends the server) ----

def test_drain_refuses_new_calls_and_ends_open_streams(http):
    """While draining: /health is 503, new calls get 503, an open stream goes on; once the grace is over
    (here: the server's cancellation of what is left, called directly) it ends with an error event."""
    stream = http.client.chat.completions.create(**chat("Drain me", max_tokens=LONG, temperature=0, stream=True,
                                                        extra_body={"ignore_eos": True}))
    chunks = iter(stream)
    next(chunks)
    drained = threading.Thread(target=http.bg.drain, args=(600.0,))
    drained.start()
    http.wait(lambda m: True, "metrics")    # the HTTP port still answers while draining
    deadline = time.monotonic() + 30
    while http.get("/health")[0] != 503:
        assert time.monotonic() < deadline, "/health did not turn 503"
        time.sleep(0.05)
    with pytest.raises(openai.InternalServerError) as e:
        http.client.chat.completions.create(**chat("too late", max_tokens=4))
    assert e.value.status_code == 503 and "draining" in e.value.body["message"]
    next(chunks)                              # the open stream still gets tokens
    http.bg.run(_shutdown_streams(http.bg))
    with pytest.raises(openai.APIError) as e:
        for _ in chunks:
            pass
    assert "shut down" in str(e.value)
    drained.join(60)
    assert not drained.is_alive()


async def _shutdown_streams(bg: BackgroundServer) -> None:
    bg.server.frontend.shutdown_streams()
