"""Workers die and nothing is lost: kill -9 at the queue's fault points, hung workers, boot
failures, rolling restarts, and three CLI clients while both workers are SIGKILLed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from scratchd.client.api import build_request
from scratchd.daemon.app import queue_prefix
from scratchd.daemon.config import load_config
from scratchd.daemon.pool.supervisor import PoolHalted, Supervisor, WorkerState
from scratchd.ipc.queue import Geometry, RequestQueue, Status
from scratchd.protocol import wire
from scratchd.protocol.image import decode_image, encode_png

from ..harness import DaemonProcess
from ..test_app import RawConnection

INFER = [sys.executable, "-c", "from scratchd.daemon.cli import main; main()", "infer"]


def _frames(n: int, seed: int = 0, size: int = 96) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size), dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize(
    "point",
    [
        "claim.unlinked",  # inside the queue's critical section (robust mutex held)
        "claim.marked",  # critical section, descriptor already CLAIMED
        "claim.returned",  # between claim and compute
        "complete.mid_result",  # halfway through writing results
        "complete.flipped",  # result published, doorbell not rung
    ],
)
def test_kill9_at_a_fault_point_loses_nothing_and_a_replacement_serves(point: str) -> None:
    env = {"SCRATCHD_WORKER_FAULT": f"cpu0={point}"}
    with DaemonProcess(workers=1, slots=32, env=env) as d:
        first_pid = d.worker_pids()["cpu0"]
        conn = RawConnection(d.socket)
        n = 20
        for i, frame in enumerate(_frames(n)):
            conn.send(build_request(i, frame))
        replies = [conn.receive() for _ in range(n)]
        assert conn.nothing_more()
        counts = Counter(r.id for r in replies)
        assert counts == Counter(range(n)), "every request answered exactly once"
        assert {r.status for r in replies if isinstance(r, wire.Reply)} == {"ok"}
        d.wait_ready(restarts={"cpu0": 1})
        status = d.status()
        (worker,) = status.workers
        assert worker.restarts == 1 and worker.pid != first_pid and worker.requests > 0
        assert "event=worker_died" in d.log() and "SIGKILL" in d.log()
        conn.close()


def test_a_hung_worker_is_terminated_killed_and_replaced() -> None:
    workers = "hang_timeout_ms = 800\nkill_grace_ms = 300\n"
    with DaemonProcess(workers=1, slots=16, workers_extra=workers) as d:
        pid = d.worker_pids()["cpu0"]
        os.kill(pid, signal.SIGSTOP)  # alive but silent: no heartbeat, ignores SIGTERM
        conn = RawConnection(d.socket)
        for i, frame in enumerate(_frames(4, seed=5)):
            conn.send(build_request(i, frame))
        replies = [conn.receive(60) for _ in range(4)]
        assert {r.status for r in replies if isinstance(r, wire.Reply)} == {"ok"}
        assert d.worker_pids()["cpu0"] != pid
        assert "SIGKILL" in d.log()
        conn.close()


def test_a_worker_that_cannot_boot_halts_the_pool_with_the_reason(tmp_path: Path) -> None:
    """``serve`` refuses a broken model file itself (exit 2, tests/daemon/test_commands.py);
    whatever else stops a worker's boot halts the pool with the worker's reason instead of a
    restart loop. A model file broken behind ``serve``'s back plays that here."""
    broken = tmp_path / "broken.npz"
    broken.write_bytes(b"this is not a model")
    config = load_config(None, {"workers.cpu_workers": 2, "model.path": str(broken)}, environ={})
    prefix = queue_prefix(f"/tmp/halt-{os.getpid()}.sock")

    async def scenario() -> tuple[str, int]:
        geometry = Geometry(slots=8, slot_bytes=1 << 16, max_workers=8)
        queue = RequestQueue.create_unique(prefix, geometry)
        sup = Supervisor(config, queue, queue.name, "cpu", 2, lambda report: None)
        try:
            with pytest.raises(PoolHalted) as halted:
                await sup.start()
            restarts = sum(x.restarts for x in sup.lineage)
            await sup.stop_all(2.0)
            return str(halted.value), restarts
        finally:
            queue.close()

    reason, restarts = asyncio.run(scenario())
    assert "failed to boot" in reason and str(broken) in reason
    assert restarts == 0  # no crash loop


