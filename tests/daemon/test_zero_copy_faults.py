"""Zero-copy requests through the daemon's faults and lifecycle: a worker killed with -9, a
reload and a drain (SIGTERM) with requests from a registered region in flight. As with socket
frames, no request is lost and every one gets exactly one reply."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import numpy as np

from scratchd.client.api import AsyncClient
from scratchd.protocol import wire

from .live_daemon import LiveDaemon, daemon_config, live_daemon, real_crops

N = 30  # within the client ring's slots: every request goes through the region


async def _burst(
    daemon: LiveDaemon, images: list[np.ndarray], during: signal.Signals | None
) -> tuple[list[wire.Reply], AsyncClient]:
    """``images`` pipelined over one zero-copy connection; after the first reply, ``during``
    goes to the serving worker (SIGKILL) or the daemon (SIGHUP, SIGTERM)."""
    client = await AsyncClient.connect(daemon.socket_path, timeout=120)
    tasks = [asyncio.ensure_future(client.infer(i, deadline_ms=120_000)) for i in images]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    if during is signal.SIGKILL:
        status = await client.status()
        victim = next(w.pid for w in status.workers if w.state == "ready")
        os.kill(victim, signal.SIGKILL)
    elif during is not None:
        daemon.proc.send_signal(during)
    replies = await asyncio.gather(*tasks)
    return list(replies), client


def _maps_a_region(pid: int) -> bool:
    return pid > 0 and "memfd:scratchd-region" in Path(f"/proc/{pid}/maps").read_text()


def _each_answered_once(replies: list[wire.Reply]) -> None:
    assert sorted(r.id for r in replies) == sorted({r.id for r in replies})
    assert len(replies) == N


def test_kill9_reload_and_drain_lose_no_zero_copy_request(tmp_path: Path, data_dir: Path) -> None:
    crops = real_crops(data_dir, 8, size=96)
    images = [crops[k % len(crops)] for k in range(N)]
    config = daemon_config(workers={"cpu_workers": 1, "standby": True}, queue={"slots": 64})
    with live_daemon(tmp_path, config) as daemon:

        async def scenario() -> None:
            baseline, client = await _burst(daemon, images, None)
            assert client.ring is not None, client.zero_copy_error
            status = await client.status()
            readers = [w.pid for w in status.workers if _maps_a_region(w.pid)]
            assert readers, "no worker read the pixels from the client's region in place"
            expected = [(r.verdict, r.score) for r in baseline]
            await client.close()
            for during in (signal.SIGKILL, signal.SIGHUP):
                replies, client = await _burst(daemon, images, during)
                assert client.ring is not None and client.ring.in_use() == 0
                await client.close()
                _each_answered_once(replies)
                assert [r.status for r in replies] == ["ok"] * N, {r.error for r in replies}
                assert [(r.verdict, r.score) for r in replies] == expected
            replies, client = await _burst(daemon, images, signal.SIGTERM)
            await client.close()
            _each_answered_once(replies)
            assert {r.status for r in replies} == {"ok"}  # all were accepted before the drain

        asyncio.run(scenario())
        assert daemon.proc.wait(60) == 0
    assert "event=worker_died" in daemon.stderr_path.read_text()
