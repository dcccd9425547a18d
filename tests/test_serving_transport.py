"""What the gRPC server does before any model is involved: reflection under v1 and v1alpha, and requests over
--max-message-bytes. Real gRPC on loopback, with the port open and no model loaded (fast)."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from serving.background import BackgroundServer
from serving.options import ServerOptions
from serving.proto.stratum.v1 import stratum_pb2 as pb
from serving.proto.stratum.v1 import stratum_pb2_grpc as pb_grpc
from stratum_jax.config import RuntimeConfig

LIMIT = 64 << 10


@pytest.fixture(scope="module")
def bg(tmp_path_factory):
    options = ServerOptions(port=0, metrics_port=-1, max_message_bytes=LIMIT, drain_grace_s=0.0,
                            profile_dir=str(tmp_path_factory.mktemp("profiles")))
    server = BackgroundServer(RuntimeConfig(model="tiny"), options).start(load=False)
    yield server
    server.stop()


def reflect(channel, version: str, request: reflection_pb2.ServerReflectionRequest):
    """One reflection request on the method path of `version`. v1 and v1alpha messages are the same bytes
    (the v1 proto only renamed the package), so v1alpha's classes encode the v1 call as a v1 client would."""
    call = channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    return list(call(iter([request]), timeout=10))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_both_versions(bg, version):
    with grpc.insecure_channel(bg.target) as channel:
        [r] = reflect(channel, version, reflection_pb2.ServerReflectionRequest(list_services=""))
        names = {s.name for s in r.list_services_response.service}
        assert {"stratum.v1.Stratum", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
                "grpc.reflection.v1alpha.ServerReflection"} <= names
        for symbol, service, method in [("stratum.v1.Stratum", "Stratum", "Messages"),
                                        ("grpc.reflection.v1.ServerReflection", "ServerReflection",
                                         "ServerReflectionInfo")]:
            [r] = reflect(channel, version, reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol))
            assert not r.HasField("error_response"), r.error_response
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in r.file_descriptor_response.file_descriptor_proto]
            assert method in {m.name for f in files for s in f.service if s.name == service for m in s.method}


def _requests_by_status(bg) -> dict[str, float]:
    """The calls refused before a stack was chosen (stack="router"), by status."""
    return bg.server.frontend.router_metrics.status_counts()


def test_oversized_request_is_counted_and_names_the_flag(bg):
    """Over --max-message-bytes (but within what the transport takes): RESOURCE_EXHAUSTED, counted in
    stratum_requests_total, with a message naming the flag that raises the limit."""
    stub = pb_grpc.StratumStub(grpc.insecure_channel(bg.target))
    before = _requests_by_status(bg).get("resource_exhausted", 0)
    big = pb.MessagesRequest(messages=[pb.Message(role="user", content="z" * (LIMIT + 1))], max_tokens=8)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Messages(big, timeout=10))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-message-bytes" in e.value.details() and str(LIMIT) in e.value.details()
    assert _requests_by_status(bg).get("resource_exhausted", 0) == before + 1
    for rpc, request in [(stub.CountTokens, pb.CountTokensRequest(messages=big.messages)),
                         (stub.CostEstimate, pb.CostEstimateRequest(messages=big.messages, max_tokens=8))]:
        with pytest.raises(grpc.RpcError) as e:
            rpc(request, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-message-bytes" in e.value.details()
    # A request within the limit gets past the size check (here: to "still loading", as no model is loaded).
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Messages(pb.MessagesRequest(messages=[pb.Message(role="user", content="hi")], max_tokens=8),
                           timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