def test_rolling_restart_replaces_every_worker_while_requests_flow() -> None:
    config = load_config(None, {"workers.cpu_workers": 2, "workers.heartbeat_ms": 100}, environ={})
    model = os.environ.get("SCRATCHD_TEST_MODEL", "")
    if model:
        config = load_config(None, {"model.path": model, "workers.cpu_workers": 2}, environ={})
    prefix = queue_prefix(f"/tmp/rolling-{os.getpid()}.sock")

    async def scenario() -> tuple[list[Status], set[int], set[int]]:
        geometry = Geometry(slots=32, slot_bytes=1 << 16, max_workers=8)
        queue = RequestQueue.create_unique(prefix, geometry)
        done: list[Status] = []
        sup = Supervisor(config, queue, queue.name, "cpu", 2, lambda report: None)
        loop = asyncio.get_running_loop()
        loop.add_reader(
            queue.completion_fd, lambda: done.extend(c.status for c in queue.collect_completed())
        )
        try:
            await sup.start()
            before = {w.proc.pid for w in sup.workers.values()}
            frame = _frames(1, size=64)[0]

            async def feed() -> None:
                for i in range(60):
                    while (h := queue.reserve()) is None:
                        await asyncio.sleep(0.01)
                    np.frombuffer(queue.payload(h), np.uint8, count=frame.size)[:] = frame.ravel()
                    queue.submit(h, request_id=i, conn_id=1, priority=0, part_class=0,
                                 deadline_ns=time.monotonic_ns() + 60 * 10**9,
                                 height=64, width=64, want_mask=False)  # fmt: skip
                    await asyncio.sleep(0.01)

            feeder = asyncio.ensure_future(feed())
            await sup.rolling_restart()
            await feeder
            while len(done) < 60:
                await asyncio.sleep(0.02)
            after = {w.proc.pid for w in sup.workers.values() if w.state is WorkerState.READY}
            await sup.stop_all(2.0)
            return done, before, after
        finally:
            loop.remove_reader(queue.completion_fd)
            queue.close()

    # A bound, so that a wedged scenario fails with a traceback instead of stalling CI.
    done, before, after = asyncio.run(asyncio.wait_for(scenario(), 180))
    assert len(done) == 60 and set(done) == {Status.OK}
    assert len(after) == 2 and not before & after


def _run_clients(socket: str, images: list[str], clients: int) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [*INFER, "--socket", socket, "--json", "--concurrency", "8", *images],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(clients)
    ]


def _tiles(data_dir: Path, out: Path, n: int, size: int = 96) -> list[str]:
    """``n`` centre crops of real SD-900 images, taking the images in turn (real content at a
    quarter of the compute: the CI machine has two cores)."""
    sources = sorted((data_dir / "sd900" / "images").glob("*.png"))
    paths = []
    for i in range(n):
        src = sources[i % len(sources)]
        image = decode_image(src.read_bytes())
        top, left = (image.shape[0] - size) // 2, (image.shape[1] - size) // 2
        dst = out / f"{i}-{src.name}"
        dst.write_bytes(
            encode_png(np.ascontiguousarray(image[top : top + size, left : left + size]))
        )
        paths.append(str(dst))
    return paths


