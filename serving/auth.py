"""API keys: the keys file, the check, and the gRPC interceptor that turns away calls without a valid x-api-key.

The keys file holds one key per line; blank lines and lines starting with '#' are ignored. The standard
health service stays open, so that load balancers and orchestrators can probe without a key.
"""
from __future__ import annotations

import hmac
import pathlib

import grpc

from serving.headers import API_KEY_HEADER, metadata_dict

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
MESSAGES_METHOD = "/stratum.v1.Stratum/Messages"


def load_keys(path: str | pathlib.Path) -> tuple[str, ...]:
    """Reads a keys file; raises ValueError naming the file (and line) when it can't be used."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--keys-file {path}: cannot read it ({e.strerror})") from e
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(c.isspace() for c in key) or not key.isprintable():
            raise ValueError(f"{path}:{number}: a key must be one printable word without spaces")
        keys.append(key)
    if not keys:
        raise ValueError(f"--keys-file {path}: no keys in it (one key per line; '#' starts a comment)")
    return tuple(keys)


class KeyChecker:
    """Whether a key is one of the configured keys; shared by the gRPC interceptor and the HTTP endpoint."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    def valid(self, key: str | None) -> bool:
        if not key:
            return False
        given = key.encode()
        # compare_digest against every key, without stopping early, so timing says nothing about them.
        return sum(hmac.compare_digest(given, k) for k in self._keys) > 0


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to calls whose x-api-key is missing or not one of the configured keys."""

    def __init__(self, keys: tuple[str, ...], on_reject=None) -> None:
        self._keys = KeyChecker(keys)
        self._on_reject = on_reject   # called with the method name of each rejected call

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        key = metadata_dict(handler_call_details.invocation_metadata).get(API_KEY_HEADER)
        if self._keys.valid(key):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:          # unknown method: let gRPC answer UNIMPLEMENTED
            return None
        if self._on_reject is not None:
            self._on_reject(method)
        message = (f"missing {API_KEY_HEADER} header" if not key else f"the {API_KEY_HEADER} is not valid") + \
            f": send a key from the server's --keys-file in the {API_KEY_HEADER} metadata header"
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, message)


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that ends every call with (code, message)."""

    async def refuse(request_or_iterator, context):
        await context.abort(code, message)

    async def refuse_streaming(request_or_iterator, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    return grpc.stream_stream_rpc_method_handler(refuse_streaming, **kw)
