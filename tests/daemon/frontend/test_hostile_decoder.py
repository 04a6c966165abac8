"""Fuzzing the frame decoder and the request checks: whatever arrives, only typed outcomes.

The daemon's first line against a hostile peer is pure code: the typed msgpack decode
(``wire.decode_client_frame``, as the acceptor calls it: raw pixels stay a view of the
received body) and the acceptor's checks before any byte is copied into a payload slot
(``check_image``). Whatever the bytes, the decoder either returns a message or raises
``DecodeError``, and a request that passes the checks can be written into a slot without
overflowing it. The live-socket half of the fuzzing is in ``test_hostile.py``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchd.daemon.frontend.images import Invalid, check_image
from scratchd.protocol import wire

SLOT_BYTES = 4096

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=64),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
request_keys = st.sampled_from(
    [
        *("id", "type", "part_class", "pixels", "height", "width", "channels", "encoded"),
        *("priority", "deadline_ms", "want_mask", "extra"),
    ]
)


def _decode(body: bytes | bytearray) -> wire.ClientFrame | None:
    try:
        return wire.decode_client_frame(body)
    except wire.DecodeError:
        return None


@given(st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_decode_error(body: bytes) -> None:
    message = _decode(body)
    assert message is None or isinstance(message, wire.InferFrame | wire.StatusRequest)
    rid = wire.salvage_request_id(body)
    assert 0 <= rid < 2**63


@given(
    st.dictionaries(request_keys, values, max_size=10),
    st.sampled_from(["infer", "status", "reply", "", None]),
)
def test_msgpack_maps_with_wrong_fields_and_types(fields: dict[str, Any], tag: Any) -> None:
    if tag is not None:
        fields["type"] = tag
    body = msgspec.msgpack.encode(fields)
    message = _decode(body)
    if isinstance(message, wire.InferFrame):
        _check_never_overflows(message)


@given(
    height=st.integers(min_value=-(2**31), max_value=2**31),
    width=st.integers(min_value=-(2**31), max_value=2**31),
    channels=st.integers(min_value=-5, max_value=300),
    n_pixels=st.integers(min_value=0, max_value=3 * SLOT_BYTES + 7),
    encoded=st.none() | st.binary(max_size=32),
    raw=st.booleans(),
)
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_declared_shapes_never_overflow_a_slot(
    height: int, width: int, channels: int, n_pixels: int, encoded: bytes | None, raw: bool
) -> None:
    request = wire.InferRequest(
        id=1,
        pixels=bytes(n_pixels) if raw else None,
        height=height,
        width=width,
        channels=channels,
        encoded=encoded,
    )
    # Round trip through the wire, as the daemon sees it.
    message = _decode(wire.encode_frame(request)[wire.PREFIX_BYTES :])
    assert isinstance(message, wire.InferFrame)
    _check_never_overflows(message)


def _check_never_overflows(request: wire.InferFrame) -> None:
    try:
        check_image(request, SLOT_BYTES)
    except Invalid as exc:
        assert str(exc), "a refusal must say why"
        return
    if request.encoded is not None:
        assert request.pixels is None and request.encoded
        return
    assert request.pixels is not None
    assert request.channels in (1, 3)
    assert 0 < request.height * request.width <= SLOT_BYTES
    padded = -(-request.height // 16) * 16 * (-(-request.width // 16) * 16)
    assert padded <= 2 * SLOT_BYTES, "the network's cost follows the padded area"
    assert len(request.pixels) == request.height * request.width * request.channels


@given(st.binary(min_size=4, max_size=4))
def test_any_length_prefix_is_read_as_an_unsigned_length(prefix: bytes) -> None:
    length = wire.frame_length(prefix)
    assert 0 <= length < 2**32
