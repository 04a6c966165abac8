"""The supervisor: spawns worker processes, learns of each death at once, reclaims, restarts.

Each worker has a stable logical id (``cpu0``, ``cpu1``, …) and, while it runs, a row
("slot") of the queue's worker table. A worker's life, driven only from the event loop::

    spawn ──▶ STARTING ──READY line──▶ READY ──SIGTERM (stop/retire/hang)──▶ STOPPING
                 │                        │                                     │
                 └────────── process exits (pidfd readable) ◀───────────────────┘
                                          │
                               reclaim_worker(slot): its claims go back to the queue
                               (or time out, or fail after max_kills), row cleared
                                          │
                      BOOT_ERROR before READY → the pool HALTS (no crash loop)
                      retired / pool stopping → gone
                      otherwise               → the card's (or pool's) warm standby at
                                                once when it is READY, else a fresh process
                                                after backoff (the first one at once)

Deaths are seen through a pidfd (``os.pidfd_open``) registered with ``loop.add_reader``:
readable the instant the process exits, whatever killed it; no SIGCHLD handler, no polling
``waitpid``. The only timer is the watchdog (once per heartbeat interval): it SIGTERMs a READY
worker whose shared-memory heartbeat is older than ``hang_timeout``, SIGKILLs one that has not
exited ``kill_grace`` after its SIGTERM, and kills a worker stuck in boot.

CUDA pools (``device == "cuda"``): one worker per card in ``gpus``, each started with
``CUDA_VISIBLE_DEVICES`` naming its card (by NVML index, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
so that CUDA numbers cards as NVML does), and one warm standby *per card* (a standby has its
CUDA context, modules and graphs on that card, so it can only replace that card's worker).
A CPU pool shares one standby (group 0).

Workers learn of *our* death through the death pipe (they hold its read end, only we hold
the write end: EOF when we die) and PR_SET_PDEATHSIG (see ``scratchd.workers.protocol``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Callable

from scratchd.daemon.config import Config
from scratchd.daemon.pool.standby import MAX_CONSECUTIVE_BOOT_FAILURES, Standbys
from scratchd.daemon.pool.worker_process import (
    STABLE_AFTER_S,
    Lineage,
    Worker,
    WorkerState,
    describe_exit,
    launch,
    restart_delay,
    worker_env,
)
from scratchd.ipc.layout import NS_PER_MS, NS_PER_S
from scratchd.ipc.queue import ReclaimReport, RequestQueue
from scratchd.protocol.log import log_event
from scratchd.workers.protocol import ExitCode, WorkerSpec


class PoolState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    HALTED = "halted"


class PoolHalted(RuntimeError):
    """A worker failed to boot: serving cannot start or continue. The message says why."""


class Supervisor:
    """Keeps ``count`` workers of ``device`` alive on ``queue``.

    ``on_reclaimed`` is called after every reclaim (the dispatcher collects the completions
    a reclaim produces: timeouts and quarantined failures).
    """

    def __init__(
        self,
        config: Config,
        queue: RequestQueue,
        queue_name: str,
        device: str,
        count: int,
        on_reclaimed: Callable[[ReclaimReport], None],
        gpus: list[int] | None = None,
    ) -> None:
        self.config = config
        self.queue = queue
        self.queue_name = queue_name
        self.device = device
        self.count = count
        self.gpus = list(gpus or [])
        if device == "cuda" and len(self.gpus) != count:
            raise ValueError(f"a CUDA pool needs one GPU per worker, got {self.gpus} for {count}")
        self.on_reclaimed = on_reclaimed
        self.state = PoolState.STARTING
        self.halt_reason = ""
        self.halted = asyncio.Event()
        self.workers: dict[int, Worker] = {}  # by slot
        self.lineage = [Lineage() for _ in range(count)]
        self.names_by_slot: dict[int, str] = {}
        self._loop = asyncio.get_running_loop()
        self._death_r, self._death_w = os.pipe()  # workers get the read end; we keep the write
        self._watchdog: asyncio.TimerHandle | None = None
        self._changed = asyncio.Event()  # set whenever a worker becomes READY or exits
        # Warm, not serving: the next replacement, one per group (see the module docstring).
        self.spares = Standbys(
            device,
            count,
            launch=self._launch,
            free_slot=self._free_slot,
            work_fd=queue.work_fd,
            running=self._running,
            enabled=lambda: self.config.workers.standby,
            halt=self.halt,
            loop=self._loop,
        )

    @property
    def standbys(self) -> dict[int, Worker]:
        """The warm spare of each group that has one, booting or READY."""
        return self.spares.workers

    @property
    def standby_lines(self) -> dict[int, Lineage]:
        return self.spares.lines

    # ---- starting ---------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the pool and wait until every worker is READY (raises PoolHalted)."""
        for wid in range(self.count):
            self.spawn_worker(wid)
        self._schedule_watchdog()
        while self.ready_count() < self.count and self.state is not PoolState.HALTED:
            self._changed.clear()
            await self._changed.wait()
        if self.state is PoolState.HALTED:
            raise PoolHalted(self.halt_reason)
        self.state = PoolState.RUNNING
        for group in self.spares.groups():  # after the pool: their boot does not slow it
            self.spares.spawn(group)

    def spawn_worker(self, wid: int) -> Worker:
        """Start the process for logical worker ``wid`` in a free worker-table slot."""
        worker = self._launch(wid, self._free_slot())
        self.workers[worker.slot] = worker
        self.names_by_slot[worker.slot] = worker.name
        self.lineage[wid].spawned += 1
        return worker

    def _running(self) -> bool:
        return self.state in (PoolState.STARTING, PoolState.RUNNING)

    def _launch(self, wid: int, slot: int, group: int | None = None) -> Worker:
        max_batch, max_delay_ms, extra = self._backend_args()
        spec = WorkerSpec(
            queue=self.queue_name,
            slot=slot,
            backend=self.device,
            model_path=self.config.model.path,
            max_batch=max_batch,
            max_delay_ms=max_delay_ms,
            heartbeat_ms=self.config.workers.heartbeat_ms,
            parent_pid=os.getpid(),
            extra=extra,
        )
        group = self.spares.group_of(wid) if group is None else group
        env = self._worker_env(wid, group)
        worker = launch(wid, self.device, spec, self.queue, self._death_r, env)
        worker.group = group
        self._loop.add_reader(worker.ready_fd, self._on_ready_pipe, worker)
        self._loop.add_reader(worker.pidfd, self._on_exit, worker)
        return worker

    def _backend_args(self) -> tuple[int, int, tuple[str, ...]]:
        """``(max_batch, max_delay_ms, extra flags)`` for this pool's workers, from the
        current config (a reload changes it): a GPU worker takes the queue's batch limits
        and its memory settings; a CPU worker its own, smaller limits. Both take
        ``model.views`` (no flag when empty: the model file's own views)."""
        q, w = self.config.queue, self.config.workers
        views, cascade = self.config.model.views, self.config.model.cascade
        model = (f"--views={','.join(views)}",) if views else ()
        if self.device != "cuda":
            if cascade is not None:  # the CUDA backend has no cascade: only CPU workers
                model = (*model, f"--cascade={'on' if cascade else 'off'}")
            return (min(q.max_batch, w.cpu_max_batch),
                    min(q.max_queue_delay_ms, w.cpu_max_queue_delay_ms), model)  # fmt: skip
        extra = (
            *model,
            f"--gpu-reserve-mb={w.gpu_reserve_mb}",
            f"--gpu-arena-mb={w.gpu_arena_mb}",
            *(f"--gpu-warm-size={h}x{wd}" for h, wd in w.gpu_warm_sizes),
        )
        return q.max_batch, q.max_queue_delay_ms, extra

    def _free_slot(self) -> int:
        used = set(self.workers)
        for slot in range(self.queue.geometry.max_workers):
            if slot not in used:
                return slot
        raise RuntimeError("no free worker-table slot (more workers than queue max_workers)")

    def _worker_env(self, wid: int, group: int) -> dict[str, str]:
        first = wid >= 0 and self.lineage[wid].spawned == 0
        env = worker_env(f"{self.device}{wid}", self.count, arm_fault=first)
        if self.device == "cuda":  # an NVML index; CUDA must count cards as NVML does (gpus.py)
            env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
            env["CUDA_VISIBLE_DEVICES"] = str(self.gpus[group])
        return env

    def _on_ready_pipe(self, worker: Worker) -> None:
        try:
            chunk = os.read(worker.ready_fd, 4096)
        except BlockingIOError:
            return
        if not chunk:
            self._close_ready_pipe(worker)
        elif worker.take_boot_output(chunk):
            self._changed.set()
            self._close_ready_pipe(worker)

    def _close_ready_pipe(self, worker: Worker) -> None:
        if worker.ready_fd >= 0:
            self._loop.remove_reader(worker.ready_fd)
            os.close(worker.ready_fd)
            worker.ready_fd = -1

    # ---- deaths -----------------------------------------------------------------------

    def _on_exit(self, worker: Worker) -> None:
        self._loop.remove_reader(worker.pidfd)
        os.close(worker.pidfd)
        if worker.ready_fd >= 0:  # read what a failing boot said before it died
            self._on_ready_pipe(worker)
            self._close_ready_pipe(worker)
        code = worker.proc.wait()
        was_ready = worker.ready_ns > 0
        worker.state = WorkerState.EXITED
        if worker.standby:
            worker.exited.set()  # stop_all() waits on the standby's exit too
            self.spares.on_exit(worker, code, was_ready)
            return
        report = self.queue.reclaim_worker(
            worker.slot, time.monotonic_ns(), max_kills=self.config.workers.max_kills
        )
        del self.workers[worker.slot]
        worker.exited.set()
        self._changed.set()
        planned = worker.retiring or self.state in (PoolState.STOPPING, PoolState.STOPPED)
        log_event(
            "worker_exited" if planned else "worker_died",
            logging.INFO if planned else logging.WARNING,
            worker=worker.name,
            pid=worker.proc.pid,
            cause=describe_exit(code),
            requeued=len(report.requeued),
            expired=len(report.expired),
            quarantined=len(report.quarantined),
        )
        self.on_reclaimed(report)
        self._decide_after_exit(worker, code, was_ready)

    def _decide_after_exit(self, worker: Worker, code: int, was_ready: bool) -> None:
        if worker.retiring or self.state in (PoolState.STOPPING, PoolState.STOPPED):
            return
        if self.state is PoolState.HALTED:
            return
        lineage = self.lineage[worker.id]
        if not was_ready:
            lineage.boot_failures += 1
            if code == ExitCode.BOOT_ERROR:
                self.halt(f"worker {worker.name} failed to boot: {worker.boot_reason()}")
                return
            if lineage.boot_failures >= MAX_CONSECUTIVE_BOOT_FAILURES:
                self.halt(
                    f"worker {worker.name} died {lineage.boot_failures} times during boot "
                    f"(last exit {describe_exit(code)}): {worker.boot_reason()}"
                )
                return
        else:
            lineage.boot_failures = 0
            if (time.monotonic_ns() - worker.ready_ns) / NS_PER_S >= STABLE_AFTER_S:
                lineage.failures = 0
        lineage.failures += 1
        # A READY standby takes over at once, backoff or not: it is already booted, and a
        # new one boots behind it (seconds on a GPU), which paces a crash loop by itself;
        # a request that kills each worker it meets is quarantined (``max_kills``). Waiting
        # the backoff only let the queue fill (0.1 s, 0.2 s after a second, third kill -9
        # within STABLE_AFTER_S: 200–400 requests at 2000 req/s). Fresh processes back off.
        if self._promote_standby(worker.id):
            return
        delay = restart_delay(lineage.failures)
        lineage.pending = self._loop.call_later(delay, self._respawn, worker.id)

    def _respawn(self, wid: int) -> None:
        lineage = self.lineage[wid]
        lineage.pending = None
        if self.state in (PoolState.RUNNING, PoolState.STARTING):
            if self._promote_standby(wid):  # a standby READY by now beats a fresh boot
                return
            lineage.restarts += 1
            lineage.last_restart_s = time.time()
            worker = self.spawn_worker(wid)
            log_event("worker_restart", worker=worker.name, pid=worker.proc.pid, slot=worker.slot)

    def _promote_standby(self, wid: int) -> bool:
        """The warm standby of ``wid``'s group takes over as worker ``wid`` in a free slot;
        False if there is none READY."""
        standby = self.spares.take(wid)
        if standby is None:
            return False
        self.workers[standby.slot] = standby
        self.names_by_slot[standby.slot] = standby.name
        lineage = self.lineage[wid]
        lineage.restarts += 1
        lineage.spawned += 1
        lineage.last_restart_s = time.time()
        log_event("worker_restart", worker=standby.name, pid=standby.proc.pid, slot=standby.slot,
                  standby=True)  # fmt: skip
        return True

    def halt(self, reason: str) -> None:
        """Stop the pool for good: the daemon cannot serve (reported, exits non-zero)."""
        if self.state is PoolState.HALTED:
            return
        self.state = PoolState.HALTED
        self.halt_reason = reason
        self.halted.set()
        self._changed.set()

    # ---- watchdog ---------------------------------------------------------------------

    def _schedule_watchdog(self) -> None:
        self._watchdog = self._loop.call_later(
            self.config.workers.heartbeat_ms / 1000.0, self._check_workers
        )

    def _check_workers(self) -> None:
        now = time.monotonic_ns()
        cfg = self.config.workers
        beats = {row.slot: row.heartbeat_ns for row in self.queue.worker_rows()}
        for worker in [*self.workers.values(), *self.standbys.values()]:
            if worker.state is WorkerState.STOPPING:
                if now - worker.term_ns > cfg.kill_grace_ms * NS_PER_MS:
                    self._signal(worker, signal.SIGKILL)
            elif worker.state is WorkerState.STARTING:
                if now - worker.started_ns > cfg.boot_timeout_ms * NS_PER_MS:
                    self._signal(worker, signal.SIGKILL)
            elif worker.standby:
                continue  # idle by design: no slot, no heartbeat
            elif now - max(beats.get(worker.slot, 0), worker.ready_ns) > (
                cfg.hang_timeout_ms * NS_PER_MS
            ):
                self.terminate(worker)
        if self.state not in (PoolState.STOPPED, PoolState.HALTED):
            self._schedule_watchdog()

    def terminate(self, worker: Worker) -> None:
        """SIGTERM now; the watchdog SIGKILLs if it is still there after ``kill_grace``."""
        if worker.state in (WorkerState.STOPPING, WorkerState.EXITED):
            return
        worker.state = WorkerState.STOPPING
        worker.term_ns = time.monotonic_ns()
        self._signal(worker, signal.SIGTERM)

    @staticmethod
    def _signal(worker: Worker, sig: signal.Signals) -> None:
        if worker.state is WorkerState.EXITED:
            return
        with contextlib.suppress(OSError):  # already gone: its pidfd reports the exit
            signal.pidfd_send_signal(worker.pidfd, sig)

    # ---- planned changes --------------------------------------------------------------

    async def rolling_restart(self) -> None:
        """Replace every worker, one at a time, while the queue keeps flowing: start the new
        one in a spare slot, wait for its READY, then retire the old one (SIGTERM: it
        finishes its batch; anything it still holds is reclaimed). Raises PoolHalted if a
        replacement cannot boot (the old worker is then kept)."""
        for old in sorted(self.workers.values(), key=lambda w: w.id):
            if old.retiring or old.state is not WorkerState.READY:
                continue
            new = self.spawn_worker(old.id)
            done = asyncio.ensure_future(new.exited.wait())
            ready = asyncio.ensure_future(new.ready.wait())
            await asyncio.wait([done, ready], return_when="FIRST_COMPLETED")
            done.cancel()
            ready.cancel()
            if new.state is not WorkerState.READY:
                raise PoolHalted(f"replacement {new.name} did not boot: {new.boot_reason()}")
            old.retiring = True
            self.terminate(old)
            await old.exited.wait()
        for group, old_standby in self.spares.retire_all():  # spares: new config and model
            self.terminate(old_standby)
            self.spares.spawn(group)

    async def stop_all(self, grace_s: float) -> None:
        """SIGTERM every worker, wait up to ``grace_s``, SIGKILL the rest, wait for them."""
        if self.state is not PoolState.HALTED:
            self.state = PoolState.STOPPING
        for lineage in self.lineage:
            if lineage.pending is not None:
                lineage.pending.cancel()
        self.spares.cancel_pending()
        workers = [*self.workers.values(), *self.standbys.values()]
        for worker in workers:
            self.terminate(worker)
        waits = [w.exited.wait() for w in workers]
        if waits:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(w) for w in waits], timeout=grace_s
            )
            for worker in workers:
                self._signal(worker, signal.SIGKILL)
            if pending:
                await asyncio.wait(pending)
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.state is not PoolState.HALTED:
            self.state = PoolState.STOPPED
        if self._death_w >= 0:  # workers see EOF on the death pipe; nothing more to spawn
            os.close(self._death_w)
            os.close(self._death_r)
            self._death_w = self._death_r = -1

    # ---- views ------------------------------------------------------------------------

    def worker_name(self, slot: int) -> str | None:
        return self.names_by_slot.get(slot)

    def ready_count(self) -> int:
        return sum(w.state is WorkerState.READY for w in self.workers.values())
