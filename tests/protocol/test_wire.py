"""The client protocol: frames round-trip, the schema rejects what it should, masks survive."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from scratchd.protocol import wire

_ids = st.integers(min_value=0, max_value=2**63 - 1)
_floats = st.floats(allow_nan=False, allow_infinity=False, width=32)

requests = st.builds(
    wire.InferRequest,
    id=_ids,
    part_class=st.text(max_size=20),
    pixels=st.one_of(st.none(), st.binary(max_size=64)),
    height=st.integers(0, 5000),
    width=st.integers(0, 5000),
    channels=st.sampled_from([1, 3]),
    encoded=st.one_of(st.none(), st.binary(max_size=64)),
    priority=st.one_of(st.none(), st.integers(0, 7)),
    deadline_ms=st.one_of(st.none(), st.integers(1, 10**6)),
    want_mask=st.booleans(),
)
replies = st.builds(
    wire.Reply,
    id=_ids,
    status=st.sampled_from(wire.STATUSES),
    verdict=st.sampled_from(["", "defect", "clean"]),
    score=_floats,
    boxes=st.lists(st.tuples(_floats, _floats, _floats, _floats, _floats), max_size=5),
    timings=st.builds(wire.Timings, queue_ms=_floats, compute_ms=_floats, total_ms=_floats),
    worker=st.one_of(st.none(), st.text(max_size=8)),
    error=st.text(max_size=40),
)


def _body(frame: bytearray) -> bytearray:
    assert wire.frame_length(frame[: wire.PREFIX_BYTES]) == len(frame) - wire.PREFIX_BYTES
    return frame[wire.PREFIX_BYTES :]


@given(requests)
def test_requests_round_trip_through_frames(request: wire.InferRequest) -> None:
    assert wire.decode_client_message(_body(wire.encode_frame(request))) == request


@given(replies)
def test_replies_round_trip_through_frames(reply: wire.Reply) -> None:
    assert wire.decode_daemon_message(_body(wire.encode_frame(reply))) == reply


def test_status_messages_are_told_apart_by_their_tag() -> None:
    msg = wire.decode_client_message(_body(wire.encode_frame(wire.StatusRequest(id=5))))
    assert msg == wire.StatusRequest(id=5)
    status = wire.StatusReply(
        id=5,
        state="serving",
        pid=1,
        uptime_s=1.5,
        backend="cpu",
        workers=[
            wire.WorkerStatus(id=0, name="cpu0", pid=9, state="ready", device="cpu", restarts=1)
        ],
        queue=wire.QueueStatus(depth=[0] * 8, slots=4, in_use=0, in_flight=0),
    )
    assert wire.decode_daemon_message(_body(wire.encode_frame(status))) == status


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # reserved msgpack byte
        msgspec.msgpack.encode({"type": "infer"}),  # no id
        msgspec.msgpack.encode({"type": "nope", "id": 1}),
        msgspec.msgpack.encode({"type": "infer", "id": -1}),
        msgspec.msgpack.encode({"type": "infer", "id": 1, "height": "tall"}),
        msgspec.msgpack.encode([1, 2, 3]),
    ],
)
def test_malformed_bodies_raise_decode_errors(body: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        wire.decode_client_message(body)


def test_an_old_client_without_new_fields_still_decodes() -> None:
    body = msgspec.msgpack.encode({"type": "infer", "id": 3, "encoded": b"x"})
    msg = wire.decode_client_message(body)
    assert isinstance(msg, wire.InferRequest)
    assert (msg.part_class, msg.priority, msg.deadline_ms, msg.want_mask) == (
        "normal",
        None,
        None,
        False,
    )


def test_unknown_fields_from_a_newer_client_are_ignored() -> None:
    body = msgspec.msgpack.encode({"type": "infer", "id": 3, "encoded": b"x", "future": 1})
    assert isinstance(wire.decode_client_message(body), wire.InferRequest)


def test_request_id_is_salvaged_from_a_body_that_fails_the_schema() -> None:
    body = msgspec.msgpack.encode({"type": "infer", "id": 77, "height": "tall"})
    assert wire.salvage_request_id(body) == 77
    assert wire.salvage_request_id(b"\xc1") == 0
    assert wire.salvage_request_id(msgspec.msgpack.encode({"id": True})) == 0


@given(st.integers(1, 40), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_masks_survive_bit_packing(height: int, width: int, seed: int) -> None:
    mask = (np.random.default_rng(seed).random((height, width)) > 0.5).astype(np.uint8) * 255
    packed, shape = wire.pack_mask(mask)
    assert len(packed) == (height * width + 7) // 8
    reply = wire.Reply(id=1, status="ok", mask=packed, mask_shape=shape)
    back = wire.unpack_mask(wire.decode_daemon_message(_body(wire.encode_frame(reply))))  # type: ignore[arg-type]
    assert back is not None
    np.testing.assert_array_equal(back, mask)


def test_a_truncated_mask_is_refused() -> None:
    reply = wire.Reply(id=1, status="ok", mask=b"\xff", mask_shape=(4, 4))
    with pytest.raises(ValueError, match="mask"):
        wire.unpack_mask(reply)


# ---- the daemon's zero-copy decoding (InferFrame) -------------------------------------------


def test_infer_frame_has_exactly_the_fields_of_infer_request() -> None:
    """Appending a field to one and not the other would silently drop it in the daemon."""
    request, frame = wire.InferRequest(id=0), wire.InferFrame(id=0)
    assert wire.InferFrame.__struct_fields__ == wire.InferRequest.__struct_fields__
    for name in wire.InferRequest.__struct_fields__:
        assert getattr(frame, name) == getattr(request, name), name
    assert wire.InferFrame.__struct_config__.tag == wire.InferRequest.__struct_config__.tag


def _decoded(decode: object, body: bytes) -> object:
    try:
        return decode(body)  # type: ignore[operator]
    except wire.DecodeError as exc:
        return ("error", str(exc))


@given(requests)
def test_the_daemon_decodes_every_request_as_the_schema_does(request: wire.InferRequest) -> None:
    body = _body(wire.encode_frame(request))
    frame = wire.decode_client_frame(body)
    assert isinstance(frame, wire.InferFrame)
    for name in wire.InferRequest.__struct_fields__:
        assert getattr(frame, name) == getattr(request, name), name


@given(st.one_of(st.binary(max_size=200), requests.map(lambda r: _body(wire.encode_frame(r)))))
def test_garbage_is_refused_by_both_decoders_with_the_same_reason(body: bytes) -> None:
    strict, frame = (
        _decoded(wire.decode_client_message, body),
        _decoded(wire.decode_client_frame, body),
    )
    if isinstance(strict, tuple):
        assert frame == strict
    else:
        assert not isinstance(frame, tuple)


def _raw(body: bytes) -> object:
    try:
        return wire.decode_client_frame_raw(body)
    except Exception as exc:  # any exception: decode_failure says why
        return ("error", wire.decode_failure(exc))


@given(
    st.one_of(
        st.binary(max_size=200),
        requests.map(lambda r: _body(wire.encode_frame(r))),
        st.integers(1, 5000).map(lambda n: b"\x81\xa2id" + b"\x91" * n + b"\x01"),  # deep
    )
)
def test_the_raw_frame_decoder_says_what_decode_client_frame_says(body: bytes) -> None:
    """The daemon's per-request call (no wrapper) decodes what ``decode_client_frame``
    decodes and, for any other body, ``decode_failure`` gives its DecodeError's reason."""
    raw, wrapped = _raw(body), _decoded(wire.decode_client_frame, body)
    if isinstance(wrapped, tuple):
        assert raw == wrapped
    else:
        assert raw == wrapped and type(raw) is type(wrapped)


