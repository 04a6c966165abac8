"""Issue 21, "exactly one reply for any frame", against a real CPU daemon: a frame that makes
the stream untrustworthy (a length prefix over the cap, a body that stops arriving) closes only
its connection, and only after every request already accepted on it has been answered; the
last reply (id 0, ``invalid``) says why, then EOF. The Python clients hand those replies to
their callers before they raise ``ConnectionError`` with the daemon's reason.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import numpy as np
import pytest

from scratchd.client.api import AsyncClient, Client, build_request
from scratchd.protocol import wire

from .live_daemon import LiveDaemon, daemon_config, live_daemon, real_crops

PREFIX: Final = struct.Struct(">I")
STALL_MS: Final = 150
PIPELINED: Final = 12
OVERSIZED: Final = PREFIX.pack(2**32 - 1)
STALLED: Final = PREFIX.pack(1000) + b"\x81"  # ... and nothing more
DEADLINE_MS: Final = 300_000  # correctness is the point, not the machine's pace


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    # One worker and crops large enough that the pipelined requests are still being served
    # when the bad frame (or its stall) ends the stream.
    config = daemon_config(server={"frame_timeout_ms": STALL_MS})
    with live_daemon(tmp_path_factory.mktemp("stream-end"), config) as d:
        yield d


@pytest.fixture(scope="module")
def crops(data_dir: Path) -> list[np.ndarray]:
    """512 x 512 (the slot's size), tiled from real crops: seconds of work for one worker."""
    return [np.ascontiguousarray(np.tile(c, (4, 4))) for c in real_crops(data_dir, PIPELINED, 128)]


def _read_until_eof(sock: socket.socket) -> list[wire.Reply]:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    replies = []
    while data:
        n = wire.frame_length(data[:4])
        assert len(data) >= 4 + n, "EOF inside a reply"
        reply = wire.decode_daemon_message(data[4 : 4 + n])
        assert isinstance(reply, wire.Reply)
        replies.append(reply)
        data = data[4 + n :]
    return replies


@pytest.mark.parametrize(("bad", "why"), [(OVERSIZED, "exceeds the limit"), (STALLED, "within")])
def test_pipelined_requests_are_answered_before_the_reason_and_eof(
    daemon: LiveDaemon, crops: list[np.ndarray], bad: bytes, why: str
) -> None:
    frames = [
        wire.encode_frame(build_request(i, crop, deadline_ms=DEADLINE_MS))
        for i, crop in enumerate(crops, 1)
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(300)
        sock.connect(daemon.socket_path)
        sock.sendall(b"".join(bytes(f) for f in frames) + bad)
        replies = _read_until_eof(sock)
    *answers, last = replies
    assert sorted(r.id for r in answers) == list(range(1, PIPELINED + 1))
    assert [r.status for r in answers] == ["ok"] * PIPELINED, [r.error for r in answers]
    assert (last.id, last.status) == (0, "invalid") and why in last.error
    assert "closing the connection" in last.error
    assert daemon.wait_settled().queue.in_use == 0
    assert daemon.proc.poll() is None


def _then(images: list[np.ndarray], client: Client, bad: bytes) -> Iterator[np.ndarray]:
    """``images``, then ``bad`` written on ``client``'s socket behind their requests."""
    yield from images
    client._sock.sendall(bad)


@pytest.mark.parametrize(("bad", "why"), [(OVERSIZED, "exceeds the limit"), (STALLED, "within")])
def test_the_client_returns_the_replies_in_flight_then_raises_the_reason(
    daemon: LiveDaemon, crops: list[np.ndarray], bad: bytes, why: str
) -> None:
    with Client(daemon.socket_path, timeout=300, zero_copy=False) as client:
        images = _then(crops, client, bad)
        replies = dict(client.map(images, concurrency=PIPELINED + 1, deadline_ms=DEADLINE_MS))
        assert sorted(replies) == list(range(PIPELINED))
        assert {r.status for r in replies.values()} == {"ok"}
        with pytest.raises(ConnectionError, match=why):
            client.infer(crops[0], deadline_ms=DEADLINE_MS)


@pytest.mark.parametrize(("bad", "why"), [(OVERSIZED, "exceeds the limit"), (STALLED, "within")])
def test_the_async_client_returns_the_replies_in_flight_then_raises_the_reason(
    daemon: LiveDaemon, crops: list[np.ndarray], bad: bytes, why: str
) -> None:
    async def run() -> None:
        async with await AsyncClient.connect(daemon.socket_path, 300, zero_copy=False) as client:
            calls = [
                asyncio.ensure_future(client.infer(crop, deadline_ms=DEADLINE_MS)) for crop in crops
            ]
            while len(client._waiting) < PIPELINED:  # until every call has written its frame
                await asyncio.sleep(0)
            client._writer.write(bad)
            replies = await asyncio.gather(*calls)
            assert [r.status for r in replies] == ["ok"] * PIPELINED
            with pytest.raises(ConnectionError, match=why):
                await client.infer(crops[0], deadline_ms=DEADLINE_MS)

    asyncio.run(run())
