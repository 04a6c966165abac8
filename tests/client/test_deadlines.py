"""The clients' per-call deadline against a fake daemon that dribbles its replies: a call
times out as a whole (not per socket read), the connection stays usable, and the late reply
is dropped instead of being kept for ever; errors name the socket."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from scratchd.client.api import AsyncClient, Client
from scratchd.protocol import wire

IMAGE = np.zeros((4, 4), np.uint8)


def _read_frame(conn: socket.socket) -> wire.ClientMessage:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            assert chunk, "the client hung up"
            data += chunk
        return data

    while True:  # past the ping a client sends as it connects (its pong is not needed)
        body = exactly(wire.frame_length(exactly(wire.PREFIX_BYTES)))
        message = wire.decode_client_message(body)
        if not isinstance(message, wire.Ping):
            return message


def _reply(request_id: int) -> bytes:
    message = wire.Reply(id=request_id, status="ok", verdict="clean", error="x" * 300)
    return bytes(wire.encode_frame(message))


class Dribbler:
    """Answers request 1 a byte every ``gap_s`` (each read waits far less than the client's
    timeout, the whole reply far more) until the test says the client gave up; then, once
    request 2 arrives, sends the rest of reply 1 and all of reply 2."""

    def __init__(self, path: str, gap_s: float = 0.05) -> None:
        self.gap_s = gap_s
        self.gave_up = threading.Event()
        self.sent_of_first = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(1)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            first = _read_frame(conn)
            late = _reply(first.id)
            while self.sent_of_first < len(late) - 1 and not self.gave_up.is_set():
                conn.sendall(late[self.sent_of_first : self.sent_of_first + 1])
                self.sent_of_first += 1
                time.sleep(self.gap_s)
            second = _read_frame(conn)
            conn.sendall(late[self.sent_of_first :] + _reply(second.id))
            conn.recv(1)  # until the client closes

    def close(self) -> None:
        self.gave_up.set()
        self.listener.close()
        self.thread.join(10)


def test_a_call_times_out_as_a_whole_and_its_late_reply_is_dropped(tmp_path: Path) -> None:
    server = Dribbler(str(tmp_path / "slow.sock"))
    try:
        with Client(str(tmp_path / "slow.sock"), timeout=0.5, zero_copy=False) as client:
            with pytest.raises(TimeoutError, match=re.escape("slow.sock")):
                client.infer(IMAGE)
            server.gave_up.set()
            assert server.sent_of_first < len(_reply(2)) - 1, "cut short mid-reply"
            reply = client.infer(IMAGE, timeout=30)  # finishes reply 1's frame, drops it
            assert (reply.id, reply.status) == (3, "ok")  # 1: the ping
            assert client._early == {} and client._pending == set()
    finally:
        server.close()


def test_the_async_client_times_out_a_call_and_drops_its_late_reply(tmp_path: Path) -> None:
    path = str(tmp_path / "slow.sock")
    server = Dribbler(path)

    async def scenario() -> None:
        client = await AsyncClient.connect(path, timeout=0.5, zero_copy=False)
        try:
            with pytest.raises(TimeoutError, match=re.escape("slow.sock")):
                await client.infer(IMAGE)
            server.gave_up.set()
            reply = await client.infer(IMAGE, timeout=30)
            assert (reply.id, reply.status) == (3, "ok")  # 1: the ping
            assert client._waiting == {}
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()


def test_errors_name_the_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "nobody.sock")
    with pytest.raises(FileNotFoundError) as raised:
        Client(path)
    assert str(raised.value).startswith(f"scratchd at {path}: [Errno 2] ")
    assert raised.value.errno == 2

    async def connect() -> None:
        await AsyncClient.connect(path)

    with pytest.raises(FileNotFoundError, match=re.escape(f"scratchd at {path}: ")):
        asyncio.run(connect())


def test_a_daemon_that_hangs_up_is_named(tmp_path: Path) -> None:
    path = str(tmp_path / "rude.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    try:
        with Client(path, timeout=30) as client:
            conn, _ = listener.accept()
            conn.close()
            with pytest.raises(ConnectionError, match=re.escape(f"scratchd at {path}")):
                client.status()
    finally:
        listener.close()
