"""Large raw frames: their pixels are found exactly where a client put them (or not at all),
the body without them decodes to the same request, or is told apart and rebuilt; and a live
daemon serves a large raw frame exactly as it serves the same image encoded."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.client.api import Client
from scratchd.daemon.frontend import raw_frames
from scratchd.daemon.frontend.connection import HEAD_BYTES, SCAN_BYTES
from scratchd.protocol import wire
from scratchd.protocol.image import decode_image, encode_png

from ...protocol.test_wire import _body, requests
from ..harness import DaemonProcess

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=40),
    st.binary(max_size=300),
)
_values = st.one_of(_scalars, st.lists(_scalars, max_size=3), st.dictionaries(st.text(), _scalars))
_maps = st.dictionaries(
    st.one_of(st.sampled_from(["pixels", "type", "id", "height"]), st.text(max_size=300)),
    _values,
    max_size=8,
)


def _hide(body: bytes, at: raw_frames.PixelsAt) -> memoryview:
    """The body with its pixels taken out, as the daemon's connection builds it."""
    hidden = bytearray(body[: at.header]) + bytearray(2) + body[at.start + at.length :]
    raw_frames.hide_pixels(memoryview(hidden), at)
    assert at.hidden_end == at.header + 2  # the empty bin
    assert len(hidden) == at.hidden_length(len(body))
    return memoryview(hidden)


@given(requests.filter(lambda r: r.pixels is not None))
def test_pixels_are_found_where_a_client_put_them_and_the_rest_decodes_without_them(
    request: wire.InferRequest,
) -> None:
    body = bytes(_body(wire.encode_frame(request)))
    at = raw_frames.locate_pixels(memoryview(body)[: at_most(body)])
    assert at is not None
    assert body[at.start : at.start + at.length] == request.pixels
    hidden = _hide(body, at)
    frame = wire.decode_client_frame(hidden)
    assert frame == msgspec.structs.replace(wire.decode_client_frame(body), pixels=None)
    out = bytearray(len(body))
    n = raw_frames.rebuild_body(memoryview(out), hidden, memoryview(request.pixels), at)
    assert n == len(body) and out == body


def at_most(body: bytes) -> int:
    """How much of the body the connection searches (a little past the pixels' header)."""
    return min(len(body), SCAN_BYTES)


@given(_maps, st.integers(0, 400))
def test_any_map_either_shows_its_pixels_bin_exactly_or_is_left_to_the_decoder(
    fields: dict[str, object], cut: int
) -> None:
    body = msgspec.msgpack.encode(fields)
    at = raw_frames.locate_pixels(memoryview(body)[:cut])  # never raises, whatever is cut off
    if at is None:
        return
    value = fields["pixels"]
    assert isinstance(value, bytes)
    assert body[at.start : at.start + at.length] == value
    assert at.header < at.start <= cut
    hidden = _hide(body, at)
    assert msgspec.msgpack.decode(hidden) == {
        ("\0" * 6 if k == "pixels" else k): (b"" if k == "pixels" else v) for k, v in fields.items()
    }


@pytest.mark.parametrize(
    "head",
    [b"", b"\x81", b"\x81\xa6pixels", b"\x81\xa6pixels\xc6\x00", b"\x81\xa6pixels\xc0",
     b"\x91\xc4\x01x", b"\x81\x01\xc4\x01x", b"\x82\xa1a\x91\x01\xa6pixels\xc4\x01x",
     b"\xdf\xff\xff\xff\xff" + b"\xa1a\x01" * 10],
)  # fmt: skip
def test_what_cannot_be_read_as_a_map_with_a_pixels_bin_is_not_located(head: bytes) -> None:
    assert raw_frames.locate_pixels(memoryview(head)) is None


@pytest.mark.parametrize("second", [None, b"", b"x", "text"])
def test_a_second_pixels_key_is_never_mistaken_for_pixels_kept_elsewhere(second: object) -> None:
    pixels = bytes(300)
    first = msgspec.msgpack.encode({"type": "infer", "id": 1, "pixels": pixels})
    extra = msgspec.msgpack.encode("pixels") + msgspec.msgpack.encode(second)
    body = bytes([first[0] + 1]) + first[1:] + extra  # one entry more in the map
    at = raw_frames.locate_pixels(memoryview(body))
    assert at is not None and body[at.start : at.start + at.length] == pixels
    if isinstance(second, str):  # not even the type a pixels field takes
        with pytest.raises(wire.DecodeError):
            raw_frames.decode_without_pixels(_hide(body, at))
    else:
        assert raw_frames.decode_without_pixels(_hide(body, at)) is None
    at = raw_frames.locate_pixels(memoryview(first))
    assert at is not None
    assert raw_frames.decode_without_pixels(_hide(first, at)) == wire.InferFrame(id=1)


def test_a_live_daemon_serves_a_large_raw_frame_as_it_serves_the_same_image_encoded(
    data_dir: Path,
) -> None:
    """End to end: a real image sent raw (160 KB: its pixels go straight into a slot) gets
    the reply, mask included, that the same image sent as PNG (decoded the usual way) gets."""
    path = sorted((data_dir / "sd900" / "images").glob("Sc_*.png"))[0]
    grey = np.tile(decode_image(path.read_bytes()), (2, 2))  # 400 x 400 of a real scratch
    png = encode_png(grey)
    assert grey.nbytes > 2 * HEAD_BYTES
    with DaemonProcess(workers=1, slots=8) as daemon, Client(daemon.socket, timeout=120) as c:
        raw, encoded = c.infer(grey, want_mask=True), c.infer(png, want_mask=True)
        assert raw.status == encoded.status == "ok", (raw.error, encoded.error)
        assert (raw.verdict, raw.score, raw.boxes) == (
            encoded.verdict,
            encoded.score,
            encoded.boxes,
        )
        assert raw.mask == encoded.mask and raw.mask_shape == grey.shape
        assert daemon.status().queue.in_use == 0  # the slot it was received into is free again
