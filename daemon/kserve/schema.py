"""The gRPC messages of the Open Inference Protocol, built at import into a private pool.

``grpc_predict_v2.proto`` beside this module is the definition (the protocol's names and
field numbers); :data:`MESSAGES` says the same in a table that is turned into a
``FileDescriptorProto`` here, added to a :class:`~google.protobuf.descriptor_pool.DescriptorPool`
of our own, and made into message classes. Not protoc's generated modules, because those
register ``inference.*`` in protobuf's *default* pool: a process that also imports another
build of the same protocol (tritonclient's, a plant integration's) would fail with a duplicate
symbol, and the generated code pins the protobuf runtime to the generator's version.
``tests/daemon/kserve/test_schema.py`` compiles the .proto and checks it equals this table.

A field is ``(name, number, type)``; the type is a scalar name (``string``, ``bool``, …),
a message name (nested ones as ``Outer.Inner``), ``repeated <type>``, or
``map<Message>`` (string keys). ``InferParameter``'s fields form its oneof.
"""

from __future__ import annotations

from typing import Any, Final

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE: Final = "inference"
SERVICE: Final = f"{PACKAGE}.GRPCInferenceService"
FILE_NAME: Final = "grpc_predict_v2.proto"

_FD = descriptor_pb2.FieldDescriptorProto
SCALARS: Final[dict[str, int]] = {
    "bool": _FD.TYPE_BOOL,
    "int32": _FD.TYPE_INT32,
    "int64": _FD.TYPE_INT64,
    "uint32": _FD.TYPE_UINT32,
    "uint64": _FD.TYPE_UINT64,
    "float": _FD.TYPE_FLOAT,
    "double": _FD.TYPE_DOUBLE,
    "string": _FD.TYPE_STRING,
    "bytes": _FD.TYPE_BYTES,
}

Field = tuple[str, int, str]
_TENSOR: Final[list[Field]] = [
    ("name", 1, "string"),
    ("datatype", 2, "string"),
    ("shape", 3, "repeated int64"),
    ("parameters", 4, "map<InferParameter>"),
    ("contents", 5, "InferTensorContents"),
]
MESSAGES: Final[dict[str, list[Field]]] = {
    "ServerLiveRequest": [],
    "ServerLiveResponse": [("live", 1, "bool")],
    "ServerReadyRequest": [],
    "ServerReadyResponse": [("ready", 1, "bool")],
    "ModelReadyRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelReadyResponse": [("ready", 1, "bool")],
    "ServerMetadataRequest": [],
    "ServerMetadataResponse": [
        ("name", 1, "string"),
        ("version", 2, "string"),
        ("extensions", 3, "repeated string"),
    ],
    "ModelMetadataRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelMetadataResponse.TensorMetadata": [
        ("name", 1, "string"),
        ("datatype", 2, "string"),
        ("shape", 3, "repeated int64"),
    ],
    "ModelMetadataResponse": [
        ("name", 1, "string"),
        ("versions", 2, "repeated string"),
        ("platform", 3, "string"),
        ("inputs", 4, "repeated ModelMetadataResponse.TensorMetadata"),
        ("outputs", 5, "repeated ModelMetadataResponse.TensorMetadata"),
    ],
    "InferParameter": [
        ("bool_param", 1, "bool"),
        ("int64_param", 2, "int64"),
        ("string_param", 3, "string"),
        ("double_param", 4, "double"),
        ("uint64_param", 5, "uint64"),
    ],
    "InferTensorContents": [
        ("bool_contents", 1, "repeated bool"),
        ("int_contents", 2, "repeated int32"),
        ("int64_contents", 3, "repeated int64"),
        ("uint_contents", 4, "repeated uint32"),
        ("uint64_contents", 5, "repeated uint64"),
        ("fp32_contents", 6, "repeated float"),
        ("fp64_contents", 7, "repeated double"),
        ("bytes_contents", 8, "repeated bytes"),
    ],
    "ModelInferRequest.InferInputTensor": _TENSOR,
    "ModelInferRequest.InferRequestedOutputTensor": [
        ("name", 1, "string"),
        ("parameters", 2, "map<InferParameter>"),
    ],
    "ModelInferRequest": [
        ("model_name", 1, "string"),
        ("model_version", 2, "string"),
        ("id", 3, "string"),
        ("parameters", 4, "map<InferParameter>"),
        ("inputs", 5, "repeated ModelInferRequest.InferInputTensor"),
        ("outputs", 6, "repeated ModelInferRequest.InferRequestedOutputTensor"),
        ("raw_input_contents", 7, "repeated bytes"),
    ],
    "ModelInferResponse.InferOutputTensor": _TENSOR,
    "ModelInferResponse": [
        ("model_name", 1, "string"),
        ("model_version", 2, "string"),
        ("id", 3, "string"),
        ("parameters", 4, "map<InferParameter>"),
        ("outputs", 5, "repeated ModelInferResponse.InferOutputTensor"),
        ("raw_output_contents", 6, "repeated bytes"),
    ],
    "ModelConfigRequest": [("name", 1, "string"), ("version", 2, "string")],
    "ModelInput": [("name", 1, "string"), ("data_type", 2, "int32"), ("dims", 4, "repeated int64")],
    "ModelOutput": [
        ("name", 1, "string"),
        ("data_type", 2, "int32"),
        ("dims", 3, "repeated int64"),
    ],
    "ModelConfig": [
        ("name", 1, "string"),
        ("platform", 2, "string"),
        ("max_batch_size", 4, "int32"),
        ("input", 5, "repeated ModelInput"),
        ("output", 6, "repeated ModelOutput"),
        ("backend", 17, "string"),
    ],
    "ModelConfigResponse": [("config", 1, "ModelConfig")],
}
ONEOFS: Final[dict[str, str]] = {"InferParameter": "parameter_choice"}

