"""Standby groups (daemon/standby.py) without processes: which spare may replace whom, one per
card for CUDA, one shared for CPU, and a standby that keeps failing to boot halts the pool.
The processes themselves are exercised end to end in test_supervisor.py (CPU) and
tests/workers/test_cuda.py (GPU)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from scratchd.daemon.config import load_config
from scratchd.daemon.standby import MAX_CONSECUTIVE_BOOT_FAILURES, StandbyMixin
from scratchd.daemon.worker_process import Lineage, Worker, WorkerState
from scratchd.workers.protocol import STANDBY_SLOT, ExitCode


class Pool(StandbyMixin):
    """The supervisor's side of the contract, recorded instead of spawning processes."""

    def __init__(self, device: str, count: int) -> None:
        self.config = load_config()
        self.device, self.count = device, count
        self.workers, self.names_by_slot = {}, {}
        self.lineage = [Lineage() for _ in range(count)]
        self.standbys = {}
        self.standby_lines = {g: Lineage() for g in self.groups()}
        self._loop = cast(asyncio.AbstractEventLoop, SimpleNamespace(
            call_later=lambda delay, fn, *args: ("later", delay, fn, args),
            call_soon=lambda fn, *args: None,
        ))  # fmt: skip
        self.launched: list[int] = []
        self.halted = ""
        self.pids = iter(range(1000, 2000))

    def _launch(self, wid: int, slot: int, group: int | None = None) -> Worker:
        self.launched.append(-1 if group is None else group)
        proc: Any = SimpleNamespace(pid=next(self.pids))
        return Worker(id=wid, device=self.device, slot=slot, proc=proc, pidfd=-1, ready_fd=-1)

    def _free_slot(self) -> int:
        return len(self.workers)

    def _running(self) -> bool:
        return not self.halted

    def halt(self, reason: str) -> None:
        self.halted = reason


def test_a_cpu_pool_shares_one_standby_and_a_cuda_pool_has_one_per_card() -> None:
    cpu = Pool("cpu", 3)
    assert cpu.groups() == [0] and {cpu.group_of(w) for w in range(3)} == {0}
    cuda = Pool("cuda", 2)
    assert cuda.groups() == [0, 1] and [cuda.group_of(w) for w in range(2)] == [0, 1]
    for g in cuda.groups():
        cuda.spawn_standby(g)
        cuda.spawn_standby(g)  # one per group, however often asked
    assert cuda.launched == [0, 1]
    assert {g: w.group for g, w in cuda.standbys.items()} == {0: 0, 1: 1}
    assert all(w.slot == STANDBY_SLOT for w in cuda.standbys.values())


def test_only_a_ready_standby_of_the_dead_workers_card_takes_over() -> None:
    cuda = Pool("cuda", 2)
    cuda.spawn_standby(1)
    assert not cuda._promote_standby(0)  # card 0 has none; card 1's cannot help
    assert not cuda._promote_standby(1)  # card 1's is still booting
    assert 1 in cuda.standbys


@pytest.mark.parametrize("code", [ExitCode.BOOT_ERROR, ExitCode.CRASH])
def test_a_standby_that_cannot_boot_halts_the_pool(code: ExitCode) -> None:
    pool = Pool("cpu", 1)
    for _ in range(MAX_CONSECUTIVE_BOOT_FAILURES):
        pool.spawn_standby(0)
        spare = pool.standbys[0]
        pool._on_standby_exit(spare, int(code), was_ready=False)
        if pool.halted:
            break
    assert "standby worker" in pool.halted
    assert (len(pool.launched) == 1) == (code is ExitCode.BOOT_ERROR)  # at once / after retries


def test_a_retired_standby_leaving_is_not_a_failure() -> None:
    pool = Pool("cpu", 1)
    pool.spawn_standby(0)
    old = pool.standbys.pop(0)  # retired (a rolling restart replaced it)
    pool.spawn_standby(0)
    old.state = WorkerState.EXITED
    pool._on_standby_exit(old, -9, was_ready=True)
    assert pool.standbys[0] is not old and not pool.halted
