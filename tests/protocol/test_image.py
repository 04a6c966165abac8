"""Decoding of request images: formats, greyscale conversion, and hostile headers."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from scratchd.protocol.image import ImageError, decode_image, encode_png, sniff_format


def _encode(arr: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode=mode).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "BMP"])
def test_lossless_formats_round_trip_exactly(fmt: str) -> None:
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, size=(37, 53), dtype=np.uint8)
    out = decode_image(_encode(arr, fmt))
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, arr)


def test_jpeg_decodes_close_to_the_original() -> None:
    arr = np.tile(np.arange(64, dtype=np.uint8) * 4, (48, 1))
    out = decode_image(_encode(arr, "JPEG"))
    assert out.shape == arr.shape
    assert np.abs(out.astype(int) - arr.astype(int)).mean() < 3


def test_rgb_becomes_luma() -> None:
    rgb = np.zeros((4, 4, 3), dtype=np.uint8)
    rgb[..., 1] = 200  # pure green: luma 0.587 * 200 = 117
    out = decode_image(_encode(rgb, "PNG"))
    assert out.shape == (4, 4)
    assert abs(int(out[0, 0]) - 117) <= 1


def test_unknown_bytes_are_rejected() -> None:
    with pytest.raises(ImageError, match="not a PNG"):
        decode_image(b"GIF89a....")
    assert sniff_format(b"") is None


def test_truncated_png_is_an_image_error() -> None:
    data = _encode(np.full((64, 64), 7, dtype=np.uint8), "PNG")
    with pytest.raises(ImageError, match="corrupt or truncated"):
        decode_image(data[: len(data) // 2])


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims a huge canvas, with a tiny IDAT: a decompression bomb shape."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 16))
        + chunk(b"IEND", b"")
    )


def test_bomb_header_is_refused_before_decoding() -> None:
    with pytest.raises(ImageError, match="than the limit"):
        decode_image(_png_header_only(60000, 60000), max_pixels=1024 * 1024)


def test_encode_png_round_trips_masks() -> None:
    mask = np.zeros((10, 12), dtype=np.uint8)
    mask[2:5, 3:9] = 255
    np.testing.assert_array_equal(decode_image(encode_png(mask)), mask)
    with pytest.raises(ValueError):
        encode_png(mask.astype(np.float32))
