"""Server reflection under both names clients use: grpc.reflection.v1 and grpc.reflection.v1alpha.

grpcio-reflection 1.x ships only the v1alpha service, and `enable_server_reflection` registers only it, so
a client that speaks v1 (grpcurl and most current tools try v1 first) would get UNIMPLEMENTED. The v1
proto is v1alpha's with the package renamed: same messages, same field numbers, so the same bytes. The v1
service is therefore served by the same servicer, on its own method path, with v1alpha's message classes
doing the (identical) wire encoding. Its descriptor is added to the pool too, so v1 itself can be
described through reflection like every other service.
"""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME          # "grpc.reflection.v1alpha.ServerReflection"
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Adds grpc/reflection/v1/reflection.proto to `pool`, derived from the v1alpha file (unless a newer
    grpcio-reflection already put the real one there)."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")            # java/go package options name v1alpha
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old):]
    for method in proto.service[0].method:
        method.input_type = new + method.input_type[len(old):]
        method.output_type = new + method.output_type[len(old):]
    pool.Add(proto)


def enable_reflection(service_names, server: grpc.aio.Server) -> None:
    """Serves reflection for `service_names` (plus both reflection services) under v1 and v1alpha."""
    pool = descriptor_pool.Default()
    _add_v1_descriptor(pool)
    names = tuple(service_names) + (V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names, pool=pool)
    reflection.enable_server_reflection(names, server, pool=pool)                # v1alpha
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,     # same bytes as v1
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        V1_SERVICE, {"ServerReflectionInfo": handler}),))
