"""The model as the Open Inference Protocol sees it, for both transports (HTTP and gRPC).

Model ``scratchnet`` (its version: the served model file's), one input, four outputs::

    image   UINT8  [H, W] grey or [H, W, 3] RGB; a batch [N, H, W] / [N, H, W, 3] is N requests
    score   FP32   [1]    (a batch: [N])          the image score
    defect  BOOL   [1]    (a batch: [N])          the verdict: True when ``defect``
    boxes   FP32   [K, 5] (a batch: [N, K, 5])    x0, y0, x1, y1 (pixels, x1/y1 exclusive), score;
                                                  a batch pads each image's rows to the largest
                                                  K with rows of zeros (an empty box)
    mask    UINT8  [H, W] (a batch: [N, H, W])    0/255; only when the request names it

A request's ``parameters`` may hold ``part_class`` (string), ``priority`` (0..7, higher
first, as on the Unix socket: not Triton's order, where 1 is highest) and ``deadline_ms``
(int); without ``deadline_ms``, Triton's ``timeout`` (microseconds, what tritonclient's
``timeout=`` sends) is the deadline. A batch's images share them; each is one
request in the daemon's queue, and the call is answered when all are. A call whose images are
not all ``ok`` is answered with the protocol's error for the first one that is not
(:data:`HTTP_STATUS`, :data:`GRPC_CODE`: whether a client should retry).

Nothing here knows HTTP or gRPC: :func:`images` turns an input tensor's bytes into request
frames, :func:`outputs` turns the replies into output tensors (name, datatype, shape, bytes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from scratchd.protocol import wire

MODEL: Final = "scratchnet"
SERVER: Final = "scratchd"
PLATFORM: Final = "scratchd"
INPUT: Final = "image"
DEFAULT_OUTPUTS: Final = ("score", "defect", "boxes")
OUTPUTS: Final = (*DEFAULT_OUTPUTS, "mask")
DATATYPES: Final[dict[str, str]] = {
    INPUT: "UINT8",
    "score": "FP32",
    "defect": "BOOL",
    "boxes": "FP32",
    "mask": "UINT8",
}
SHAPES: Final[dict[str, list[int]]] = {  # -1: any size; metadata shows the single-image form
    INPUT: [-1, -1],
    "score": [1],
    "defect": [1],
    "boxes": [-1, 5],
    "mask": [-1, -1],
}

HTTP_STATUS: Final[dict[wire.ReplyStatus, int]] = {
    "invalid": 400,  # the request is wrong: do not retry it as sent
    "error": 500,  # the daemon failed this request
    "overloaded": 503,  # retry later, or elsewhere
    "timeout": 504,  # its deadline passed in the queue: retry if it still matters
}
GRPC_CODE: Final[dict[wire.ReplyStatus, str]] = {  # names of grpc.StatusCode
    "invalid": "INVALID_ARGUMENT",
    "error": "INTERNAL",
    "overloaded": "UNAVAILABLE",
    "timeout": "DEADLINE_EXCEEDED",
}


class TensorError(ValueError):
    """A request this protocol cannot serve as sent (400 / INVALID_ARGUMENT)."""


class NotFound(LookupError):
    """A model or version this server does not have (404 / NOT_FOUND)."""


@dataclass(frozen=True)
class Options:
    """The request parameters every image of one call gets."""

    part_class: str = "normal"
    priority: int | None = None
    deadline_ms: int | None = None


def check_model(name: str, version: str, served: str) -> None:
    """Raise :class:`NotFound` unless ``name`` (and ``version``, when given) is served."""
    if name != MODEL:
        raise NotFound(f"unknown model {name!r}; this server has {MODEL!r}")
    if version and version != served:
        raise NotFound(f"model {MODEL!r} has no version {version!r}; it serves {served!r}")


def options(parameters: Mapping[str, object]) -> Options:
    """The scratchd parameters of a request (other parameters are the protocol's: ignored)."""
    part_class = parameters.get("part_class", "normal")
    if not isinstance(part_class, str):
        raise TensorError(f"parameter part_class must be a string, got {part_class!r}")
    deadline_ms = _int_param(parameters, "deadline_ms")
    timeout_us = _int_param(parameters, "timeout")
    if deadline_ms is None and timeout_us:  # Triton's request timeout, in microseconds
        deadline_ms = max(1, -(-timeout_us // 1000))
    return Options(part_class, _int_param(parameters, "priority"), deadline_ms)


def _int_param(parameters: Mapping[str, object], name: str) -> int | None:
    value = parameters.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TensorError(f"parameter {name} must be an integer, got {value!r}")
    return value


def wanted_outputs(names: Sequence[str]) -> tuple[str, ...]:
    """The outputs to answer: those named (each known), or the default three."""
    for name in names:
        if name not in OUTPUTS:
            raise TensorError(f"unknown output {name!r}; the model has {', '.join(OUTPUTS)}")
    return tuple(dict.fromkeys(names)) if names else DEFAULT_OUTPUTS


def check_input(name: str, datatype: str, shape: Sequence[int]) -> tuple[list[int], bool]:
    """The input's shape as one image ``[H, W, C]``-style list and whether it is a batch."""
    if name != INPUT:
        raise TensorError(f"unknown input {name!r}; the model takes {INPUT!r}")
    if datatype != "UINT8":
        raise TensorError(f"input {INPUT!r} must be UINT8, got {datatype}")
    dims = [int(d) for d in shape]
    if any(d <= 0 for d in dims):
        raise TensorError(f"input {INPUT!r} has shape {dims}; every dimension must be positive")
    if len(dims) == 2:
        return dims, False
    if len(dims) == 3:  # [H, W, 3] or [N, H, W]: a last axis of 3 means RGB
        return (dims, False) if dims[2] == 3 else (dims, True)
    if len(dims) == 4 and dims[3] == 3:
        return dims, True
    raise TensorError(
        f"input {INPUT!r} has shape {dims}; expected [H, W], [H, W, 3], [N, H, W] or [N, H, W, 3]"
    )


def images(
    datatype: str, shape: Sequence[int], data: bytes | memoryview, opts: Options, want_mask: bool
) -> tuple[list[wire.InferFrame], bool]:
    """The request frames for an input tensor's raw bytes, and whether it was a batch."""
    dims, batch = check_input(INPUT, datatype, shape)
    expected = int(np.prod(dims))
    if len(data) != expected:
        raise TensorError(
            f"input {INPUT!r} of shape {dims} needs {expected} bytes, got {len(data)}"
        )
    per_image = dims[1:] if batch else dims
    count = dims[0] if batch else 1
    height, width = per_image[0], per_image[1]
    channels = per_image[2] if len(per_image) == 3 else 1
    size = height * width * channels
    view = memoryview(data).cast("B")
    frames = [
        wire.InferFrame(
            id=i,
            part_class=opts.part_class,
            pixels=view[i * size : (i + 1) * size],
            height=height,
            width=width,
            channels=channels,
            priority=opts.priority,
            deadline_ms=opts.deadline_ms,
            want_mask=want_mask,
        )
        for i in range(count)
    ]
    return frames, batch


def failure(replies: Sequence[wire.Reply]) -> wire.Reply | None:
    """The first reply that is not ``ok`` (the call's answer is its error), or None."""
    return next((r for r in replies if r.status != "ok"), None)


def error_message(reply: wire.Reply, count: int) -> str:
    where = f"image {reply.id} of {count}: " if count > 1 else ""
    return f"{reply.status}: {where}{reply.error or reply.status}"


@dataclass(frozen=True)
class Tensor:
    """One output tensor: its bytes are little-endian, row-major (BOOL: one byte each)."""

    name: str
    datatype: str
    shape: list[int]
    data: bytes

    def values(self) -> list[object]:
        """The elements as a flat list (the JSON form of a non-binary output)."""
        dtype = {"FP32": "<f4", "BOOL": "?", "UINT8": "u1"}[self.datatype]
        return np.frombuffer(self.data, dtype=dtype).tolist()


def outputs(replies: Sequence[wire.Reply], names: Sequence[str], batch: bool) -> list[Tensor]:
    """The output tensors of ``ok`` replies, in the order ``names`` gives."""
    lead = [len(replies)] if batch else []
    tensors = []
    for name in names:
        if name == "score":
            array = np.array([r.score for r in replies], dtype="<f4")
            tensors.append(Tensor(name, "FP32", lead or [1], array.tobytes()))
        elif name == "defect":
            array = np.array([r.verdict == "defect" for r in replies], dtype=bool)
            tensors.append(Tensor(name, "BOOL", lead or [1], array.tobytes()))
        elif name == "boxes":
            rows = max((len(r.boxes) for r in replies), default=0)
            array = np.zeros((len(replies), rows, 5), dtype="<f4")
            for i, r in enumerate(replies):
                if r.boxes:
                    array[i, : len(r.boxes)] = np.asarray(r.boxes, dtype="<f4")
            tensors.append(Tensor(name, "FP32", [*lead, rows, 5], array.tobytes()))
        elif name == "mask":
            masks = [_mask(r) for r in replies]
            tensors.append(
                Tensor(
                    name, "UINT8", [*lead, *masks[0].shape], b"".join(m.tobytes() for m in masks)
                )
            )
    return tensors


def _mask(reply: wire.Reply) -> np.ndarray:
    mask = wire.unpack_mask(reply)
    if mask is None:
        raise TensorError("the worker returned no mask")
    return mask
