"""Hostile frame bodies on the frame path: nested thousands deep, sizes that lie, wrong types.

Whatever a body holds, the decoder raises only ``DecodeError`` (msgspec raises
``RecursionError`` for deep nesting, even in a field the schema skips), the frame gets exactly
one reply (``invalid``, addressed to the body's id when one can be read), the connection
stays open, and a request already in flight on it is still answered. The log gets a
throttled warning, never a traceback per frame.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Final

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scratchd.daemon.frontend.connection import ReadState
from scratchd.ipc.queue import Result, Status
from scratchd.protocol import wire
from scratchd.protocol.log import LOGGER_NAME

from .test_acceptor import PREFIX, FrontEnd
from .test_connection import deliver

REPRODUCTION: Final = b"\x91" * 1000 + b"\xc0"
"""Issue 21's: an array in an array … 1000 deep around a nil."""
IN_FLIGHT_ID: Final = 2**62 + 5
"""The id of the request already queued when the hostile frame arrives (no body salvages it)."""
INFER_HEAD: Final = b"\x83\xa4type\xa5infer\xa2id\x01\xa4junk"
"""A map of three keys: ``type: infer``, ``id: 1`` and ``junk``, whose value follows."""


def _nest(depth: int, kind: str) -> bytes:
    """A nil inside ``depth`` one-element arrays or one-key maps."""
    return (b"\x91" if kind == "array" else b"\x81\xa1k") * depth + b"\xc0"


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    nested = _nest(draw(st.integers(1, 20_000)), draw(st.sampled_from(["array", "map"])))
    lying = draw(st.sampled_from([  # a header announcing far more than the body holds
        b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff",
        b"\xdb\x7f\xff\xff\xff", b"\xc9\xff\xff\xff\xff\x01",
    ]))  # fmt: skip
    value = draw(st.sampled_from([nested, lying, b"\xc1", b"\xd9\xff"]))
    field = draw(st.sampled_from([b"\xa4junk", b"\xa6pixels", b"\xa2id", b"\xa6height"]))
    body = draw(st.sampled_from([
        value,  # the body itself
        INFER_HEAD[:-5] + field + value,  # a field of an inference request
        b"\x83\xa4type\xa6status\xa2id\x01" + field + value,  # of a status request
        b"\x82\xa4type" + value + b"\xa2id\x01",  # the tag
    ]))  # fmt: skip
    return body + draw(st.binary(min_size=1, max_size=8))  # trailing bytes: never valid


def _in_flight_request() -> bytes:
    grey = np.arange(64, dtype=np.uint8).reshape(8, 8)
    request = wire.InferRequest(id=IN_FLIGHT_ID, pixels=grey.tobytes(), height=8, width=8)
    return bytes(wire.encode_frame(request))


async def _with_a_request_in_flight(front: FrontEnd, hostile: list[bytes]) -> list[wire.Reply]:
    """On one connection: a request that is queued, then ``hostile`` frames, then the worker
    answers the queued one. Every reply written, in order; the connection must still be open."""
    conn, transport = front.connect()
    deliver(conn, _in_flight_request(), [])
    deliver(conn, b"".join(PREFIX.pack(len(body)) + body for body in hostile), [])
    await asyncio.sleep(0)  # the refusals leave at the end of the loop's turn
    assert conn.state is not ReadState.CLOSED and not transport.closed
    (claim,) = front.queue.claim_batch(0, 8, time.monotonic_ns())
    front.queue.complete(0, claim, Result(Status.OK, score=0.5))
    front.dispatcher.collect()
    await asyncio.sleep(0)
    replies = []
    for data in transport.written:
        while data:
            n = wire.frame_length(data[:4])
            reply = wire.decode_daemon_message(data[4 : 4 + n])
            assert isinstance(reply, wire.Reply)
            replies.append(reply)
            data = data[4 + n :]
    conn.close()
    return replies


def _serve(hostile: list[bytes]) -> list[wire.Reply]:
    async def run() -> list[wire.Reply]:
        front = FrontEnd()
        try:
            return await _with_a_request_in_flight(front, hostile)
        finally:
            await front.close()

    return asyncio.run(run())


def _check_answered(replies: list[wire.Reply], hostile: int) -> None:
    """One ``invalid`` reply per hostile frame, and the request in flight answered ``ok``."""
    ours = [r for r in replies if r.id == IN_FLIGHT_ID]
    assert [r.status for r in ours] == ["ok"]
    refusals = [r for r in replies if r.id != IN_FLIGHT_ID]
    assert len(refusals) == hostile
    assert all(r.status == "invalid" and r.error.startswith("malformed") for r in refusals)


@settings(max_examples=200, deadline=None)
@given(hostile_bodies())
def test_a_hostile_body_raises_only_decode_error(body: bytes) -> None:
    with pytest.raises(wire.DecodeError):
        wire.decode_client_frame(body)
    assert wire.salvage_request_id(body) in (0, 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(hostile_bodies(), min_size=1, max_size=3))
def test_hostile_bodies_are_answered_invalid_and_the_request_in_flight_is_answered(
    bodies: list[bytes],
) -> None:
    _check_answered(_serve(bodies), len(bodies))


def test_the_issues_reproduction_is_answered_invalid_and_the_connection_serves_on() -> None:
    replies = _serve([REPRODUCTION])
    _check_answered(replies, 1)
    assert "Expected `object`, got `array`" in replies[0].error


def test_nesting_in_a_skipped_field_is_named() -> None:
    with pytest.raises(wire.DecodeError, match="nested too deeply"):
        wire.decode_client_frame(INFER_HEAD + _nest(100_000, "array"))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def lines() -> Iterator[Lines]:
    logger = logging.getLogger(LOGGER_NAME)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_a_flood_of_malformed_frames_logs_a_few_warnings_and_no_traceback(lines: Lines) -> None:
    flood = [REPRODUCTION, INFER_HEAD + _nest(50_000, "map"), msgspec.msgpack.encode([1])] * 20
    _check_answered(_serve(flood), len(flood))
    events = [getattr(r, "event", "") for r in lines.records]
    assert 0 < events.count("malformed_frame") <= 5
    assert all(r.levelno < logging.ERROR and r.exc_info is None for r in lines.records)
