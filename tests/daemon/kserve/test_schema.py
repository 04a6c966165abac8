"""The gRPC messages built at import are the .proto's, and speak what tritonclient speaks."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from tritonclient.grpc import service_pb2

from scratchd.daemon.kserve import schema

PROTO = Path(schema.__file__).with_name(schema.FILE_NAME)


def test_the_table_is_the_proto(tmp_path: Path) -> None:
    out = tmp_path / "set.pb"
    includes = str(importlib.resources.files("grpc_tools") / "_proto")
    argv = ["protoc", "-I", str(PROTO.parent), "-I", includes, f"--descriptor_set_out={out}"]
    assert protoc.main([*argv, PROTO.name]) == 0
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    assert compiled == schema.file_descriptor()


def test_every_field_matches_tritonclients_build_of_the_protocol() -> None:
    """Same names, numbers and wire types for every message both define (Triton's
    DataType enum is an int32 here: the same varint on the wire)."""
    pool = service_pb2.DESCRIPTOR.pool
    for name in schema.MESSAGES:
        ours = schema.POOL.FindMessageTypeByName(f"inference.{name}")
        theirs = pool.FindMessageTypeByName(f"inference.{name}")
        theirs_by_number = {f.number: f for f in theirs.fields}
        for field in ours.fields:
            other = theirs_by_number[field.number]
            assert other.name == field.name, (name, field.name)
            kind = {other.TYPE_ENUM: other.TYPE_INT32}.get(other.type, other.type)
            assert (kind, other.is_repeated) == (field.type, field.is_repeated), (name, field.name)
    service = pool.FindServiceByName("inference.GRPCInferenceService")
    for method, request, response in schema.METHODS:
        found = service.methods_by_name[method]
        assert (found.input_type.name, found.output_type.name) == (request, response)
