"""Memory against a live daemon: connections that announce the largest frame and send a few
bytes of it, or a lot of it, then stall, cost the main process what they sent (within
``[server] receive_budget_mb``), not what they announced, and it comes back once they are
gone; real clients are served throughout."""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path

from scratchd.protocol import wire

from ..live_daemon import LiveDaemon, daemon_config, live_daemon, real_crops

MIB = 1024 * 1024
SLOT_BYTES = MIB  # the largest frame: 3 MiB + 64 KiB
PNG_START = b"\x89PNG\r\n\x1a\n" + bytes(1016)  # the start of an `encoded` body, then nothing


def rss(daemon: LiveDaemon) -> int:
    """The main process's resident memory, bytes."""
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def stall(daemon: LiveDaemon, count: int, sent: int) -> list[socket.socket]:
    """``count`` connections, each announcing the largest frame and sending ``sent`` bytes
    of an encoded request's body (a msgpack map whose bin is that long), then nothing."""
    max_frame = 3 * SLOT_BYTES + wire.MAX_FRAME_OVERHEAD
    head = b"\x82\xa4type\xa5infer\xa7encoded\xc6" + struct.pack(">I", max_frame - 25)
    body = head + (PNG_START * (sent // len(PNG_START) + 1))[: sent - len(head)]
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        sock.connect(daemon.socket_path)  # blocking: waits for room in the backlog
        sock.setblocking(False)
        data = struct.pack(">I", max_frame) + body
        try:
            while data:
                data = data[sock.send(data) :]
        except BlockingIOError:
            pass  # the daemon stopped reading it (the budget): the rest waits in the socket
        socks.append(sock)
    return socks


def settle(daemon: LiveDaemon, seconds: float = 1.0) -> None:
    """Let the daemon read what was sent (a status round trip is behind it)."""
    time.sleep(seconds)
    daemon.status()


def served(daemon: LiveDaemon, crop: object) -> bool:
    with daemon.client(timeout=60) as client:
        return client.infer(crop, deadline_ms=60_000).status == "ok"  # type: ignore[arg-type]


def test_stalled_frames_hold_what_they_sent_not_what_they_announced(
    tmp_path: Path, data_dir: Path
) -> None:
    crop = real_crops(data_dir, 1)[0]
    config = daemon_config(queue={"slot_bytes": SLOT_BYTES}, server={"frame_timeout_ms": 60_000})
    with live_daemon(tmp_path, config) as daemon:
        assert served(daemon, crop)
        before = rss(daemon)
        socks = stall(daemon, 200, 4096)
        settle(daemon)
        during = rss(daemon)
        assert served(daemon, crop)
        for sock in socks:
            sock.close()
        settle(daemon)
        after = rss(daemon)
    # Announced: 200 x 3 MiB. Held: a head (64 KiB) and a page or two each.
    assert during - before < 48 * MIB, (before, during, after)
    assert after - before < 24 * MIB, (before, during, after)


def test_frames_that_really_send_megabytes_stay_within_the_budget(
    tmp_path: Path, data_dir: Path
) -> None:
    crop = real_crops(data_dir, 1)[0]
    config = daemon_config(
        queue={"slot_bytes": SLOT_BYTES},
        server={"frame_timeout_ms": 3000, "receive_budget_mb": 8},
    )
    with live_daemon(tmp_path, config) as daemon:
        before = rss(daemon)
        socks = stall(daemon, 48, 2 * MIB)  # 96 MiB sent, then the senders stall
        settle(daemon)
        during = rss(daemon)
        # A real client is served: small frames need no budget.
        assert served(daemon, crop)
        # The stalled frames are cut off after frame_timeout_ms, each answered and closed.
        reasons = []
        for sock in socks:
            sock.setblocking(True)
            sock.settimeout(30)
            length = wire.frame_length(sock.recv(4, socket.MSG_WAITALL))
            reply = wire.decode_daemon_message(sock.recv(length, socket.MSG_WAITALL))
            assert isinstance(reply, wire.Reply)
            reasons.append(reply.error)
            sock.close()
        settle(daemon)
        after = rss(daemon)
    assert all("not received within 3000 ms" in r for r in reasons), set(reasons)
    # Held at once: the 8 MiB budget, a head's worth per connection, one frame past it.
    assert during - before < 8 * MIB + 48 * 128 * 1024 + 4 * MIB + 16 * MIB, (before, during)
    assert after - before < 24 * MIB, (before, during, after)