def test_three_clients_all_ok_while_both_workers_are_killed_in_turn(
    data_dir: Path, tmp_path: Path
) -> None:
    images = _tiles(data_dir, tmp_path, 280)
    assert len(images) == 280
    with DaemonProcess(workers=2, slots=64, max_batch=2) as d:
        clients = _run_clients(d.socket, images, 3)
        replaced_in: list[float] = []
        for name, restarts in (("cpu0", 1), ("cpu1", 1)):
            time.sleep(0.7)  # let work pile up on the victim
            victim = d.worker_pids()[name]
            os.kill(victim, signal.SIGKILL)
            start = time.monotonic()
            d.wait_ready(restarts={name: restarts})
            replaced_in.append(time.monotonic() - start)
            assert d.worker_pids()[name] != victim
        outputs = [c.communicate(timeout=600) for c in clients]
        for client, (out, err) in zip(clients, outputs, strict=True):
            lines = [json.loads(line) for line in out.splitlines()]
            assert [line["image"] for line in lines] == images, err
            bad = [line for line in lines if line["status"] != "ok"]
            assert not bad, bad[:3]
            assert client.returncode == 0
        status = d.status()
        assert [w.restarts for w in status.workers] == [1, 1]
        assert all(w.state == "ready" for w in status.workers)
        print(f"worker replacement after SIGKILL: {', '.join(f'{s:.3f} s' for s in replaced_in)}")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in "ZX"  # exited (a zombie only waits for its new parent to reap it)


def test_workers_leave_with_a_killed_daemon_and_the_next_one_replaces_its_leftovers() -> None:
    d = DaemonProcess(workers=2, slots=16)
    try:
        d.start()
        pids = list(d.worker_pids().values())
        assert d.proc is not None
        d.proc.kill()  # kill -9 the main process: no cleanup at all
        d.proc.wait()
        deadline = time.monotonic() + 30
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids)
        left = d.shm_path
        assert left.exists() and Path(d.socket).exists()  # what a crash leaves behind
        d.start()  # same socket: both are found stale; the dead segment is removed
        assert not left.exists() and d.shm_path != left  # a fresh random name
        conn = RawConnection(d.socket)
        conn.send(build_request(1, _frames(1)[0]))
        reply = conn.receive()
        assert isinstance(reply, wire.Reply) and reply.status == "ok"
        conn.close()
        assert d.stop() == 0
        assert not d.shm_path.exists()
    finally:
        d.__exit__(None, None, None)


def test_a_request_that_kills_every_worker_taking_it_is_quarantined() -> None:
    env = {"SCRATCHD_WORKER_FAULT": "*=claim.returned"}  # every worker dies on its first claim
    with DaemonProcess(workers=1, slots=8, env=env) as d:
        conn = RawConnection(d.socket)
        conn.send(build_request(7, _frames(1)[0]))
        reply = conn.receive()
        assert isinstance(reply, wire.Reply)
        assert (reply.id, reply.status) == (7, "error")
        assert "quarantined" in reply.error
        assert conn.nothing_more()
        assert d.log().count("event=worker_died") == 3  # workers.max_kills
        d.wait_ready(restarts={"cpu0": 3})  # the pool itself carries on
        conn.close()


def test_the_warm_standby_takes_over_a_killed_worker_and_a_new_spare_boots() -> None:
    with DaemonProcess(workers=2, slots=16) as d:
        deadline = time.monotonic() + 120
        while (spare := d.status().standby) is None or spare.state != "ready":
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert [s.pid for s in d.status().standbys] == [spare.pid]  # a CPU pool has one
        victim = d.worker_pids()["cpu1"]
        os.kill(victim, signal.SIGKILL)
        d.wait_ready(restarts={"cpu1": 1})
        assert d.worker_pids()["cpu1"] == spare.pid  # the spare, not a fresh process
        conn = RawConnection(d.socket)
        for i, frame in enumerate(_frames(6, seed=9)):
            conn.send(build_request(i, frame))
        replies = [conn.receive() for _ in range(6)]
        assert {r.status for r in replies if isinstance(r, wire.Reply)} == {"ok"}
        conn.close()
        while (new_spare := d.status().standby) is None or new_spare.state != "ready":
            assert time.monotonic() < deadline, d.log()
            time.sleep(0.05)
        assert new_spare.pid not in (spare.pid, victim)
        assert "standby=true" in d.log()
        # A second death in a row (within the backoff's window) takes the new standby too
        # (at once, not after the backoff: test_standby.py checks that part).
        os.kill(spare.pid, signal.SIGKILL)
        d.wait_ready(restarts={"cpu1": 2})
        assert d.worker_pids()["cpu1"] == new_spare.pid
        assert d.log().count("standby=true") == 2


