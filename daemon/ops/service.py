"""The daemon's face to systemd and to operators: readiness, status, watchdog, reload.

:class:`ServiceManager` is created with the daemon's other parts (daemon/app.py), reads
them and the daemon's lifecycle, and is told of each lifecycle change; it owns nothing the
daemon serves with::

    Daemon.__init__ ─▶ ServiceManager(...)   NOTIFY_SOCKET and LISTEN_FDS taken from the
                                             environment (workers must not inherit them)
    SIGHUP (any time) ─▶ request_reload()    recorded; served once SERVING
    SERVING ─▶ serving()                     READY=1 + STATUS=; watchdog task (WATCHDOG=1
                                             every WATCHDOG_USEC/2 while healthy, STATUS= on
                                             change); reload task
    DRAINING ─▶ stopping()                   tasks cancelled (a reload in progress stops
                                             where it is; the drain stops every worker
                                             anyway); STOPPING=1
    HALTED ─▶ halted()                       tasks cancelled; STATUS= says why

Healthy, for the watchdog, means SERVING with at least one worker READY: a pool that has
lost every worker, or a loop that no longer turns, stops the pings and systemd restarts the
service after ``WatchdogSec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, MutableMapping

from scratchd.daemon.config import Config
from scratchd.daemon.frontend.dispatch import Dispatcher
from scratchd.daemon.lifecycle import Lifecycle
from scratchd.daemon.ops.notify import Notifier, inherited_listener, start_watchdog
from scratchd.daemon.ops.reload import Reloader, ReloadState
from scratchd.daemon.pool.supervisor import Supervisor
from scratchd.ipc.queue import RequestQueue


class ServiceManager:
    """sd_notify, socket activation and SIGHUP reloads for one daemon: the parts it reads
    (``queue``, ``supervisor``, ``dispatcher``), the daemon's ``lifecycle`` state, its
    configuration (``current``) and how a reloaded one is applied (``apply``);
    ``read_config`` reads the configuration again as ``serve`` first read it."""

    def __init__(
        self,
        *,
        queue: RequestQueue,
        supervisor: Supervisor,
        dispatcher: Dispatcher,
        lifecycle: Callable[[], Lifecycle],
        current: Callable[[], Config],
        apply: Callable[[Config], None],
        read_config: Callable[[], Config] | None,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self.queue = queue
        self.supervisor = supervisor
        self.dispatcher = dispatcher
        self.lifecycle = lifecycle
        self.notifier = Notifier.from_env(environ)
        self.listener: socket.socket | None = inherited_listener(environ)
        self.reloader = Reloader(
            read_config=read_config or current,
            current=current,
            apply=apply,
            rolling_restart=supervisor.rolling_restart,
            notifier=self.notifier,
            summary=self.summary,
        )
        self._tasks: list[asyncio.Task[None]] = []

    # ---- lifecycle ----------------------------------------------------------------------

    def request_reload(self) -> None:
        """The SIGHUP handler: record and wake, nothing else."""
        self.reloader.request()

    def serving(self) -> None:
        self.notifier.ready(self.summary())
        watchdog = start_watchdog(self.notifier, self.healthy, summary=self.summary)
        if watchdog is not None:
            self._tasks.append(watchdog)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self.reloader.run(), name="scratchd-reload"))

    def stopping(self) -> None:
        self._cancel_tasks()
        self.notifier.stopping(f"draining {len(self.dispatcher.pending)} requests")

    def halted(self, reason: str) -> None:
        self._cancel_tasks()
        self.notifier.status(f"halted: {reason}")

    async def close(self) -> None:
        """Wait for cancelled tasks to finish (a reload stops at its next await)."""
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self.notifier.close()

    def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()

    # ---- what systemd is told -----------------------------------------------------------

    def healthy(self) -> bool:
        return self.lifecycle() is Lifecycle.SERVING and self.supervisor.ready_count() > 0

    def summary(self) -> str:
        """One line for ``systemctl status``: workers, queue, reload state."""
        ready = self.supervisor.ready_count()
        queued = sum(self.queue.depth_by_priority())
        in_flight = len(self.dispatcher.pending)
        line = (
            f"{self.lifecycle().value}: {ready}/{self.supervisor.count} workers ready, "
            f"{queued} queued, {in_flight} in flight"
        )
        if self.reloader.state is ReloadState.RELOADING:
            line += ", reloading"
        elif self.reloader.last_error:
            line += f", last reload failed: {self.reloader.last_error}"
        return line
