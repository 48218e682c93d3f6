"""Server reflection on both grpc.reflection.v1 and grpc.reflection.v1alpha, for both services.

grpcurl, Postman and grpc-java's newer clients ask grpc.reflection.v1 first; older clients only
know v1alpha. grpcio-reflection (1.85) ships only v1alpha. The v1 protocol is v1alpha under a
new package name, with the same messages, fields and numbers, so the bytes on the wire are the
same: the v1 method here is v1alpha's servicer behind v1's method path. For `describe` of the v1
service itself to work, its descriptor is added to the default pool, derived from the installed
v1alpha one by renaming the package (unless something else registered it first).
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME            # grpc.reflection.v1alpha.ServerReflection
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE_NAME = "grpc/reflection/v1/reflection.proto"      # the name the upstream file has


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindServiceByName(V1_SERVICE_NAME)
        return
    except KeyError:
        pass
    file = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(file)
    old_prefix, new_prefix = f".{file.package}.", f".{V1_PACKAGE}."
    file.name, file.package = V1_FILE_NAME, V1_PACKAGE
    for message in file.message_type:
        for f in message.field:
            if f.type_name.startswith(old_prefix):
                f.type_name = new_prefix + f.type_name[len(old_prefix):]
    for service in file.service:
        for method in service.method:
            method.input_type = new_prefix + method.input_type[len(old_prefix):]
            method.output_type = new_prefix + method.output_type[len(old_prefix):]
    file.options.java_package = "io.grpc.reflection.v1"
    file.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    pool.AddSerializedFile(file.SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server | grpc.aio.Server) -> None:
    """Serves reflection (v1 and v1alpha) on `server`, a grpc or grpc.aio server, listing
    `service_names` and both reflection services."""
    _register_v1_descriptor(descriptor_pool.Default())
    names = [*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    reflection.enable_server_reflection(names, server)     # v1alpha
    servicer = (reflection.aio.ReflectionServicer(names) if isinstance(server, grpc.aio.Server)
                else reflection.ReflectionServicer(names))
    v1 = grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
        ),
    })
    server.add_generic_rpc_handlers((v1,))
