"""The Open Inference Protocol over HTTP/REST (KServe v2), an aiohttp server on the daemon's loop.

Routes (``{m}`` is ``/v2/models/scratchnet``, optionally ``/versions/<version>``)::

    GET  /v2/health/live     200 while the loop answers
    GET  /v2/health/ready    200 while the daemon serves with a READY worker; else 400
    GET  /v2                 server metadata
    GET  {m}                 model metadata            GET {m}/ready   200 / 400
    GET  {m}/config          model configuration (the extension perf_analyzer reads)
    POST {m}/infer           inference

An inference body is JSON, or with the binary tensor data extension a JSON header of
``Inference-Header-Content-Length`` bytes followed by the tensors' bytes: an input whose
``parameters`` hold ``binary_data_size`` takes that many bytes, in input order. Outputs are
binary when the output's ``binary_data`` parameter or the request's ``binary_data_output`` is
true, else JSON ``data`` lists. An error is ``{"error": "..."}`` with the status
``tensors.HTTP_STATUS`` gives (404 for an unknown model or version).
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np
from aiohttp import web

from scratchd.daemon.kserve import model_info, tensors
from scratchd.daemon.kserve.bridge import Bridge
from scratchd.daemon.kserve.model_info import Served

HEADER_LENGTH: Final = "Inference-Header-Content-Length"
MAX_FRAMES_PER_BODY: Final = 16
"""A body may hold this many frames of the largest size (``queue.slot_bytes``, RGB)."""
_JSON = msgspec.json.Encoder()


def _json(status: int, document: Any) -> web.Response:
    return web.Response(status=status, body=_JSON.encode(document), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return _json(status, {"error": message})


class HttpEndpoint:
    """The routes above on one TCP port (``start``; ``port`` is the one bound)."""

    def __init__(self, bridge: Bridge, served: Served, slot_bytes: int) -> None:
        self.bridge = bridge
        self.served = served
        self.port = 0
        max_body = MAX_FRAMES_PER_BODY * 3 * slot_bytes + 64 * 1024
        self.app = web.Application(client_max_size=max_body)
        model = "/v2/models/{model}"
        version = model + "/versions/{version}"
        self.app.add_routes(
            [
                web.get("/v2/health/live", self.live),
                web.get("/v2/health/ready", self.ready),
                web.get("/v2", self.metadata),
                *(web.get(prefix, self.model_metadata) for prefix in (model, version)),
                *(web.get(prefix + "/ready", self.model_ready) for prefix in (model, version)),
                *(web.get(prefix + "/config", self.model_config) for prefix in (model, version)),
                *(web.post(prefix + "/infer", self.infer) for prefix in (model, version)),
            ]
        )
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, reuse_address=True)
        await site.start()
        self.port = int(self._runner.addresses[0][1])  # the bound one, for port 0

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- health and metadata -----------------------------------------------------------

    async def live(self, _request: web.Request) -> web.Response:
        return _json(200, {"live": True})

    async def ready(self, _request: web.Request) -> web.Response:
        ready = self.served.ready()
        return _json(200 if ready else 400, {"ready": ready})

    async def metadata(self, _request: web.Request) -> web.Response:
        return _json(200, model_info.server_metadata())

    def _model(self, request: web.Request) -> web.Response | None:
        """None when the request names the served model (and version), else the 404."""
        try:
            tensors.check_model(
                request.match_info["model"],
                request.match_info.get("version", ""),
                self.served.version(),
            )
        except tensors.NotFound as exc:
            return _error(404, str(exc))
        return None

    async def model_metadata(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(200, model_info.model_metadata(self.served.version()))

    async def model_ready(self, request: web.Request) -> web.Response:
        if (missing := self._model(request)) is not None:
            return missing
        ready = self.served.ready()
        return _json(200 if ready else 400, {"name": tensors.MODEL, "ready": ready})

    async def model_config(self, request: web.Request) -> web.Response:
        return self._model(request) or _json(200, model_info.model_config())

    # ---- inference ---------------------------------------------------------------------

    async def infer(self, request: web.Request) -> web.Response:
        if (missing := self._model(request)) is not None:
            return missing
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            return _error(413, exc.text or "request body too large")
        try:
            header, frames, batch, names, binary = _parse(body, request.headers.get(HEADER_LENGTH))
        except tensors.TensorError as exc:
            return _error(400, str(exc))
        replies = await self.bridge.infer(frames)
        failed = tensors.failure(replies)
        if failed is not None:
            status = tensors.HTTP_STATUS.get(failed.status, 500)
            return _error(status, tensors.error_message(failed, len(replies)))
        try:
            outputs = tensors.outputs(replies, names, batch)
        except tensors.TensorError as exc:
            return _error(500, str(exc))
        return _respond(header, outputs, binary, self.served.version())


def _parse(
    body: bytes, header_length: str | None
) -> tuple[dict[str, Any], list[Any], bool, tuple[str, ...], set[str]]:
    """The request header, its frames, whether a batch, the outputs and which are binary."""
    try:
        split = len(body) if header_length is None else int(header_length)
    except ValueError:
        raise tensors.TensorError(f"{HEADER_LENGTH} is not a number: {header_length!r}") from None
    if not 0 <= split <= len(body):
        raise tensors.TensorError(
            f"{HEADER_LENGTH} {split} is outside the body's {len(body)} bytes"
        )
    try:
        header = msgspec.json.decode(body[:split])
    except msgspec.DecodeError as exc:
        raise tensors.TensorError(f"request header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise tensors.TensorError("request header must be a JSON object")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise tensors.TensorError(f"expected exactly one input, {tensors.INPUT!r}")
    tensor = inputs[0]
    params = _dict(header.get("parameters"), "parameters")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        raise tensors.TensorError("input shape must be a list of integers")
    tensors.check_input(str(tensor.get("name")), str(tensor.get("datatype")), shape)
    data = _input_bytes(tensor, memoryview(body)[split:])
    requested = header.get("outputs") or []
    if not isinstance(requested, list) or not all(isinstance(o, dict) for o in requested):
        raise tensors.TensorError("outputs must be a list of objects")
    names = tensors.wanted_outputs([str(o.get("name")) for o in requested])
    everything_binary = params.get("binary_data_output") is True
    binary = {
        str(o.get("name"))
        for o in requested
        if _dict(o.get("parameters"), "output parameters").get("binary_data", everything_binary)
    }
    if not requested and everything_binary:
        binary = set(names)
    frames, batch = tensors.images(
        "UINT8", shape, data, tensors.options(params), want_mask="mask" in names
    )
    return header, frames, batch, names, binary


def _dict(value: object, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise tensors.TensorError(f"{what} must be a JSON object")
    return value


def _input_bytes(tensor: dict[str, Any], binary: memoryview) -> bytes | memoryview:
    size = _dict(tensor.get("parameters"), "input parameters").get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or not 0 <= size <= len(binary):
            raise tensors.TensorError(
                f"binary_data_size {size!r} does not fit the {len(binary)} bytes after the header"
            )
        return binary[:size]
    data = tensor.get("data")
    if data is None:
        raise tensors.TensorError(f"input {tensors.INPUT!r} has neither data nor binary_data_size")
    try:
        values = np.asarray(data, dtype=np.int64).ravel()
    except (ValueError, TypeError, OverflowError):
        raise tensors.TensorError("input data must be integers") from None
    if values.size and (values.min() < 0 or values.max() > 255):
        raise tensors.TensorError("UINT8 input data must be within 0..255")
    return values.astype(np.uint8).tobytes()


def _respond(
    header: dict[str, Any], outputs: list[tensors.Tensor], binary: set[str], version: str
) -> web.Response:
    document: dict[str, Any] = {"model_name": tensors.MODEL, "model_version": version}
    if isinstance(header.get("id"), str):
        document["id"] = header["id"]
    entries, blobs = [], []
    for tensor in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": tensor.shape,
        }
        if tensor.name in binary:
            entry["parameters"] = {"binary_data_size": len(tensor.data)}
            blobs.append(tensor.data)
        else:
            entry["data"] = tensor.values()
        entries.append(entry)
    document["outputs"] = entries
    head = _JSON.encode(document)
    if not blobs:
        return web.Response(status=200, body=head, content_type="application/json")
    response = web.Response(status=200, body=b"".join([head, *blobs]))
    response.content_type = "application/octet-stream"
    response.headers[HEADER_LENGTH] = str(len(head))
    return response
