"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), grpc.aio on the
daemon's loop.

The messages are ``schema``'s (built from ``grpc_predict_v2.proto``); the methods are the
protocol's health, metadata and ``ModelInfer``. The input's bytes come in
``raw_input_contents`` (or, for small requests, ``contents.uint_contents``); outputs go back
in ``raw_output_contents``, one entry per output in order. An error is the call's status:
``tensors.GRPC_CODE`` for a reply that is not ``ok``, ``INVALID_ARGUMENT`` for a request that
cannot be served as sent, ``NOT_FOUND`` for an unknown model or version.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Final

import grpc
import numpy as np

from scratchd.daemon.kserve import model_info, schema, tensors
from scratchd.daemon.kserve.bridge import Bridge
from scratchd.daemon.kserve.model_info import Served

MESSAGE_OVERHEAD: Final = 64 * 1024
MAX_FRAMES_PER_CALL: Final = 16
"""A call may carry this many frames of the largest size (``queue.slot_bytes``, RGB)."""

Handler = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class GrpcEndpoint:
    """The service on one TCP port (``start``; ``port`` is the one bound)."""

    def __init__(self, bridge: Bridge, served: Served, slot_bytes: int) -> None:
        self.bridge = bridge
        self.served = served
        self.port = 0
        self.max_message = MAX_FRAMES_PER_CALL * 3 * slot_bytes + MESSAGE_OVERHEAD
        self._server: grpc.aio.Server | None = None

    def _handlers(self) -> grpc.GenericRpcHandler:
        methods: dict[str, Handler] = {
            "ServerLive": self.server_live,
            "ServerReady": self.server_ready,
            "ModelReady": self.model_ready,
            "ServerMetadata": self.server_metadata,
            "ModelMetadata": self.model_metadata,
            "ModelInfer": self.model_infer,
            "ModelConfig": self.model_config,
        }
        handlers = {}
        for name, request, response in schema.METHODS:
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                methods[name],
                request_deserializer=schema.message_class(request).FromString,
                response_serializer=schema.message_class(response).SerializeToString,
            )
        return grpc.method_handlers_generic_handler(schema.SERVICE, handlers)

    async def start(self, host: str, port: int) -> None:
        options = [
            ("grpc.max_receive_message_length", self.max_message),
            ("grpc.max_send_message_length", self.max_message),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.aio.server(options=options)
        self._server.add_generic_rpc_handlers((self._handlers(),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"gRPC endpoint cannot bind {address}")
        await self._server.start()

    async def close(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None

    # ---- health and metadata -----------------------------------------------------------

    async def server_live(self, _request: Any, _context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerLiveResponse(live=True)

    async def server_ready(self, _request: Any, _context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerReadyResponse(ready=self.served.ready())

    async def server_metadata(self, _request: Any, _context: grpc.aio.ServicerContext) -> Any:
        return schema.ServerMetadataResponse(**model_info.server_metadata())

    async def _check_model(
        self, name: str, version: str, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            tensors.check_model(name, version, self.served.version())
        except tensors.NotFound as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))

    async def model_ready(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.name, request.version, context)
        return schema.ModelReadyResponse(ready=self.served.ready())

    async def model_metadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.name, request.version, context)
        return schema.ModelMetadataResponse(**model_info.model_metadata(self.served.version()))

    async def model_config(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.name, request.version, context)
        return schema.ModelConfigResponse(config=model_info.model_config(numeric_types=True))

    # ---- inference ---------------------------------------------------------------------

    async def model_infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._check_model(request.model_name, request.model_version, context)
        try:
            frames, batch, names = _parse(request)
        except tensors.TensorError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        replies = await self.bridge.infer(frames)
        failed = tensors.failure(replies)
        if failed is not None:
            code = getattr(grpc.StatusCode, tensors.GRPC_CODE.get(failed.status, "INTERNAL"))
            await context.abort(code, tensors.error_message(failed, len(replies)))
        try:
            outputs = tensors.outputs(replies, names, batch)
        except tensors.TensorError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        response = schema.ModelInferResponse(
            model_name=tensors.MODEL, model_version=self.served.version(), id=request.id
        )
        for tensor in outputs:
            response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
            response.raw_output_contents.append(tensor.data)
        return response


def _parameters(params: Any) -> dict[str, object]:
    """A protobuf parameter map as plain values (whichever of the oneof is set)."""
    values: dict[str, object] = {}
    for key, param in params.items():
        kind = param.WhichOneof("parameter_choice")
        if kind is not None:
            values[key] = getattr(param, kind)
    return values


def _parse(request: Any) -> tuple[list[Any], bool, tuple[str, ...]]:
    if len(request.inputs) != 1:
        raise tensors.TensorError(f"expected exactly one input, {tensors.INPUT!r}")
    tensor = request.inputs[0]
    tensors.check_input(tensor.name, tensor.datatype, list(tensor.shape))
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            raise tensors.TensorError("raw_input_contents must hold exactly the one input")
        data: bytes = request.raw_input_contents[0]
    elif tensor.contents.uint_contents:
        values = np.asarray(tensor.contents.uint_contents, dtype=np.uint32)
        if values.max() > 255:
            raise tensors.TensorError("UINT8 input contents must be within 0..255")
        data = values.astype(np.uint8).tobytes()
    else:
        raise tensors.TensorError(f"input {tensors.INPUT!r} has no contents")
    names = tensors.wanted_outputs([o.name for o in request.outputs])
    opts = tensors.options(_parameters(request.parameters))
    frames, batch = tensors.images(
        tensor.datatype, list(tensor.shape), data, opts, want_mask="mask" in names
    )
    return frames, batch, names
