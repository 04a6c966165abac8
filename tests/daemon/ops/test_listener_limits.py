"""A connection flood on the health (or the metrics) listener of a live daemon: beyond
``[server] http_max_connections`` a connection is answered 503 and closed, silent ones are
closed after ``http_header_timeout_ms``, and the Unix socket serves throughout."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from ..live_daemon import daemon_config, live_daemon


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.parametrize(("listener", "path"), [("health", "/livez"), ("metrics", "/metrics")])
def test_a_listener_flood_is_capped_and_the_daemon_keeps_serving(
    tmp_path: Path, listener: str, path: str
) -> None:
    config = daemon_config(server={"http_max_connections": 8, "http_header_timeout_ms": 500})
    with live_daemon(tmp_path, config) as daemon:
        status = daemon.status()
        port = status.health_port if listener == "health" else status.metrics_port
        assert _get(port, path).startswith(b"HTTP/1.1 200 ")
        time.sleep(0.2)
        baseline = _open_fds(daemon.proc.pid)
        flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(40)]
        try:
            time.sleep(0.2)  # accepted: 8 held, the rest answered and closed
            answers = [sock.recv(65536) for sock in flood[8:]]
            assert all(a.startswith(b"HTTP/1.1 503 ") for a in answers), answers[:2]
            assert b"too many connections (limit 8)" in answers[0]
            assert _open_fds(daemon.proc.pid) <= baseline + 8
            assert daemon.status().state  # the Unix socket answers meanwhile
            for sock in flood[:8]:  # the silent ones: closed after the header timeout
                assert sock.recv(1) == b""
            assert _get(port, path).startswith(b"HTTP/1.1 200 ")
        finally:
            for sock in flood:
                sock.close()
        for _ in range(50):
            if _open_fds(daemon.proc.pid) <= baseline:
                break
            time.sleep(0.1)
        assert _open_fds(daemon.proc.pid) <= baseline
