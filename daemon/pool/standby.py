"""Warm standby workers: booted, warmed up, not serving until a worker dies (supervisor.py).

A standby is an ordinary worker process started with ``STANDBY_SLOT``: it loads the model and
runs its warm-up (a GPU standby also captures its graphs), says READY, then waits on its
control socket. When a worker dies, the supervisor asks :meth:`Standbys.take` for the dead
worker's replacement: the standby is handed a free slot (``hand_over``: the slot number and its
work eventfd travel over the socket) and serves within milliseconds, while a new standby boots
behind it::

    spawn(g) ── READY ──▶ workers[g] ── worker of group g dies ──▶ take(wid) ──▶ Supervisor
        ▲                                                              │         (its slot,
        └────────────────────── call_soon(spawn, g) ◀──────────────────┘          its lineage)

Groups: a CPU pool shares one standby (group 0); a CUDA pool has one per card (group = the
worker's id), because a standby's CUDA context, modules and graphs live on its own card.
A standby that fails to boot ``MAX_CONSECUTIVE_BOOT_FAILURES`` times in a row (or says
BOOT_ERROR) halts the pool, like a worker. One that dies after READY, before it was handed a
slot, counts as a failure too unless it was READY for ``STABLE_AFTER_S``: its next spare
waits the restart backoff (``restart_delay``), so a spare that keeps dying while waiting
(whatever in its environment kills it) is paced instead of respawned at once forever. From
the second death in a row each one is a ``standby_crash_loop`` warning, and the group shows
in the status as ``restarting`` until the next spare is spawned. The serving workers are
not affected, so this never halts the pool.

:class:`Standbys` owns the spares and their lineages only; the supervisor owns the serving
workers and passes in, when it builds this, the few things a spare needs from it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Final

from scratchd.daemon.pool.worker_process import (
    STABLE_AFTER_S,
    Lineage,
    Worker,
    WorkerState,
    describe_exit,
    hand_over,
    restart_delay,
)
from scratchd.ipc.layout import NS_PER_S
from scratchd.protocol.log import log_event
from scratchd.workers.protocol import STANDBY_SLOT, ExitCode

MAX_CONSECUTIVE_BOOT_FAILURES: Final = 5


class Standbys:
    """The warm spares of a pool of ``count`` workers of ``device``, one per group.

    Collaborators, all the supervisor's: ``launch(wid, slot, group)`` starts a worker process;
    ``free_slot()`` names a free worker-table slot; ``work_fd(slot)`` is that slot's work
    eventfd; ``running()`` is False once the pool stops; ``enabled()`` reads
    ``workers.standby`` from the current config; ``halt(reason)`` stops the pool for good.
    """

    def __init__(
        self,
        device: str,
        count: int,
        *,
        launch: Callable[[int, int, int], Worker],
        free_slot: Callable[[], int],
        work_fd: Callable[[int], int],
        running: Callable[[], bool],
        enabled: Callable[[], bool],
        halt: Callable[[str], None],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.device = device
        self.count = count
        self._launch = launch
        self._free_slot = free_slot
        self._work_fd = work_fd
        self._running = running
        self._enabled = enabled
        self._halt = halt
        self._loop = loop
        self.workers: dict[int, Worker] = {}
        """The spare of each group that has one, booting or READY."""
        self.lines = {g: Lineage() for g in self.groups()}
        """Each group's spares over time: spawned, boot failures, the pending respawn."""

    def groups(self) -> list[int]:
        """Standby groups: one per card for CUDA, a single shared one for CPU."""
        return list(range(self.count)) if self.device == "cuda" else [0]

    def group_of(self, wid: int) -> int:
        return wid if self.device == "cuda" else 0

    def spawn(self, group: int = 0) -> None:
        """Start a warm spare (``workers.standby``) for ``group`` unless it has one or the pool
        is stopping."""
        line = self.lines[group]
        line.pending = None
        if self._enabled() and group not in self.workers and self._running():
            self.workers[group] = self._launch(STANDBY_SLOT, STANDBY_SLOT, group)
            line.spawned += 1

    def take(self, wid: int) -> Worker | None:
        """Hand a free slot to the READY spare of worker ``wid``'s group, which now serves in
        it as ``wid``; None if there is none. The caller records it as a serving worker."""
        group = self.group_of(wid)
        standby = self.workers.get(group)
        if standby is None or standby.state is not WorkerState.READY:
            return None
        del self.workers[group]
        slot = self._free_slot()
        # Either way the group's next spare is started: out of ``workers``, this one's exit
        # is a non-event.
        self._loop.call_soon(self.spawn, group)
        if not hand_over(standby, slot, self._work_fd(slot)):
            return None  # it is gone (or going: its control socket is closed)
        standby.id, standby.slot, standby.ready_ns = wid, slot, time.monotonic_ns()
        return standby

    def retire_all(self) -> list[tuple[int, Worker]]:
        """Take every spare out (their exits become non-events) and return them by group: a
        rolling restart stops them and spawns new ones with the new config and model."""
        retired = list(self.workers.items())
        self.workers.clear()
        return retired

    def cancel_pending(self) -> None:
        """Cancel every group's scheduled respawn (the pool is stopping)."""
        for line in self.lines.values():
            if line.pending is not None:
                line.pending.cancel()

    def on_exit(self, worker: Worker, code: int, was_ready: bool) -> None:
        """A spare's process exited: start the next one after backoff, or halt the pool."""
        if worker.control is not None:
            worker.control.close()
            worker.control = None
        group = worker.group
        current: Worker | None = self.workers.get(group)
        if current is None or current.proc.pid != worker.proc.pid:
            return  # a standby retired, or one that died while being handed a slot
        del self.workers[group]
        planned = not self._running()
        level = logging.INFO if planned else logging.WARNING
        log_event("standby_exited", level, pid=worker.proc.pid, cause=describe_exit(code))
        if planned:
            return
        line = self.lines[group]
        if not was_ready:
            line.boot_failures += 1
            if code == ExitCode.BOOT_ERROR:
                self._halt(f"standby worker failed to boot: {worker.boot_reason()}")
                return
            if line.boot_failures >= MAX_CONSECUTIVE_BOOT_FAILURES:
                self._halt(f"standby worker died {line.boot_failures} times during boot")
                return
        else:
            line.boot_failures = 0
            if (time.monotonic_ns() - worker.ready_ns) / NS_PER_S >= STABLE_AFTER_S:
                line.failures = 0
        line.failures += 1
        delay = restart_delay(line.failures)
        if line.failures > 1:
            log_event("standby_crash_loop", logging.WARNING, group=group,
                      deaths_in_a_row=line.failures, backoff_s=delay)  # fmt: skip
        line.pending = self._loop.call_later(delay, self.spawn, group)

    def backing_off(self) -> list[int]:
        """The groups without a spare whose next one waits its backoff (a crash loop)."""
        return [g for g, line in self.lines.items() if line.pending is not None]
