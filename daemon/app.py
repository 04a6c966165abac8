"""The daemon: wires queue, supervisor, dispatcher and acceptor together and runs them.

Lifecycle: daemon/lifecycle.py's enum, transitions only through :meth:`Daemon.transition`.

Start (:func:`run_daemon`): create the shared-memory queue
``/scratchd-<uid>-<hash of the socket path>-<64 random bits>`` (created with ``O_EXCL``, so no
other user can take or pre-empt the name; the dead segments of a crashed previous run on the
same socket are found by the prefix and removed: ``ipc/shm.py``) and build the daemon's
parts around it, all at once (:class:`Daemon`); then start the dispatcher (completion
doorbell), spawn the workers and wait for all READY, then open the socket.

Shutdown, top to bottom (:meth:`Daemon.drain`): stop accepting (socket closed and
unlinked); new frames on open connections get ``overloaded``; wait for image decodes in
progress, then for every accepted request to be answered, up to ``server.drain_timeout_ms``
(the rest are answered ``error``); stop the workers (SIGTERM, SIGKILL after
``workers.kill_grace_ms``); close connections; unlink the shared memory; exit 0. A second
SIGTERM/SIGINT kills the workers, unlinks the shared memory and exits at once (status 1).

Signal handlers only record and wake (``loop.add_signal_handler``: they set an event the
main coroutine waits on); the work happens in :meth:`Daemon.run`.

Seams for the observability and operations work: :meth:`Daemon.account` sees every reply
with its in-flight record and completion; :meth:`Daemon.snapshot` builds ``status``;
``self.supervisor.rolling_restart()`` replaces workers one at a time.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Final

from scratchd.daemon.config import Config
from scratchd.daemon.frontend.acceptor import Acceptor
from scratchd.daemon.frontend.dispatch import Dispatcher, InFlight
from scratchd.daemon.kserve.endpoint import KServeEndpoint
from scratchd.daemon.kserve.model_info import Served
from scratchd.daemon.lifecycle import Lifecycle, check_transition
from scratchd.daemon.ops.observability import (
    Listeners,
    Observability,
    read_model_reference,
    worker_device,
)
from scratchd.daemon.ops.service import ServiceManager
from scratchd.daemon.pool.gpus import Placement, place
from scratchd.daemon.pool.supervisor import PoolHalted, Supervisor, WorkerState
from scratchd.ipc.layout import NS_PER_MS
from scratchd.ipc.queue import Completion, DescState, Geometry, ReclaimReport, RequestQueue
from scratchd.protocol import wire
from scratchd.protocol.log import log_event

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def queue_prefix(socket_path: str) -> str:
    """The start of the shared-memory name for the daemon serving ``socket_path`` (the rest
    is random: ``RequestQueue.create_unique``)."""
    digest = hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:12]
    return f"/scratchd-{os.getuid()}-{digest}-"


class Daemon:
    """One daemon instance around its ``queue`` (created by :func:`run_daemon`, which also
    closes it); ``await daemon.run()`` serves until told to stop. Built on the running event
    loop: the dispatcher and the supervisor take it. ``read_config`` re-reads the
    configuration the way ``serve`` first read it (SIGHUP reloads)."""

    def __init__(
        self,
        config: Config,
        queue: RequestQueue,
        queue_name: str,
        placement: Placement,
        read_config: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.state = Lifecycle.STARTING
        self.placement = placement
        self.backend = placement.backend
        self.queue = queue
        self.queue_name = queue_name
        self.started = time.time()
        self.replies: collections.Counter[str] = collections.Counter()
        self.halt_reason = ""
        self._signals = 0
        self._stop = asyncio.Event()
        self.supervisor = Supervisor(
            config,
            queue,
            queue_name,
            self.backend,
            placement.workers,
            self._on_reclaimed,
            placement.gpus,
        )
        self.dispatcher = Dispatcher(
            queue, config.queue.tick_ms * NS_PER_MS, self.account, self.supervisor.worker_name
        )
        self.acceptor = Acceptor(config, queue, self.dispatcher, self.snapshot)
        # Metrics, drift, entropy, /livez /readyz /metrics (daemon/ops/observability.py).
        self.obs = Observability(
            config,
            read_model_reference(config.model.path),
            devices=[self.backend],
            worker_states=[s.value for s in WorkerState],
            device_of=worker_device(self.supervisor),
        )
        self.listeners = Listeners(
            self.obs, queue, self.supervisor, self.dispatcher, lambda: self.state.value
        )
        # The Open Inference Protocol (daemon/kserve/): HTTP and gRPC, through the acceptor.
        served = Served(
            ready=lambda: self.listeners.readiness.check()[0],
            version=lambda: self.obs.model.version,
        )
        self.kserve = KServeEndpoint(config, self.acceptor, served)
        # systemd (NOTIFY_SOCKET, LISTEN_FDS) and SIGHUP reloads.
        self.service = ServiceManager(
            queue=queue,
            supervisor=self.supervisor,
            dispatcher=self.dispatcher,
            lifecycle=lambda: self.state,
            current=lambda: self.config,
            apply=self.apply_config,
            read_config=read_config,
        )

    def transition(self, new: Lifecycle) -> None:
        check_transition(self.state, new)
        log_event("lifecycle", state=new.value, was=self.state.value)
        self.state = new

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT; the process exit status."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal)
        loop.add_signal_handler(signal.SIGHUP, self.service.request_reload)
        return await self._serve()

    async def _serve(self) -> int:
        config = self.config
        self.dispatcher.start()
        # Health and metrics listen before the workers boot: /readyz says why it is not ready.
        try:
            await self.listeners.start()
        except OSError as exc:
            return await self._halt(f"health/metrics listener on {config.server.bind}: {exc}")
        log_event(
            "start", backend=self.backend, workers=self.placement.workers,
            placement=self.placement.why,
        )  # fmt: skip
        try:
            await self._first_of(self.supervisor.start(), self._stop.wait())
        except PoolHalted as exc:
            return await self._halt(str(exc))
        if not self._stop.is_set():
            await self.acceptor.listen(config.server.socket, self.service.listener)
            try:
                await self.kserve.start()
            except OSError as exc:
                return await self._halt(f"kserve listener on {config.server.bind}: {exc}")
            self.transition(Lifecycle.SERVING)
            log_event("ready", socket=config.server.socket, queue=self.queue_name)
            self.service.serving()
            await self._first_of(self._stop.wait(), self.supervisor.halted.wait())
        if self.supervisor.halt_reason:
            return await self._halt(self.supervisor.halt_reason)
        await self.drain()
        return EXIT_OK

    @staticmethod
    async def _first_of(*aws: object) -> None:
        tasks = [asyncio.ensure_future(a) for a in aws]  # type: ignore[call-overload]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()

    async def drain(self) -> None:
        """Stop accepting, answer everything accepted, stop workers (see module docstring)."""
        self.transition(Lifecycle.DRAINING)
        self.service.stopping()
        self.acceptor.draining = True
        self.acceptor.stop_listening()
        log_event("drain", in_flight=len(self.dispatcher.pending))
        bound = self.config.server.drain_timeout_ms / 1000.0
        try:
            await asyncio.wait_for(self._settle(), bound)
        except TimeoutError:
            self.dispatcher.fail_pending("daemon stopped before this request completed")
        await self._stop_everything()
        self.transition(Lifecycle.STOPPED)

    async def _settle(self) -> None:
        await self.acceptor.wait_for_decodes()
        await self.dispatcher.idle.wait()

    async def _halt(self, reason: str) -> int:
        self.halt_reason = reason
        self.transition(Lifecycle.HALTED)
        log_event("halted", logging.ERROR, reason=reason)
        self.service.halted(reason)
        self.acceptor.draining = True
        self.acceptor.stop_listening()
        await self.acceptor.wait_for_decodes()
        self.dispatcher.fail_pending(f"no workers: {reason}")
        await self._stop_everything()
        return EXIT_FAILED

    async def _stop_everything(self) -> None:
        await self.service.close()
        await self.supervisor.stop_all(self.config.workers.kill_grace_ms / 1000.0)
        self.dispatcher.collect()
        self.dispatcher.stop()
        await self.acceptor.close_connections()
        await self.kserve.close()
        await self.listeners.close()

    def _on_stop_signal(self) -> None:
        self._signals += 1
        if self._signals == 1:
            self._stop.set()
        else:
            self._force_exit()

    def _force_exit(self) -> None:
        """Second signal: leave now, but leave nothing behind in /dev/shm."""
        for worker in list(self.supervisor.workers.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.proc.pid, signal.SIGKILL)
        self.queue.unlink()
        self.acceptor.stop_listening()
        os._exit(EXIT_FAILED)

    # ---- seams ------------------------------------------------------------------------

    def account(self, flight: InFlight, reply: wire.Reply, completion: Completion | None) -> None:
        """Every reply passes here exactly once (metrics hook in here)."""
        self.replies[reply.status] += 1
        self.obs.account(flight, reply, completion)

    def apply_config(self, config: Config) -> None:
        """A reload's configuration (only keys that may change live differ): workers spawned
        from now on, the acceptor's classes and allow-list use it."""
        self.config = config
        self.supervisor.config = config
        self.acceptor.reconfigure(config)
        self.obs.apply_config(config)

    def _on_reclaimed(self, report: ReclaimReport) -> None:
        """A dead worker's claims were reclaimed: answer the ones that timed out or failed,
        and arm the expiry timer for the requeued ones."""
        self.dispatcher.requeued()

    def snapshot(self, request_id: int = 0) -> wire.StatusReply:
        """The status reply: lifecycle, workers, queue occupancy, reply counts."""
        rows = {row.slot: row for row in self.queue.worker_rows()}
        now = time.monotonic_ns()
        workers = []
        live = {w.id: w for w in self.supervisor.workers.values() if not w.retiring}
        for wid, lineage in enumerate(self.supervisor.lineage):
            w = live.get(wid)
            name = f"{self.backend}{wid}"
            if w is None:
                workers.append(
                    wire.WorkerStatus(wid, name, 0, "restarting", self.backend, lineage.restarts)
                )
                continue
            row = rows.get(w.slot)
            workers.append(
                wire.WorkerStatus(
                    id=wid,
                    name=name,
                    pid=w.proc.pid,
                    state=w.state.value,
                    device=w.device,
                    restarts=lineage.restarts,
                    slot=w.slot,
                    heartbeat_age_ms=(now - row.heartbeat_ns) / 1e6 if row else 0.0,
                    batches=row.batches if row else 0,
                    requests=row.requests if row else 0,
                    model_version=w.version,
                    **self.obs.worker_fields(name),
                )
            )
        spares = {  # by group, in group order: group 0 (a CUDA pool's first card) is `standby`
            group: wire.WorkerStatus(
                id=-1,
                name=spare.name if self.backend == "cpu" else f"{spare.name}{group}",
                pid=spare.proc.pid,
                state=spare.state.value,
                device=spare.device,
                restarts=max(0, self.supervisor.standby_lines[group].spawned - 1),
                model_version=spare.version,
            )
            for group, spare in sorted(self.supervisor.standbys.items())
        }
        for group in self.supervisor.spares.backing_off():  # a crash-looping spare, paced
            spares[group] = wire.WorkerStatus(
                id=-1,
                name=f"{self.backend}-standby" + ("" if self.backend == "cpu" else str(group)),
                pid=0,
                state="restarting",
                device=self.backend,
                restarts=max(0, self.supervisor.standby_lines[group].spawned - 1),
            )
        spares = dict(sorted(spares.items()))
        counts = self.queue.counts_by_state()
        queue = wire.QueueStatus(
            depth=self.queue.depth_by_priority(),
            slots=self.config.queue.slots,
            in_use=self.config.queue.slots - counts[DescState.FREE],
            in_flight=len(self.dispatcher.pending),
        )
        return wire.StatusReply(
            id=request_id,
            state=self.state.value,
            pid=os.getpid(),
            uptime_s=time.time() - self.started,
            backend=self.backend,
            workers=workers,
            queue=queue,
            requests=dict(self.replies),
            classes={n: (c.priority, c.deadline_ms) for n, c in self.config.classes.items()},
            reloads=self.service.reloader.count,
            reload_error=self.service.reloader.last_error,
            reload_needs_restart=list(self.service.reloader.needs_restart),
            refused_connections=self.acceptor.gate.refused,
            standby=spares.get(0),
            standbys=list(spares.values()),
            **self.obs.status_fields(),
            **self.listeners.status_fields(),
        )


def serve(
    config: Config,
    read_config: Callable[[], Config] | None = None,
    placement: Placement | None = None,
) -> int:
    """Run a daemon on uvloop in the foreground; returns the exit status. ``read_config``
    reads the configuration again for a reload (SIGHUP); ``placement`` is
    ``gpus.place(config)`` when the caller already decided it."""
    import uvloop

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run_daemon(config, read_config, placement))


async def run_daemon(
    config: Config,
    read_config: Callable[[], Config] | None = None,
    placement: Placement | None = None,
) -> int:
    """Create the queue, build a :class:`Daemon` around it and run it; the queue is closed
    (and, its creator being us, unlinked) however the daemon ends."""
    placement = placement or place(config)
    q = config.queue
    geometry = Geometry(slots=q.slots, slot_bytes=q.slot_bytes, tick_ms=q.tick_ms)
    queue = RequestQueue.create_unique(
        queue_prefix(config.server.socket), geometry, worker_spin_us=q.worker_spin_us
    )
    try:
        daemon = Daemon(config, queue, queue.name, placement, read_config)
        return await daemon.run()
    finally:
        queue.close()
