"""Acceptor validation without a daemon: what is refused before a slot is reserved, class
resolution, and conversion of raw/encoded images into a payload slot."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from PIL import Image

from scratchd.daemon.acceptor import Invalid, check_image, convert_into
from scratchd.ipc.image import ImageError
from scratchd.ipc.wire import InferRequest


def _raw(arr: np.ndarray) -> InferRequest:
    channels = 1 if arr.ndim == 2 else arr.shape[2]
    return InferRequest(
        id=1, pixels=arr.tobytes(), height=arr.shape[0], width=arr.shape[1], channels=channels
    )


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (InferRequest(id=1), "exactly one of"),
        (InferRequest(id=1, pixels=b"\0", encoded=b"\0", height=1, width=1), "exactly one of"),
        (InferRequest(id=1, encoded=b"GIF89a"), "not a PNG, BMP or JPEG"),
        (InferRequest(id=1, pixels=b"\0" * 4, height=2, width=2, channels=2), "channels"),
        (InferRequest(id=1, pixels=b"", height=0, width=5), "positive height"),
        (InferRequest(id=1, pixels=b"\0" * 3, height=2, width=2), "needs 4"),
        (InferRequest(id=1, pixels=b"", height=100, width=100), "exceeds the limit of 4096"),
    ],
)
def test_requests_that_cannot_be_served_are_refused_with_a_reason(
    request_: InferRequest, reason: str
) -> None:
    with pytest.raises(Invalid, match=reason):
        check_image(request_, 4096)


def test_well_formed_requests_pass() -> None:
    check_image(InferRequest(id=1, pixels=b"\0" * 12, height=2, width=2, channels=3), 4096)
    check_image(InferRequest(id=1, pixels=b"\0" * 4096, height=64, width=64), 4096)
    check_image(InferRequest(id=1, encoded=b"\xff\xd8\xff\xe0"), 4096)  # decoded later


@settings(max_examples=50, deadline=None)
@given(arrays(np.uint8, st.tuples(st.integers(1, 17), st.integers(1, 17), st.just(3))))
def test_raw_rgb_fills_the_slot_exactly_as_the_same_image_sent_as_png(rgb: np.ndarray) -> None:
    raw, png = bytearray(1024), bytearray(1024)
    shape = convert_into(memoryview(raw), _raw(rgb))
    assert shape == rgb.shape[:2]
    assert convert_into(memoryview(png), InferRequest(id=1, encoded=_png(rgb))) == shape
    assert raw == png  # the same grey pixels, and nothing written past them


@pytest.mark.parametrize("kind", ["png", "rgb"])
def test_conversion_writes_grey_pixels_into_the_slot(kind: str) -> None:
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (13, 21), dtype=np.uint8)
    rgb = np.repeat(grey[:, :, None], 3, axis=2)
    request = InferRequest(id=1, encoded=_png(grey)) if kind == "png" else _raw(rgb)
    slot = bytearray(1024)
    shape = convert_into(memoryview(slot), request)
    assert shape == (13, 21)
    np.testing.assert_array_equal(np.frombuffer(slot, np.uint8, count=13 * 21), grey.ravel())


def test_an_encoded_image_larger_than_a_slot_is_refused_before_decoding() -> None:
    big = np.zeros((64, 64), np.uint8)
    with pytest.raises(ImageError, match="limit of 1024"):
        convert_into(memoryview(bytearray(1024)), InferRequest(id=1, encoded=_png(big)))
