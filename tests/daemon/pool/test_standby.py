"""Standby groups (daemon/pool/standby.py) without processes: which spare may replace whom, one per
card for CUDA, one shared for CPU, and a standby that keeps failing to boot halts the pool.
The processes themselves are exercised end to end in test_supervisor.py (CPU) and
tests/workers/test_cuda.py (GPU)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import pytest

from scratchd.daemon.config import load_config
from scratchd.daemon.pool.standby import MAX_CONSECUTIVE_BOOT_FAILURES, Standbys
from scratchd.daemon.pool.supervisor import PoolState, Supervisor
from scratchd.daemon.pool.worker_process import (
    STABLE_AFTER_S,
    Lineage,
    Worker,
    WorkerState,
    restart_delay,
)
from scratchd.ipc.layout import NS_PER_S
from scratchd.protocol.log import LOGGER_NAME
from scratchd.workers.protocol import STANDBY_SLOT, ExitCode, parse_take


class Pool(Supervisor):
    """A supervisor whose processes are recorded instead of spawned, and whose loop keeps the
    calls it is given instead of running them. Its ``Standbys`` is built as the Supervisor
    builds it, with these collaborators."""

    def __init__(self, device: str, count: int, work_fd: int = -1) -> None:
        # Not Supervisor.__init__: that one needs a running loop and opens the death pipe.
        self.config = load_config()
        self.device, self.count = device, count
        self.state, self.halt_reason = PoolState.RUNNING, ""
        self.halted, self._changed = asyncio.Event(), asyncio.Event()
        self.workers, self.names_by_slot = {}, {}
        self.lineage = [Lineage() for _ in range(count)]
        self.soon: list[tuple[Any, tuple[Any, ...]]] = []  # call_soon's calls, not run
        self._loop = cast(asyncio.AbstractEventLoop, SimpleNamespace(
            call_later=lambda delay, fn, *args: ("later", delay, fn, args),
            call_soon=lambda fn, *args: self.soon.append((fn, args)),
        ))  # fmt: skip
        self.launched: list[int] = []
        self.pids = iter(range(1000, 2000))
        self.spares = Standbys(
            device,
            count,
            launch=self._launch,
            free_slot=self._free_slot,
            work_fd=lambda slot: work_fd,
            running=self._running,
            enabled=lambda: self.config.workers.standby,
            halt=self.halt,
            loop=self._loop,
        )

    def _launch(self, wid: int, slot: int, group: int | None = None) -> Worker:
        self.launched.append(-1 if group is None else group)
        proc: Any = SimpleNamespace(pid=next(self.pids))
        worker = Worker(id=wid, device=self.device, slot=slot, proc=proc, pidfd=-1, ready_fd=-1)
        worker.group = self.spares.group_of(wid) if group is None else group  # as Supervisor's
        return worker

    def _free_slot(self) -> int:
        return len(self.workers)


def test_a_cpu_pool_shares_one_standby_and_a_cuda_pool_has_one_per_card() -> None:
    cpu = Pool("cpu", 3)
    assert cpu.spares.groups() == [0] and {cpu.spares.group_of(w) for w in range(3)} == {0}
    cuda = Pool("cuda", 2)
    assert cuda.spares.groups() == [0, 1] and [cuda.spares.group_of(w) for w in range(2)] == [0, 1]
    for g in cuda.spares.groups():
        cuda.spares.spawn(g)
        cuda.spares.spawn(g)  # one per group, however often asked
    assert cuda.launched == [0, 1]
    assert {g: w.group for g, w in cuda.standbys.items()} == {0: 0, 1: 1}
    assert all(w.slot == STANDBY_SLOT for w in cuda.standbys.values())


def test_only_a_ready_standby_of_the_dead_workers_card_takes_over() -> None:
    cuda = Pool("cuda", 2)
    cuda.spares.spawn(1)
    assert not cuda._promote_standby(0)  # card 0 has none; card 1's cannot help
    assert not cuda._promote_standby(1)  # card 1's is still booting
    assert 1 in cuda.standbys


@pytest.mark.parametrize("code", [ExitCode.BOOT_ERROR, ExitCode.CRASH])
def test_a_standby_that_cannot_boot_halts_the_pool(code: ExitCode) -> None:
    pool = Pool("cpu", 1)
    for _ in range(MAX_CONSECUTIVE_BOOT_FAILURES):
        pool.spares.spawn(0)
        spare = pool.standbys[0]
        pool.spares.on_exit(spare, int(code), was_ready=False)
        if pool.halt_reason:
            break
    assert "standby worker" in pool.halt_reason
    assert (len(pool.launched) == 1) == (code is ExitCode.BOOT_ERROR)  # at once / after retries


def test_a_retired_standby_leaving_is_not_a_failure() -> None:
    pool = Pool("cpu", 1)
    pool.spares.spawn(0)
    old = pool.standbys.pop(0)  # retired (a rolling restart replaced it)
    pool.spares.spawn(0)
    old.state = WorkerState.EXITED
    pool.spares.on_exit(old, -9, was_ready=True)
    assert pool.standbys[0] is not old and not pool.halt_reason


@pytest.fixture
def work_fd() -> Iterator[int]:
    """Stands in for a slot's work eventfd: any descriptor can travel with the message."""
    fd = os.open(os.devnull, os.O_RDONLY)
    yield fd
    os.close(fd)


def _ready_spare(pool: Pool, group: int) -> tuple[Worker, socket.socket]:
    """A READY standby for ``group`` whose control socket's other end is returned."""
    pool.spares.spawn(group)
    spare = pool.standbys[group]
    spare.control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spare.state, spare.ready_ns = WorkerState.READY, 1
    return spare, theirs