def test_without_a_standby_a_fresh_process_replaces_a_killed_worker() -> None:
    with DaemonProcess(workers=1, slots=16, workers_extra="standby = false\n") as d:
        assert d.status().standby is None
        victim = d.worker_pids()["cpu0"]
        os.kill(victim, signal.SIGKILL)
        d.wait_ready(restarts={"cpu0": 1})
        assert d.worker_pids()["cpu0"] != victim
        assert d.status().standby is None


def test_gpu_worker_flags_from_the_config_are_what_the_worker_parses() -> None:
    from types import SimpleNamespace

    from scratchd.daemon.config import load_config
    from scratchd.daemon.pool.supervisor import Supervisor
    from scratchd.workers.main import parse_args
    from scratchd.workers.protocol import WorkerSpec

    cfg = load_config(overrides={"queue.max_batch": 8, "workers.gpu_arena_mb": 2048,
                                 "workers.gpu_warm_sizes": [[512, 640], [1024, 1024]],
                                 "model.views": ["identity", "flip_v"]})  # fmt: skip
    for device in ("cuda", "cpu"):
        max_batch, delay, extra = Supervisor._backend_args(
            SimpleNamespace(config=cfg, device=device)  # type: ignore[arg-type]
        )
        spec = WorkerSpec("/q", 0, device, "", max_batch, delay, 100, 1, extra)
        args = parse_args(spec.argv(ready_fd=3, death_fd=4, work_fd=5, done_fd=6)[3:])
        assert args.backend == device
        assert args.views == ("identity", "flip_v")  # model.views, in order, for both pools
        if device == "cuda":
            assert (args.max_batch, args.gpu_arena_mb, args.gpu_reserve_mb) == (8, 2048, 1024)
            assert args.gpu_warm_size == ["512x640", "1024x1024"]
        else:  # a CPU worker keeps its own, smaller limits and no GPU flags
            assert (args.max_batch, args.max_delay_ms) == (2, 0)
            assert args.gpu_warm_size == []


def test_without_model_views_a_worker_gets_no_views_flag() -> None:
    """Empty ``model.views``: no flag, so the worker keeps the model file's own views."""
    from types import SimpleNamespace

    from scratchd.workers.main import parse_args
    from scratchd.workers.protocol import WorkerSpec

    cfg = load_config(environ={})
    for device in ("cuda", "cpu"):
        pool = SimpleNamespace(config=cfg, device=device)
        max_batch, delay, extra = Supervisor._backend_args(pool)  # type: ignore[arg-type]
        assert not any(flag.startswith("--views") for flag in extra)
        spec = WorkerSpec("/q", 0, device, "", max_batch, delay, 100, 1, extra)
        assert parse_args(spec.argv(ready_fd=3, death_fd=4, work_fd=5, done_fd=6)[3:]).views == ()


def test_a_cuda_worker_opens_the_card_nvml_names() -> None:
    from types import SimpleNamespace

    from scratchd.daemon.pool.worker_process import Lineage

    pool = SimpleNamespace(device="cuda", count=2, gpus=[3, 1], lineage=[Lineage(), Lineage()])
    for wid, card in ((0, "3"), (1, "1")):
        env = Supervisor._worker_env(pool, wid, group=wid)  # type: ignore[arg-type]
        # CUDA's default order is fastest first; NVML's, whose indices gpus holds, is by bus id
        assert (env["CUDA_DEVICE_ORDER"], env["CUDA_VISIBLE_DEVICES"]) == ("PCI_BUS_ID", card)
