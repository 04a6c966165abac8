"""How an image becomes a request frame (``build_request``, ``request_frame``), for both clients.

An image is a path (its bytes are sent encoded: PNG, BMP or JPEG), encoded ``bytes``, a uint8
numpy array ``(H, W)`` (grey) or ``(H, W, 3)`` (RGB) sent raw, or a
:class:`~scratchd.client.regions.RegionImage` already placed in a registered region (the
zero-copy path: the request names where its pixels lie and carries none).

An array's pixels are copied once on their way to the socket: ``request_frame`` encodes them
straight from the array into the frame (a view of the array stands for ``pixels``, which
msgpack encodes as the same bin as the ``bytes`` would be), instead of ``tobytes`` and then a
zero-filled frame buffer and a second copy into it; the bytes sent are the same as
``wire.encode_frame(build_request(...))``'s. ``widen_send_buffer`` lets the socket take a
whole frame at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Final, cast

import msgspec
import numpy as np

from scratchd.client.regions import RegionImage
from scratchd.protocol import wire

ImageInput = str | os.PathLike[str] | bytes | np.ndarray | RegionImage


def build_request(
    request_id: int,
    image: ImageInput,
    *,
    part_class: str | None = None,
    priority: int | None = None,
    deadline_ms: int | None = None,
    want_mask: bool = False,
) -> wire.InferRequest:
    """The wire request for ``image`` (see the module docstring for accepted inputs)."""
    request = _request(request_id, image, part_class, priority, deadline_ms, want_mask)
    if isinstance(request.pixels, memoryview):
        return msgspec.structs.replace(request, pixels=request.pixels.tobytes())
    return request


def request_frame(
    request_id: int,
    image: ImageInput,
    *,
    part_class: str | None = None,
    priority: int | None = None,
    deadline_ms: int | None = None,
    want_mask: bool = False,
    into: bytearray | None = None,
) -> bytearray:
    """``wire.encode_frame(build_request(...))``'s bytes, an array's pixels copied only once:
    from the array into the frame, which grows as msgpack is written (not zero-filled).
    ``into``: a buffer to write the frame into (its contents replaced), else a new one."""
    request = _request(request_id, image, part_class, priority, deadline_ms, want_mask)
    return wire.encode_frame_into(request, bytearray(wire.PREFIX_BYTES) if into is None else into)


def _request(
    request_id: int,
    image: ImageInput,
    part_class: str | None,
    priority: int | None,
    deadline_ms: int | None,
    want_mask: bool,
) -> wire.InferRequest:
    """The request, an array's ``pixels`` a flat view of it (msgpack: the same bin)."""
    common = {
        "id": request_id,
        "part_class": part_class or "normal",
        "priority": priority,
        "deadline_ms": deadline_ms,
        "want_mask": want_mask,
    }
    if isinstance(image, RegionImage):
        return wire.InferRequest(
            region=image.region,
            offset=image.offset,
            height=image.height,
            width=image.width,
            channels=image.channels,
            **common,  # type: ignore[arg-type]
        )
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3):
            raise ValueError(f"expected uint8 (H, W) or (H, W, 3), got {image.dtype} {image.shape}")
        channels = 1 if image.ndim == 2 else image.shape[2]
        view = np.ascontiguousarray(image).data.cast("B")
        return wire.InferRequest(
            pixels=cast(bytes, view),  # encoded from the buffer as is; never decoded
            height=image.shape[0],
            width=image.shape[1],
            channels=channels,
            **common,  # type: ignore[arg-type]
        )
    data = image if isinstance(image, bytes) else Path(image).read_bytes()
    return wire.InferRequest(encoded=data, **common)  # type: ignore[arg-type]


SEND_BUFFER_BYTES: Final = 4 * 1024 * 1024


def widen_send_buffer(sock: socket.socket | None) -> None:
    """Let a whole 1 MiB frame sit in the daemon's receive queue (the kernel caps this at
    ``net.core.wmem_max``): the daemon then reads a frame in one or two ``recv`` calls
    instead of one per ~200 KiB (the default send buffer), and wakes up that much less."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)


def closing_reason(sock: socket.socket) -> str:
    """``": <reason>"`` from the reply with id 0 among the whole frames ``sock`` holds now,
    read without waiting (a daemon that closed the connection said why last), else ``""``.
    Only for a connection already lost, read from a frame's start: what it reads is gone."""
    data = bytearray()
    with contextlib.suppress(OSError):  # dry (EAGAIN), reset once drained, or closed
        while chunk := sock.recv(1 << 16, socket.MSG_DONTWAIT):
            data += chunk
    said, view = "", memoryview(data)
    while len(view) >= wire.PREFIX_BYTES:
        end = wire.PREFIX_BYTES + wire.frame_length(view[: wire.PREFIX_BYTES])
        if len(view) < end:
            break
        try:
            message = wire.decode_daemon_message(view[wire.PREFIX_BYTES : end])
        except wire.DecodeError:
            break
        if message.id == 0 and isinstance(message, wire.Reply):
            said = f": {message.error}"
        view = view[end:]
    return said
