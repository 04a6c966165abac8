"""Decoding request and dataset images into greyscale uint8 arrays.

One place decides what an acceptable image is, for the acceptor (requests), the dataset
tools (shards) and ``scratchd eval``:

- encoded PNG, BMP or JPEG bytes, recognised by their signature, never by a file name;
- the header is read first and the pixel count checked against ``max_pixels`` *before*
  any pixel is decoded (decompression-bomb protection: a 40-byte PNG header can claim
  a 60000x60000 canvas);
- colour is converted to 8-bit luma (ITU-R 601-2, Pillow's ``L`` mode); 16-bit greyscale
  is scaled to 8 bits;
- every failure is an :class:`ImageError` with a reason fit to send back to a client.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

# Signatures of the formats a line camera delivers.
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"BM", "BMP"),
    (b"\xff\xd8\xff", "JPEG"),
)

DEFAULT_MAX_PIXELS = 4096 * 4096


class ImageError(ValueError):
    """The bytes are not an image scratchd accepts; the message says why."""


def sniff_format(data: bytes | memoryview) -> str | None:
    """The format named by the leading bytes (``PNG``, ``BMP``, ``JPEG``) or None."""
    head = bytes(data[:8])
    for magic, name in _SIGNATURES:
        if head.startswith(magic):
            return name
    return None


def decode_image(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode PNG/BMP/JPEG bytes to a C-contiguous ``uint8`` array of shape ``(H, W)``.

    Raises :class:`ImageError` for unknown formats, truncated or corrupt data, and images
    whose header claims more than ``max_pixels`` pixels (checked before decoding).
    """
    fmt = sniff_format(data)
    if fmt is None:
        raise ImageError("not a PNG, BMP or JPEG image")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb check warns or raises at its limits; ours is stricter and
            # runs first, so silence its warning and keep its error as a corrupt image.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(bytes(data)), formats=[fmt])
            width, height = img.size
            if width <= 0 or height <= 0:
                raise ImageError(f"{fmt} image has an empty size {width}x{height}")
            if width * height > max_pixels:
                raise ImageError(
                    f"{fmt} image is {width}x{height} = {width * height} pixels, "
                    f"more than the limit of {max_pixels}"
                )
            img.load()
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(
            f"{fmt} image has more pixels than the limit of {max_pixels}: {exc}"
        ) from None
    except (OSError, ValueError, SyntaxError) as exc:
        raise ImageError(f"corrupt or truncated {fmt} image: {exc}") from None
    return to_grey(img)


def to_grey(img: Image.Image) -> np.ndarray:
    """Convert a decoded Pillow image to a contiguous uint8 ``(H, W)`` array."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(img, dtype=np.uint32)
        peak = 65535 if img.mode.startswith("I;16") else max(int(arr.max()), 1)
        return np.ascontiguousarray((arr * 255 + peak // 2) // peak, dtype=np.uint8)
    if img.mode != "L":
        img = img.convert("L")
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8))


def encode_png(array: np.ndarray) -> bytes:
    """Encode a uint8 ``(H, W)`` array as PNG (masks written by ``--mask-out``)."""
    if array.dtype != np.uint8 or array.ndim != 2:
        raise ValueError(f"expected a uint8 (H, W) array, got {array.dtype} {array.shape}")
    buf = io.BytesIO()
    Image.fromarray(array, mode="L").save(buf, format="PNG")
    return buf.getvalue()
