"""Server reflection answers on grpc.reflection.v1 and v1alpha, on the scheduler and the worker,
through clients built from each version's own message types."""
from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from common.reflection import V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME
from tests.support.procs import free_port


def _v1_messages(channel: grpc.Channel):
    """grpc.reflection.v1's message classes, built from the descriptor the server itself serves
    (asked over v1alpha) in a pool of their own: so the v1 client below depends on nothing of ours."""
    reply = _ask(channel, "v1alpha", file_containing_symbol=V1_SERVICE_NAME)
    pool = descriptor_pool.DescriptorPool()
    for serialized in reply.file_descriptor_response.file_descriptor_proto:
        pool.Add(descriptor_pb2.FileDescriptorProto.FromString(serialized))
    return tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"grpc.reflection.v1.{name}"))
                 for name in ("ServerReflectionRequest", "ServerReflectionResponse"))


def _ask(channel: grpc.Channel, version: str, **fields):
    """Sends one reflection request of `version` (v1 or v1alpha) and returns the reply."""
    if version == "v1":
        request_cls, response_cls = _v1_messages(channel)
        service = V1_SERVICE_NAME
    else:
        request_cls, response_cls = v1alpha_pb2.ServerReflectionRequest, v1alpha_pb2.ServerReflectionResponse
        service = V1ALPHA_SERVICE_NAME
    call = channel.stream_stream(f"/{service}/ServerReflectionInfo", request_serializer=request_cls.SerializeToString,
                                 response_deserializer=response_cls.FromString)
    [reply] = call(iter([request_cls(**fields)]), timeout=10)
    assert type(reply).DESCRIPTOR.full_name == f"{service.rpartition('.')[0]}.ServerReflectionResponse"
    return reply


def _files(reply) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in reply.file_descriptor_response.file_descriptor_proto]
    return {f.package: f for f in files}


@pytest.fixture(scope="module")
def worker_addr():
    from worker_svc.server import WorkerServer   # no model: reflection answers while the model loads
    server = WorkerServer("127.0.0.1", free_port())
    server.start()
    yield server.address
    server.stop(grace=0)


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_the_scheduler_lists_and_describes_its_services(services, version):
    with services.channel() as channel:
        listed = {s.name for s in _ask(channel, version, list_services="").list_services_response.service}
        assert listed == {"llm.v1.Generation", "grpc.health.v1.Health", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME}
        generation = _files(_ask(channel, version, file_containing_symbol="llm.v1.Generation"))["llm.v1"]
        [service] = generation.service
        assert [m.name for m in service.method] == ["Generate", "Chat", "Tokenize", "Detokenize", "Abort", "GetModelInfo"]
        assert generation.options.go_package and generation.options.java_package
        # A client that describes every listed service needs the reflection services too.
        for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME):
            package = name.rpartition(".")[0]
            [reflection_service] = _files(_ask(channel, version, file_containing_symbol=name))[package].service
            assert reflection_service.method[0].input_type == f".{package}.ServerReflectionRequest"


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_the_worker_lists_and_describes_its_services(worker_addr, version):
    with grpc.insecure_channel(worker_addr) as channel:
        listed = {s.name for s in _ask(channel, version, list_services="").list_services_response.service}
        assert listed == {"llm.worker.v1.Worker", "grpc.health.v1.Health", V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME}
        worker = _files(_ask(channel, version, file_containing_symbol="llm.worker.v1.Worker"))["llm.worker.v1"]
        assert [m.name for m in worker.service[0].method] == ["Describe", "Step", "Steps", "Reset", "Claim",
                                                                   "PrepareGrammar"]
        unknown = _ask(channel, version, file_containing_symbol="no.such.Service")
        assert unknown.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
