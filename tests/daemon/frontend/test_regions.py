"""Zero-copy requests against a live daemon: registration (SCM_RIGHTS), the answers they give,
and hostile clients: descriptors that are no sealed memfd, reads outside a region, another
connection's region, a broken handshake, limits, a client that dies with requests in flight."""

from __future__ import annotations

import array
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scratchd.client.api import Client
from scratchd.client.regions import create_memfd, send_descriptor
from scratchd.protocol import wire

from ..live_daemon import LiveDaemon, daemon_config, live_daemon, real_crops

SIZE = 256 * 1024
TIMEOUT_MS = 3000  # the daemon's frame_timeout_ms: how long it waits for the descriptor byte


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    server = {
        "max_regions_per_connection": 2,
        "max_region_bytes": 1 << 30,
        "frame_timeout_ms": TIMEOUT_MS,
    }
    with live_daemon(tmp_path_factory.mktemp("regions"), daemon_config(server=server)) as d:
        yield d


def connect(daemon: LiveDaemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(daemon.socket_path)
    return sock


def read(sock: socket.socket) -> wire.DaemonMessage:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    return wire.decode_daemon_message(exactly(wire.frame_length(exactly(4))))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def register(sock: socket.socket, fd: int, size: int = SIZE, rid: int = 1) -> wire.RegionReply:
    sock.sendall(wire.encode_frame(wire.RegisterRegion(id=rid, size=size)))
    answer = read(sock)
    if isinstance(answer, wire.SendDescriptor):
        assert answer.id == rid
        send_descriptor(sock, fd)
        answer = read(sock)
    assert isinstance(answer, wire.RegionReply) and answer.id == rid
    return answer


def infer(sock: socket.socket, rid: int = 5, **fields: object) -> wire.Reply:
    sock.sendall(wire.encode_frame(wire.InferRequest(id=rid, **fields)))  # type: ignore[arg-type]
    reply = read(sock)
    assert isinstance(reply, wire.Reply) and reply.id == rid
    return reply


def sealed(image: np.ndarray | None = None, size: int = SIZE) -> int:
    fd = create_memfd(size)
    if image is not None:
        os.pwrite(fd, image.tobytes(), 0)
    return fd


def test_zero_copy_replies_are_the_socket_paths_replies(daemon: LiveDaemon, data_dir: Path) -> None:
    greys = real_crops(data_dir, 6)
    images = [*greys, *(np.stack([g, g[::-1], g.T], axis=2) for g in greys[:2])]
    with daemon.client() as zc, Client(daemon.socket_path, timeout=30, zero_copy=False) as plain:
        for image in images:  # one at a time: the ring's one slot is written again each time
            a = zc.infer(image, want_mask=True, deadline_ms=60_000)
            b = plain.infer(image, want_mask=True, deadline_ms=60_000)
            assert a.status == b.status == "ok", (a.error, b.error)
            assert (a.verdict, a.score, a.boxes, a.mask) == (b.verdict, b.score, b.boxes, b.mask)
        assert zc.ring is not None and zc.ring.region == 1 and zc.zero_copy_error == ""
        assert zc.ring.in_use() == 0  # every slot free again once answered
        replies = dict(zc.map(greys, concurrency=4, deadline_ms=60_000))
        assert [replies[i].status for i in range(len(greys))] == ["ok"] * len(greys)


def test_requests_outside_a_region_are_invalid_and_the_connection_serves_on(
    daemon: LiveDaemon, data_dir: Path
) -> None:
    image = real_crops(data_dir, 1)[0]
    fd = sealed(image)
    with connect(daemon) as sock:
        assert register(sock, fd).status == "ok"
        os.close(fd)
        hostile: list[dict[str, Any]] = [
            {"region": 1, "offset": SIZE - 10, "height": 4, "width": 4},  # past the end
            {"region": 1, "offset": SIZE, "height": 1, "width": 1},
            {"region": 1, "offset": 2**62, "height": 1, "width": 1},
            {"region": 1, "height": 2**62, "width": 2**62, "channels": 3},  # sizes that overflow
            {"region": 1, "height": 2**31, "width": 2**31},
            {"region": 1, "height": 0, "width": 4},
            {"region": 1, "height": 4, "width": 4, "channels": 2},
            {"region": 7, "height": 4, "width": 4},  # never registered
            {"region": 1, "height": 4, "width": 4, "pixels": bytes(16)},  # both
            {"region": 1, "height": 1, "width": SIZE // 2},  # inside, but pads past 2 slots
        ]
        for fields in hostile:
            reply = infer(sock, **fields)
            assert reply.status == "invalid" and reply.error, fields
        h, w = image.shape
        reply = infer(sock, region=1, height=h, width=w, deadline_ms=60_000)
        assert reply.status == "ok", reply.error


def test_another_connections_region_cannot_be_named(daemon: LiveDaemon) -> None:
    fd = sealed(np.full((16, 16), 200, np.uint8))
    with connect(daemon) as owner, connect(daemon) as other:
        assert register(owner, fd).region == 1
        reply = infer(other, region=1, height=16, width=16)
        assert reply.status == "invalid" and "not registered on this connection" in reply.error
    os.close(fd)


def _descriptors(tmp_path: Path) -> dict[str, int]:
    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, SIZE)
    shrinkable = os.memfd_create("grow-only", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(shrinkable, SIZE)
    fcntl.fcntl(shrinkable, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    disk = tmp_path / "on-disk"
    disk.write_bytes(bytes(SIZE))
    r, w = os.pipe()
    os.close(w)
    return {
        "unsealed memfd": unsealed,
        "shrinkable memfd": shrinkable,
        "too small": sealed(size=4096),
        "file on disk": os.open(disk, os.O_RDONLY),
        "pipe": r,
        "directory": os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY),
        "/dev/zero": os.open("/dev/zero", os.O_RDONLY),
    }


def test_hostile_descriptors_are_refused_and_the_connection_stays(
    daemon: LiveDaemon, tmp_path: Path
) -> None:
    fds = _descriptors(tmp_path)
    try:
        with connect(daemon) as sock:
            for k, (name, fd) in enumerate(fds.items()):
                answer = register(sock, fd, rid=10 + k)
                assert answer.status == "invalid" and answer.region == 0, name
                assert answer.error and "closing" not in answer.error, name
            sock.sendall(wire.encode_frame(wire.StatusRequest(id=99)))
            assert isinstance(read(sock), wire.StatusReply)
    finally:
        for fd in fds.values():
            os.close(fd)


def _handshake_then(daemon: LiveDaemon, send: str) -> tuple[wire.RegionReply, bool]:
    """Register, then break the handshake as ``send`` says; the answer and whether the daemon
    closed the connection."""
    fd, extra = sealed(), sealed()
    try:
        with connect(daemon) as sock:
            sock.sendall(wire.encode_frame(wire.RegisterRegion(id=3, size=SIZE)))
            assert isinstance(read(sock), wire.SendDescriptor)
            if send == "byte without descriptor":
                sock.sendall(wire.DESCRIPTOR_BYTE)
            elif send == "two descriptors":
                fds = array.array("i", [fd, extra])
                sock.sendmsg([b"\0"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            elif send == "a frame instead":
                sock.sendall(wire.encode_frame(wire.StatusRequest(id=4)))
            answer = read(sock)  # "nothing": the daemon gives up after frame_timeout_ms
            assert isinstance(answer, wire.RegionReply)
            return answer, closed_by_peer(sock)
    finally:
        os.close(fd)
        os.close(extra)


@pytest.mark.parametrize(
    "send", ["byte without descriptor", "two descriptors", "a frame instead", "nothing"]
)
def test_a_broken_handshake_is_answered_and_the_connection_closed(
    daemon: LiveDaemon, send: str
) -> None:
    answer, closed = _handshake_then(daemon, send)
    assert answer.status == "invalid" and answer.error.endswith("closing")
    assert closed
    assert daemon.proc.poll() is None
    with daemon.client() as client:  # everyone else is served as before
        assert client.infer(np.zeros((32, 32), np.uint8), deadline_ms=60_000).status == "ok"


def test_limits_refuse_registration_before_any_descriptor(daemon: LiveDaemon) -> None:
    fds = [sealed() for _ in range(3)]
    try:
        with connect(daemon) as sock:
            assert [register(sock, fd, rid=k).status for k, fd in enumerate(fds)] == [
                "ok",
                "ok",
                "overloaded",  # max_regions_per_connection = 2
            ]
        with connect(daemon) as sock:  # more bytes than the daemon maps: refused at once
            sock.sendall(wire.encode_frame(wire.RegisterRegion(id=8, size=2 << 30)))
            answer = read(sock)
            assert isinstance(answer, wire.RegionReply) and answer.status == "overloaded"
            assert "bytes of client regions" in answer.error
    finally:
        for fd in fds:
            os.close(fd)


def _region_mappings(pid: int) -> int:
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:scratchd-region")


def test_a_client_that_dies_with_requests_in_flight_leaves_nothing_mapped(
    daemon: LiveDaemon, data_dir: Path
) -> None:
    """Its requests are answered to no one or dropped; its region is unmapped with the
    connection and no slot stays in use. Reading a slot again only after its reply is the
    client's rule; the daemon never needs more than that."""
    pid = daemon.proc.pid
    before = _region_mappings(pid)
    fd = sealed(real_crops(data_dir, 1)[0])
    sock = connect(daemon)
    assert register(sock, fd).status == "ok"
    assert _region_mappings(pid) == before + 1
    for rid in range(20):
        request = wire.InferRequest(id=rid, region=1, height=64, width=64, deadline_ms=60_000)
        sock.sendall(wire.encode_frame(request))
    sock.close()
    os.close(fd)
    status = daemon.wait_settled()
    assert (status.queue.in_use, status.queue.in_flight) == (0, 0)
    workers = [w.pid for w in status.workers if w.pid > 0]
    end = time.monotonic() + 20
    while time.monotonic() < end and any(
        _region_mappings(p) > (before if p == pid else 0) for p in [pid, *workers]
    ):
        time.sleep(0.05)
    assert _region_mappings(pid) == before
    assert [_region_mappings(p) for p in workers] == [0] * len(workers)  # workers let go too


def test_a_shrink_attempt_after_registration_fails_and_the_daemon_serves_on(
    daemon: LiveDaemon, data_dir: Path
) -> None:
    image = real_crops(data_dir, 1)[0]
    fd = sealed(image)
    with connect(daemon) as sock:
        assert register(sock, fd).status == "ok"
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        h, w = image.shape
        assert infer(sock, region=1, height=h, width=w, deadline_ms=60_000).status == "ok"
    os.close(fd)
