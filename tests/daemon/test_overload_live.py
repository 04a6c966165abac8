"""Issue 21's overload promises against a real daemon (CPU backend, one worker, small
queue): no ``ok`` after its deadline however deep the flood, refusals that say why, and a
safety class that a normal-class flood never squeezes out. Assertions are on counts and on
the daemon's own timings, never on how fast this machine is."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import numpy as np

from scratchd.client.api import AsyncClient
from scratchd.protocol import wire
from tests.daemon.live_daemon import daemon_config, live_daemon, real_crops

DEADLINE_MS = 300


async def _flood(path: str, crops: list[np.ndarray], n: int, **options: object) -> list[wire.Reply]:
    async with await AsyncClient.connect(path, timeout=120) as client:
        calls = [client.infer(crops[i % len(crops)], **options) for i in range(n)]  # type: ignore[arg-type]
        return list(await asyncio.gather(*calls))


def test_under_a_flood_no_reply_is_ok_after_its_deadline(tmp_path: Path, data_dir: Path) -> None:
    """A pipelined flood with a 300 ms deadline, far beyond what one CPU worker serves in
    that time: each request is answered once; every ``ok`` within its deadline (the reply's
    own total); what could not be served in time is refused at the door with the reason
    (the service rate is measured by then), or answered ``timeout``."""
    # More slots than the flood: the queue never fills, so what is refused is refused for
    # its deadline whatever the model's speed (a fast model serves 32 slots within 300 ms).
    config = daemon_config(
        server={"max_in_flight_per_connection": 256},
        queue={"slots": 256},
        **{"classes.normal": {"priority": 0, "deadline_ms": DEADLINE_MS}},
    )
    crops = real_crops(data_dir, 8)
    with live_daemon(tmp_path, config) as daemon:
        with daemon.client(timeout=120) as client:  # measure the service rate first
            for crop in crops[:4]:
                assert client.infer(crop, deadline_ms=60_000).status == "ok"
        replies = asyncio.run(_flood(daemon.socket_path, crops, 200))
    assert len(replies) == 200 and len({r.id for r in replies}) == 200
    statuses = Counter(r.status for r in replies)
    assert set(statuses) <= {"ok", "timeout", "overloaded"}, statuses
    late = [r.timings.total_ms for r in replies if r.status == "ok"]
    assert all(total <= DEADLINE_MS for total in late), sorted(late)[-5:]
    refused = [r.error for r in replies if r.status == "overloaded"]
    assert any("cannot be served within its deadline" in e for e in refused), Counter(refused)
    for reply in replies:
        if reply.status == "timeout":
            assert "deadline" in reply.error


async def _flood_with_safety(path: str, crops: list[np.ndarray]) -> tuple[list, list]:
    """A normal-class flood that keeps the queue full (each connection re-sends as soon as
    an answer comes back) and, once it has been refused for a full queue, 10 safety
    requests at once. Returns (normal replies, safety replies)."""
    normal: list[wire.Reply] = []
    stop = asyncio.Event()
    full = asyncio.Event()

    async def sender(client: AsyncClient, k: int) -> None:
        i = k
        while not stop.is_set():
            reply = await client.infer(crops[i % len(crops)])
            normal.append(reply)
            if reply.status == "overloaded":
                full.set()
                await asyncio.sleep(0.002)  # a refusal is instant: do not spin the CPU
            i += 1

    clients = [await AsyncClient.connect(path, timeout=120) for _ in range(2)]
    tasks = [asyncio.create_task(sender(c, 32 * j + k)) for j, c in enumerate(clients)
             for k in range(32)]  # fmt: skip
    try:
        await asyncio.wait_for(full.wait(), 120)
        async with await AsyncClient.connect(path, timeout=120) as safety_client:
            calls = [safety_client.infer(crops[i % len(crops)], part_class="safety")
                     for i in range(10)]  # fmt: skip
            safety = list(await asyncio.gather(*calls))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in clients:
            await c.close()
    return normal, safety


def test_a_normal_flood_never_squeezes_out_the_safety_class(tmp_path: Path, data_dir: Path) -> None:
    """16 slots (2 reserved for priority >= 4), a normal flood of 64 in flight that keeps
    them full: 10 safety requests sent at once are all served ``ok``; they took the
    reserved slots and the slots of shed normal requests, which were answered
    ``overloaded`` saying so. Deadlines are generous: this is about priority, not speed."""
    config = daemon_config(
        queue={"slots": 16},
        **{
            "classes.normal": {"priority": 0, "deadline_ms": 120_000},
            "classes.safety": {"priority": 7, "deadline_ms": 120_000},
        },
    )
    crops = real_crops(data_dir, 8)
    with live_daemon(tmp_path, config) as daemon:
        normal, safety = asyncio.run(_flood_with_safety(daemon.socket_path, crops))
    assert [r.status for r in safety] == ["ok"] * 10, [r.error for r in safety]
    refused = [r.error for r in normal if r.status == "overloaded"]
    assert any("queue full for priority 0" in e for e in refused)
    assert any("shed to make room for a priority 7 request" in e for e in refused)
    assert {r.status for r in normal} <= {"ok", "overloaded"}
