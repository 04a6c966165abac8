"""The main process's own user-space cost per request, without sockets: what the event loop's
thread spends from a frame's bytes arriving to its reply being written, kernel excluded.

    python scripts/bench_frontend_loop.py                          # 1024x1024 and 16x16
    python scripts/bench_frontend_loop.py --sizes 1024 --batch 1 --accounting --profile
    python scripts/bench_frontend_loop.py --sizes 1024 --path region  # pixels in a client region

``bench_frontend.py`` measures the whole main process over a real socket, but on a machine
shared with its own clients its numbers move with the load. This runs the same parts
(``Connection`` + ``Acceptor`` + ``Dispatcher`` + ``RequestQueue``, with ``--accounting``
the daemon's per-reply accounting) in one thread and plays the rest itself: the kernel
(it fills what ``get_buffer`` lends and calls ``buffer_updated``, as uvloop's ``recv_into``
does, writing every byte of the frame except the pixels: their copy is the kernel's, and
which buffer they land in is what the front end chooses) and the worker (it claims
``--batch`` requests and completes them; its time is measured apart and left out). Replies
go to a transport that only counts them. CPU is ``time.thread_time`` of this thread.

``--path region``: the connection first registers a sealed memfd through the real handshake
(``RegisterRegion``, the descriptor over a socket pair), then every request names its pixels
in that region (``region``, ``offset``) instead of carrying them: the zero-copy path, where
the front end handles descriptors only.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import socket
import time
from pathlib import Path
from typing import Any

import bench_frontend as fe
import numpy as np

from scratchd.client.regions import create_memfd, send_descriptor
from scratchd.daemon.config import Config, QueueConfig, ServerConfig
from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.daemon.frontend.connection import Connection
from scratchd.daemon.frontend.dispatch import Dispatcher
from scratchd.ipc.queue import Geometry, RequestQueue, Result, Status
from scratchd.protocol import wire

SLOTS = 64


class CountingTransport:
    """What the connection writes to: replies are counted, not sent. ``sock`` is what it
    says the connection's socket is (the region handshake reads its descriptor byte there)."""

    def __init__(self, sock: socket.socket | None = None) -> None:
        self.replies = 0
        self.sock = sock

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def writelines(self, data: list[bytearray]) -> None:
        self.replies += len(data)

    def write(self, data: bytes | bytearray) -> None:
        self.replies += count_frames(data)

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.sock if name == "socket" and self.sock is not None else default


def count_frames(data: bytes | bytearray) -> int:
    """Frames in a buffer of length-prefixed frames (one turn's replies, written at once)."""
    n, pos = 0, 0
    while pos < len(data):
        pos += wire.PREFIX_BYTES + wire.frame_length(data[pos : pos + wire.PREFIX_BYTES])
        n += 1
    return n


def deliver(conn: Connection, frame: memoryview, pixels: tuple[int, int]) -> None:
    """The kernel's part: fill each lent buffer, leaving out the pixel bytes' copy."""
    lo = 0
    while lo < len(frame):
        buf = conn.get_buffer(-1)
        n = min(len(buf), len(frame) - lo)
        for a, b in ((lo, min(lo + n, pixels[0])), (max(lo, pixels[1]), lo + n)):
            if a < b:  # the bytes around the pixels: head, tail, the next frame's prefix
                buf[a - lo : b - lo] = frame[a:b]
        conn.buffer_updated(n)
        lo += n


def raw_frame(size: int) -> tuple[memoryview, tuple[int, int]]:
    """A raw grey request as a client sends it, and where its pixels lie in the frame."""
    pixels = np.random.default_rng(0).integers(0, 256, size * size, np.uint8).tobytes()
    request = wire.InferRequest(id=1, pixels=pixels, height=size, width=size)
    frame = bytes(wire.encode_frame(request))
    start = frame.index(pixels)
    return memoryview(frame), (start, start + len(pixels))


def region_frame(size: int) -> tuple[memoryview, tuple[int, int]]:
    """A grey request naming its pixels in region 1 (none of its bytes are pixels)."""
    request = wire.InferRequest(id=1, height=size, width=size, region=1, offset=0)
    frame = memoryview(bytes(wire.encode_frame(request)))
    return frame, (len(frame), len(frame))


