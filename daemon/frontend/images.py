"""What a request's image must be, and how it gets into its payload slot.

``check_image`` rejects what can be seen to be wrong before any pixel is touched (which of
raw / encoded, channels, sizes, a shape whose padded area would cost far more than its pixel
count, a byte count that does not match the shape). Then, on the acceptor's loop, raw grey
pixels are copied into the slot (``write_raw_grey``: one memcpy from the received frame);
encoded images and raw RGB are converted by ``convert_into`` in the decode thread pool,
straight into the slot.

The request may be a :class:`~scratchd.protocol.wire.InferRequest` (``pixels`` as bytes) or the
daemon's zero-copy :class:`~scratchd.protocol.wire.InferFrame` (``pixels`` a view of the frame):
both only need the buffer protocol.
"""

from __future__ import annotations

import functools

import numpy as np
from PIL import Image

from scratchd.kernels.normalize_pad import padded_size
from scratchd.protocol import wire
from scratchd.protocol.image import ImageError, decode_image, sniff_format, to_grey

AnyInferRequest = wire.InferRequest | wire.InferFrame


class Invalid(ValueError):
    """A request that cannot be served as sent; the message goes back to the client."""


def check_image(request: AnyInferRequest, slot_bytes: int) -> None:
    """Reject what can be seen to be wrong before any pixel is touched. (A request whose
    pixels lie in a client region has its bytes checked there, ``RegionDesk.resolve``, and
    only its shape here: ``check_shape``.)"""
    if (request.pixels is None) == (request.encoded is None):
        raise Invalid("exactly one of 'pixels' (raw) or 'encoded' (PNG/BMP/JPEG) must be set")
    if request.encoded is not None:
        if sniff_format(request.encoded) is None:
            raise Invalid("'encoded' is not a PNG, BMP or JPEG image")
        return
    assert request.pixels is not None
    h, w, c = request.height, request.width, request.channels
    check_shape(h, w, c, slot_bytes)
    if len(request.pixels) != h * w * c:
        raise Invalid(f"'pixels' has {len(request.pixels)} bytes, {h}x{w}x{c} needs {h * w * c}")


def check_shape(h: int, w: int, c: int, slot_bytes: int) -> None:
    """Reject a raw image's declared shape: channels, sizes, a slot's worth of pixels, a shape
    that pads to far more (``shape_cost_error``). What a request whose pixels lie in a
    client region is checked against (its bytes are bounds-checked there, not counted)."""
    if c not in (1, 3):
        raise Invalid(f"channels must be 1 (grey) or 3 (RGB), got {c}")
    if h <= 0 or w <= 0:
        raise Invalid(f"raw image needs positive height and width, got {h}x{w}")
    if h * w > slot_bytes:
        raise Invalid(f"image of {h}x{w} = {h * w} pixels exceeds the limit of {slot_bytes}")
    reason = shape_cost_error(h, w, slot_bytes)
    if reason:
        raise Invalid(reason)


def write_raw_grey(payload: memoryview, request: AnyInferRequest) -> tuple[int, int]:
    assert request.pixels is not None
    n = request.height * request.width
    np.frombuffer(payload, dtype=np.uint8, count=n)[:] = np.frombuffer(request.pixels, np.uint8)
    return request.height, request.width


def convert_into(payload: memoryview, request: AnyInferRequest) -> tuple[int, int]:
    """Decode/convert the request's image into ``payload`` as grey uint8; returns (H, W).

    Runs in the decode thread pool. Encoded images go through ``decode_image`` with the slot
    size as the pixel limit (checked from the header, before decoding).
    """
    slot_bytes = len(payload)
    if request.encoded is not None:
        grey = decode_image(request.encoded, max_pixels=slot_bytes)
    else:
        assert request.pixels is not None
        rgb = np.frombuffer(request.pixels, np.uint8).reshape(request.height, request.width, 3)
        grey = to_grey(Image.fromarray(rgb, "RGB"))  # the luma an encoded RGB image gets
    height, width = grey.shape
    reason = shape_cost_error(height, width, slot_bytes)
    if reason:
        raise ImageError(reason)
    np.frombuffer(payload, dtype=np.uint8, count=grey.size)[:] = grey.ravel()
    return int(height), int(width)


@functools.lru_cache(maxsize=1024)  # asked per request; a line sends few shapes
def shape_cost_error(height: int, width: int, slot_bytes: int) -> str:
    """Why a frame's shape would cost far more than its pixel count, or "" if it will not.

    The network pads each side to a multiple of 16 (``kernels.normalize_pad``): its cost and
    memory follow the padded area, not the pixel count.
    A 1 x 4M frame fits a 4 MiB slot but pads to 16 x 4M: sixteen times the largest frame's
    compute and activation memory, enough to OOM a worker or stall it past its heartbeat.
    The padded area may be at most twice the slot: room for the padding of any frame that
    is not extremely elongated (a full-slot frame needs a shorter side of about 8 or more).
    """
    padded = padded_size(height) * padded_size(width)
    if padded <= 2 * slot_bytes:
        return ""
    return (
        f"image of {height}x{width} pads to {padded} pixels for the network, more than twice "
        f"the limit of {slot_bytes}; send frames that are less elongated"
    )
