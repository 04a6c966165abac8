"""The daemon's face to systemd and to operators: readiness, status, watchdog, reload.

:class:`ServiceManager` is created with the :class:`~scratchd.daemon.app.Daemon` and told
of its lifecycle; it owns nothing the daemon serves with::

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
from typing import TYPE_CHECKING

from scratchd.daemon.config import Config
from scratchd.daemon.ops.notify import Notifier, inherited_listener, start_watchdog
from scratchd.daemon.ops.reload import Reloader, ReloadState

if TYPE_CHECKING:
    from scratchd.daemon.app import Daemon


class ServiceManager:
    """sd_notify, socket activation and SIGHUP reloads for one daemon."""

    def __init__(
        self,
        daemon: Daemon,
        read_config: Callable[[], Config] | None,
        environ: MutableMapping[str, str] | None = None,
    ) -> None:
        self.daemon = daemon
        self.notifier = Notifier.from_env(environ)
        self.listener: socket.socket | None = inherited_listener(environ)
        self.reloader = Reloader(
            read_config=read_config or (lambda: daemon.config),
            current=lambda: daemon.config,
            apply=daemon.apply_config,
            rolling_restart=lambda: daemon.supervisor.rolling_restart(),
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
        self.notifier.stopping(f"draining {len(self.daemon.dispatcher.pending)} requests")

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
        from scratchd.daemon.app import Lifecycle

        daemon = self.daemon
        return daemon.state is Lifecycle.SERVING and daemon.supervisor.ready_count() > 0

    def summary(self) -> str:
        """One line for ``systemctl status``: workers, queue, reload state."""
        daemon = self.daemon
        supervisor = getattr(daemon, "supervisor", None)
        if supervisor is None:
            return daemon.state.value
        ready = supervisor.ready_count()
        queued = sum(daemon.queue.depth_by_priority())
        in_flight = len(daemon.dispatcher.pending)
        line = (
            f"{daemon.state.value}: {ready}/{supervisor.count} workers ready, "
            f"{queued} queued, {in_flight} in flight"
        )
        if self.reloader.state is ReloadState.RELOADING:
            line += ", reloading"
        elif self.reloader.last_error:
            line += f", last reload failed: {self.reloader.last_error}"
        return line