def test_a_ready_standby_is_handed_the_dead_workers_slot_and_serves_in_it(work_fd: int) -> None:
    cuda = Pool("cuda", 2, work_fd)
    cuda.workers[0] = Worker(id=0, device="cuda", slot=0, proc=cast(Any, None), pidfd=-1,
                             ready_fd=-1)  # fmt: skip  # card 0's worker, alive in slot 0
    spare, theirs = _ready_spare(cuda, 1)
    with theirs:
        assert cuda._promote_standby(1)
        message, fds, _, _ = socket.recv_fds(theirs, 64, 1)
    for fd in fds:
        os.close(fd)
    assert parse_take(message) == 1 and len(fds) == 1  # TAKE <slot> and its work eventfd
    assert cuda.workers[1] is spare and (spare.id, spare.slot) == (1, 1)
    assert cuda.names_by_slot[1] == "cuda1"
    assert (cuda.lineage[1].restarts, cuda.lineage[1].spawned) == (1, 1)
    assert cuda.lineage[0].restarts == 0
    assert 1 not in cuda.standbys and cuda.soon == [(cuda.spares.spawn, (1,))]  # next spare


def test_a_standby_gone_before_its_hand_over_is_replaced_by_a_new_spare(work_fd: int) -> None:
    pool = Pool("cpu", 2, work_fd)
    spare, theirs = _ready_spare(pool, 0)
    theirs.close()  # the standby died (its exit not seen yet): the hand-over fails
    assert not pool._promote_standby(1)
    assert pool.workers == {} and pool.lineage[1].restarts == 0
    assert pool.standbys == {} and pool.soon == [(pool.spares.spawn, (0,))]
    for fn, args in pool.soon:
        fn(*args)
    assert pool.standbys[0] is not spare and pool.launched == [0, 0]
    pool.spares.on_exit(spare, -9, was_ready=True)  # the old one's exit is a non-event
    assert pool.standbys[0] is not spare and not pool.halt_reason


def _dies(pool: Pool, failures: int) -> Worker:
    """Worker 0 of ``pool`` was READY and dies now, its ``failures``-th death in a row."""
    pool.state = PoolState.RUNNING
    pool.lineage[0].failures = failures - 1
    dead = Worker(id=0, device=pool.device, slot=0, proc=cast(Any, None), pidfd=-1, ready_fd=-1)
    dead.ready_ns = time.monotonic_ns()  # not READY for STABLE_AFTER_S: the count goes on
    return dead


@pytest.mark.parametrize("failures", [1, 2, 5])
def test_a_ready_standby_takes_over_at_once_whatever_the_backoff(
    work_fd: int, failures: int
) -> None:
    pool = Pool("cpu", 1, work_fd)
    dead = _dies(pool, failures)
    spare, theirs = _ready_spare(pool, 0)
    with theirs:
        pool._decide_after_exit(dead, -9, True)
        assert pool.workers[0] is spare and pool.lineage[0].pending is None  # nothing deferred
        theirs.settimeout(0)  # handed over already: the message is there
        _, fds, _, _ = socket.recv_fds(theirs, 64, 1)
    for fd in fds:
        os.close(fd)
    assert pool.lineage[0].failures == failures  # the crash-loop count still counts


def test_without_a_ready_standby_a_fresh_process_waits_the_backoff(work_fd: int) -> None:
    pool = Pool("cpu", 1, work_fd)
    dead = _dies(pool, 3)
    pool.spares.spawn(0)  # still booting
    pool._decide_after_exit(dead, -9, True)
    assert pool.workers == {}
    assert pool.lineage[0].pending[:2] == ("later", restart_delay(3))  # type: ignore[index]


class Events(logging.Handler):
    """The names of the events logged while installed (``log_event``'s ``event``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.names.append(getattr(record, "event", ""))


@pytest.fixture
def events() -> Iterator[Events]:
    logger = logging.getLogger(LOGGER_NAME)
    handler, level = Events(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _ready_then_dies(pool: Pool, ready_s: float = 0.0) -> Any:
    """The group's spare boots, says READY, and dies ``ready_s`` later before it was handed
    a slot (as one whose wait fails does); the respawn it schedules is returned."""
    pool.spares.spawn(0)
    spare = pool.standbys[0]
    spare.state = WorkerState.READY
    spare.ready_ns = time.monotonic_ns() - int(ready_s * NS_PER_S)
    pool.spares.on_exit(spare, int(ExitCode.CRASH), was_ready=True)
    return pool.spares.lines[0].pending


def test_a_standby_that_keeps_dying_after_ready_backs_off_and_is_reported(
    events: Events,
) -> None:
    pool = Pool("cpu", 1)
    delays = []
    for _ in range(8):
        pending = _ready_then_dies(pool)
        assert pool.spares.backing_off() == [0]  # the status shows the group restarting
        delays.append(pending[1])
    assert delays == [restart_delay(n) for n in range(1, 9)]  # growing, up to the cap
    assert delays[0] == 0.0 and delays[-1] > 1.0
    assert events.names.count("standby_crash_loop") == 7  # from the second death in a row
    assert not pool.halt_reason  # the serving workers are fine: never a halt
    pool.spares.spawn(0)  # the backoff ran out: spawned, no longer backing off
    assert pool.spares.backing_off() == []


def test_a_standby_that_was_ready_long_enough_starts_the_count_again() -> None:
    pool = Pool("cpu", 1)
    for _ in range(4):
        _ready_then_dies(pool)
    pending = _ready_then_dies(pool, ready_s=STABLE_AFTER_S)
    assert pending[1] == 0.0 and pool.spares.lines[0].failures == 1
