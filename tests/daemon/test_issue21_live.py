"""Two of issue 21's reproductions run against a real CPU daemon, as the issue ran them.

- Defect 3: with a thousand idle client connections the main process holds descriptors past
  ``FD_SETSIZE``, so the control socket and death pipe it hands a new standby are numbered
  ≥ 1024; killing the serving worker (twice: the second time it is a standby booted with those
  numbers that must take over) leaves the daemon serving, with no standby crash loop.
- Defect 6: a body nested a thousand arrays deep on a connection with a request in flight is
  answered ``invalid``, the request in flight ``ok``, the connection serves on, and the log
  holds a warning, never a traceback.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import numpy as np
import pytest

from scratchd.client.api import build_request
from scratchd.protocol import wire

from .live_daemon import LiveDaemon, daemon_config, live_daemon, real_crops

FD_SETSIZE: Final = 1024
IDLE: Final = FD_SETSIZE + 16
NESTED: Final = b"\x91" * 1000 + b"\xc0"  # the body
DEADLINE_MS: Final = 300_000


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until(condition: object, what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.05)


@pytest.fixture
def descriptors() -> Iterator[None]:
    """Room for this process's idle connections and the daemon's (it inherits the limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 2 * IDLE + 512
    if soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {want}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _ready(daemon: LiveDaemon, restarts: int) -> bool:
    status = daemon.status()
    (worker,) = status.workers
    standby = status.standby
    return (
        worker.state == "ready"
        and worker.restarts >= restarts
        and standby is not None
        and standby.state == "ready"
    )


def _serves(daemon: LiveDaemon) -> bool:
    with daemon.client(timeout=120) as client:
        reply = client.infer(np.zeros((32, 32), np.uint8), deadline_ms=DEADLINE_MS)
    return reply.status == "ok"


def test_a_standby_booted_past_fd_setsize_takes_over_and_serves(
    tmp_path: Path, descriptors: None
) -> None:
    caps = {"max_connections": 2 * IDLE, "max_connections_per_uid": 2 * IDLE}
    server = {**caps, "max_connections_per_pid": 2 * IDLE, "first_frame_timeout_ms": 600_000}
    config = daemon_config(server=server)
    with live_daemon(tmp_path, config) as daemon, contextlib.ExitStack() as idle:
        for _ in range(IDLE):
            sock = idle.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            sock.connect(daemon.socket_path)
        pid = daemon.proc.pid
        _until(lambda: _open_fds(pid) > IDLE, "the daemon accepts the idle connections")
        for restarts in (1, 2):  # the second takeover is by a standby booted past FD_SETSIZE
            (worker,) = daemon.status().workers
            _until(lambda r=restarts: _ready(daemon, r - 1), "a ready standby")
            os.kill(worker.pid, signal.SIGKILL)
            _until(lambda r=restarts: _ready(daemon, r), "the standby takes over, a new one boots")
            assert _serves(daemon)
        log = daemon.stderr_path.read_text(errors="replace")
        assert "out of range" not in log and "Traceback" not in log
        takeovers = daemon.events("worker_restart")
        assert [e.get("standby") for e in takeovers] == ["true", "true"]  # never a fresh boot
        assert daemon.events("standby_crash_loop") == []
        assert daemon.events("standby_exited") == []
        assert _open_fds(pid) > FD_SETSIZE  # the idle connections were held throughout


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    with live_daemon(tmp_path_factory.mktemp("issue21")) as d:
        yield d


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def _replies(sock: socket.socket, count: int) -> list[wire.Reply]:
    data = b""
    replies: list[wire.Reply] = []
    while len(replies) < count:
        chunk = sock.recv(1 << 16)
        assert chunk, "closed before every reply came"
        data += chunk
        while len(data) >= 4 and len(data) >= 4 + (n := wire.frame_length(data[:4])):
            reply = wire.decode_daemon_message(data[4 : 4 + n])
            assert isinstance(reply, wire.Reply)
            replies.append(reply)
            data = data[4 + n :]
    return replies


def test_a_deeply_nested_body_is_invalid_and_the_request_in_flight_is_answered(
    daemon: LiveDaemon, data_dir: Path
) -> None:
    # 512 x 512 from a real crop: the worker is still at it when the nested body arrives
    image = np.ascontiguousarray(np.tile(real_crops(data_dir, 1, 128)[0], (4, 4)))
    request = wire.encode_frame(build_request(41, image, deadline_ms=DEADLINE_MS))
    later = wire.encode_frame(build_request(42, image, deadline_ms=DEADLINE_MS))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(300)
        sock.connect(daemon.socket_path)
        sock.sendall(bytes(request) + _frame(NESTED) * 3)
        replies = {r.id: r for r in _replies(sock, 4)}  # id 0 thrice: one of them kept
        assert replies[41].status == "ok", replies[41].error
        assert replies[0].status == "invalid" and "malformed request" in replies[0].error
        sock.sendall(bytes(later))  # the same connection serves on
        (reply,) = _replies(sock, 1)
        assert (reply.id, reply.status) == (42, "ok")
    log = daemon.stderr_path.read_text(errors="replace")
    assert "Traceback" not in log and "RecursionError" not in log
    assert 1 <= len(daemon.events("malformed_frame")) <= 3