def test_a_body_nested_too_deeply_is_explained_as_decode_client_frame_explains_it() -> None:
    body = b"\x81\xa2id" + b"\x91" * 100_000 + b"\x01"
    assert _raw(body) == ("error", "malformed msgpack: nested too deeply")
    assert _decoded(wire.decode_client_frame, body) == _raw(body)


def test_raw_pixels_are_a_view_of_the_received_frame_not_a_copy() -> None:
    pixels = bytes(range(256)) * 16
    body = bytearray(_body(wire.encode_frame(wire.InferRequest(id=1, pixels=pixels))))
    frame = wire.decode_client_frame(memoryview(body))
    assert isinstance(frame, wire.InferFrame) and isinstance(frame.pixels, memoryview)
    assert frame.pixels == pixels
    start = bytes(body).index(pixels)
    body[start] ^= 0xFF  # the buffer changes under it: it is the same memory
    assert frame.pixels[0] == pixels[0] ^ 0xFF


@given(requests)
def test_encode_frame_sizes_its_buffer_for_any_request(request: wire.InferRequest) -> None:
    frame = wire.encode_frame(request)
    assert isinstance(frame, bytearray)  # written as it is: no copy to bytes
    body = msgspec.msgpack.encode(request)
    assert wire.frame_length(frame[: wire.PREFIX_BYTES]) == len(body)
    assert frame == wire.LENGTH_PREFIX.pack(len(body)) + body  # nothing left over or short


@given(st.lists(replies, max_size=6))
def test_frames_encoded_together_are_each_frame_encoded_alone_joined(
    replies: list[wire.Reply],
) -> None:
    """A connection writes one turn's replies as one buffer: byte for byte the frames
    ``encode_frame`` makes, back to back, each decodable on its own."""
    joined = wire.encode_frames(replies)
    assert bytes(joined) == b"".join(bytes(wire.encode_frame(r)) for r in replies)
    pos, decoded = 0, []
    while pos < len(joined):
        length = wire.frame_length(joined[pos : pos + wire.PREFIX_BYTES])
        body = joined[pos + wire.PREFIX_BYTES : pos + wire.PREFIX_BYTES + length]
        decoded.append(wire.decode_daemon_message(body))
        pos += wire.PREFIX_BYTES + length
    assert decoded == replies