# The service's methods, each (name, request message, response message).
METHODS: Final[tuple[tuple[str, str, str], ...]] = tuple(
    (name, f"{name}Request", f"{name}Response")
    for name in (
        "ServerLive",
        "ServerReady",
        "ModelReady",
        "ServerMetadata",
        "ModelMetadata",
        "ModelInfer",
        "ModelConfig",
    )
)


def _map_entry_name(field: str) -> str:
    """protoc's name for a map field's entry type: ``parameters`` → ``ParametersEntry``."""
    return "".join(part.capitalize() for part in field.split("_")) + "Entry"


def _add_field(
    message: descriptor_pb2.DescriptorProto, name: str, number: int, kind: str, scope: str
) -> None:
    field = message.field.add(name=name, number=number, json_name=_json_name(name))
    repeated = kind.startswith("repeated ")
    kind = kind.removeprefix("repeated ")
    field.label = _FD.LABEL_REPEATED if repeated else _FD.LABEL_OPTIONAL
    if kind.startswith("map<"):
        entry = message.nested_type.add(name=_map_entry_name(name))
        entry.options.map_entry = True
        _add_field(entry, "key", 1, "string", "")
        _add_field(entry, "value", 2, kind[4:-1], "")
        field.label = _FD.LABEL_REPEATED
        field.type = _FD.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{scope}.{entry.name}"
    elif kind in SCALARS:
        field.type = SCALARS[kind]
    else:
        field.type = _FD.TYPE_MESSAGE
        field.type_name = f".{PACKAGE}.{kind}"


def _json_name(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """The table as the ``FileDescriptorProto`` protoc would make of the .proto."""
    proto = descriptor_pb2.FileDescriptorProto(name=FILE_NAME, package=PACKAGE, syntax="proto3")
    built: dict[str, descriptor_pb2.DescriptorProto] = {}
    for full, fields in MESSAGES.items():  # an outer message is listed after its nested ones
        outer, _, inner = full.partition(".")
        if inner:
            message = descriptor_pb2.DescriptorProto(name=inner)
        else:
            message = proto.message_type.add(name=outer)
            for nested in [n for n in MESSAGES if n.startswith(outer + ".")]:
                message.nested_type.append(built[nested])
        for name, number, kind in fields:
            _add_field(message, name, number, kind, full)
        if full in ONEOFS:
            message.oneof_decl.add(name=ONEOFS[full])
            for field in message.field:
                field.oneof_index = 0
        built[full] = message
    for message in proto.message_type:  # nested map entries after declared nested types
        entries = [n for n in message.nested_type if n.options.map_entry]
        others = [n for n in message.nested_type if not n.options.map_entry]
        del message.nested_type[:]
        message.nested_type.extend(others + entries)
    service = proto.service.add(name=SERVICE.rpartition(".")[2])
    for name, request, response in METHODS:
        service.method.add(
            name=name, input_type=f".{PACKAGE}.{request}", output_type=f".{PACKAGE}.{response}"
        )
    return proto


POOL: Final = descriptor_pool.DescriptorPool()
POOL.Add(file_descriptor())


def message_class(name: str) -> Any:
    """The message class of ``inference.<name>`` (nested: ``Outer.Inner``)."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))


ServerLiveResponse: Final = message_class("ServerLiveResponse")
ServerReadyResponse: Final = message_class("ServerReadyResponse")
ModelReadyResponse: Final = message_class("ModelReadyResponse")
ServerMetadataResponse: Final = message_class("ServerMetadataResponse")
ModelMetadataResponse: Final = message_class("ModelMetadataResponse")
ModelInferRequest: Final = message_class("ModelInferRequest")
ModelInferResponse: Final = message_class("ModelInferResponse")
InferParameter: Final = message_class("InferParameter")
ModelConfigResponse: Final = message_class("ModelConfigResponse")