async def register_region(conn: Connection, client: socket.socket, size: int) -> None:
    """The region handshake, as a client runs it: ``RegisterRegion`` delivered, the descriptor
    sent on the client's end, the loop turned until the desk has mapped it."""
    register = memoryview(bytes(wire.encode_frame(wire.RegisterRegion(id=1, size=size))))
    deliver(conn, register, (len(register), len(register)))
    fd = create_memfd(size)
    try:
        send_descriptor(client, fd)
        for _ in range(1000):
            await asyncio.sleep(0.001)
            if isinstance(conn.handler, Acceptor) and conn.handler.regions.registered(conn):
                return
    finally:
        os.close(fd)
    raise SystemExit("the region was not registered")


async def measure(args: argparse.Namespace, size: int) -> dict[str, Any]:
    slot_bytes = max(64, size * size)
    config = Config(
        server=ServerConfig(socket="/nonexistent"),
        queue=QueueConfig(slots=SLOTS, slot_bytes=slot_bytes),
    )
    queue = RequestQueue.create(f"/sdbench-loop-{os.getpid()}-{size}", Geometry(SLOTS, slot_bytes))
    fe.fault_in_slots(queue, SLOTS)
    queue.register_worker(0, os.getpid())
    account = fe.daemon_accounting(config) if args.accounting else fe.no_accounting
    dispatcher = Dispatcher(queue, 1_000_000, account, lambda _: "cpu0")
    acceptor = Acceptor(config, queue, dispatcher, fe.status_reply)
    ours, client = socket.socketpair()
    conn, transport = Connection(1, acceptor), CountingTransport(ours)
    conn.connection_made(transport)  # type: ignore[arg-type]
    if args.path == "region":
        await register_region(conn, client, size * size)
        transport.replies = 0  # SendDescriptor and RegionReply: not requests
        frame, pixels = region_frame(size)
    else:
        frame, pixels = raw_frame(size)
    histogram = np.ones(64, np.uint32)
    profile = cProfile.Profile() if args.profile else None
    rounds = max(1, args.requests // args.batch)
    worker_ns = 0
    try:
        if profile is not None:
            profile.enable()
        t0 = time.thread_time_ns()
        for _ in range(rounds):
            for _ in range(args.batch):
                deliver(conn, frame, pixels)
            w0 = time.thread_time_ns()
            claims = queue.claim_batch(0, args.batch, time.monotonic_ns())
            result = Result(Status.OK, score=0.1, entropy=0.25, histogram=histogram,
                            compute_ns=1_000_000, batch_size=len(claims))  # fmt: skip
            for claim in claims:
                queue.complete(0, claim, result)
            worker_ns += time.thread_time_ns() - w0
            dispatcher.collect()
            await asyncio.sleep(0)  # the replies of this turn are written
        total_ns = time.thread_time_ns() - t0
        if profile is not None:
            profile.disable()
    finally:
        conn.connection_lost(None)
        await acceptor.close_connections()
        queue.close()
        ours.close()
        client.close()
    requests = rounds * args.batch
    if transport.replies != requests:
        raise SystemExit(f"{transport.replies} replies to {requests} requests")
    if profile is not None:
        print(f"cProfile, {size}x{size} ({requests} requests; profiler overhead included):")
        pstats.Stats(profile).sort_stats("tottime").print_stats(20)
    return {
        "size": size,
        "path": args.path,
        "batch": args.batch,
        "accounting": args.accounting,
        "requests": requests,
        "loop_cpu_us_per_request": round((total_ns - worker_ns) / requests / 1e3, 1),
    }


async def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await measure(args, int(size)) for size in args.sizes.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="1024,16")
    p.add_argument("--batch", type=int, default=4, help="requests per worker batch and loop turn")
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--path", choices=("socket", "region"), default="socket",
                   help="pixels in the frame, or named in a registered client region")  # fmt: skip
    p.add_argument("--accounting", action="store_true", help="the daemon's per-reply metrics")
    p.add_argument("--profile", action="store_true", help="cProfile, top functions by own time")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import uvloop

    rows = uvloop.run(run_all(args))
    print(f"{'size':>6}{'path':>8}{'batch':>7}{'accounting':>12}{'loop CPU us/req':>17}")
    for r in rows:
        print(
            f"{r['size']:>6}{r['path']:>8}{r['batch']:>7}{r['accounting']!s:>12}"
            f"{r['loop_cpu_us_per_request']:>17}"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
