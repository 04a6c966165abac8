"""Warm standby workers: booted, warmed up, not serving until a worker dies (supervisor.py).

A standby is an ordinary worker process started with ``STANDBY_SLOT``: it loads the model and
runs its warm-up (a GPU standby also captures its graphs), says READY, then waits on its
control socket. When a worker dies, the supervisor hands the standby the dead worker's slot
(``hand_over``: the slot number and its work eventfd travel over the socket) and the
replacement serves within milliseconds, while a new standby boots behind it::

    spawn_standby(g) ── READY ──▶ standbys[g] ── worker of group g dies ──▶ _promote_standby
          ▲                                                                      │
          └──────────────────── call_soon(spawn_standby, g) ◀────────────────────┘

Groups: a CPU pool shares one standby (group 0); a CUDA pool has one per card (group = the
worker's id), because a standby's CUDA context, modules and graphs live on its own card.
A standby that fails to boot ``MAX_CONSECUTIVE_BOOT_FAILURES`` times in a row (or says
BOOT_ERROR) halts the pool, like a worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Final

from scratchd.daemon.pool.worker_process import (
    Lineage,
    Worker,
    WorkerState,
    describe_exit,
    hand_over,
    restart_delay,
)
from scratchd.protocol.log import log_event
from scratchd.workers.protocol import STANDBY_SLOT, ExitCode

if TYPE_CHECKING:
    from scratchd.daemon.config import Config
    from scratchd.ipc.queue import RequestQueue

MAX_CONSECUTIVE_BOOT_FAILURES: Final = 5


class StandbyMixin(ABC):
    """The standby half of :class:`~scratchd.daemon.pool.supervisor.Supervisor`."""

    # Provided by the Supervisor.
    config: Config
    queue: RequestQueue
    device: str
    count: int
    workers: dict[int, Worker]
    names_by_slot: dict[int, str]
    lineage: list[Lineage]
    standbys: dict[int, Worker]
    standby_lines: dict[int, Lineage]
    _loop: asyncio.AbstractEventLoop

    @abstractmethod
    def _launch(self, wid: int, slot: int, group: int | None = None) -> Worker: ...

    @abstractmethod
    def _free_slot(self) -> int: ...

    @abstractmethod
    def _running(self) -> bool: ...

    @abstractmethod
    def halt(self, reason: str) -> None: ...

    def groups(self) -> list[int]:
        """Standby groups: one per card for CUDA, a single shared one for CPU."""
        return list(range(self.count)) if self.device == "cuda" else [0]

    def group_of(self, wid: int) -> int:
        return wid if self.device == "cuda" else 0

    def spawn_standby(self, group: int = 0) -> None:
        """Start a warm spare (``workers.standby``) for ``group`` unless it has one or we are
        stopping."""
        line = self.standby_lines[group]
        line.pending = None
        if self.config.workers.standby and group not in self.standbys and self._running():
            worker = self._launch(STANDBY_SLOT, STANDBY_SLOT, group)
            self.standbys[group] = worker
            line.spawned += 1

    def _promote_standby(self, wid: int) -> bool:
        """Hand a free slot to the warm standby as worker ``wid``; False if there is none."""
        group = self.group_of(wid)
        standby = self.standbys.get(group)
        if standby is None or standby.state is not WorkerState.READY:
            return False
        del self.standbys[group]
        slot = self._free_slot()
        if not hand_over(standby, slot, self.queue.work_fd(slot)):
            # It is gone (or going: its control socket is closed). Out of ``standbys``, its
            # exit is a non-event, so the group's next spare is started here.
            self._loop.call_soon(self.spawn_standby, group)
            return False
        standby.id, standby.slot, standby.ready_ns = wid, slot, time.monotonic_ns()
        self.workers[slot] = standby
        self.names_by_slot[slot] = standby.name
        lineage = self.lineage[wid]
        lineage.restarts += 1
        lineage.spawned += 1
        lineage.last_restart_s = time.time()
        log_event("worker_restart", worker=standby.name, pid=standby.proc.pid, slot=slot,
                  standby=True)  # fmt: skip
        self._loop.call_soon(self.spawn_standby, group)
        return True

    def _on_standby_exit(self, worker: Worker, code: int, was_ready: bool) -> None:
        if worker.control is not None:
            worker.control.close()
            worker.control = None
        group = worker.group
        current: Worker | None = self.standbys.get(group)
        if current is None or current.proc.pid != worker.proc.pid:
            return  # a standby retired, or one that died while being handed a slot
        del self.standbys[group]
        planned = not self._running()
        level = logging.INFO if planned else logging.WARNING
        log_event("standby_exited", level, pid=worker.proc.pid, cause=describe_exit(code))
        if planned:
            return
        line = self.standby_lines[group]
        if not was_ready and code == ExitCode.BOOT_ERROR:
            self.halt(f"standby worker failed to boot: {worker.boot_reason()}")
            return
        line.failures = 0 if was_ready else line.failures + 1
        if line.failures >= MAX_CONSECUTIVE_BOOT_FAILURES:
            self.halt(f"standby worker died {line.failures} times during boot")
            return
        line.pending = self._loop.call_later(
            restart_delay(line.failures + 1), self.spawn_standby, group
        )
