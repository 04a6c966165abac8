"""The small queue the ipc tests share, and a request submitted into it."""

from __future__ import annotations

import os

from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Geometry, Handle, RequestQueue

TICK = NS_PER_MS  # GEOMETRY's tick_ms
SLOTS = 6
MAX_KILLS = 2
GEOMETRY = Geometry(slots=SLOTS, slot_bytes=16, tick_ms=1, max_workers=3, wheel_ticks=8)


def shm_name(tag: str) -> str:
    return f"/scratchd-test-{tag}-{os.getpid()}"


def submit(
    q: RequestQueue, rid: int, *, priority: int = 0, deadline_ns: int, conn: int = 1
) -> Handle:
    h = q.reserve()
    assert h is not None
    q.payload(h)[:4] = bytes([rid % 256] * 4)
    q.submit(
        h, request_id=rid, conn_id=conn, priority=priority, part_class=0,
        deadline_ns=deadline_ns, height=2, width=2, want_mask=False,
    )  # fmt: skip
    return h
