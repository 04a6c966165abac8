"""Connection places against a live daemon: a flood of silent connections from one process
gives up its places to real clients (the oldest of the process holding the most go first,
and only once silent for ``first_frame_timeout_ms``); an idle gateway that connected and sent
nothing stays, as does one that sent frames; a full cap (in total, per process) is refused
with a reason the Python clients raise."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scratchd.client.api import AsyncClient, Client
from scratchd.protocol import wire

from ..live_daemon import LiveDaemon, daemon_config, live_daemon

SILENT_MS = 300
FLOOD = """
import socket, sys, time
socks = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    socks.append(s)
print("connected", flush=True)
sys.stdin.read()  # until the test is done
"""


def flood(daemon: LiveDaemon, count: int) -> subprocess.Popen[str]:
    """Another process holding ``count`` connections that never send a byte."""
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD, daemon.socket_path, str(count)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "connected"
    return proc


def status_on(sock: socket.socket, request_id: int) -> wire.DaemonMessage:
    sock.sendall(wire.encode_frame(wire.StatusRequest(id=request_id)))
    length = wire.frame_length(sock.recv(4, socket.MSG_WAITALL))
    return wire.decode_daemon_message(sock.recv(length, socket.MSG_WAITALL))


def test_silent_connections_make_room_and_idle_gateways_stay(tmp_path: Path) -> None:
    config = daemon_config(server={"max_connections": 16, "first_frame_timeout_ms": SILENT_MS})
    with live_daemon(tmp_path, config) as daemon:
        talked = daemon.client(timeout=30)  # a gateway that sent frames, then idles
        assert talked.status().state == "serving"
        pinged = daemon.client(timeout=30)  # connected (the client's ping) and idle
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a gateway in another
        silent.connect(daemon.socket_path)  # language, waiting for its first part
        silent.settimeout(30)
        flooder = flood(daemon, 64)  # takes every place left, refused beyond
        try:
            time.sleep(2 * SILENT_MS / 1000)
            clients = []
            for _ in range(12):  # each takes the place of one of the flood's
                client = Client(daemon.socket_path, timeout=30)
                assert client.status().state == "serving"
                clients.append(client)
            assert len(daemon.events("silent_connection_closed")) >= 1
            for client in clients:
                client.close()
        finally:
            assert flooder.stdin is not None
            flooder.stdin.close()
            flooder.wait(30)
        # Nobody was under pressure from them: the idle gateways were never touched.
        assert isinstance(status_on(silent, 5), wire.StatusReply)
        assert pinged.status().state == "serving"
        assert talked.status().state == "serving"
        for client in (talked, pinged):
            client.close()
        silent.close()


def test_silent_connections_stay_while_there_is_room(tmp_path: Path) -> None:
    config = daemon_config(server={"max_connections": 16, "first_frame_timeout_ms": SILENT_MS})
    with live_daemon(tmp_path, config) as daemon:
        idle = []
        for _ in range(8):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(daemon.socket_path)
            sock.settimeout(30)
            idle.append(sock)
        time.sleep(3 * SILENT_MS / 1000)
        for _ in range(7):  # up to the cap, with the 8 silent ones: none has to go
            with daemon.client() as client:
                assert client.status().state == "serving"
        for k, sock in enumerate(idle):
            assert isinstance(status_on(sock, k + 1), wire.StatusReply)
            sock.close()
        assert daemon.events("silent_connection_closed") == []


def test_a_full_cap_is_refused_with_a_reason_both_clients_raise(tmp_path: Path) -> None:
    server = {"max_connections": 5, "max_connections_per_pid": 3, "first_frame_timeout_ms": 60_000}
    with live_daemon(tmp_path, daemon_config(server=server)) as daemon:
        mine = [daemon.client() for _ in range(3)]
        for client in mine:
            assert client.status().state == "serving"  # spoken: never evicted
        with (
            pytest.raises(ConnectionError, match=r"too many connections from pid \d+ \(limit 3 "),
            Client(daemon.socket_path, timeout=30) as client,
        ):
            client.status()

        async def async_status() -> None:
            async with await AsyncClient.connect(daemon.socket_path, timeout=30) as client:
                await client.status()

        with pytest.raises(ConnectionError, match="too many connections from pid"):
            asyncio.run(async_status())
        mine.pop().close()
        others = flood(daemon, 3)  # silent, but not for first_frame_timeout_ms: they stay
        try:
            with (
                pytest.raises(ConnectionError, match=r"too many connections \(limit 5\)"),
                Client(daemon.socket_path, timeout=30) as client,
            ):
                client.status()
        finally:
            assert others.stdin is not None
            others.stdin.close()
            others.wait(30)
        for client in mine:
            assert client.status().state == "serving"
            client.close()
        assert {e["limit"] for e in daemon.events("connections_full")} == {"3", "5"}
