"""The OpenAI-compatible HTTP endpoint: a Starlette app on uvicorn, in the gRPC server's process and event loop.

    POST /v1/chat/completions, POST /v1/completions   (streamed as server-sent events with "stream": true)
    GET  /v1/models, /v1/models/{id}
    GET  /health     200 while SERVING, 503 while loading or draining (no key needed, for probes)
    GET  /metrics    the server's Prometheus registry (no key needed, like --metrics-port)

A completion call is a frontend.Generation, exactly as a gRPC Messages call: the same checks, limits,
engine runner, metrics and drain. This file only reads HTTP (body size, JSON, the key, headers) and writes
the OpenAI shapes (openai_api.py). Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`
with the HTTP status of their Failure; once a stream has started (status 200 sent), an error is one
`data: {"error": ...}` event, which the `openai` SDK raises as an APIError.

A client that disconnects (or a stream the client closes) cancels its request: the engine frees its KV
pages at the next step.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time

import prometheus_client
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from serving import openai_api
from serving.auth import KeyChecker
from serving.frontend import SERVING, Failure, Finished, Frontend, Generation, RequestFailed
from serving.translate import GenerateRequest

log = logging.getLogger(__name__)

# Failure -> (HTTP status, OpenAI error type, OpenAI error code)
HTTP_ERRORS = {
    Failure.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    Failure.UNKNOWN_MODEL: (404, "invalid_request_error", "model_not_found"),
    Failure.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    Failure.TOO_LARGE: (413, "invalid_request_error", "request_too_large"),
    Failure.QUEUE_FULL: (429, "rate_limit_error", "queue_full"),
    Failure.UNAVAILABLE: (503, "server_error", "unavailable"),
    Failure.DEADLINE_EXCEEDED: (504, "server_error", "deadline_exceeded"),
    Failure.INTERNAL: (500, "server_error", None),
}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}   # no proxy buffering of the stream
_RETRY_AFTER_S = "1"


def error_body(failure: Failure, message: str) -> dict:
    _, kind, code = HTTP_ERRORS[failure]
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(failure: Failure, message: str) -> JSONResponse:
    status = HTTP_ERRORS[failure][0]
    headers = {"Retry-After": _RETRY_AFTER_S} if failure in (Failure.QUEUE_FULL, Failure.UNAVAILABLE) else None
    return JSONResponse(error_body(failure, message), status_code=status, headers=headers)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class OpenAIApp:
    """The routes, over the shared Frontend. `keys`: the --keys-file keys, or None (no authentication)."""

    def __init__(self, frontend: Frontend, keys: tuple[str, ...] | None, registry) -> None:
        self.frontend = frontend
        self.keys = None if keys is None else KeyChecker(keys)
        self.registry = registry
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ], exception_handlers={HTTPException: self._http_error})

    # ---- open endpoints ----

    async def health(self, request: Request) -> Response:
        state = self.frontend.state
        return JSONResponse({"status": state}, status_code=200 if state == SERVING else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(prometheus_client.generate_latest(self.registry),
                        media_type=prometheus_client.CONTENT_TYPE_LATEST)

    # ---- /v1/models ----

    async def models(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        served = self.frontend.served
        data = [] if served is None else [self._model_card(served.translator.limits.model_name)]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        served, name = self.frontend.served, request.path_params["model"]
        if served is None or name != served.translator.limits.model_name:
            served_name = "no model yet" if served is None else repr(served.translator.limits.model_name)
            return error_response(Failure.UNKNOWN_MODEL, f"model {name!r} is not served here (this server serves "
                                                         f"{served_name})")
        return JSONResponse(self._model_card(name))

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "stratum"}

    # ---- completions ----

    async def chat_completions(self, request: Request) -> Response:
        return await self._complete(request, openai_api.parse_chat)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, openai_api.parse_completion)

    async def _complete(self, request: Request, parse) -> Response:
        generation = self.frontend.generation()
        if (refused := self._refused(request)) is not None:
            generation.end(Failure.UNAUTHENTICATED.status)   # counted, as gRPC's refused Messages calls are
            return refused
        parsed: openai_api.Parsed | None = None

        def read() -> GenerateRequest:
            nonlocal parsed
            parsed = parse(openai_api.parse_body(body))
            return parsed.request

        try:
            body, size = await self._read_body(request)
            started = await generation.start(size, request.headers.items(), read)
        except RequestFailed as e:
            generation.close()
            return error_response(e.failure, e.message)
        except BaseException:
            generation.close()
            raise
        tokenizer = self.frontend.served.translator.tokenizer
        writer = openai_api.Writer(parsed.options, started, lambda t: tokenizer.decode([t]))
        if parsed.options.stream:
            return _GenerationStream(generation, self._stream(generation, writer))
        try:
            return await self._whole(request, generation, writer)
        finally:
            generation.close()

    async def _stream(self, generation: Generation, writer: openai_api.Writer):
        """The SSE body. Starlette cancels it when the client disconnects (_GenerationStream closes the call)."""
        try:
            if (first := writer.first_chunk()) is not None:
                yield _sse(first)
            async for event in generation.events():
                if isinstance(event, Finished):
                    for chunk in writer.last_chunks(event):
                        yield _sse(chunk)
                else:
                    yield _sse(writer.chunk(event))
            yield b"data: [DONE]\n\n"
        except RequestFailed as e:
            yield _sse(error_body(e.failure, e.message))

    async def _whole(self, request: Request, generation: Generation, writer: openai_api.Writer) -> Response:
        """The reply of a non-streamed call, or nothing when the client disconnects first."""
        async def collect():
            outputs = []
            async for event in generation.events():
                if isinstance(event, Finished):
                    return writer.reply(outputs, event)
                outputs.append(event)

        reply = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not reply.done():          # the client went away: nobody reads the reply
            reply.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reply
            return Response(status_code=499)
        try:
            return JSONResponse(reply.result(), headers=_stack_header(generation))
        except RequestFailed as e:
            return error_response(e.failure, e.message)

    # ---- helpers ----

    async def _read_body(self, request: Request) -> tuple[bytes, int]:
        """The body, and its size; past --max-message-bytes it stops reading (the size is then a lower
        bound) and the Generation refuses the call as TOO_LARGE."""
        limit = self.frontend.max_message_bytes
        declared = request.headers.get("content-length")
        if limit is not None and declared is not None and declared.isdigit() and int(declared) > limit:
            return b"", int(declared)
        chunks, size = [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                break
        return b"".join(chunks), size

    def _refused(self, request: Request) -> JSONResponse | None:
        """The 401 reply when keys are configured and the request has no valid one, else None."""
        if self.keys is None:
            return None
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        if self.keys.valid(key):
            return None
        what = "no API key" if not key else "the API key is not valid"
        return error_response(Failure.UNAUTHENTICATED, f"{what}: send 'Authorization: Bearer KEY' with a key from "
                                                       "the server's --keys-file")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        """Unknown paths and methods, in OpenAI's error shape."""
        message = {404: f"no endpoint {request.url.path}: see /v1/chat/completions, /v1/completions, /v1/models, "
                        "/health and /metrics",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _stack_header(generation: Generation) -> dict[str, str]:
    """x-stratum-stack: the stack that serves the call (gRPC puts it on MessageStop)."""
    return {} if generation.pool is None else {"x-stratum-stack": generation.pool.name}


class _GenerationStream(StreamingResponse):
    """An SSE response that closes its call however the response ends: finished, failed, or cancelled by
    a disconnect, even one that comes before the body generator has started (whose own finally would then
    never run)."""

    def __init__(self, generation: Generation, body) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**_SSE_HEADERS, **_stack_header(generation)})
        self.generation = generation

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Uvicorn(uvicorn.Server):
    # The stratum server owns SIGTERM/SIGINT (serve.py): it drains gRPC and HTTP together. uvicorn's own
    # handlers would shut the HTTP side down at once, without the drain.
    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving an OpenAIApp on a socket bound here (so that port 0 is resolved, and a port in use
    is an error at start-up rather than in a background task)."""

    def __init__(self, app: OpenAIApp, host: str, port: int, tls: tuple[str, str] | None = None,
                 shutdown_timeout_s: float = 10.0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family, backlog=2048)
        except OSError as e:
            raise ValueError(f"--http-port {port}: cannot listen on {host}:{port} ({e.strerror})") from e
        self.host = host
        self.port = self._socket.getsockname()[1]
        self.scheme = "https" if tls else "http"
        config = uvicorn.Config(app.app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=shutdown_timeout_s,
                                ssl_certfile=tls[0] if tls else None, ssl_keyfile=tls[1] if tls else None)
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]), name="stratum-http")
        self._task.add_done_callback(_log_failure)

    async def stop(self) -> None:
        """Stops accepting; open connections get up to shutdown_timeout_s to finish (streams have ended by
        then: the drain waits for them first)."""
        if self._task is None:
            self._socket.close()
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the HTTP server stopped: %r", task.exception())

