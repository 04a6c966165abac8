"""Hostile peers against a live daemon: malformed frames, fuzzing, disconnect storms, the
allow-list, the per-connection in-flight limit. Whatever they do, real parts keep being
served correctly and no payload slot leaks.
"""

from __future__ import annotations

import io
import os
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from scratchd.protocol import wire

from ..live_daemon import (
    LiveDaemon,
    assert_served_correctly,
    daemon_config,
    live_daemon,
    real_crops,
    real_images,
)

PREFIX = struct.Struct(">I")
SLOT = 256 * 1024  # the test daemon's slot_bytes (daemon_config)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveDaemon]:
    with live_daemon(tmp_path_factory.mktemp("hostile")) as d:
        yield d


def _frame(body: bytes) -> bytes:
    return PREFIX.pack(len(body)) + body


def _request(**fields: object) -> bytes:
    return _frame(msgspec.msgpack.encode({"type": "infer", "id": 7, **fields}))


def _bomb_png(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose header claims ``width`` x ``height`` (CRC fixed up)."""
    buf = io.BytesIO()
    Image.fromarray(np.zeros((1, 1), np.uint8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = data.index(b"IHDR")
    struct.pack_into(">II", data, ihdr + 4, width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17]))
    struct.pack_into(">I", data, ihdr + 17, crc)
    return bytes(data)


# Each kind: (what is sent, whether one reply comes back). The reply, when one comes, must be
# `invalid`; then the client hangs up (a fresh connection per frame).
MALFORMED: list[tuple[str, Callable[[random.Random], bytes], bool]] = [
    ("garbage body", lambda r: _frame(r.randbytes(r.randint(1, 200))), True),
    ("empty body", lambda r: _frame(b""), True),
    ("wrong schema", lambda r: _request(id="seven", height=[1]), True),
    ("unknown type", lambda r: _frame(msgspec.msgpack.encode({"type": "rm -rf", "id": 1})), True),
    ("pixel count", lambda r: _request(pixels=b"\0" * 10, height=4, width=4), True),
    ("huge shape", lambda r: _request(pixels=b"\0", height=2**31, width=2**31), True),
    ("elongated", lambda r: _request(pixels=bytes(SLOT), height=1, width=SLOT), True),
    ("both images", lambda r: _request(pixels=b"\0", height=1, width=1, encoded=b"x"), True),
    ("channels", lambda r: _request(pixels=b"\0" * 8, height=2, width=2, channels=2), True),
    ("not an image", lambda r: _request(encoded=b"\x89PNG\r\n\x1a\n" + r.randbytes(64)), True),
    ("png bomb", lambda r: _request(encoded=_bomb_png(60_000, 60_000)), True),
    ("part class", lambda r: _request(pixels=b"\0", height=1, width=1, part_class="x\n"), True),
    ("priority", lambda r: _request(pixels=b"\0", height=1, width=1, priority=99), True),
    ("deadline", lambda r: _request(pixels=b"\0", height=1, width=1, deadline_ms=-5), True),
    ("oversized prefix", lambda r: PREFIX.pack(2**32 - 1), True),
    ("truncated body", lambda r: PREFIX.pack(1000) + r.randbytes(10), False),
    ("half a prefix", lambda r: b"\0\0", False),
    ("nothing", lambda r: b"", False),
]


def _read_reply(sock: socket.socket) -> wire.Reply:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed before a full reply")
            data += chunk
        return data

    message = wire.decode_daemon_message(exactly(wire.frame_length(exactly(4))))
    assert isinstance(message, wire.Reply)
    return message


def test_3000_malformed_frames_leave_the_daemon_serving_real_images(
    daemon: LiveDaemon, data_dir: Path
) -> None:
    rng = random.Random(7)
    answered: dict[str, int] = {}
    for i in range(3000):
        name, make, replies = MALFORMED[i % len(MALFORMED)]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(daemon.socket_path)
            sock.sendall(make(rng))
            if replies:
                reply = _read_reply(sock)
                assert reply.status == "invalid", f"{name}: {reply.status} {reply.error}"
                assert reply.error, f"{name}: an invalid reply must say why"
                answered[name] = answered.get(name, 0) + 1
    assert len(answered) == sum(r for _, _, r in MALFORMED)
    assert daemon.proc.poll() is None, "the daemon must survive"
    status = daemon.wait_settled()
    assert (status.queue.in_use, status.queue.in_flight) == (0, 0), "a slot leaked"
    assert_served_correctly(daemon, real_images(data_dir, 6))


def _disconnect_storm(path: str, count: int, seed: int) -> None:
    """``count`` connections, each gone mid-request: a third after a whole request (before
    its reply: the queue path), a third halfway through the body, a third inside the prefix."""
    rng = random.Random(seed)
    pixels = np.arange(16 * 16, dtype=np.uint8).tobytes()
    full = wire.encode_frame(wire.InferRequest(id=1, pixels=pixels, height=16, width=16))
    for i in range(count):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(path)
            kind = i % 3
            if kind == 0:
                sock.sendall(full)
            elif kind == 1:
                sock.sendall(full[: rng.randint(5, len(full) - 1)])
            else:
                sock.sendall(full[: rng.randint(1, 3)])


def test_100000_disconnects_mid_request_leak_no_slot(tmp_path: Path, data_dir: Path) -> None:
    config = daemon_config(queue={"slots": 16})
    with live_daemon(tmp_path, config) as daemon:
        started = time.monotonic()
        threads = [
            threading.Thread(target=_disconnect_storm, args=(daemon.socket_path, 50_000, seed))
            for seed in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = 100_000 / (time.monotonic() - started)
        assert daemon.proc.poll() is None
        status = daemon.wait_settled(timeout=60)
        assert (status.queue.in_use, status.queue.in_flight) == (0, 0), f"leak: {status.queue}"
        # Every one of the 16 slots is usable again: 16 pipelined parts, none overloaded
        # (safety class: it may take the slots reserved for the higher priorities too).
        crops = real_crops(data_dir, 16)
        with daemon.client(timeout=120) as client:
            options = {"part_class": "safety", "deadline_ms": 60_000}
            replies = [r for _, r in client.map(crops, concurrency=16, **options)]
        assert [r.status for r in replies] == ["ok"] * 16, [r.error for r in replies]
        print(f"100000 disconnects at {rate:.0f}/s")


frames = st.one_of(
    st.binary(max_size=300).map(_frame),
    st.dictionaries(
        st.sampled_from(["type", "id", "pixels", "height", "width", "channels", "encoded"]),
        st.one_of(
            st.integers(-(2**40), 2**40),
            st.binary(max_size=64),
            st.sampled_from(["infer", "status", "normal", "safety"]),
            st.none(),
            st.booleans(),
        ),
        max_size=7,
    ).map(lambda d: _frame(msgspec.msgpack.encode(d))),
    # Well-formed raw requests with hostile scheduling fields: the queue stores deadlines as
    # int64 nanoseconds, priorities as 0..7.
    st.builds(
        lambda h, w, deadline, priority, part, mask: _frame(
            msgspec.msgpack.encode(
                {
                    **{"type": "infer", "id": 1, "pixels": bytes(h * w), "height": h},
                    **{"width": w, "deadline_ms": deadline, "priority": priority},
                    **{"part_class": part, "want_mask": mask},
                }
            )
        ),
        st.integers(1, 24),
        st.integers(1, 24),
        st.sampled_from([None, 0, -1, 1, 60_000, 10**13, 2**62, 2**63 - 1])
        | st.integers(-(2**63), 2**63 - 1),
        st.none() | st.integers(-2, 9) | st.integers(-(2**63), 2**63 - 1),
        st.sampled_from(["normal", "safety", "normal", "", "x" * 1000]),
        st.booleans(),
    ),
)


@given(st.lists(frames, min_size=1, max_size=8))
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_frames_on_a_live_socket_get_one_reply_each(
    daemon: LiveDaemon, batch: list[bytes]
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(daemon.socket_path)
        sock.sendall(b"".join(batch))
        for _ in batch:
            message = wire.decode_daemon_message(_read_body(sock))
            # Bad input is named ('invalid'); 'error' would mean the daemon failed on it.
            statuses = {"ok", "invalid", "overloaded", "timeout"}
            if not isinstance(message, wire.StatusReply | wire.Pong):
                assert isinstance(message, wire.Reply) and message.status in statuses, message
    assert daemon.proc.poll() is None


def _read_body(sock: socket.socket) -> bytes:
    prefix = _recv_exactly(sock, 4)
    return _recv_exactly(sock, wire.frame_length(prefix))


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the daemon closed the connection instead of answering"
        data += chunk
    return data


def test_a_peer_outside_the_allow_list_is_refused(tmp_path: Path, data_dir: Path) -> None:
    ours = os.getuid()
    other = 65534 if ours == 0 else ours + 1
    config = daemon_config(server={"allowed_uids": [other]})
    with live_daemon(tmp_path, config) as daemon:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(daemon.socket_path)
            sock.sendall(wire.encode_frame(wire.StatusRequest(id=5)))
            reply = _read_reply(sock)
            assert reply.status == "error" and "uid" in reply.error
            assert sock.recv(1) == b"", "a refused connection is closed after one reply"
        (refusal,) = daemon.events("access_refused")
        assert refusal["uid"] == str(ours) and f"pid={os.getpid()}" in refusal["reason"]


def test_only_listed_uids_are_served(tmp_path: Path, data_dir: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    config = daemon_config(server={"allowed_uids": [0], "socket_mode": 0o666})
    with live_daemon(tmp_path, config) as daemon:
        os.chmod(Path(daemon.socket_path).parent, 0o755)
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child, as an outsider (nobody)
            code = 1
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(10)
                    sock.connect(daemon.socket_path)
                    sock.sendall(wire.encode_frame(wire.StatusRequest(id=1)))
                    os.write(write_end, _read_reply(sock).status.encode())
                    assert sock.recv(1) == b""  # then closed
                code = 0
            except BaseException as exc:
                os.write(write_end, repr(exc).encode())
            finally:
                os._exit(code)
        os.close(write_end)
        _, code = os.waitpid(pid, 0)
        assert os.read(read_end, 100) == b"error" and code == 0
        os.close(read_end)
        status = daemon.status()  # we, uid 0, are listed
        assert status.refused_connections == 1
        assert_served_correctly(daemon, real_images(data_dir, 4))


def test_per_connection_in_flight_limit(tmp_path: Path, data_dir: Path) -> None:
    config = daemon_config(server={"max_in_flight_per_connection": 4}, queue={"slots": 32})
    images = real_images(data_dir, 12)
    with live_daemon(tmp_path, config) as daemon:
        greedy = [
            wire.encode_frame(wire.InferRequest(id=i, encoded=data, deadline_ms=60_000))
            for i, (_, data) in enumerate(images, start=1)
        ]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(60)
            sock.connect(daemon.socket_path)
            sock.sendall(b"".join(greedy))  # 12 at once on one connection
            replies = [_read_reply(sock) for _ in greedy]
        statuses = sorted(r.status for r in replies)
        refused = [r for r in replies if r.status == "overloaded"]
        assert len(refused) >= 12 - 4 - 1, statuses  # a few may finish while others arrive
        assert all("per connection" in r.error for r in refused)
        assert {r.status for r in replies} <= {"ok", "overloaded"}
        assert_served_correctly(daemon, images[:4])


def test_a_stalled_frame_is_cut_off_and_too_many_connections_are_refused(
    tmp_path: Path, data_dir: Path
) -> None:
    # The idle ones never grow silent enough to make room (daemon/frontend/places.py).
    server = {"frame_timeout_ms": 300, "max_connections": 8, "first_frame_timeout_ms": 600_000}
    config = daemon_config(server=server)
    with live_daemon(tmp_path, config) as daemon:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as slow:
            slow.settimeout(10)
            slow.connect(daemon.socket_path)
            slow.sendall(PREFIX.pack(1000) + b"\x81")  # ... and nothing more
            reply = _read_reply(slow)
            assert reply.status == "invalid" and "not received within 300 ms" in reply.error
            assert slow.recv(1) == b""
        idle = []
        try:
            for _ in range(8):  # up to the limit: held open, idle between frames
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(10)
                sock.connect(daemon.socket_path)
                idle.append(sock)
            time.sleep(0.3)  # the daemon accepts asynchronously
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as extra:
                extra.settimeout(10)
                extra.connect(daemon.socket_path)
                reply = _read_reply(extra)
                assert reply.status == "error" and "too many connections" in reply.error
            (full,) = daemon.events("connections_full")
            assert full["limit"] == "8"
            assert daemon.proc.poll() is None
        finally:
            for sock in idle:
                sock.close()
        # The idle ones are gone (once the daemon has seen them close): serving again.
        crop = real_crops(data_dir, 1)[0]
        for attempt in range(50):
            try:
                with daemon.client(timeout=60) as client:
                    assert client.infer(crop, deadline_ms=60_000).status == "ok"
                break
            except ConnectionError:
                assert attempt < 49, "still refused after the idle connections closed"
                time.sleep(0.1)


def _small_real_image(data_dir: Path, fmt: str) -> bytes:
    crop = real_crops(data_dir, 1, size=32)[0]
    buf = io.BytesIO()
    Image.fromarray(crop).save(buf, format=fmt)
    return buf.getvalue()


@given(data=st.data())
@settings(max_examples=90, deadline=None, suppress_health_check=list(HealthCheck))
def test_corrupted_real_images_are_invalid_never_an_error(
    daemon: LiveDaemon, data_dir: Path, data: st.DataObject
) -> None:
    fmt = data.draw(st.sampled_from(["PNG", "BMP", "JPEG"]), label="format")
    image = bytearray(_small_real_image(data_dir, fmt))
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        at = data.draw(st.integers(0, len(image) - 1), label="at")
        image[at] = data.draw(st.integers(0, 255), label="byte")
    cut = data.draw(st.integers(8, len(image)), label="cut")
    with daemon.client(timeout=60) as client:
        reply = client.infer(bytes(image[:cut]), deadline_ms=60_000)
    assert reply.status in ("ok", "invalid"), reply.error
